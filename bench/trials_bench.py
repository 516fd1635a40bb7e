"""The paper's testbed (section IV-A) reproduced in namespaces: Kick-Ass against CUBIC.

    .venv/bin/python bench/trials_bench.py [--period S] [--quick] > bench/trials_bench.json

A benchmark, not a test: it runs real trials (`kickass trials run` in eight
sender namespaces at once, aligned periods) through ka-router and a 100 ms
emulated WAN to a kickass-agent, and prints one JSON object:

* light load: 100 Mbit/s, 8 senders, Pareto flows of 1..2000 packets (mean
  ~100), mean gap 0.5 s per sender; Kick-Ass (padded handshake) and CUBIC
  periods, then Kick-Ass with the paper's handshake;
* heavy load: 10 Mbit/s, mean flow 1 MB, mean gap 8 s per sender.

For each: mean and p95 FCT per size bucket and protocol, the speedup, the time
in Kick-Ass mode, and the router's queueing delay (queue bytes / capacity,
per 10 ms telemetry sample) as a CDF, per protocol period. The paper reports
Kick-Ass about 2x faster than CUBIC under light load and near-zero median
queueing under heavy load. All figures come from one run on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import kickass_db as db
from kickass_testbed.pg import create_database, embedded_postgres
from kickass_testbed.trials import TrialSpec, rate_bps, run_trial
from kickass_testbed.wan import TestbedConfig
from sqlalchemy import create_engine, text

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
        key = f"{f['size_bucket']}/{f['protocol']}" + (
            "-paper" if f["protocol"] == "kickass" and f["handshake"] == "paper" else ""
        )
        out.setdefault(key, []).append(f["fct_ms"])
    return {
        k: {"n": len(v), "mean_ms": round(statistics.fmean(v), 1), "p95_ms": round(pct(v, 0.95), 1)}
        for k, v in sorted(out.items())
    }


def pooled(flows: list[dict[str, Any]], protocol: str, handshake: str | None = None) -> dict:
    sel = [
        f
        for f in flows
        if f["protocol"] == protocol
        and f["fct_ms"] is not None
        and (handshake is None or f["handshake"] == handshake)
    ]
    fcts = [f["fct_ms"] for f in sel]
    ka = [f["ka_mode_fraction"] for f in sel if f["ka_mode_fraction"] is not None]
    failed = sum(
        1 for f in flows if f["protocol"] == protocol and not f["completed"]
        and (handshake is None or f["handshake"] == handshake)
    )  # fmt: skip
    return {
        "flows": len(sel),
        "failed": failed,
        "mean_fct_ms": round(statistics.fmean(fcts), 1) if fcts else None,
        "p95_fct_ms": round(pct(fcts, 0.95), 1) if fcts else None,
        "ka_mode_fraction_mean": round(statistics.fmean(ka), 4) if ka else None,
    }


def periods(database_url: str, router_run_name: str) -> list[tuple[float, float, str]]:
    """(start unix, end unix, protocol) of every period of the trials on this router run."""
    engine = create_engine(db.sqlalchemy_url(database_url))
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT extract(epoch FROM t.started_at) + p.start_offset_s, p.duration_s, "
                    "p.protocol FROM trial_periods p JOIN trials t ON t.id = p.trial_pk "
                    "WHERE t.router_run_name = :r"
                ),
                {"r": router_run_name},
            ).all()
    finally:
        engine.dispose()
    return [(float(a), float(a) + float(d), p) for a, d, p in rows]


def queue_cdf(telemetry: list[dict], spans: list[tuple[float, float, str]], bps: float) -> dict:
    by: dict[str, list[float]] = {}
    for s in telemetry:
        if s.get("type") != "sample" or "ts" not in s:
            continue
        for a, b, proto in spans:
            if a <= s["ts"] < b:
                by.setdefault(proto, []).append(s["queue_bytes"] * 8 / bps * 1000)
                break
    return {
        proto: {f"p{int(q * 100)}": round(pct(v, q), 3) for q in (0.1, 0.5, 0.9, 0.99)}
        | {"samples": len(v)}
        for proto, v in by.items()
    }


def scenario(
    url: str,
    name: str,
    capacity: str,
    spec: TrialSpec,
    extra: TrialSpec | None = None,
    router_args: list[str] | None = None,
) -> dict[str, Any]:
    database = create_database(url, f"bench_{name}_{os.getpid()}")
    config = TestbedConfig(
        senders=len(SENDERS),
        receivers=1,
        capacity=capacity,
        rtt_ms=100.0,
        router_args=list(router_args or []),
    )
    bps = rate_bps(capacity)
    t0 = time.monotonic()
    out = run_trial(database, config, spec, senders=SENDERS)
    flows = list(out.flows)
    cdf = queue_cdf(out.telemetry, periods(database, out.router_run_name), bps)
    if extra is not None:
        paper = run_trial(database, config, extra, senders=SENDERS)
        flows += [f for f in paper.flows if f["protocol"] == "kickass"]
        cdf["kickass-paper"] = queue_cdf(
            paper.telemetry, periods(database, paper.router_run_name), bps
        ).get("kickass")
    ka = pooled(flows, "kickass", "padded")
    tcp = pooled(flows, "tcp")
    result = {
        "capacity": capacity,
        "senders": len(SENDERS),
        "rtt_ms": 100,
        "period_s": spec.period_s,
        "workload": {"mean_gap_s": spec.mean_gap_s, "mean_packets": spec.mean_packets},
        "kickass": ka,
        "tcp_cubic": tcp,
        "speedup_mean_fct": round(tcp["mean_fct_ms"] / ka["mean_fct_ms"], 3)
        if ka["mean_fct_ms"] and tcp["mean_fct_ms"]
        else None,
        "by_size": fct_table(flows),
        "queueing_delay_ms_cdf": cdf,
        "seconds": round(time.monotonic() - t0, 1),
    }
    if extra is not None:
        paper_hs = pooled(flows, "kickass", "paper")
        result["kickass_paper_handshake"] = paper_hs
        if paper_hs["mean_fct_ms"] and ka["mean_fct_ms"]:
            result["padded_over_paper_handshake"] = round(
                paper_hs["mean_fct_ms"] / ka["mean_fct_ms"], 3
            )
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--period", type=float, default=40.0, help="seconds per period (light load)")
    ap.add_argument("--heavy-period", type=float, default=90.0, help="seconds per period (heavy)")
    ap.add_argument("--quick", action="store_true", help="short periods, for a smoke run")
    ap.add_argument("--only", choices=["light", "heavy"], help="run one scenario (default: both)")
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
        if args.only in (None, "light"):
            print("light load ...", file=sys.stderr, flush=True)
            report["light"] = scenario(
                url,
                "light",
                "100mbit",
                TrialSpec(pairs=1, period_s=light_p, mean_gap_s=0.5, seed=11),
                extra=TrialSpec(
                    pairs=1,
                    period_s=light_p,
                    mean_gap_s=0.5,
                    seed=12,
                    protocols="kickass",
                    handshake="paper",
                ),  # fmt: skip
                router_args=args.router_arg,
            )
        if args.only in (None, "heavy"):
            print("heavy load ...", file=sys.stderr, flush=True)
            report["heavy"] = scenario(
                url,
                "heavy",
                "10mbit",
                TrialSpec(pairs=1, period_s=heavy_p, mean_gap_s=8.0, mean_packets=694.0, seed=13),
                router_args=args.router_arg,
            )
    json.dump(report, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
