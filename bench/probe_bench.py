"""Benchmark of the measurement server's probe engine (not a test).

Runs on loopback as root, with an embedded PostgreSQL (or KICKASS_DATABASE_URL)
so database writes are part of the cost. A separate "path" process plays the
volunteers: it does the real handshake for every session and acknowledges
probes, optionally after an emulated round-trip time and with emulated loss
(the Internet is the one part that cannot exist here).

Figures, all from one run on this machine:
  capacity      probes/s the engine sends with 8 saturating sessions, against a
                minimal raw-socket loop sending the same packets (ratio);
  concurrency   sessions with W=1 over a 100 ms RTT: achieved/ideal probe rate
                for growing session counts;
  plan_duration the paper's full plan (36,600 probes) over a 100 ms RTT path
                with 5% loss each way: W=1 against W=16, extrapolated from
                measured sub-plans, and whether their drop rates agree.

Usage: .venv/bin/python bench/probe_bench.py [--quick] > result.json
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import multiprocessing as mp
import os
import random
import selectors
import socket
import sys
import time
from contextlib import ExitStack

from kickass_core import wire
from kickass_core.plan import ProbePlan
from kickass_server.engine import ProbeEngine
from kickass_server.packets import SessionPackets, open_raw_socket
from kickass_server.policy import Policy

SPLIT_UDP_LEN = 1472


def path_process(conn, server, sessions, rtt_s, loss, seed) -> None:  # noqa: ANN001
    """The volunteers' side: handshake, then ACK every probe (after rtt_s, with
    per-packet loss `loss` on every fragment and on the ACK)."""
    rng = random.Random(seed)
    sel = selectors.DefaultSelector()
    socks = {}
    for sid, cookie in sessions:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        s.bind(("127.0.0.1", 0))
        s.setblocking(False)
        tag = bytes.fromhex(sid)
        socks[s] = tag
        s.sendto(wire.Hello(tag, bytes.fromhex(cookie)).encode(), server)
        sel.register(s, selectors.EVENT_READ)
    due: list[tuple[float, int, socket.socket, bytes]] = []
    received = 0
    n = 0
    conn.send("ready")
    while not conn.poll():
        timeout = 0.01 if not due else max(0.0, min(0.01, due[0][0] - time.monotonic()))
        for key, _ in sel.select(timeout):
            s = key.fileobj
            for _ in range(64):
                try:
                    data = s.recv(2048)
                except BlockingIOError:
                    break
                msg = wire.decode(data)
                if isinstance(msg, wire.Challenge):
                    # The ECHO crosses the same emulated path: the server's
                    # first timeout estimate comes from this round trip.
                    echo = wire.Echo(msg.session_tag, msg.token).encode()
                    n += 1
                    heapq.heappush(due, (time.monotonic() + rtt_s, n, s, echo))
                    continue
                if not isinstance(msg, wire.ProbeHeader):
                    continue
                received += 1
                packets = 2 if len(data) == SPLIT_UDP_LEN else 1
                if loss and any(rng.random() < loss for _ in range(packets + 1)):
                    continue  # a fragment, the whole packet or the ACK was lost
                ack = wire.Ack(msg.session_tag, msg.seq, len(data)).encode()
                if rtt_s:
                    n += 1
                    heapq.heappush(due, (time.monotonic() + rtt_s, n, s, ack))
                else:
                    s.sendto(ack, server)
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, _, s, ack = heapq.heappop(due)
            s.sendto(ack, server)
    conn.send({"received": received})


def sink_process(conn) -> None:  # noqa: ANN001
    """Counts what the minimal raw sender puts on loopback (UDP port 9)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.bind(("127.0.0.1", 9))
    s.settimeout(0.05)
    n = 0
    conn.send("ready")
    while not conn.poll():
        try:
            s.recv(2048)
            n += 1
        except TimeoutError:
            pass
    conn.send(n)


def bench_policy() -> Policy:
    big = 10**12
    return Policy(
        pps_global=1e9,
        pps_per_address=1e9,
        pps_per_prefix=1e9,
        max_sessions=100000,
        sessions_per_address=100000,
        sessions_per_prefix=100000,
        sessions_per_address_hour=100000,
        sessions_per_prefix_hour=100000,
        bytes_per_address_hour=big,
        bytes_per_prefix_hour=big,
        max_repetitions=1000,
        silence_timeout_s=600,
    )


def run_engine(
    url: str,
    plans: list[ProbePlan],
    rtt_s: float,
    loss: float,
    seconds: float,
    until_done: bool = False,
    seed: int = 1,
) -> dict:
    from kickass_db.store import Store

    engine = ProbeEngine(
        Store(url), bench_policy(), bind_host="127.0.0.1", probe_port=0, server_version="bench"
    )
    engine.start()
    try:
        news = [engine.create_session(p, "127.0.0.1") for p in plans]
        parent, child = mp.Pipe()
        proc = mp.Process(
            target=path_process,
            args=(
                child,
                ("127.0.0.1", engine.probe_port),
                [(n.session_id, n.cookie) for n in news],
                rtt_s,
                loss,
                seed,
            ),
        )
        proc.start()
        assert parent.recv() == "ready"
        t0 = time.monotonic()

        def snapshots() -> list:
            # Frozen copies: the engine's runs are not shared with callers.
            return [s for s in (engine.snapshot(n.session_id) for n in news) if s is not None]

        while time.monotonic() - t0 < seconds:
            if until_done and all(s.state not in ("created", "probing") for s in snapshots()):
                break
            time.sleep(0.05)
        elapsed = time.monotonic() - t0
        live = snapshots()
        sent = sum(s.sent for s in live)
        done = len(live) == len(news) and all(s.state == "complete" for s in live)
        phase = {
            ph: [sum(s.phase_sent[ph] for s in live), sum(s.phase_acked[ph] for s in live)]
            for ph in ("whole", "split")
        }
        parent.send("stop")
        path = parent.recv()
        proc.join(5)
        return {
            "elapsed_s": elapsed,
            "probes_sent": sent,
            "complete": done,
            "phase": phase,
            "path_received": path["received"],
            "db_backlog": engine.stats()["db_write_backlog"],
        }
    finally:
        engine.stop()


