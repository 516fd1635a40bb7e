"""The paper's testbed (section IV-A) reproduced in namespaces: Kick-Ass against CUBIC.

    .venv/bin/python bench/trials_bench.py [--period S] [--quick] [--only ROW] \
        > bench/trials_bench.json

A benchmark, not a test: it runs real trials (`kickass trials run` in eight
sender namespaces at once, aligned periods) through ka-router and a 100 ms
emulated WAN to a kickass-agent, and prints one JSON object:

* light load: 100 Mbit/s, 8 senders, Pareto flows of 1..2000 packets (mean
  ~100), mean gap 0.5 s per sender; Kick-Ass (padded handshake) and CUBIC
  periods, then Kick-Ass with the paper's handshake;
* heavy load: 10 Mbit/s, mean flow 1 MB, mean gap 8 s per sender, open loop
  (a flow's gap counts from the last one's start) and, as ``heavy-closed``,
  the paper's closed-loop on-off senders (8 s off after each flow ends);
* ``floor``: ka-router ``--mode droptail`` (no rates: Kick-Ass runs in TCP
  mode), 10 Mbit/s, ~5.8 Mbit/s offered: Kick-Ass's TCP mode against CUBIC;
* ``experiment-c`` (issue 24): the light row with half of each Kick-Ass
  period's flows TCP (``kickass@tcp50``): the ``kickass@tcp50[tcp]`` row is
  the TCP flows' FCT without Kick-Ass beside them over with it;
* ``experiment-a``, ``experiment-b``: the paper's §III-D congestion
  experiments (kickass_testbed.congestion), two 40 s TCP epochs in 130 s
  (one 12 s epoch with ``--quick``).
* ``experiment-d`` (issue 24): the paper's §IV-B in miniature
  (kickass_testbed.wide_area): one round of Kick-Ass and CUBIC periods from
  one sender to ten emulated paths (4-250 ms, four behind a legacy drop-tail
  link of 20-50 Mbit/s), at 10 and at 100 Mbit/s access; per path the
  matched-flow speedup with its interval and completion per arm, the share
  finished sooner, the time in Kick-Ass mode and the largest goodput per arm
  (can the senders fill the link?), the machine's CPU over the round; a
  third round at 100 Mbit/s with the heavy rows' 1 MB mean flows (a flow
  every 2 s): the paper measured time in TCP mode on "longer-lived flows".
  ``--pairs`` pairs of 20 s periods (2 of 8 s with ``--quick``) per path.

``--only ROW`` (repeatable) runs some rows; each row reports its offered
load per arm.

The periods of a pair run the same flows under each arm (Kick-Ass, CUBIC,
and under light load Kick-Ass with the paper's handshake), in an order drawn
per pair. For each: mean and p95 FCT per size bucket and arm, the paired
speedup on matched flows with its interval over period pairs (kickass_analysis)
and beside it the share of matched flows finished sooner under Kick-Ass with
failures kept (a flow that did not finish ranked slower than any that did),
with its interval and completion per arm, the
time in Kick-Ass mode, the router's queueing delay (queue bytes / capacity,
per 10 ms telemetry sample) as a CDF per arm over the periods as they really
started, the wire bytes per payload byte per arm (what left the router's
queue over the flows' payload), and how well the eight senders kept the
schedule. The paper reports
Kick-Ass about 2x faster than CUBIC under light load and near-zero median
queueing under heavy load. All figures come from one run on this machine.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

from kickass_analysis.rollups import RollupStore
from kickass_testbed.pg import create_database, embedded_postgres
from kickass_testbed.trials import TrialSpec, rate_bps, run_trial
from kickass_testbed.wan import TestbedConfig

REPO = Path(__file__).resolve().parents[1]
SENDERS = tuple(f"s{i}" for i in range(1, 9))


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def fct_table(flows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in flows:
        if f["fct_ms"] is None:
            continue
        out.setdefault(f"{f['size_bucket']}/{f['arm']}", []).append(f["fct_ms"])
    return {
        k: {"n": len(v), "mean_ms": round(statistics.fmean(v), 1), "p95_ms": round(pct(v, 0.95), 1)}  # type: ignore[arg-type]  # v holds one at least
        for k, v in sorted(out.items())
    }


def pooled(flows: list[dict[str, Any]], arm: str) -> dict:
    """One arm's flows (every sender, every pair): FCT, completion, time in Kick-Ass mode."""
    mine = [f for f in flows if f["arm"] == arm]
    sel = [f for f in mine if f["fct_ms"] is not None]
    fcts = [f["fct_ms"] for f in sel]
    ka = [f["ka_mode_fraction"] for f in sel if f["ka_mode_fraction"] is not None]
    return {
        "flows": len(mine),
        "completed": len(sel),
        "failed": len(mine) - len(sel),
        "mean_fct_ms": round(statistics.fmean(fcts), 1) if fcts else None,
        "p95_fct_ms": round(pct(fcts, 0.95), 1) if fcts else None,  # type: ignore[arg-type]  # fcts is not empty here
        "ka_mode_fraction_mean": round(statistics.fmean(ka), 4) if ka else None,
    }


