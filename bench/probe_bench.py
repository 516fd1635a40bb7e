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

--default-plan (issue 11 part 4) measures instead what a volunteer who types
no flags gets, with the real programs end to end: ``kickass server`` and the
``kickass-probe`` client (its REPORTs, its reassembly budget, everything) in
the study's namespace internet, the client behind ka-linkem adding 50 ms
each way and losing 1% of the packets each way (kind ``wan``):

  default       the default plan (paper's 100 x every size, window "auto")
                with the default settings: its duration, the window the
                server reached (from its log), drop rates and verdict;
  fixed64       the same plan at --window 64 (the issue's 60 s reference);
  stop_and_wait --window 1, the paper's method. The whole plan takes about
                an hour at 100 ms, so by default it runs with fewer
                repetitions of every size (--w1-repetitions, 10: 3,660
                probes, about 6.5 minutes); its full-plan time is
                extrapolated;
  agreement     the default against W=1: per phase, the difference of the
                pooled drop rates with its 95% interval and z (agreement:
                the interval holds 0, |z| < 1.96), the excess split loss of
                both with their 95% intervals (agreement: they overlap), the
                verdicts (agreement: equal), and both against the path's
                configured loss (1 - 0.99^2 whole, 1 - 0.99^3 split).

--default-plan --bottleneck RATE (e.g. 4mbit) adds a slow access link: the
client's downlink served at RATE behind a 250 ms drop-tail queue (bufferbloat),
and runs the default plan only: its duration, the queue it built (the
window's record: each epoch's minimum RTT over the run's smallest), the
queue's drops (ka-linkem's counters) and its drop rates against the path's.

Usage: .venv/bin/python bench/probe_bench.py [--quick] > result.json
       .venv/bin/python bench/probe_bench.py --default-plan [--w1-repetitions N] > r.json
Take the machine's heavy-run lock: flock /tmp/kickass-heavy.lock ...
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import multiprocessing as mp
import os
import random
import re
import selectors
import socket
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, cast

from kickass_core import wire
from kickass_core.plan import ProbePlan
from kickass_core.verdict import excess
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
            s = cast(socket.socket, key.fileobj)
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
    from kickass_db.study_store import StudyStore

    engine = ProbeEngine(
        StudyStore(url), bench_policy(), bind_host="127.0.0.1", probe_port=0, server_version="bench"
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


WAN_RTT_MS = 100.0
WAN_LOSS = 0.01


def client_run(net, args: list[str], timeout: float) -> dict:  # noqa: ANN001
    """One kickass-probe run (JSON) in the "wan" client's namespace, timed."""
    from kickass_testbed.internet import parse_json_output

    t0 = time.monotonic()
    proc = net.run_client("wan", ["--json", *args], timeout=timeout)
    elapsed = time.monotonic() - t0
    out = parse_json_output(proc)
    if proc.returncode != 0:
        raise RuntimeError(f"kickass-probe exit {proc.returncode}: {proc.stderr[-2000:]}")
    pooled = out["pooled"]
    return {
        "args": args,
        "elapsed_s": round(elapsed, 2),
        "session_id": out["session_id"],
        "total_probes": out["plan"]["total_probes"],
        "window": out["plan"]["window"],
        "adaptive": out["plan"].get("adaptive", False),
        "whole": [pooled["whole"]["sent"], pooled["whole"]["acked"]],
        "split": [pooled["split"]["sent"], pooled["split"]["acked"]],
        "whole_drop_rate": pooled["whole"]["drop_rate"],
        "split_drop_rate": pooled["split"]["drop_rate"],
        "excess": out.get("excess"),
        "verdict": out["verdict"],
        "reassembly_invalid": out.get("reassembly_invalid"),
        "credit_wait_s": (out.get("reassembly") or {}).get("budget", {}).get("zero_credit_s"),
    }


def window_summary(server_log: Path, session_id: str) -> dict | None:
    """The adaptive window's record the server logged when the session ended."""
    pat = re.compile(rf"session {session_id} window (\{{.*\}})$")
    for line in server_log.read_text(errors="replace").splitlines():
        m = pat.search(line)
        if m:
            return json.loads(m.group(1))
    return None


def compare(a: dict, b: dict) -> dict:
    """Run ``a`` (the default) against ``b`` (W=1): per phase, the difference
    of drop rates with its 95% interval and z; excess intervals; verdicts."""
    out: dict = {}
    for ph, packets in (("whole", 2), ("split", 3)):
        (na, ka), (nb, kb) = a[ph], b[ph]
        pa, pb = 1 - ka / na, 1 - kb / nb
        se = math.sqrt(pa * (1 - pa) / na + pb * (1 - pb) / nb)
        pooled = (na - ka + nb - kb) / (na + nb)
        se0 = math.sqrt(pooled * (1 - pooled) * (1 / na + 1 / nb))
        d = pa - pb
        out[ph] = {
            "default": pa,
            "w1": pb,
            "difference": d,
            "ci95": [d - 1.96 * se, d + 1.96 * se],
            "z": d / se0 if se0 else 0.0,
            "agree": abs(d / se0 if se0 else 0.0) < 1.96,
            "path_truth": 1 - (1 - WAN_LOSS) ** packets,
            "default_z_vs_truth": (pa - (1 - (1 - WAN_LOSS) ** packets))
            / math.sqrt((1 - (1 - WAN_LOSS) ** packets) * (1 - WAN_LOSS) ** packets / na),
        }
    xa = excess(a["whole"][0], a["whole"][1], a["split"][0], a["split"][1])
    xb = excess(b["whole"][0], b["whole"][1], b["split"][0], b["split"][1])
    assert xa is not None and xb is not None
    out["excess"] = {
        "default": xa.to_json(),
        "w1": xb.to_json(),
        "intervals_overlap": xa.low <= xb.high and xb.low <= xa.high,
    }
    out["verdicts"] = {"default": a["verdict"], "w1": b["verdict"]}
    out["agree"] = (
        out["whole"]["agree"]
        and out["split"]["agree"]
        and out["excess"]["intervals_overlap"]
        and a["verdict"] == b["verdict"]
    )
    return out


def wan_internet(stack: ExitStack, **wan: Any) -> tuple:
    """The study internet with one "wan" client (WAN_RTT_MS, WAN_LOSS each
    way, plus ``wan`` options), on KICKASS_DATABASE_URL or an embedded
    PostgreSQL; everything is closed with ``stack``. Returns (net, log_dir)."""
    from kickass_db import upgrade
    from kickass_testbed.internet import probe_internet
    from kickass_testbed.pg import embedded_postgres

    url = os.environ.get("KICKASS_DATABASE_URL") or stack.enter_context(embedded_postgres())
    upgrade(url)
    log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="probe-bench-")))
    net = stack.enter_context(
        probe_internet(
            url,
            kinds=("wan",),
            wan_rtt_ms=WAN_RTT_MS,
            wan_loss=WAN_LOSS,
            log_dir=log_dir,
            **wan,
        )
    )
    return net, log_dir