def minimal_sender(seconds: float) -> dict:
    """The floor: one raw socket, prebuilt packets, a bare loop."""
    plan = ProbePlan.build()
    tag = b"\x01" * 8
    t = SessionPackets("127.0.0.1", "127.0.0.1", 9000, 9, tag)
    pkts = []
    for seq in range(0, plan.total_probes, 97):
        p = plan.probe(seq)
        pkts.append(t.render(p.phase, p.ip_len, seq, seq % 65535 + 1))
    raw = open_raw_socket()
    raw.setblocking(True)
    parent, child = mp.Pipe()
    proc = mp.Process(target=sink_process, args=(child,))
    proc.start()
    assert parent.recv() == "ready"
    probes = 0
    t0 = time.monotonic()
    i = 0
    while time.monotonic() - t0 < seconds:
        for _ in range(64):
            for pkt in pkts[i % len(pkts)]:
                raw.sendto(pkt, ("127.0.0.1", 0))
            i += 1
        probes += 64
    elapsed = time.monotonic() - t0
    parent.send("stop")
    got = parent.recv()
    proc.join(5)
    raw.close()
    return {
        "elapsed_s": elapsed,
        "probes_sent": probes,
        "pps": probes / elapsed,
        "sink_received": got,
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="shorter runs, fewer points")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("ERROR: the benchmark needs root (raw sockets)", file=sys.stderr)
        return 2
    secs = 3.0 if args.quick else 6.0
    out: dict = {"version": 1, "metadata": {"machine_cores": os.cpu_count(), "time": time.time()}}
    with ExitStack() as stack:
        url = os.environ.get("KICKASS_DATABASE_URL")
        if not url:
            from kickass_testbed.pg import embedded_postgres

            url = stack.enter_context(embedded_postgres())
        from kickass_db import upgrade

        upgrade(url)
        print("capacity: minimal raw sender...", file=sys.stderr)
        base = minimal_sender(secs)
        print("capacity: engine with 8 saturating sessions...", file=sys.stderr)
        big = ProbePlan.build(repetitions=100, window=64)
        eng = run_engine(url, [big] * 8, 0.0, 0.0, secs)
        eng["pps"] = eng["probes_sent"] / eng["elapsed_s"]
        out["capacity"] = {
            "minimal_raw_sender": base,
            "engine": eng,
            "ratio_engine_to_minimal": eng["pps"] / base["pps"],
        }
        print(
            f"  engine {eng['pps']:.0f} probes/s vs minimal {base['pps']:.0f}: "
            f"{eng['pps'] / base['pps']:.2f}",
            file=sys.stderr,
        )
        conc = []
        for k in [50, 200] if args.quick else [100, 400, 1000]:
            print(f"concurrency: {k} sessions, W=1, 100 ms RTT...", file=sys.stderr)
            r = run_engine(url, [ProbePlan.build(repetitions=100, window=1)] * k, 0.1, 0.0, secs)
            ideal = k * 10.0 * r["elapsed_s"]
            conc.append(
                {
                    "sessions": k,
                    "achieved_over_ideal": r["probes_sent"] / ideal,
                    "probes_sent": r["probes_sent"],
                    "elapsed_s": r["elapsed_s"],
                }
            )
            print(f"  achieved/ideal {r['probes_sent'] / ideal:.2f}", file=sys.stderr)
        out["concurrency"] = conc
        rep_w1 = 1 if args.quick else 2
        rep_w16 = 5 if args.quick else 20
        res = {}
        for w, rep in ((1, rep_w1), (16, rep_w16)):
            print(
                f"plan duration: W={w}, {rep} repetitions, 100 ms RTT, 5% loss...", file=sys.stderr
            )
            plan = ProbePlan.build(repetitions=rep, window=w)
            r = run_engine(url, [plan], 0.1, 0.05, 3600, until_done=True, seed=w)
            full = ProbePlan.build().total_probes
            r["full_plan_estimate_s"] = r["elapsed_s"] * full / plan.total_probes
            for ph, (sent, acked) in r["phase"].items():
                r[f"{ph}_drop_rate"] = 1 - acked / sent if sent else None
            res[f"W{w}"] = r
            print(
                f"  {r['elapsed_s']:.1f}s -> full plan ~{r['full_plan_estimate_s'] / 60:.1f} min;"
                f" whole {r['whole_drop_rate']:.3f} split {r['split_drop_rate']:.3f}",
                file=sys.stderr,
            )
        agree = {}
        for ph in ("whole", "split"):
            a, b = res["W1"]["phase"][ph], res["W16"]["phase"][ph]
            p1, p2 = 1 - a[1] / a[0], 1 - b[1] / b[0]
            pooled = (a[0] - a[1] + b[0] - b[1]) / (a[0] + b[0])
            se = math.sqrt(pooled * (1 - pooled) * (1 / a[0] + 1 / b[0]))
            agree[ph] = {
                "W1": p1,
                "W16": p2,
                "z": (p1 - p2) / se if se else 0.0,
                "expected": 1 - 0.95 ** (2 if ph == "whole" else 3),
            }
        res["agreement"] = agree
        res["speedup_W16_over_W1"] = (
            res["W1"]["full_plan_estimate_s"] / res["W16"]["full_plan_estimate_s"]
        )
        out["plan_duration"] = res
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