def spans(periods: list[dict[str, Any]]) -> list[tuple[float, float, str]]:
    """(start unix, end unix, arm) of every period as it really started."""
    return [
        (p["period_started_at"].timestamp(),
         p["period_started_at"].timestamp() + float(p["duration_s"]), p["arm"])
        for p in periods
    ]  # fmt: skip


def alignment(periods: list[dict[str, Any]], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """How well the senders kept the schedule: each period's start against its
    scheduled offset, and the spread of the same period's start across senders;
    the latest starts with what the runner did before them (its ``--json``
    ``period_starts``: the last period's deadline and end, an upload's time)."""
    deviation = [abs(float(p["start_deviation_s"])) for p in periods
                 if p["start_deviation_s"] is not None]  # fmt: skip
    by_index: dict[int, list[float]] = {}
    for p in periods:
        by_index.setdefault(p["period_index"], []).append(p["period_started_at"].timestamp())
    spread = [max(v) - min(v) for v in by_index.values() if len(v) > 1]
    return {
        "start_deviation_s_max": round(max(deviation), 4) if deviation else None,
        "start_spread_across_senders_s_max": round(max(spread), 3) if spread else None,
        "goal_s": 1.0,
        "latest": sorted(
            (
                {
                    "sender": n,
                    "period": int(i),
                    **slot,
                    "late_s": round(slot["actual_s"] - slot["scheduled_s"], 4),
                }
                for n, run in enumerate(runs)
                for i, slot in run.get("period_starts", {}).items()
                if slot.get("actual_s") is not None
            ),
            key=lambda x: -x["late_s"],
        )[:3],
    }


def queue_cdf(telemetry: list[dict], spans: list[tuple[float, float, str]], bps: float) -> dict:
    by: dict[str, list[float]] = {}
    for s in telemetry:
        if s.get("type") != "sample" or "ts" not in s:
            continue
        for a, b, arm in spans:
            if a <= s["ts"] < b:
                by.setdefault(arm, []).append(s["queue_bytes"] * 8 / bps * 1000)
                break
    return {
        arm: {f"p{int(q * 100)}": round(pct(v, q), 3) for q in (0.1, 0.5, 0.9, 0.99)}  # type: ignore[arg-type]  # v holds one at least
        | {"samples": len(v)}
        for arm, v in by.items()
    }


def wire_per_payload(
    telemetry: list[dict], periods: list[dict[str, Any]], flows: list[dict[str, Any]], gap_s: float
) -> dict[str, Any]:
    """Per arm: the bytes that left ka-router's queue (telemetry: the output
    rate over each sample's interval, IP bytes of every packet the access link
    carried, RTT indicators and handshakes included; the ACKs run the other
    way) over the payload of the flows, from each period's real start to the
    next one's (its period and the gap its flows finish in). Every sender has
    a row per period; they share the router, so a period is counted once,
    from its earliest start to its latest end. Only periods whose every flow
    completed count (a flow cut short carried part of its payload);
    ``periods_counted`` says how many. A loss-free TCP path needs
    1500/1448 = 1.036; Kick-Ass's fragments 1520/1440 = 1.056 (issue 24)."""
    by_period: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for f in flows:
        by_period[(f["period_index"], f["arm"])].append(f)
    spans: dict[tuple[int, str], tuple[float, float]] = {}
    for p in periods:
        key = (p["period_index"], p["arm"])
        a = p["period_started_at"].timestamp()
        b = a + float(p["duration_s"]) + gap_s
        lo, hi = spans.get(key, (a, b))
        spans[key] = (min(lo, a), max(hi, b))
    wire: dict[str, float] = defaultdict(float)
    payload: dict[str, float] = defaultdict(float)
    counted: Counter[str] = Counter()
    samples = sorted(
        (s for s in telemetry if s.get("type") == "sample" and "ts" in s), key=lambda s: s["ts"]
    )
    times = [s["ts"] for s in samples]
    for (index, arm), (a, b) in spans.items():
        mine = by_period.get((index, arm), [])
        if not mine or not all(f["completed"] for f in mine):
            continue
        for s in samples[bisect.bisect_left(times, a) : bisect.bisect_left(times, b)]:
            wire[arm] += s["output_rate_bps"] / 8 * s["interval_ms"] / 1000
        payload[arm] += sum(f["size_bytes"] for f in mine)
        counted[arm] += 1
    return {
        arm: {
            "wire_bytes": round(wire[arm]),
            "payload_bytes": round(payload[arm]),
            "wire_per_payload": round(wire[arm] / payload[arm], 4) if payload[arm] else None,
            "periods_counted": counted[arm],
        }
        for arm in sorted(counted)
    }


def _r3(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def speedups(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The paired speedup (kickass_analysis: matched flows, geometric mean,
    interval over period pairs) pooled over the senders' trials, per arm and
    bucket, and beside it ``sooner``: the share of matched flows finished
    sooner under the arm, failures kept, with its interval over period pairs
    (the speedup leaves out every pair with a failure)."""
    out: dict[str, Any] = {}
    for r in rows:
        if r["scope"] != "pooled":
            continue
        out.setdefault(f"{r['arm']} vs {r['baseline_arm']}", {})[r["size_bucket"]] = {
            "matched": r["matched"],
            "clusters": r["clusters"],
            "completion": [r["completion_arm"], r["completion_baseline"]],
            "speedup": _r3(r["speedup"]),
            "interval": [_r3(r["speedup_low"]), _r3(r["speedup_high"])],
            "sooner": {
                "share": _r3(r["sooner"]),
                "interval": [_r3(r["sooner_low"]), _r3(r["sooner_high"])],
                "pairs": r["sooner_pairs"],
                "clusters": r["sooner_clusters"],
            },
        }
    return out


def failures(flows: list[dict[str, Any]]) -> dict[str, list[tuple[str, int]]]:
    """Why flows did not complete, per arm: the five commonest reasons (their
    first 100 characters), so a completion rate comes with its causes."""
    by: dict[str, Counter[str]] = defaultdict(Counter)
    for f in flows:
        if not f["completed"]:
            by[f["arm"]][(f.get("error") or "no reason stored")[:100]] += 1
    return {arm: c.most_common(5) for arm, c in sorted(by.items())}


def pooled_speedups(database: str) -> list[dict[str, Any]]:
    """v_trial_speedups of this scenario's database: the senders' trials pooled
    (same workload, arms, capacity and destination: one group)."""
    with RollupStore(database) as store:
        return store.speedups()


def offered_load(flows: list[dict[str, Any]], periods: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm, the payload bit/s its flows asked for over its periods, all
    senders together: as the runners recorded it per period (summed over
    the senders' trials, averaged over the arm's periods), and from the flow
    sizes over the periods' time."""
    out: dict[str, Any] = {}
    for arm in sorted({p["arm"] for p in periods}):
        mine = [p for p in periods if p["arm"] == arm]
        by_index: dict[int, list[float]] = defaultdict(list)
        for p in mine:
            if p.get("offered_load_bps") is not None:
                by_index[p["period_index"]].append(float(p["offered_load_bps"]))
        seconds = sum({p["period_index"]: float(p["duration_s"]) for p in mine}.values())
        asked = sum(f["size_bytes"] * 8 for f in flows if f["arm"] == arm)
        out[arm] = {
            "recorded_bps": round(statistics.fmean(sum(v) for v in by_index.values()))
            if by_index
            else None,
            "from_sizes_bps": round(asked / seconds) if seconds else None,
        }
    return out


def scenario(
    url: str,
    name: str,
    capacity: str,
    spec: TrialSpec,
    router_args: list[str] | None = None,
    mode: str = "kickass",
) -> dict[str, Any]:
    database = create_database(url, f"bench_{name.replace('-', '_')}_{os.getpid()}")
    config = TestbedConfig(
        senders=len(SENDERS),
        receivers=1,
        capacity=capacity,
        rtt_ms=100.0,
        mode=mode,
        router_args=list(router_args or []),
    )
    bps = rate_bps(capacity)
    t0 = time.monotonic()
    out = run_trial(database, config, spec, senders=SENDERS)
    flows = list(out.flows)
    arms = (spec.arms or "").split(",")
    return {
        "capacity": capacity,
        "router_mode": mode,
        "senders": len(SENDERS),
        "rtt_ms": 100,
        "period_s": spec.period_s,
        "pairs": spec.pairs,
        "arms": arms,
        "workload": {
            "mean_gap_s": spec.mean_gap_s,
            "mean_packets": spec.mean_packets,
            "loop": "closed" if "closed" in spec.extra_args else "open",
        },
        "offered_load": offered_load(flows, out.periods),
        "by_arm": {arm: pooled(flows, arm) for arm in sorted({f["arm"] for f in flows})},
        "paired_speedup": speedups(pooled_speedups(database)),
        "by_size": fct_table(flows),
        "failures": failures(flows),
        "queueing_delay_ms_cdf": queue_cdf(out.telemetry, spans(out.periods), bps),
        "wire_bytes": wire_per_payload(out.telemetry, out.periods, flows, spec.gap_s),
        "schedule": alignment(out.periods, out.result["runs"]),
        "seconds": round(time.monotonic() - t0, 1),
    }


# The rows of issue 24's table, each runnable alone (--only).
ROWS = {
    "light": "100 Mbit/s, mean gap 0.5 s per sender; Kick-Ass, CUBIC, the paper's handshake",
    "heavy": "10 Mbit/s, 1 MB mean, open loop (~91%% offered)",
    "heavy-closed": "10 Mbit/s, 1 MB mean, the paper's closed-loop on-off senders (8 s off)",
    "floor": "the TCP-mode floor: ka-router --mode droptail, Kick-Ass in TCP mode vs CUBIC",
    "experiment-c": "the light row with half of each Kick-Ass period's flows TCP (kickass@tcp50)",
    "experiment-a": "8 Kick-Ass + 8 CUBIC flows, TCP switched on and off at ka-router",
    "experiment-b": "the same with the congestion at a legacy bottleneck behind ka-router",
    "experiment-d": "ten emulated wide-area paths (4-250 ms, some behind a legacy link), "
    "Kick-Ass vs CUBIC at 10 and 100 Mbit/s access",
}


def experiment(kind: str, quick: bool) -> dict[str, Any]:
    """The paper's congestion experiment (a) or (b) (kickass_testbed.congestion):
    per TCP epoch, Jain's index, the Kick-Ass/TCP mean per flow, utilisation
    and the RTTs to enter and leave TCP mode."""
    from kickass_testbed.congestion import CongestionSpec, run_congestion

    epochs = ((8.0, 20.0),) if quick else ((10.0, 50.0), (70.0, 110.0))
    spec = CongestionSpec(kind=kind, epochs=epochs, duration_s=28.0 if quick else 130.0)
    t0 = time.monotonic()
    o = run_congestion(spec)
    return {
        "kind": kind,
        "epochs": [e.__dict__ for e in o.epochs],
        "alone": o.alone,
        "seconds": round(time.monotonic() - t0, 1),
    }


# Experiment (d)'s rounds: the access rate, and the flows' mean size (packets)
# and mean gap (s). "100mbit-long" is the paper's measurement of time in
# TCP mode, on "longer-lived flows": the heavy rows' 1 MB mean.
EXPERIMENT_D = {
    "10mbit": (10e6, 100.0, 0.5),
    "100mbit": (100e6, 100.0, 0.5),
    "100mbit-long": (100e6, 694.0, 2.0),
}


def experiment_d(
    url: str, pairs: int, quick: bool, rounds: tuple[str, ...] = tuple(EXPERIMENT_D)
) -> dict[str, Any]:
    """Experiment (d)'s ``rounds``: per path the figures of
    kickass_testbed.wide_area, and across paths the speedups' range and the
    median time in Kick-Ass mode, beside the paper's (1.2-4x; 50% in TCP
    mode in the median case at 100 Mbit/s, on longer-lived flows)."""
    from kickass_testbed.wide_area import WideAreaSpec, run_wide_area

    out: dict[str, Any] = {"paper": {"speedup": [1.2, 4.0], "tcp_mode_median_at_100mbit": 0.5}}
    for name in rounds:
        access, mean_packets, mean_gap_s = EXPERIMENT_D[name]
        spec = WideAreaSpec(
            capacity_bps=access,
            pairs=2 if quick else pairs,
            period_s=8.0 if quick else 20.0,
            mean_packets=mean_packets,
            mean_gap_s=mean_gap_s,
        )
        database = create_database(
            url, f"bench_experiment_d_{name.replace('-', '_')}_{os.getpid()}"
        )
        o = run_wide_area(spec, database)
        out[name] = {
            "pairs": spec.pairs,
            "period_s": spec.period_s,
            "mean_packets": mean_packets,
            "mean_gap_s": mean_gap_s,
            "summary": o.summary,
            "paths": o.paths,
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--period", type=float, default=40.0, help="seconds per period (light load)")
    ap.add_argument("--heavy-period", type=float, default=90.0, help="seconds per period (heavy)")
    ap.add_argument(
        "--pairs",
        type=int,
        default=4,
        help="pairs of periods per trial (the interval is over pairs: at least 2, 4 by default)",
    )
    ap.add_argument("--quick", action="store_true", help="short periods, for a smoke run")
    ap.add_argument(
        "--only",
        choices=ROWS,
        action="append",
        help="run only these rows (repeatable; default: all): "
        + "; ".join(f"{k}: {v}" for k, v in ROWS.items()),
    )
    ap.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra ka-router argument, repeatable (e.g. --router-arg=--tcp-mode-hold=3)",
    )
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("ERROR: the benchmark builds network namespaces: run as root", file=sys.stderr)
        return 2
    light_p, heavy_p = (10.0, 20.0) if args.quick else (args.period, args.heavy_period)
    rev = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    report: dict[str, Any] = {
        "version": 1,
        "metadata": {
            "benchmark": "trials_bench",
            "date": datetime.now().isoformat(timespec="seconds"),
            "git": rev,
            "machine": {"cpus": os.cpu_count(), "kernel": platform.release()},
            "note": "one run; figures are for this 2-core machine, compare ratios not absolutes",
        },
    }
    report["metadata"]["router_args"] = args.router_arg
    with embedded_postgres() as url:
        rows = args.only or list(ROWS)
        light = TrialSpec(pairs=args.pairs, period_s=light_p, mean_gap_s=0.5, seed=11)
        heavy = TrialSpec(
            pairs=args.pairs, period_s=heavy_p, mean_gap_s=8.0, mean_packets=694.0, seed=13,
            arms="kickass,tcp:cubic",
        )  # fmt: skip
        # Every pair replays the same flows under each arm, in an order drawn
        # per pair.
        specs: dict[str, tuple[str, TrialSpec, str]] = {
            "light": ("100mbit", replace(light, arms="kickass,tcp:cubic,kickass:paper"), "kickass"),
            "heavy": ("10mbit", heavy, "kickass"),
            "heavy-closed": ("10mbit", replace(heavy, extra_args=["--loop", "closed"]), "kickass"),
            # ~5.8 Mbit/s offered, as the floor's namespace test (one sender there).
            "floor": (
                "10mbit",
                TrialSpec(
                    pairs=args.pairs,
                    period_s=light_p,
                    mean_gap_s=0.8,
                    mean_packets=50.0,
                    max_packets=800,
                    seed=21,
                    arms="kickass,tcp:cubic",
                ),  # fmt: skip
                "droptail",
            ),
            "experiment-c": ("100mbit", replace(light, arms="kickass@tcp50,tcp:cubic"), "kickass"),
        }
        for row in rows:
            print(f"{row} ...", file=sys.stderr, flush=True)
            if row == "experiment-d":
                report[row] = experiment_d(url, args.pairs, args.quick)
                continue
            if row.startswith("experiment-") and row != "experiment-c":
                report[row] = experiment(
                    "kickass-bottleneck" if row == "experiment-a" else "legacy-bottleneck",
                    args.quick,
                )
                continue
            capacity, spec, mode = specs[row]
            report[row] = scenario(url, row, capacity, spec, router_args=args.router_arg, mode=mode)
    json.dump(report, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