def bottleneck_bench(rate: str) -> dict:
    """The default plan over the "wan" path with a slow, deep-buffered downlink."""
    from kickass_testbed.trials import rate_bps

    bps = rate_bps(rate)
    queue = int(bps / 8 * 0.25)
    out: dict = {
        "version": 1,
        "metadata": {
            "machine_cores": os.cpu_count(),
            "time": time.time(),
            "path": {
                "rtt_ms": WAN_RTT_MS,
                "loss_each_way": WAN_LOSS,
                "downlink": rate,
                "queue_bytes": queue,
                "emulator": "ka-linkem",
            },
        },
    }
    with ExitStack() as stack:
        net, log_dir = wan_internet(stack, wan_downlink=rate, wan_queue=f"{queue}b")
        before = linkem_towards_client(log_dir)
        print(f"default plan behind a {rate} downlink...", file=sys.stderr)
        d = client_run(net, [], timeout=3600)
        d["window_summary"] = window_summary(net.server_log, d["session_id"])
        d["plan_megabits"] = round(plan_bits(d["total_probes"]) / 1e6, 1)
        d["link_floor_s"] = round(plan_bits(d["total_probes"]) / bps, 1)
        out["default"] = d
        time.sleep(1.5)  # the emulator's next counters line
        after = linkem_towards_client(log_dir)
        out["linkem_towards_client"] = {
            k: after[k] - before.get(k, 0) for k in ("arrived", "lost", "dropped", "delivered")
        }
        for ph, packets in (("whole", 2), ("split", 3)):
            n, k = d[ph]
            truth = 1 - (1 - WAN_LOSS) ** packets
            out[f"{ph}_z_vs_path"] = (1 - k / n - truth) / math.sqrt(truth * (1 - truth) / n)
        print(f"  {d['elapsed_s']:.1f} s, window {d['window_summary']}", file=sys.stderr)
    return out


