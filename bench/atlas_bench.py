"""Benchmark of the RIPE Atlas part (not a test): ingest and the ICMP responder.

Figures, all from one run on this machine, as ratios:
  ingest     Atlas results into PostgreSQL (a real, embedded one, or
             KICKASS_DATABASE_URL): rows/s stored by the ingest's COPY path
             (results + per-packet outcomes, one transaction per window)
             against a plain INSERT per row of the same rows; and rows/s of
             the whole pipeline (Sagan parsing, join to the reply log, COPY).
  responder  echo replies/s of `kickass atlas responder` (whole sizes, then
             the split sweep) against a minimal raw-socket echo loop (read,
             flip the type, swap the addresses, send), both in a network
             namespace answering the same flood from another one; replies
             counted by the server interface's kernel counters.

Needs root (namespaces, raw sockets, nftables).
Usage: .venv/bin/python bench/atlas_bench.py [--quick] > bench/atlas_bench.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kickass_db as db
import yaml
from kickass_atlas.campaign import Campaign
from kickass_atlas.ingest import MeasurementSpec, join, parse_result
from kickass_atlas.responder import nft_ruleset
from kickass_atlas.responder_core import ReplyRecord
from kickass_atlas.store import AtlasStore
from kickass_testbed.pg import create_database, embedded_postgres
from kickass_testbed.topology import Built, End, Host, Link, Process, Topology, build

VERSION = 1
KICKASS = str(Path(sys.executable).with_name("kickass"))
WHOLE, SPLIT, CLIENT = "198.18.110.10", "198.18.110.11", "198.18.110.2"
PACKETS, INTERVAL = 16, 240


# -- ingest --------------------------------------------------------------------------


def synthetic(
    n_results: int, n_probes: int, msm_id: int, target: str, seed: int
) -> tuple[list[dict[str, Any]], list[ReplyRecord]]:
    """Result lines as the probe firmware writes them (ping.c: an x only
    before the first reply, after it a lost reply leaves no entry and the
    sequence number is re-used; the time is the run's end) and the reply log
    they join to: 5% of requests lost on the way in, 5% of replies on the
    way back."""
    rng = random.Random(seed)
    lines: list[dict[str, Any]] = []
    log: list[ReplyRecord] = []
    t0 = 1_790_000_000
    per_probe = max(1, n_results // n_probes)
    for p in range(n_probes):
        address = f"198.51.{100 + p // 250}.{1 + p % 250}"
        seq = 1
        for r in range(per_probe):
            ts = t0 + r * INTERVAL + (p % 60) + PACKETS
            entries: list[dict[str, Any]] = []
            got_reply, last_seq, attempt = False, -1, 0
            for k in range(PACKETS):
                arrived = False
                if rng.random() >= 0.05:  # the request arrived: we replied
                    attempt = attempt + 1 if seq == last_seq else 0
                    last_seq = seq
                    log.append(
                        ReplyRecord(
                            len(log), target, address, 0x4000 + p, seq, 100, "whole", 100,
                            ts - PACKETS + k + 0.3, attempt,
                        )
                    )  # fmt: skip
                    arrived = rng.random() >= 0.05
                if arrived:
                    entries.append({"rtt": 20.0 + k})
                    got_reply, seq = True, (seq + 1) % 256
                elif not got_reply:
                    entries.append({"x": "*"})
                    seq = (seq + 1) % 256
            rtts = [e["rtt"] for e in entries if "rtt" in e]
            lines.append(
                {
                    "af": 4, "avg": sum(rtts) / len(rtts) if rtts else -1, "dst_addr": target,
                    "dst_name": target, "dup": 0, "from": address, "fw": 5120, "lts": 10,
                    "max": max(rtts, default=-1), "min": min(rtts, default=-1),
                    "msm_id": msm_id, "msm_name": "Ping", "prb_id": 10_000 + p, "proto": "ICMP",
                    "rcvd": len(rtts), "result": entries, "sent": PACKETS, "size": 72,
                    "src_addr": "192.168.1.2", "step": INTERVAL, "timestamp": ts, "ttl": 60,
                    "type": "ping", "stored_timestamp": ts + 5,
                }
            )  # fmt: skip
    return lines, log


def bench_ingest(url: str, n_results: int) -> dict[str, Any]:
    campaign = Campaign.from_dict(
        {
            "name": "bench",
            "target": {"whole": "192.0.2.10", "split": "192.0.2.11"},
            "probes": {"count": 200, "area": "WW"},
            "whole": {"sizes": [100]},
            "packets": PACKETS,
            "interval": INTERVAL,
            "duration": 86400,
            "credit_budget": 10**12,
        }
    )
    planned = campaign.plan().measurements[1]
    out: dict[str, Any] = {"results": n_results, "packets_per_result": PACKETS}
    with AtlasStore(url) as store:
        cid = store.upsert_campaign(campaign)
        for msm_id in (1, 2):
            copy = dataclasses.replace(planned, key=f"{planned.key}-{msm_id}")
            store.record_measurement(cid, msm_id, copy, {}, None)
        lines, log = synthetic(n_results, 200, 1, planned.target, seed=1)
        t = time.perf_counter()
        for i in range(0, len(log), 2000):
            store.write_reply_log(cid, uuid.uuid4(), log[i : i + 2000])
        out["reply_log_rows_per_s"] = round(len(log) / (time.perf_counter() - t))

        spec = MeasurementSpec(1, cid, "whole", planned.target, 100, PACKETS, 1000, 72)
        t = time.perf_counter()
        parsed = [parse_result(x) for x in lines]
        t_parsed = time.perf_counter()
        replies = store.reply_log(cid, planned.target, 100, 0, 2**31)
        rows, outcomes = join(parsed, replies, spec, {})
        t_joined = time.perf_counter()
        store.store_chunk(1, rows, outcomes, datetime.now(UTC))
        t_stored = time.perf_counter()
        n_rows = len(rows) + len(outcomes)
        out["rows"] = n_rows
        out["copy_rows_per_s"] = round(n_rows / (t_stored - t_joined))
        out["pipeline_rows_per_s"] = round(n_rows / (t_stored - t))
        out["parse_results_per_s"] = round(len(lines) / (t_parsed - t))
        out["join_results_per_s"] = round(len(lines) / (t_joined - t_parsed))

        rows2 = [dataclasses.replace(r, msm_id=2) for r in rows]
        outcomes2 = [dataclasses.replace(o, msm_id=2) for o in outcomes]
        t = time.perf_counter()
        store.store_chunk_row_by_row(2, rows2, outcomes2, datetime.now(UTC))
        out["insert_per_row_rows_per_s"] = round(n_rows / (time.perf_counter() - t))
    out["copy_vs_insert_per_row"] = round(
        out["copy_rows_per_s"] / out["insert_per_row_rows_per_s"], 2
    )
    return out


# -- the responder ---------------------------------------------------------------------

MINIMAL_ECHO = r"""
import socket, struct
rx = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
rx.setsockopt(255, 1, struct.pack("I", ~(1 << 8) & 0xFFFFFFFF))  # ICMP_FILTER: echo requests
rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
tx = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
tx.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, 0x4B41)
print("echo ready", flush=True)
while True:
    d = rx.recv(65535)
    ihl = (d[0] & 15) * 4
    icmp = d[ihl:]
    s = (~struct.unpack_from("!H", icmp, 2)[0] & 0xFFFF) + 0xF7FF
    s = (s & 0xFFFF) + (s >> 16)
    # IP checksum and id left 0: the kernel fills both in for IP_HDRINCL.
    header = struct.pack(
        "!BBHHHBBH4s4s", 0x45, 0, 20 + len(icmp), 0, 0, 64, 1, 0, d[16:20], d[12:16]
    )
    reply = header + struct.pack("!BBH", 0, 0, ~s & 0xFFFF) + icmp[4:]
    try:
        tx.sendto(reply, (socket.inet_ntoa(d[12:16]), 0))
    except OSError:
        pass
