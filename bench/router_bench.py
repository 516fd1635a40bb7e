"""Benchmark (not a test): ka-router against Linux kernel forwarding over the
same veth path, in ONE run, reported as ratios (this machine has 2 shared
cores; absolute numbers mean little, ratios measured together do).

    sudo .venv/bin/python bench/router_bench.py [--seconds 3]

Path: gen (198.18.1.2) -- rtr -- sink (198.18.2.2), veth, offloads off.
Path and programs come from kickass_testbed (edge.py spec, topology.build).
Traffic: ka-blast, 1500-byte IP packets (1472-byte UDP payload), DF clear,
sendmmsg batches of 32, as fast as it can, pinned to CPU 0. The router (when
used) is pinned to CPU 1. The sink counts datagrams with an nftables counter
on packets with fragment offset 0 (whole packets and leading fragments) and
drops them in prerouting, so no receiving process competes for CPU.

Phases:
  kernel        plain Linux forwarding in rtr
  ka_fragment   ka-router, capacity 100gbit (no shaping limit), frozen rate
                1 Gbit/s -> every packet cut (leading fragment 1176 bytes)
  ka_pass       ka-router in droptail mode: the TUN detour without cutting
  latency       ka-blast at 1000 pps, one-way latency (same clock) through
                kernel forwarding and through ka-router (fragmenting)
Prints one JSON object (format version 1) with a metadata block.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kickass_testbed.binaries import RUST_BINARIES, rust_binary
from kickass_testbed.edge import RCV, edge_path, ka_router
from kickass_testbed.topology import Built, build

NFT_COUNT = """
table ip kabench {
  chain pre {
    type filter hook prerouting priority -300; policy accept;
    ip saddr 198.18.1.2 ip frag-off & 0x1fff == 0 counter drop
    ip saddr 198.18.1.2 counter drop
  }
}
"""


def nft_count(topo: Built) -> tuple[int, int]:
    """(datagrams, IP packets): offset-0 packets, and all packets."""
    out = topo["rcv"].run(["nft", "-j", "list", "table", "ip", "kabench"]).stdout
    counts = [
        int(e["counter"]["packets"])
        for item in json.loads(out)["nftables"]
        if "rule" in item
        for e in item["rule"]["expr"]
        if "counter" in e
    ]
    if len(counts) != 2:
        raise RuntimeError("kabench counters missing")
    return counts[0], counts[0] + counts[1]


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process (the router is one thread)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks, int(fields[12]) / ticks


def blast_max(topo: Built, seconds: float) -> dict:
    exe = str(rust_binary("ka-blast"))
    r = topo["snd"].run(
        [
            exe,
            "send",
            "--dst",
            f"{RCV}:9000",
            "--duration",
            f"{seconds}s",
            "--batch",
            "32",
        ],
        timeout=seconds + 30,
        cpus=(0,),
    )
    return json.loads(r.stdout)


def throughput(topo: Built, seconds: float, router_pid: int | None) -> dict:
    topo["rcv"].nft(NFT_COUNT)
    try:
        before = nft_count(topo)
        cpu0 = cpu_seconds(router_pid) if router_pid else (0.0, 0.0)
        t0 = time.monotonic()
        sent = blast_max(topo, seconds)
        time.sleep(0.3)  # let queues drain into the counter
        elapsed = time.monotonic() - t0 - 0.3
        after = nft_count(topo)
        got, packets = after[0] - before[0], after[1] - before[1]
        cpu1 = cpu_seconds(router_pid) if router_pid else None
    finally:
        topo["rcv"].run(["nft", "delete", "table", "ip", "kabench"], check=False)
    pps = got / sent["seconds"]
    out = {
        "offered_pps": round(sent["pps"]),
        "delivered_pps": round(pps),
        "delivered_gbit_per_s_of_1500B": round(pps * 1500 * 8 / 1e9, 3),
        # IP packets that reached the sink (a cut datagram is two).
        "delivered_ip_packets_pps": round(packets / sent["seconds"]),
        "loss_fraction": round(1 - got / max(sent["sent"], 1), 4),
    }
    if cpu1 is not None:
        user, system = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
        out["router_cpu_cores"] = round((user + system) / elapsed, 3)
        out["router_cpu_us_per_packet"] = round((user + system) / max(got, 1) * 1e6, 3)
        # Kernel time in the router's syscalls: mostly the forwarding work
        # that each TUN write triggers (route, ip_output, veth, peer rx).
        out["router_system_fraction"] = round(system / max(user + system, 1e-9), 3)
    return out


def latency(topo: Built, pps: int = 1000, seconds: float = 2.0) -> dict:
    exe = str(rust_binary("ka-blast"))
    rx = topo["rcv"].popen(
        [
            exe,
            "recv",
            "--bind",
            f"{RCV}:9001",
            "--duration",
            f"{seconds + 5}s",
            "--idle",
            "1s",
        ],
        stdout=subprocess.PIPE,
    )
    time.sleep(0.3)
    topo["snd"].run(
        [
            exe,
            "send",
            "--dst",
            f"{RCV}:9001",
            "--pps",
            str(pps),
            "--duration",
            f"{seconds}s",
        ],
        timeout=seconds + 30,
    )
    out, _ = rx.communicate(timeout=seconds + 15)
    r = json.loads(out)
    return {"received": r["received"], **{k: round(v, 1) for k, v in r["latency_us"].items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="per throughput phase")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("ERROR: the benchmark builds network namespaces: run it as root")
    for name in RUST_BINARIES:  # fail before building anything if one is missing
        rust_binary(name)
    result: dict = {
        "version": 1,
        "metadata": {
            "benchmark": "router_bench",
            "host": platform.node(),
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "packet_ip_bytes": 1500,
            "seconds_per_phase": args.seconds,
            "started_unix": time.time(),
        },
    }
    with tempfile.TemporaryDirectory() as tmp, build(edge_path()) as topo:
        result["kernel"] = throughput(topo, args.seconds, None)
        lat_kernel = latency(topo)

        def with_router(tel: Path, *router_args: str) -> tuple[dict, dict | None]:
            p = topo.start(ka_router(*router_args, telemetry=tel, cpus=(1,)))
            try:
                # `ip netns exec` execs in place: the Popen pid is ka-router's.
                t = throughput(topo, args.seconds, p.pid)
                lat = latency(topo) if "--mode" not in router_args else None
                return t, lat
            finally:
                code, err = p.stop()
                if code != 0:
                    raise RuntimeError(f"ka-router failed: {err}")

        tel = Path(tmp) / "fragment.ndjson"

        result["ka_fragment"], lat_ka = with_router(
            tel,
            "--capacity",
            "100gbit",
            "--buffer",
            "4096p",
            "--alpha",
            "0",
            "--beta",
            "0",
            "--initial-rate",
            "1gbit",
        )
        samples = [json.loads(x) for x in tel.read_text().splitlines() if '"sample"' in x]
        result["ka_fragment"]["leading_fragment_len"] = samples[-1]["leading_fragment_len"]
        result["ka_fragment"]["fragmented"] = samples[-1]["fragmented"]
        result["ka_pass"], _ = with_router(
            Path(tmp) / "pass.ndjson",
            "--capacity",
            "100gbit",
            "--buffer",
            "4096p",
            "--mode",
            "droptail",
        )
    k = result["kernel"]["delivered_pps"]
    result["ratio_ka_fragment_vs_kernel"] = round(result["ka_fragment"]["delivered_pps"] / k, 3)
    result["ratio_ka_pass_vs_kernel"] = round(result["ka_pass"]["delivered_pps"] / k, 3)
    result["ratio_ka_fragment_ip_packets_vs_kernel"] = round(
        result["ka_fragment"]["delivered_ip_packets_pps"]
        / result["kernel"]["delivered_ip_packets_pps"],
        3,
    )
    result["latency_us_low_load"] = {
        "kernel": lat_kernel,
        "ka_router": lat_ka,
        "added_p50": round(lat_ka["p50"] - lat_kernel["p50"], 1) if lat_ka else None,
        "added_p99": round(lat_ka["p99"] - lat_kernel["p99"], 1) if lat_ka else None,
    }
    result["goals"] = {
        "ratio_at_least_0.5": result["ratio_ka_fragment_vs_kernel"] >= 0.5,
        "at_least_1_gbit_per_s_one_core": (
            result["ka_fragment"]["delivered_gbit_per_s_of_1500B"] >= 1.0
            and result["ka_fragment"]["router_cpu_cores"] <= 1.05
        ),
    }
    with contextlib.suppress(BrokenPipeError):
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
