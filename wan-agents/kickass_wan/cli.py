"""`kickass trials`: wide-area Kick-Ass vs TCP trials.

kickass trials plan --destination A [--destination B] [--pairs N] [--period S] [--seed N] [--json]
    print the interleaved schedule and the workload's flows per period (a dry run)
kickass trials runners add NAME [--database-url URL]
    register a trial runner with the server's database; prints its upload token once
"""

from __future__ import annotations

import argparse
import json
import sys

from kickass_core.errors import KickassError

from .schedule import interleaved
from .workload import Workload, flows


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "trials",
        help="wide-area Kick-Ass vs TCP trials (schedule, runners)",
        description="Interleaved Kick-Ass and TCP trials towards remote receivers (paper IV).",
    )
    parser.set_defaults(func=lambda _a: (parser.print_help(), 2)[1])
    tsub = parser.add_subparsers(dest="trials_command", metavar="TRIALS_COMMAND")

    p = tsub.add_parser("plan", help="print the interleaved schedule and its flows (dry run)")
    p.add_argument("--destination", action="append", required=True, help="agent name (repeat)")
    p.add_argument("--pairs", type=int, default=3, help="Kick-Ass/TCP period pairs (default 3)")
    p.add_argument("--period", type=float, default=120.0, help="seconds per period (default 120)")
    p.add_argument("--mean-gap", type=float, default=0.5, help="mean gap between flows, s")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_plan)

    r = tsub.add_parser("runners", help="manage the runners allowed to upload results")
    rsub = r.add_subparsers(dest="runners_command", metavar="RUNNERS_COMMAND")
    r.set_defaults(func=lambda _a: (r.print_help(), 2)[1])
    a = rsub.add_parser("add", help="register a runner (or renew its token); prints the token")
    a.add_argument("name")
    a.add_argument("--database-url", help="postgresql:// URL (env KICKASS_DATABASE_URL)")
    a.set_defaults(func=cmd_runner_add)


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        sched = interleaved(
            args.destination, pairs=args.pairs, period_s=args.period, seed=args.seed
        )
        w = Workload(seed=args.seed, mean_gap_s=args.mean_gap)
    except ValueError as exc:
        raise KickassError(
            f"bad trial plan: {exc}", hint="see: kickass trials plan --help"
        ) from None
    periods = []
    for p in sched:
        fl = list(flows(w, p.duration_s, stream=p.index))
        periods.append(
            {**p.to_json(), "flows": len(fl), "packets": sum(f.size_packets for f in fl)}
        )
    if args.json:
        json.dump({"version": 1, "workload": w.to_json(), "periods": periods}, sys.stdout)
        print()
        return 0
    print(f"{'#':>3} {'pair':>4} {'destination':<16} {'protocol':<8} {'start':>8} {'flows':>6} "
          f"{'packets':>8}")  # fmt: skip
    for p in periods:
        print(
            f"{p['index']:>3} {p['pair']:>4} {p['destination']:<16} {p['protocol']:<8} "
            f"{p['start_s']:>7.0f}s {p['flows']:>6} {p['packets']:>8}"
        )
    total = sum(p["duration_s"] for p in periods)
    print(f"{len(periods)} periods, {total / 60:.1f} min in all", file=sys.stderr)
    return 0


def cmd_runner_add(args: argparse.Namespace) -> int:
    try:
        from kickass_db.trials import TrialStore
    except ImportError:
        raise KickassError(
            "the database package is not installed here",
            hint="run this on the server host (pip install kickass-db)",
        ) from None
    store = TrialStore(args.database_url)
    try:
        token = store.add_runner(args.name)
    finally:
        store.close()
    print(token)
    print(f"runner {args.name}: keep this token; it is shown only once", file=sys.stderr)
    return 0