def plan_bits(total_probes: int) -> float:
    from kickass_core.plan import plan_bytes

    plan = ProbePlan.build()
    assert plan.total_probes == total_probes, "only the default plan"
    return plan_bytes(plan) * 8.0


def linkem_towards_client(log_dir: Path) -> dict:
    """ka-linkem's last counters of the direction towards the client."""
    path = log_dir / "lk1-stats.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return json.loads(lines[-1])["ab"] if lines else {}


def default_plan_bench(w1_repetitions: int, skip_fixed: bool) -> dict:
    """The default plan over the "wan" path, against W=64 and W=1 (see the doc)."""
    out: dict = {
        "version": 1,
        "metadata": {
            "machine_cores": os.cpu_count(),
            "time": time.time(),
            "path": {"rtt_ms": WAN_RTT_MS, "loss_each_way": WAN_LOSS, "emulator": "ka-linkem"},
        },
    }
    with ExitStack() as stack:
        net, _ = wan_internet(stack)
        print("default plan, default settings (window auto)...", file=sys.stderr)
        d = client_run(net, [], timeout=1800)
        d["window_summary"] = window_summary(net.server_log, d["session_id"])
        out["default"] = d
        print(f"  {d['elapsed_s']:.1f} s, window {d['window_summary']}", file=sys.stderr)
        if not skip_fixed:
            print("default plan at --window 64...", file=sys.stderr)
            f = client_run(net, ["--window", "64"], timeout=1800)
            out["fixed64"] = f
            print(f"  {f['elapsed_s']:.1f} s", file=sys.stderr)
        print(f"W=1, {w1_repetitions} repetitions of every size...", file=sys.stderr)
        w1 = client_run(
            net, ["--window", "1", "--repetitions", str(w1_repetitions)], timeout=4 * 3600
        )
        full = ProbePlan.build().total_probes
        w1["full_plan_estimate_s"] = round(w1["elapsed_s"] * full / w1["total_probes"], 1)
        out["stop_and_wait"] = w1
        print(
            f"  {w1['elapsed_s']:.1f} s -> full plan ~{w1['full_plan_estimate_s'] / 60:.1f} min",
            file=sys.stderr,
        )
        out["agreement"] = compare(d, w1)
        out["speedup_default_over_w1"] = round(w1["full_plan_estimate_s"] / d["elapsed_s"], 1)
        print(
            f"  agree {out['agreement']['agree']}, speedup {out['speedup_default_over_w1']}x",
            file=sys.stderr,
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="shorter runs, fewer points")
    ap.add_argument(
        "--default-plan",
        action="store_true",
        help="the default plan (adaptive window) over a 100 ms, 1%%-lossy namespace path "
        "against W=64 and W=1, with the real server and client",
    )
    ap.add_argument(
        "--w1-repetitions",
        type=int,
        default=10,
        metavar="N",
        help="--default-plan: repetitions of the W=1 run (100 = the whole plan, ~1 h)",
    )
    ap.add_argument(
        "--skip-fixed", action="store_true", help="--default-plan: leave out the W=64 run"
    )
    ap.add_argument(
        "--bottleneck",
        metavar="RATE",
        help="--default-plan behind a slow downlink (e.g. 4mbit, 250 ms of queue): the "
        "default plan only, and the queue it built",
    )
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("ERROR: the benchmark needs root (raw sockets)", file=sys.stderr)
        return 2
    if args.default_plan and args.bottleneck:
        print(json.dumps(bottleneck_bench(args.bottleneck), indent=1))
        return 0
    if args.default_plan:
        print(json.dumps(default_plan_bench(args.w1_repetitions, args.skip_fixed), indent=1))
        return 0
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