"""

FLOOD = r"""
import socket, struct, sys, time
dst, ip_len, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
def csum(b):
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    while s >> 16: s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF
packets = []
for i in range(256):
    data = bytes(ip_len - 28)
    icmp = struct.pack("!BBHHH", 8, 0, 0, 0x5000 + i, 1) + data
    icmp = icmp[:2] + struct.pack("!H", csum(icmp)) + icmp[4:]
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, ip_len, 0, 0, 64, 1, 0,
                     socket.inet_aton("198.18.110.2"), socket.inet_aton(dst))
    packets.append(ip + icmp)
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
end = time.time() + seconds
n = 0
while time.time() < end:
    for p in packets:
        try:
            s.sendto(p, (dst, 0)); n += 1
        except OSError:
            time.sleep(0.0005)
print(n)
"""


def topology() -> Topology:
    return Topology(
        name="kabench",
        hosts=(Host("c"), Host("s")),
        links=(
            Link(
                End("c", "e0", (f"{CLIENT}/24",)),
                End("s", "e0", (f"{WHOLE}/24", f"{SPLIT}/24")),
            ),
        ),
    )


def counters(net: Built, host: str) -> tuple[int, int]:
    """(rx, tx) packets of ``host``'s e0, from the kernel."""
    link = json.loads(net[host].run(["ip", "-s", "-j", "link", "show", "e0"]).stdout)[0]
    return link["stats64"]["rx"]["packets"], link["stats64"]["tx"]["packets"]


