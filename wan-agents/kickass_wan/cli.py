"""`kickass trials`: wide-area Kick-Ass vs TCP trials.

kickass trials plan --destination A [--destination B] [--pairs N] [--period S] [--seed N] [--json]
    print the interleaved schedule and the workload's flows per period (a dry run)
kickass trials run [--config FILE] [--agent NAME=URL ...] [...]
    one round of interleaved trials (service.RoundSettings: flags > the [trials] table of FILE)
kickass trials upload --server URL
    re-send spooled results
kickass trials runners add NAME [--database-url URL]
    register a trial runner with the server's database; prints its upload token once
kickass trials agents add NAME URL --secret-file FILE|-   (agents list, agents check [NAME...])
    register a deployed receiver with this runner: its URL and the secret its package made,
    checked against the agent first (receivers.py); `run --agent NAME` then finds both
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from typing import Any

from kickass_core import config
from kickass_core.cli import group
from kickass_core.errors import KickassError
from kickass_core.flow_record import CONGESTION_CONTROLS, DEFAULT_CONGESTION_CONTROL, HANDSHAKES

from .trials import receivers
from .trials.schedule import ARM_GRAMMAR, KICKASS, Period, interleaved
from .trials.service import SECTION, RoundSettings, ScheduleSettings, run_round, uploader
from .trials.spool import Spool
from .trials.workload import pair_flows


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    tsub = group(
        sub,
        "trials",
        help="wide-area Kick-Ass vs TCP trials (schedule, runners)",
        description="Interleaved Kick-Ass and TCP trials towards remote receivers (paper IV).",
    )

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
        "--config",
        help="TOML file whose [trials] table holds the round's settings (flags override it; "
        "$KICKASS_CONFIG by default)",
    )
    run.add_argument(
        "--agent",
        action="append",
        metavar="NAME[=URL]",
        help="a registered agent's name (kickass trials agents add), or a name and a control "
        "URL with an IP literal (repeat; or agents in --config)",
    )
    run.add_argument("--secret-dir", help="directory with one secret file per agent name")
    run.add_argument(
        "--agents-dir",
        help=f"the registry of agents (default ${receivers.AGENTS_DIR_ENV} or "
        f"{receivers.DEFAULT_AGENTS_DIR})",
    )
    run.add_argument(
        "--no-check",
        action="store_true",
        help="start without checking the agents first (version, Kick-Ass receiver, clock "
        "offset, path MTU)",
    )
    _schedule_args(run)
    run.add_argument(
        "--cc",
        help=f"TCP congestion control ({', '.join(CONGESTION_CONTROLS)}...; default "
        f"{DEFAULT_CONGESTION_CONTROL})",
    )
    run.add_argument("--handshake", choices=HANDSHAKES, help="default padded")
    run.add_argument("--access-capacity", type=float, help="edge access link, bit/s (stored)")
    run.add_argument("--router-run-name", help="ka-router telemetry run this trial overlaps")
    run.add_argument("--ka-send", help="path of ka-send (default: next to this program or PATH)")
    run.add_argument("--bind", help="source address for the flows")
    run.add_argument("--server", help="measurement server URL for uploads (none: spool only)")
    run.add_argument("--runner-token-file")
    run.add_argument("--spool-dir", help="results outbox (default .kickass/spool)")
    run.add_argument(
        "--flow-timeout",
        type=float,
        help="both protocols: a flow fails this long after it was due (default 60)",
    )
    run.add_argument(
        "--max-concurrent",
        type=int,
        help="both protocols: flows in progress at once; later ones wait, their wait "
        "counted in their completion time (default 256)",
    )
    run.add_argument(
        "--tcp-metrics",
        choices=["disable", "leave"],
        help="the TCP metrics cache (ssthresh kept per destination): disable it for the "
        "trial (default; needs root) or leave it",
    )
    run.add_argument(
        "--agent-retry",
        type=float,
        metavar="S",
        help="keep asking an unreachable agent for flow tokens this long before skipping a "
        "period; its flows are recorded as not run (default 30)",
    )
    run.add_argument("--json", action="store_true")
    run.set_defaults(func=cmd_run)

    up = tsub.add_parser("upload", help="re-send spooled results to the server")
    up.add_argument("--server", required=True)
    up.add_argument("--runner-token-file")
    up.add_argument("--spool-dir", default=".kickass/spool")
    up.set_defaults(func=cmd_upload)

    _agents_parser(tsub)

    rsub = group(tsub, "runners", help="manage the runners allowed to upload results")
    a = rsub.add_parser("add", help="register a runner (or renew its token); prints the token")
    a.add_argument("name")
    a.add_argument("--database-url", help="postgresql:// URL (env KICKASS_DATABASE_URL)")
    a.set_defaults(func=cmd_runner_add)


def _agents_parser(tsub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    asub = group(
        tsub,
        "agents",
        help="register deployed receivers with this runner, and check them",
        description="The receivers this runner sends to: their control URL and the secret "
        "their package made, kept in the registry (--agents-dir).",
    )
    dir_help = (
        f"the registry (default ${receivers.AGENTS_DIR_ENV} or {receivers.DEFAULT_AGENTS_DIR})"
    )
    add = asub.add_parser(
        "add",
        help="register a receiver: checked with its secret first",
        description="Register a deployed receiver. On the runner host: "
        "ssh root@RECEIVER cat /etc/kickass-agent/secret | "
        "kickass trials agents add NAME http://ADDRESS:8700 --secret-file -",
    )
    add.add_argument("name")
    add.add_argument("url", help="its control API, http://IP:PORT (port 8700 by default)")
    add.add_argument(
        "--secret-file",
        required=True,
        help="the agent's secret (its /etc/kickass-agent/secret); - reads standard input",
    )
    add.add_argument("--agents-dir", help=dir_help)
    add.add_argument("--bind", help="source address for the check's datagrams")
    add.add_argument(
        "--no-check", action="store_true", help="register without asking the agent (it is away)"
    )
    add.set_defaults(func=cmd_agents_add)
    ls = asub.add_parser("list", help="the registered receivers")
    ls.add_argument("--agents-dir", help=dir_help)
    ls.set_defaults(func=cmd_agents_list)
    ck = asub.add_parser(
        "check",
        help="check registered receivers as a round does before it starts",
        description="Per agent: reachable with its secret, version, Kick-Ass receiver up and "
        "answering on its UDP port, clock offset, path MTU (1500-byte datagrams with DF set). "
        "Exit 0 when every agent is ready, 1 otherwise.",
    )
    ck.add_argument("names", nargs="*", metavar="NAME", help="default: every registered agent")
    ck.add_argument("--agents-dir", help=dir_help)
    ck.add_argument("--bind", help="source address for the check's datagrams")
    ck.add_argument("--json", action="store_true")
    ck.set_defaults(func=cmd_agents_check)


def _schedule_args(p: argparse.ArgumentParser) -> None:
    """What decides the periods and their flows: `plan` and `run` take the
    same, so a dry run shows exactly the flows a run will start."""
    p.add_argument("--pairs", type=int, help="period pairs (default 3)")
    p.add_argument("--period", type=float, help="seconds per period (default 120)")
    p.add_argument("--protocols", help="periods to run (default kickass,tcp)")
    p.add_argument(
        "--arms",
        help=f"what the periods of a pair run, comma-separated: {ARM_GRAMMAR} (a Kick-Ass "
        "arm's handshake, TCP mode's congestion control in the transport, NN%% of the "
        "flows run as kernel TCP instead; a TCP arm's kernel congestion control), each "
        "optionally +<ms>ms (a handicap); e.g. "
        "kickass,tcp:cubic,tcp:reno,tcp:bbr; an A/A calibration: tcp:cubic,tcp:cubic; "
        "TCP with and without Kick-Ass beside it: tcp:cubic,kickass@tcp50 "
        "(default: kickass and TCP with --cc)",
    )
    p.add_argument(
        "--gap", type=float, help="seconds between periods for flows to end (default 10)"
    )
    p.add_argument(
        "--literal-range",
        action="store_true",
        default=None,
        help="the paper's 1..2000 packets taken literally (Pareto scale 1, sizes rounded "
        "down: 71%% of flows are of one packet, mean 1.9) instead of the mean of 100 "
        "(no flow under 46 packets)",
    )
    p.add_argument(
        "--loop",
        choices=["open", "closed"],
        help="open: a flow starts its gap after the previous one started (default); closed: "
        "the paper's on-off senders, a flow starts its gap (an off time) after the previous "
        "one ended",
    )
    p.add_argument("--mean-gap", type=float, help="mean gap between flows, s (default 0.5)")
    p.add_argument("--mean-packets", type=float, help="mean flow size (default 100)")
    p.add_argument("--max-packets", type=int, help="largest flow (default 2000)")
    p.add_argument("--shape", type=float, help="Pareto shape (default 1.8)")
    p.add_argument("--seed", type=int, help="seeds the schedule and the flows (default 1)")
    p.add_argument(
        "--sender-index",
        type=int,
        help="runners sharing a --seed run aligned periods; each draws its own flows by index",
    )


def _given(pairs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in pairs.items() if v is not None}


def _schedule_mapping(args: argparse.Namespace) -> dict[str, Any]:
    """The schedule flags that were given, as RoundSettings fields."""
    out = _given(
        {
            "pairs": args.pairs,
            "period_s": args.period,
            "sender_index": args.sender_index,
            "gap_s": args.gap,
            "arms": None if args.arms is None else [a for a in args.arms.split(",") if a.strip()],
            "protocols": None
            if args.protocols is None
            else [p.strip() for p in args.protocols.split(",") if p.strip()],
        }
    )
    workload = _given(
        {
            "mean_gap_s": args.mean_gap,
            "mean_packets": args.mean_packets,
            "max_packets": args.max_packets,
            "shape": args.shape,
            "seed": args.seed,
            "literal_range": args.literal_range,
            "loop": args.loop,
        }
    )
    if workload:
        out["workload"] = workload
    return out


def settings_from_args(args: argparse.Namespace) -> RoundSettings:
    """Flags > the [trials] table of --config (or $KICKASS_CONFIG) > defaults."""
    data = dict(config.load_file(args.config).get(SECTION, {}))
    flags = _schedule_mapping(args)
    if "workload" in flags:
        flags["workload"] = {**data.get("workload", {}), **flags["workload"]}
    data.update(flags)
    if args.agent:
        registry = receivers.agents_dir(args.agents_dir)
        agents = []
        for spec in args.agent:
            name, sep, url = spec.partition("=")
            known = receivers.registered(name, registry) if name else None
            entry: dict[str, Any] = {"name": name, "url": url}
            if not sep and known is None:
                raise KickassError(
                    f"agent {spec!r} is not registered in {registry}",
                    hint="kickass trials agents add NAME URL --secret-file -, or --agent "
                    "NAME=http://IP:PORT",
                )
            if not sep and known is not None:
                entry["url"] = known[0]
            if not name or not entry["url"].startswith("http"):
                raise KickassError(f"bad --agent {spec!r}", hint="NAME or NAME=http://IP:PORT")
            # A registered agent's secret, unless --secret-dir names another place.
            if known is not None and not args.secret_dir:
                entry["secret_file"] = str(known[1])
            agents.append(entry)
        data["agents"] = agents
    data.update(
        _given(
            {
                "congestion_control": args.cc,
                "handshake": args.handshake,
                "access_capacity_bps": args.access_capacity,
                "router_run_name": args.router_run_name,
                "ka_send": args.ka_send,
                "bind": args.bind,
                "server": args.server,
                "runner_token_file": args.runner_token_file,
                "spool_dir": args.spool_dir,
                "agent_retry_s": args.agent_retry,
                "flow_timeout_s": args.flow_timeout,
                "max_concurrent": args.max_concurrent,
                "tcp_metrics": args.tcp_metrics,
            }
        )
    )
    if not data.get("agents"):
        raise KickassError("no agents", hint="--agent NAME=http://IP:PORT, or agents in --config")
    return RoundSettings.from_mapping(data, "trial settings")


def cmd_plan(args: argparse.Namespace) -> int:
    settings = ScheduleSettings.from_mapping(_schedule_mapping(args))
    w = settings.workload_obj()
    sender_index = settings.sender_index
    try:
        sched = interleaved(
            args.destination,
            pairs=settings.pairs,
            period_s=settings.period_s,
            gap_s=settings.gap_s,
            seed=w.seed,
            arms=settings.arm_objs(
                getattr(args, "cc", None) or DEFAULT_CONGESTION_CONTROL, "padded"
            ),
        )
    except ValueError as exc:
        raise KickassError(
            f"bad trial plan: {exc}", hint="see: kickass trials plan --help"
        ) from None
    dest_index = {d: i for i, d in enumerate(args.destination)}
    periods: list[dict[str, Any]] = []
    for p in sched:
        fl = pair_flows(w, p.pair, p.duration_s, sender_index, dest_index[p.destination])
        periods.append(
            {**p.to_json(), "flows": len(fl), "packets": sum(f.size_packets for f in fl)}
        )
    if args.json:
        json.dump({"version": 1, "workload": w.to_json(), "periods": periods}, sys.stdout)
        print()
        return 0
    print(f"{'#':>3} {'pair':>4} {'destination':<16} {'arm':<14} {'start':>8} {'flows':>6} "
          f"{'packets':>8}")  # fmt: skip
    for row in periods:
        print(
            f"{row['index']:>3} {row['pair']:>4} {row['destination']:<16} {row['arm']:<14} "
            f"{row['start_s']:>7.0f}s {row['flows']:>6} {row['packets']:>8}"
        )
    total = sum(p["duration_s"] for p in periods) + settings.gap_s * max(0, len(periods) - 1)
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


def cmd_run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    if not args.no_check:
        arms = settings.arm_objs(settings.congestion_control, settings.handshake)
        kickass = any(a.protocol == KICKASS for a in arms)
        checks = [
            receivers.check_agent(ref, source=settings.bind, kickass=kickass)
            for ref in settings.agent_refs(args.secret_dir)
        ]
        for c in checks:
            print(c.render(), file=sys.stderr)
        bad = [c for c in checks if not c.ok]
        if bad:
            raise KickassError(
                "not ready for a round: "
                + "; ".join(f"agent {c.name}: {', '.join(c.problems)}" for c in bad),
                hint="fix what is named (kickass trials agents check), or --no-check",
            )
    stop = threading.Event()

    def progress(p: Period) -> None:
        print(
            f"period {p.index + 1}: {p.destination} {p.protocol} for {p.duration_s:.0f}s",
            file=sys.stderr,
            flush=True,
        )

    try:
        result = run_round(settings, secret_dir=args.secret_dir, progress=progress, stop=stop)
    except KeyboardInterrupt:
        stop.set()
        print(f"interrupted: results so far are in {settings.spool_dir}", file=sys.stderr)
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
                f"{result['spooled']} results wait in {settings.spool_dir}: "
                "run `kickass trials upload` when the server is back",
                file=sys.stderr,
            )
    return 0 if result["failed_flows"] == 0 and not result["rejected"] else 1


def cmd_upload(args: argparse.Namespace) -> int:
    spool = Spool(args.spool_dir)
    report = uploader(args.server, args.runner_token_file, spool).flush()
    print(
        f"sent {report.sent}, rejected {report.rejected}, still spooled {report.pending}",
        file=sys.stderr,
    )
    for err in report.errors[:5]:
        print(f"  {err}", file=sys.stderr)
    return 0 if report.ok else 1


def cmd_agents_add(args: argparse.Namespace) -> int:
    if not args.url.startswith(("http://", "https://")):
        raise KickassError(f"bad URL {args.url!r}", hint="http://IP:PORT (port 8700 by default)")
    secret = receivers.read_secret_arg(args.secret_file, sys.stdin.read)
    if not args.no_check:
        from .trials.runner import AgentRef

        check = receivers.check_agent(AgentRef(args.name, args.url, secret), source=args.bind)
        print(check.render(), file=sys.stderr)
        if not check.ok:
            raise KickassError(
                f"agent {args.name} not registered: " + "; ".join(check.problems),
                hint="fix what is named, or --no-check to register it anyway",
            )
    registry = receivers.agents_dir(args.agents_dir)
    path = receivers.register(args.name, args.url, secret, registry)
    print(
        f"registered agent {args.name} ({args.url}); its secret is in {path}. "
        f"A round: kickass trials run --agent {args.name}",
        file=sys.stderr,
    )
    return 0


def _registered_names(registry: Any) -> list[str]:
    return sorted(p.stem for p in registry.glob("*.url") if (registry / p.stem).is_file())


def cmd_agents_list(args: argparse.Namespace) -> int:
    registry = receivers.agents_dir(args.agents_dir)
    for name in _registered_names(registry):
        known = receivers.registered(name, registry)
        assert known is not None
        print(f"{name:<16} {known[0]}")
    return 0


def cmd_agents_check(args: argparse.Namespace) -> int:
    from .trials.runner import AgentRef

    registry = receivers.agents_dir(args.agents_dir)
    names = args.names or _registered_names(registry)
    if not names:
        raise KickassError(
            f"no agents registered in {registry}", hint="kickass trials agents add NAME URL"
        )
    checks = []
    for name in names:
        known = receivers.registered(name, registry)
        if known is None:
            raise KickassError(f"agent {name} is not registered in {registry}")
        url, secret_file = known
        secret = receivers.read_secret_arg(str(secret_file), sys.stdin.read)
        checks.append(receivers.check_agent(AgentRef(name, url, secret), source=args.bind))
    if args.json:
        print(json.dumps({"version": 1, "agents": [c.to_json() for c in checks]}))
    else:
        for c in checks:
            print(c.render())
    return 0 if all(c.ok for c in checks) else 1
