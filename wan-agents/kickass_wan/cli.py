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
from pathlib import Path

from kickass_core import config
from kickass_core.errors import KickassError

from .runner import AgentRef, TrialConfig, TrialRunner
from .schedule import Period, interleaved
from .spool import Spool
from .uploader import Uploader
from .workload import Workload, period_flows


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
    _schedule_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_plan)

    run = tsub.add_parser(
        "run",
        help="run an interleaved Kick-Ass vs TCP trial towards agents",
        description="Alternating periods of Kick-Ass and TCP flows per agent (order shuffled per "
        "pair), paper workload (Pareto sizes, exponential gaps). Agent secrets: --secret-dir "
        "DIR/NAME files or KICKASS_AGENT_SECRET. Runner token: --runner-token-file or "
        "KICKASS_RUNNER_TOKEN. Progress goes to stderr; --json prints the result to stdout.",
    )
    run.add_argument(
        "--agent",
        action="append",
        required=True,
        metavar="NAME=URL",
        help="agent name and control URL with an IP literal (repeat)",
    )
    run.add_argument("--secret-dir", help="directory with one secret file per agent name")
    _schedule_args(run)
    run.add_argument("--cc", default="cubic", help="TCP congestion control (cubic, reno, bbr...)")
    run.add_argument("--handshake", choices=["padded", "paper"], default="padded")
    run.add_argument("--access-capacity", type=float, help="edge access link, bit/s (stored)")
    run.add_argument("--router-run-name", help="ka-router telemetry run this trial overlaps")
    run.add_argument("--ka-send", help="path of ka-send (default: next to this program or PATH)")
    run.add_argument("--bind", help="source address for the flows")
    run.add_argument("--server", help="measurement server URL for uploads (none: spool only)")
    run.add_argument("--runner-token-file")
    run.add_argument(
        "--spool-dir", default=".kickass/spool", help="results outbox (default %(default)s)"
    )
    run.add_argument(
        "--agent-retry",
        type=float,
        default=30.0,
        metavar="S",
        help="keep asking an unreachable agent for flow tokens this long before skipping a "
        "period; its flows are recorded as not run (default %(default)s)",
    )
    run.add_argument("--json", action="store_true")
    run.set_defaults(func=cmd_run)

    up = tsub.add_parser("upload", help="re-send spooled results to the server")
    up.add_argument("--server", required=True)
    up.add_argument("--runner-token-file")
    up.add_argument("--spool-dir", default=".kickass/spool")
    up.set_defaults(func=cmd_upload)

    r = tsub.add_parser("runners", help="manage the runners allowed to upload results")
    rsub = r.add_subparsers(dest="runners_command", metavar="RUNNERS_COMMAND")
    r.set_defaults(func=lambda _a: (r.print_help(), 2)[1])
    a = rsub.add_parser("add", help="register a runner (or renew its token); prints the token")
    a.add_argument("name")
    a.add_argument("--database-url", help="postgresql:// URL (env KICKASS_DATABASE_URL)")
    a.set_defaults(func=cmd_runner_add)


def _schedule_args(p: argparse.ArgumentParser) -> None:
    """What decides the periods and their flows: `plan` and `run` take the
    same, so a dry run shows exactly the flows a run will start."""
    p.add_argument("--pairs", type=int, default=3, help="period pairs (default %(default)s)")
    p.add_argument(
        "--period", type=float, default=120.0, help="seconds per period (default %(default)s)"
    )
    p.add_argument(
        "--protocols", default="kickass,tcp", help="periods to run (default %(default)s)"
    )
    p.add_argument(
        "--mean-gap", type=float, default=0.5, help="mean gap between flows, s (default 0.5)"
    )
    p.add_argument("--mean-packets", type=float, default=100.0, help="mean flow size (default 100)")
    p.add_argument("--max-packets", type=int, default=2000, help="largest flow (default 2000)")
    p.add_argument("--shape", type=float, default=1.8, help="Pareto shape (default 1.8)")
    p.add_argument("--seed", type=int, default=1, help="seeds the schedule and the flows")
    p.add_argument(
        "--sender-index",
        type=int,
        default=0,
        help="runners sharing a --seed run aligned periods; each draws its own flows by index",
    )


def _workload(args: argparse.Namespace) -> Workload:
    try:
        return Workload(
            max_packets=args.max_packets,
            shape=args.shape,
            mean_packets=args.mean_packets,
            mean_gap_s=args.mean_gap,
            seed=args.seed,
        )
    except ValueError as exc:
        raise KickassError(f"bad workload: {exc}") from None