def flood(net: Built, dst: str, ip_len: int, seconds: float) -> dict[str, Any]:
    rx0, tx0 = counters(net, "s")
    t = time.monotonic()
    sent = net["c"].run(
        [sys.executable, "-c", FLOOD, dst, str(ip_len), str(seconds)], timeout=seconds + 30
    )
    elapsed = time.monotonic() - t
    time.sleep(0.3)
    rx1, tx1 = counters(net, "s")
    return {
        "requests_sent": int(sent.stdout),
        "requests_received": rx1 - rx0,
        "packets_sent_by_server": tx1 - tx0,
        "seconds": round(elapsed, 2),
    }


@contextlib.contextmanager
def kernel_replies_off(net: Built) -> Iterator[None]:
    net["s"].nft(nft_ruleset([WHOLE, SPLIT]))
    try:
        yield
    finally:
        net["s"].run(["nft", "delete", "table", "inet", "kickass_icmp_responder"], check=False)


def bench_responder(seconds: float, workdir: Path) -> dict[str, Any]:
    campaign = workdir / "bench-campaign.yaml"
    campaign.write_text(
        yaml.safe_dump(
            {
                "name": "bench-responder",
                "target": {"whole": WHOLE, "split": SPLIT},
                "probes": {"count": 1, "area": "WW"},
                "duration": 3600,
                "credit_budget": 10**9,
                "responder": {"pps_per_address": 1e9, "pps_per_prefix": 1e9, "pps_global": 1e9},
            }
        )
    )
    out: dict[str, Any] = {"seconds_per_run": seconds}
    with build(topology(), log_dir=workdir) as net:
        with kernel_replies_off(net):
            net.start(
                Process("echo", "s", (sys.executable, "-c", MINIMAL_ECHO), ready_text="echo ready")
            )
            r = flood(net, WHOLE, 84, seconds)
            net.stop("echo")
        r["replies_per_s"] = round(r["packets_sent_by_server"] / r["seconds"])
        out["minimal_echo_loop_84B"] = r
        responder = Process(
            "responder", "s", (KICKASS, "atlas", "responder", str(campaign), "--no-database"),
            env={"KICKASS_CONFIG": ""}, ready_text="responder ready", ready_timeout=60,
        )  # fmt: skip
        net.start(responder)
        r = flood(net, WHOLE, 84, seconds)
        r["replies_per_s"] = round(r["packets_sent_by_server"] / r["seconds"])
        out["responder_whole_84B"] = r
        r = flood(net, SPLIT, 1500, seconds)
        # Two packets (fragments) per split reply.
        r["replies_per_s"] = round(r["packets_sent_by_server"] / 2 / r["seconds"])
        out["responder_split_1500B"] = r
        net.stop("responder")
    out["responder_vs_minimal_loop"] = round(
        out["responder_whole_84B"]["replies_per_s"] / out["minimal_echo_loop_84B"]["replies_per_s"],
        2,
    )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print(
            "ERROR: the responder benchmark needs root (namespaces, raw sockets)", file=sys.stderr
        )
        return 2
    n_results = 500 if args.quick else 3000
    seconds = 2.0 if args.quick else 4.0
    result: dict[str, Any] = {
        "version": VERSION,
        "metadata": {
            "benchmark": "atlas",
            "when": datetime.now(UTC).isoformat(timespec="seconds"),
            "cpus": os.cpu_count(),
            "quick": args.quick,
        },
    }
    with tempfile.TemporaryDirectory(prefix="kickass-atlas-bench-") as tmp:
        external = os.environ.get("KICKASS_DATABASE_URL")
        with contextlib.ExitStack() as stack:
            server = external or stack.enter_context(embedded_postgres())
            url = create_database(server, f"atlas_bench_{uuid.uuid4().hex[:8]}")
            db.upgrade(url)
            result["ingest"] = bench_ingest(url, n_results)
        result["responder"] = bench_responder(seconds, Path(tmp))
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
