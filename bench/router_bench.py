"""Benchmark (not a test): ka-router against Linux kernel forwarding over the
same veth path, in ONE run, reported as ratios (this machine has 2 shared
cores; absolute numbers mean little, ratios measured together do).

    sudo .venv/bin/python bench/router_bench.py [--seconds 3] [--repeats 3]

Path: gen (198.18.1.2) -- rtr -- sink (198.18.2.2), veth, offloads off.
Path and programs come from kickass_testbed (edge.py spec, topology.build).

Each repeat runs, back to back, for each sender:
  kernel        plain Linux forwarding in rtr
  kernel_frag   Linux forwarding that fragments too: rtr's WAN MTU 1196, so
                Linux cuts every 1500-byte datagram where ka-router does
                (1176 + 304 payload bytes); what cutting costs the receiver
  tun, packet   ka-router on that --datapath, capacity 10gbit, frozen rate
                1 Gbit/s (alpha = beta = 0) -> every 1500-byte datagram is
                cut (leading fragment 1176 bytes)
  packet_rt     the packet datapath with --rt-priority 10 (SCHED_FIFO)
Placement (--placement split, the default): the sender on CPU 0, the
router and the iperf3 server on CPU 1, and the sink's receive processing
(IP, reassembly, UDP) steered to CPU 0 with RPS on its veth: where kernel
forwarding runs it anyway (inside the sender's send), and not inside the
router's sendmmsg, where veth would otherwise run it (a real receiver is
another host). --placement veth: no RPS, iperf3 server unpinned (the
earlier runs).
Senders:
  iperf3        `iperf3 -u -b 0 -l 1472`, DF clear; its server in the sink
                receives and reassembles; goodput from the server's count
                of datagrams received
  ka-blast      1500-byte IP packets, sendmmsg batches of 32, DF clear; the
                sink counts datagrams with an nftables counter on packets
                with fragment offset 0 and drops them in prerouting (no
                receiving process)
  ka-blast-mix  the same with 100-, 576- and 1500-byte IP packets in turn
                (only the 1500-byte ones are cut)
After the repeats (ka-blast sender, ka-blast receiver, same clock):
  latency       one-way latency at 1000 pps and at 80% of the weakest
                path's ka-blast maximum (measured above; the same offered
                load on every path), kernel and each variant
  shaper        each variant at --capacity 1gbit, offered ka-blast at
                full speed: delivered IP bit/s at the sink in steady state
                (must not exceed C) and the largest per-interval output the
                router reports
Prints one JSON object (format version 2) with a metadata block.
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
import threading
import time
from pathlib import Path
from typing import Any

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


def nft_bytes(topo: Built) -> int:
    """IP bytes of every packet from the generator the sink saw."""
    out = topo["rcv"].run(["nft", "-j", "list", "table", "ip", "kabench"]).stdout
    return sum(
        int(e["counter"]["bytes"])
        for item in json.loads(out)["nftables"]
        if "rule" in item
        for e in item["rule"]["expr"]
        if "counter" in e
    )


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process (the router is one thread)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks, int(fields[12]) / ticks


# rtr's WAN MTU for kernel_frag: Linux then cuts a 1500-byte datagram into
# 1176 + 304 payload bytes, as ka-router does at the frozen 1 Gbit/s.
KERNEL_FRAG_MTU = 1196
MIX = (72, 548, 1472)  # UDP payloads: 100-, 576- and 1500-byte IP packets, in turn


def blast_max(topo: Built, seconds: float, mix: bool = False) -> dict:
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
            *(["--mix", ",".join(map(str, MIX))] if mix else []),
        ],
        timeout=seconds + 30,
        cpus=(0,),
    )
    return json.loads(r.stdout)


def throughput(topo: Built, seconds: float, router_pid: int | None, mix: bool = False) -> dict:
    topo["rcv"].nft(NFT_COUNT)
    try:
        before = nft_count(topo)
        cpu0 = cpu_seconds(router_pid) if router_pid else (0.0, 0.0)
        t0 = time.monotonic()
        sent = blast_max(topo, seconds, mix)
        time.sleep(0.3)  # let queues drain into the counter
        elapsed = time.monotonic() - t0 - 0.3
        after = nft_count(topo)
        got, packets = after[0] - before[0], after[1] - before[1]
        cpu1 = cpu_seconds(router_pid) if router_pid else None
    finally:
        topo["rcv"].run(["nft", "delete", "table", "ip", "kabench"], check=False)
    pps = got / sent["seconds"]
    mean_ip = sum(p + 28 for p in MIX) / len(MIX) if mix else 1500
    out = {
        "offered_pps": round(sent["pps"]),
        "delivered_pps": round(pps),
        "delivered_gbit_per_s_of_1500B": round(pps * 1500 * 8 / 1e9, 3),
        # IP bytes of the datagrams as sent (the mix: their mean size).
        "delivered_gbit_per_s": round(pps * mean_ip * 8 / 1e9, 3),
        # IP packets that reached the sink (a cut datagram is two).
        "delivered_ip_packets_pps": round(packets / sent["seconds"]),
        "loss_fraction": round(1 - got / max(sent["sent"], 1), 4),
    }
    if cpu1 is not None:
        out.update(router_cpu(cpu0, cpu1, elapsed, got))
    return out


def router_cpu(
    cpu0: tuple[float, float], cpu1: tuple[float, float], elapsed: float, packets: int
) -> dict:
    """The router's CPU over a throughput phase, from its (user, system)
    seconds at the start and the end."""
    user, system = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
    return {
        "router_cpu_cores": round((user + system) / elapsed, 3),
        "router_cpu_us_per_packet": round((user + system) / max(packets, 1) * 1e6, 3),
        # Kernel time in the router's syscalls: mostly the forwarding work
        # that each TUN write triggers (route, ip_output, veth, peer rx).
        "router_system_fraction": round(system / max(user + system, 1e-9), 3),
    }


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


# Router variants: name -> (--datapath, extra arguments).
VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "tun": ("tun", ()),
    "packet": ("packet", ()),
    "packet_rt": ("packet", ("--rt-priority", "10")),
}
DATAPATHS = tuple(VARIANTS)
SENDERS = ("iperf3", "ka-blast", "ka-blast-mix")
FRAGMENT_ARGS = (
    "--capacity",
    "10gbit",
    "--buffer",
    "4096p",
    "--alpha",
    "0",
    "--beta",
    "0",
    "--initial-rate",
    "1gbit",
)


SERVER_CPUS: tuple[int, ...] | None = (1,)  # the iperf3 server's (None: unpinned)


def iperf3_throughput(topo: Built, seconds: float, router_pid: int | None) -> dict:
    server = topo["rcv"].popen(
        ["iperf3", "-s", "-1", "-p", "5201", "-B", RCV],
        stdout=subprocess.DEVNULL,
        cpus=SERVER_CPUS,
    )
    try:
        time.sleep(0.4)
        cpu0 = cpu_seconds(router_pid) if router_pid else (0.0, 0.0)
        t0 = time.monotonic()
        r = topo["snd"].run(
            [
                "iperf3",
                "-c",
                RCV,
                "-p",
                "5201",
                "-u",
                "-b",
                "0",
                "-l",
                "1472",
                "-t",
                str(seconds),
                "-J",
            ],
            timeout=seconds + 30,
            cpus=(0,),
        )
        elapsed = time.monotonic() - t0
        cpu1 = cpu_seconds(router_pid) if router_pid else None
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(5)
        if server.poll() is None:
            server.kill()
    end = json.loads(r.stdout)["end"]["sum"]
    got = end["packets"] - end["lost_packets"]
    secs = end["seconds"]
    pps = got / secs
    out = {
        "offered_pps": round(end["packets"] / secs),
        "delivered_pps": round(pps),
        "goodput_gbit_per_s": round(pps * 1472 * 8 / 1e9, 3),
        "delivered_gbit_per_s_of_1500B": round(pps * 1500 * 8 / 1e9, 3),
        "delivered_gbit_per_s": round(pps * 1500 * 8 / 1e9, 3),
        "loss_fraction": round(end["lost_packets"] / max(end["packets"], 1), 4),
    }
    if cpu1 is not None:
        out.update(router_cpu(cpu0, cpu1, elapsed, got))
    return out


def run_sender(topo: Built, sender: str, seconds: float, pid: int | None) -> dict:
    if sender == "iperf3":
        return iperf3_throughput(topo, seconds, pid)
    return throughput(topo, seconds, pid, mix=sender == "ka-blast-mix")


def spread(values: list[float]) -> dict:
    return {"min": min(values), "max": max(values), "runs": values}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="per throughput phase")
    ap.add_argument("--repeats", type=int, default=3, help="kernel/tun/packet rounds")
    ap.add_argument("--no-latency", action="store_true", help="skip latency and shaper phases")
    ap.add_argument(
        "--placement",
        choices=("split", "veth"),
        default="split",
        help="split: sink receive on CPU 0 (RPS), iperf3 server on CPU 1; veth: neither",
    )
    args = ap.parse_args()
    global SERVER_CPUS
    SERVER_CPUS = (1,) if args.placement == "split" else None
    if os.geteuid() != 0:
        sys.exit("ERROR: the benchmark builds network namespaces: run it as root")
    for name in RUST_BINARIES:  # fail before building anything if one is missing
        rust_binary(name)
    result: dict = {
        "version": 2,
        "metadata": {
            "benchmark": "router_bench",
            "host": platform.node(),
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "packet_ip_bytes": 1500,
            "seconds_per_phase": args.seconds,
            "repeats": args.repeats,
            "router_args": " ".join(FRAGMENT_ARGS),
            "placement": args.placement,
            "started_unix": time.time(),
        },
        "runs": [],
    }
    with tempfile.TemporaryDirectory() as tmp, build(edge_path()) as topo:
        # iperf3 has no option to clear DF, and Linux sets it on UDP by
        # default: this makes the sender's sockets default to DF clear, so
        # every 1500-byte datagram is the router's to cut.
        topo["snd"].run(["sysctl", "-qw", "net.ipv4.ip_no_pmtu_disc=1"])
        if args.placement == "split":
            rps = "/sys/class/net/wan0/queues/rx-0/rps_cpus"
            topo["rcv"].run(["sh", "-c", f"echo 1 > {rps}"])

        def kernel_frag(sender: str) -> dict:
            """Kernel forwarding that cuts like ka-router (WAN MTU 1196)."""
            topo["rtr"].run(["ip", "link", "set", "wan", "mtu", str(KERNEL_FRAG_MTU)])
            try:
                return run_sender(topo, sender, args.seconds, None)
            finally:
                topo["rtr"].run(["ip", "link", "set", "wan", "mtu", "1500"])

        @contextlib.contextmanager
        def router(variant: str, name: str, *router_args: str):  # noqa: ANN202
            tel = Path(tmp) / f"{name}.ndjson"
            datapath, extra = VARIANTS[variant]
            p = topo.start(
                ka_router(*router_args, *extra, telemetry=tel, datapath=datapath, cpus=(1,))
            )
            try:
                yield p, tel
            finally:
                code, err = p.stop()
                if code != 0:
                    raise RuntimeError(f"ka-router failed: {err}")

        def last_exit(tel: Path) -> dict:
            lines = [json.loads(x) for x in tel.read_text().splitlines()]
            return lines[-1] if lines and lines[-1]["type"] == "exit" else {}

        def last_sample(tel: Path) -> dict:
            lines = [json.loads(x) for x in tel.read_text().splitlines()]
            return [x for x in lines if x["type"] == "sample"][-1]

        for rep in range(args.repeats):
            run: dict = {}
            for sender in SENDERS:
                row: dict[str, Any] = {
                    "kernel": run_sender(topo, sender, args.seconds, None),
                    "kernel_frag": kernel_frag(sender),
                }
                for dp in DATAPATHS:
                    with router(dp, f"{sender}-{dp}-{rep}", *FRAGMENT_ARGS) as (p, tel):
                        row[dp] = run_sender(topo, sender, args.seconds, p.pid)
                    s = last_sample(tel)
                    row[dp]["leading_fragment_len"] = s["leading_fragment_len"]
                    row[dp]["fragmented"] = s["fragmented"]
                    row[dp]["router_drops"] = s["drops"]
                    ex = last_exit(tel)
                    row[dp]["rx_socket_drops"] = ex.get("rx_socket_drops", 0)
                    row[dp]["slow_path_packets"] = ex.get("slow_path_packets", 0)
                k = row["kernel"]["delivered_pps"]
                kf = row["kernel_frag"]["delivered_pps"]
                row["ratio_kernel_frag_vs_kernel"] = round(kf / max(k, 1), 3)
                for dp in DATAPATHS:
                    row[f"ratio_{dp}_vs_kernel"] = round(row[dp]["delivered_pps"] / max(k, 1), 3)
                    row[f"ratio_{dp}_vs_kernel_frag"] = round(
                        row[dp]["delivered_pps"] / max(kf, 1), 3
                    )
                run[sender] = row
                print(
                    f"repeat {rep} {sender}: kernel {k} pps, kernel_frag "
                    f"{row['ratio_kernel_frag_vs_kernel']}, "
                    + ", ".join(
                        f"{dp} {row[f'ratio_{dp}_vs_kernel']}"
                        f" ({row[f'ratio_{dp}_vs_kernel_frag']} of kernel_frag)"
                        for dp in DATAPATHS
                    ),
                    file=sys.stderr,
                )
            result["runs"].append(run)

        summary: dict = {}
        for sender in SENDERS:
            rows = [r[sender] for r in result["runs"]]
            summary[sender] = {
                "kernel_gbit_per_s": spread([r["kernel"]["delivered_gbit_per_s"] for r in rows]),
                "kernel_frag_gbit_per_s": spread(
                    [r["kernel_frag"]["delivered_gbit_per_s"] for r in rows]
                ),
                "ratio_kernel_frag_vs_kernel": spread(
                    [r["ratio_kernel_frag_vs_kernel"] for r in rows]
                ),
                **{
                    f"ratio_{dp}_vs_kernel_frag": spread(
                        [r[f"ratio_{dp}_vs_kernel_frag"] for r in rows]
                    )
                    for dp in DATAPATHS
                },
                **{
                    f"{p}_delivered_pps": spread([r[p]["delivered_pps"] for r in rows])
                    for p in ("kernel", "kernel_frag", *DATAPATHS)
                },
                **{
                    f"{dp}_gbit_per_s": spread([r[dp]["delivered_gbit_per_s"] for r in rows])
                    for dp in DATAPATHS
                },
                **{
                    f"ratio_{dp}_vs_kernel": spread([r[f"ratio_{dp}_vs_kernel"] for r in rows])
                    for dp in DATAPATHS
                },
                **{
                    f"{dp}_cpu_us_per_datagram": spread(
                        [r[dp]["router_cpu_us_per_packet"] for r in rows]
                    )
                    for dp in DATAPATHS
                },
            }
        result["summary"] = summary

        if not args.no_latency:
            # 80% load: the same offered load on every path, 80% of the
            # weakest path's ka-blast maximum measured above (so every path
            # can carry it; the router is not shaping: capacity 10gbit).
            weakest = min(
                r["ka-blast"][k]["delivered_pps"]
                for r in result["runs"]
                for k in ("kernel", *DATAPATHS)
            )
            high = int(0.8 * weakest)
            lat: dict = {}
            for load in ("low", "80pct"):
                pps = 1000 if load == "low" else high
                row = {"pps": pps, "kernel": latency(topo, pps)}
                for dp in DATAPATHS:
                    with router(dp, f"lat-{load}-{dp}", *FRAGMENT_ARGS):
                        row[dp] = latency(topo, pps)
                for dp in DATAPATHS:
                    row[f"{dp}_added_p50_us"] = round(row[dp]["p50"] - row["kernel"]["p50"], 1)
                    row[f"{dp}_added_p99_us"] = round(row[dp]["p99"] - row["kernel"]["p99"], 1)
                lat[load] = row
            result["latency_us"] = lat

            shaper: dict = {}
            for dp in DATAPATHS:
                # FRAGMENT_ARGS with the capacity at 1 Gbit/s.
                args_1g = ("--capacity", "1gbit", *FRAGMENT_ARGS[2:])
                with router(dp, f"shaper-{dp}", *args_1g) as (p, tel):
                    topo["rcv"].nft(NFT_COUNT)
                    try:
                        b0 = nft_bytes(topo)
                        # Steady state: the sink's byte count between 1 s
                        # after the start and 0.5 s before the end (the
                        # whole-run count includes the queue drained after
                        # the sender stopped: up to 4096 packets).
                        got: dict = {}
                        blast = threading.Thread(
                            target=lambda out=got: out.update(blast_max(topo, args.seconds))
                        )
                        blast.start()
                        time.sleep(1.0)
                        s0, t0 = nft_bytes(topo), time.monotonic()
                        time.sleep(max(args.seconds - 1.5, 0.5))
                        s1, t1 = nft_bytes(topo), time.monotonic()
                        blast.join()
                        sent = got
                        time.sleep(0.3)
                        b1 = nft_bytes(topo)
                    finally:
                        topo["rcv"].run(["nft", "delete", "table", "ip", "kabench"], check=False)
                lines = [json.loads(x) for x in tel.read_text().splitlines()]
                samples = [x for x in lines if x["type"] == "sample"]
                busy = [x for x in samples if x["queue_packets"] > 0]
                shaper[dp] = {
                    "capacity_gbit_per_s": 1.0,
                    "delivered_ip_gbit_per_s": round((s1 - s0) * 8 / (t1 - t0) / 1e9, 4),
                    "delivered_ip_gbit_per_s_incl_drain": round(
                        (b1 - b0) * 8 / sent["seconds"] / 1e9, 4
                    ),
                    "max_interval_output_gbit_per_s": round(
                        max((x["output_rate_bps"] for x in busy), default=0) / 1e9, 4
                    ),
                    "intervals": len(busy),
                }
            result["shaper"] = shaper

    ip = summary["iperf3"]
    result["goals"] = {
        "iperf3_packet_ratio_at_least_0.8": ip["ratio_packet_vs_kernel"]["min"] >= 0.8,
        "iperf3_packet_ratio_at_least_0.5": ip["ratio_packet_vs_kernel"]["min"] >= 0.5,
        "iperf3_packet_at_least_1_gbit_per_s": ip["packet_gbit_per_s"]["min"] >= 1.0,
    }
    with contextlib.suppress(BrokenPipeError):
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