def _protocols(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(p.strip() for p in args.protocols.split(",") if p.strip())


def cmd_plan(args: argparse.Namespace) -> int:
    w = _workload(args)
    try:
        sched = interleaved(
            args.destination,
            pairs=args.pairs,
            period_s=args.period,
            seed=args.seed,
            protocols=_protocols(args),
        )
    except ValueError as exc:
        raise KickassError(
            f"bad trial plan: {exc}", hint="see: kickass trials plan --help"
        ) from None
    periods = []
    for p in sched:
        fl = period_flows(w, p.index, p.duration_s, args.sender_index)
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
        from kickass_db.trial_store import TrialStore
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


def _runner_token(path: str | None) -> str:
    hint = (
        "pass --runner-token-file or set KICKASS_RUNNER_TOKEN "
        "(make one on the server: kickass trials runners add NAME)"
    )
    token = config.read_secret(path, "KICKASS_RUNNER_TOKEN", "runner token", hint)
    if not token:
        raise KickassError("no runner token", hint=hint)
    return token


def _agents(args: argparse.Namespace) -> list[AgentRef]:
    out = []
    for spec in args.agent:
        name, sep, url = spec.partition("=")
        if not sep or not name or not url.startswith("http"):
            raise KickassError(f"bad --agent {spec!r}", hint="NAME=http://IP:PORT")
        secret = config.read_secret(
            Path(args.secret_dir) / name if args.secret_dir else None,
            "KICKASS_AGENT_SECRET",
            f"secret of agent {name}",
            "--secret-dir DIR (a file per agent name) or KICKASS_AGENT_SECRET",
        )
        if not secret:
            raise KickassError(
                f"no secret for agent {name}", hint="--secret-dir or KICKASS_AGENT_SECRET"
            )
        out.append(AgentRef(name, url, secret))
    return out


def cmd_run(args: argparse.Namespace) -> int:
    workload = _workload(args)
    cfg = TrialConfig(
        agents=_agents(args),
        pairs=args.pairs,
        period_s=args.period,
        workload=workload,
        congestion_control=args.cc,
        handshake=args.handshake,
        access_capacity_bps=args.access_capacity,
        router_run_name=args.router_run_name,
        ka_send=args.ka_send,
        source=args.bind,
        protocols=_protocols(args),
        sender_index=args.sender_index,
        agent_retry_s=args.agent_retry,
    )
    if args.agent_retry < 0:
        raise KickassError("--agent-retry must be >= 0")
    spool = Spool(args.spool_dir)
    uploader = (
        Uploader(args.server, _runner_token(args.runner_token_file), spool) if args.server else None
    )
    runner = TrialRunner(cfg, spool, uploader)

    def progress(p: Period) -> None:
        print(
            f"period {p.index + 1}: {p.destination} {p.protocol} for {p.duration_s:.0f}s",
            file=sys.stderr,
            flush=True,
        )

    try:
        result = runner.run(progress=progress)
    except KeyboardInterrupt:
        runner.stop.set()
        print(f"interrupted: results so far are in {args.spool_dir}", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps({"version": 1, **result}))
    else:
        for dest, by_proto in result["summary"].items():
            for proto, fcts in sorted(by_proto.items()):
                fcts = sorted(fcts)
                print(
                    f"{dest:<16} {proto:<8} flows {len(fcts):>5}  mean FCT "
                    f"{sum(fcts) / len(fcts):8.1f} ms  p50 {fcts[len(fcts) // 2]:8.1f} ms"
                )
        for sp in result["skipped_periods"]:
            print(f"period {sp['period'] + 1} skipped: {sp['error']}", file=sys.stderr)
        if result["spooled"]:
            print(
                f"{result['spooled']} results wait in {args.spool_dir}: "
                "run `kickass trials upload` when the server is back",
                file=sys.stderr,
            )
    return 0 if result["failed_flows"] == 0 and not result["rejected"] else 1


def cmd_upload(args: argparse.Namespace) -> int:
    spool = Spool(args.spool_dir)
    report = Uploader(args.server, _runner_token(args.runner_token_file), spool).flush()
    print(
        f"sent {report.sent}, rejected {report.rejected}, still spooled {report.pending}",
        file=sys.stderr,
    )
    for err in report.errors[:5]:
        print(f"  {err}", file=sys.stderr)
    return 0 if report.ok else 1
