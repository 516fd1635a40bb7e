"""`kickass schedule`: scheduled work from a schedule file, unattended.

    kickass schedule check FILE              validate; each item's next start
    kickass schedule run FILE                do what is due (once across hosts), then exit
    kickass schedule run FILE --loop         ...every minute until SIGTERM (containers)
    kickass schedule status FILE [--json]    last runs, failures, overdue items, next starts
    kickass schedule crontab FILE            the cron line (--install: into your crontab;
                                             --systemd: a oneshot service and its timer)

"Schedule" is the file of scheduled items (TOML, see
operations/example-schedule.toml); an Atlas "campaign" stays what it is
everywhere else: the YAML file of one set of RIPE Atlas measurements, which
an ``atlas`` item names.

Where claims are made: the database (``--database-url``,
$KICKASS_DATABASE_URL or ``database_url`` in $KICKASS_CONFIG), else the
measurement server's schedule API with a runner token (``--server`` and
``--runner-token-file``, or ``server``/``runner_token_file`` in the
schedule's [schedule] table): a trial runner host, which runs only trials
items.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from kickass_core import config, signing
from kickass_core.cli import group
from kickass_core.errors import KickassError

from . import crontab as cron
from . import runner as run_mod
from .claims import ApiClaims, Claims, DatabaseClaims
from .schedule_file import Schedule, load


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cmds = group(
        sub,
        "schedule",
        help="scheduled work: Atlas campaigns, trial rounds, refresh, export, housekeeping",
        description="Run a schedule file's items when due, exactly once across hosts (claims "
        "in PostgreSQL, or through the server's API on trial runner hosts); every run is a "
        "row of item_runs. See operations/README.md.",
    )

    def file_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("schedule", type=Path, help="the schedule file (TOML)")

    def where(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--database-url",
            help="claims in this database (default $KICKASS_DATABASE_URL, or database_url "
            "in $KICKASS_CONFIG)",
        )
        p.add_argument(
            "--server",
            help="no database here: claim through this measurement server's API "
            "(trials items only)",
        )
        p.add_argument(
            "--runner-token-file", help="the runner token for --server ($KICKASS_RUNNER_TOKEN)"
        )
        p.add_argument(
            "--host",
            help="this host's id in item_runs (default $KICKASS_HOST_ID or the host name; "
            "the runner's name with --server)",
        )

    p = cmds.add_parser("check", help="validate the file; list items and their next start")
    file_arg(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_check)

    p = cmds.add_parser(
        "run",
        help="do what is due, then exit (cron runs this every minute)",
        description="Claim and carry out every item due now that no host has run yet. Exit "
        "status: 0 all ok or skipped (or nothing due), 1 an item failed or timed out, "
        "2 a bad schedule file, 3 the database/server unreachable.",
    )
    file_arg(p)
    where(p)
    p.add_argument("--item", action="append", help="only this item (repeatable)")
    p.add_argument(
        "--log-file",
        type=Path,
        help="append the JSON log lines here instead of stdout; failures are then also "
        "printed to stderr (what cron mails)",
    )
    p.add_argument("--json", action="store_true", help="print a summary object at the end")
    p.add_argument(
        "--metrics-file",
        type=Path,
        help="write Prometheus metrics here after each pass (node_exporter textfile)",
    )
    p.add_argument("--loop", action="store_true", help="run a pass every --interval until SIGTERM")
    p.add_argument("--interval", type=float, default=60.0, help="seconds between --loop passes")
    p.add_argument(
        "--metrics-port",
        type=int,
        help="with --loop: serve Prometheus metrics on 127.0.0.1:PORT/metrics",
    )
    p.add_argument("--metrics-address", default="127.0.0.1", help="address for --metrics-port")
    p.set_defaults(func=cmd_run)

    p = cmds.add_parser("status", help="last runs, failures, overdue items, what is next")
    file_arg(p)
    p.add_argument("--database-url", help="default $KICKASS_DATABASE_URL")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)

    p = cmds.add_parser(
        "crontab",
        help="print (or --install) the cron line, or a systemd timer",
        description="One line runs `kickass schedule run FILE` every minute: the database "
        "decides what is due. Absolute paths only, no secret in the line.",
    )
    file_arg(p)
    p.add_argument("--install", action="store_true", help="write it into the crontab")
    p.add_argument("--user", help="with --install (root only): that user's crontab")
    p.add_argument(
        "--systemd", action="store_true", help="a oneshot service and a timer instead of cron"
    )
    p.add_argument(
        "--unit-dir",
        type=Path,
        help="with --systemd --install: where the units go (default ~/.config/systemd/user)",
    )
    p.add_argument("--log-file", type=Path, help="the run's JSON log file (recommended)")
    p.add_argument(
        "--config",
        type=Path,
        help="the configuration file the line names as KICKASS_CONFIG (default: "
        "$KICKASS_CONFIG if set)",
    )
    p.add_argument("--kickass", type=Path, help="the kickass executable (default: this one)")
    p.set_defaults(func=cmd_crontab)


# -- helpers ------------------------------------------------------------------------------


def _load(path: Path) -> tuple[Schedule, Path]:
    return load(path)


def _database_url(flag: str | None) -> str | None:
    url = config.resolve("database_url", flag or None, file=config.load_file(None))
    return str(url) if url else None


def _claims(args: argparse.Namespace, schedule: Schedule) -> tuple[Claims, str | None]:
    s = schedule.schedule
    server = args.server or s.server
    url = None if args.server else _database_url(args.database_url)
    if url:
        from kickass_db.schedule_store import host_id

        return DatabaseClaims(url, args.host or host_id(), s), url
    if not server:
        raise KickassError(
            "no database URL and no server: nowhere to claim runs",
            hint="set KICKASS_DATABASE_URL (or database_url in $KICKASS_CONFIG), or give "
            "--server and --runner-token-file on a trial runner host",
        )
    token = config.read_secret(
        args.runner_token_file or s.runner_token_file,
        "KICKASS_RUNNER_TOKEN",
        "runner token",
        "--runner-token-file or KICKASS_RUNNER_TOKEN",
    )
    if not token:
        raise KickassError(
            "claiming through the server needs a runner token",
            hint="--runner-token-file FILE or KICKASS_RUNNER_TOKEN "
            "(make one on the server: kickass trials runners add NAME)",
        )
    signing.runner_name(token)  # a malformed token is an error now, not at the first call
    return ApiClaims(server, token), None


def _out(json_mode: bool, obj: dict[str, Any], text: str) -> None:
    if json_mode:
        print(json.dumps(obj, indent=2, default=str))
    else:
        print(text)


# -- commands -----------------------------------------------------------------------------


def cmd_check(args: argparse.Namespace) -> int:
    from .items import check

    schedule, base = _load(args.schedule)
    now = datetime.now(UTC)
    notes = {i.name: check(i, base) for i in schedule.item}
    rows = [
        {
            "name": i.name,
            "kind": i.kind,
            "cron": i.cron,
            "slip_s": i.slip_s,
            "timeout_s": i.timeout_s,
            "host": i.host,
            "enabled": i.enabled,
            "next_start": i.next_start(now).isoformat(),
            "note": notes[i.name],
        }
        for i in schedule.item
    ]
    bad = [n for n in notes.values() if n is not None and n.startswith("ERROR")]
    text = "\n".join(
        f"{r['name']:<24} {r['kind']:<12} {r['cron']:<16} next {r['next_start']}"
        + ("" if r["enabled"] else " (disabled)")
        + (f"\n    {r['note']}" if r["note"] else "")
        for r in rows
    )
    verdict = f"{len(bad)} with errors" if bad else "valid"
    _out(
        args.json,
        {"schedule": schedule.schedule.name, "items": rows, "valid": not bad},
        f"{args.schedule}: {len(rows)} items, {verdict}\n{text}",
    )
    return 2 if bad else 0


def cmd_run(args: argparse.Namespace) -> int:
    schedule, base = _load(args.schedule)
    with ExitStack() as stack:
        claims, url = _claims(args, schedule)
        stack.callback(claims.close)
        stream: IO[str]
        if args.log_file is not None:
            args.log_file.parent.mkdir(parents=True, exist_ok=True)
            stream = stack.enter_context(args.log_file.open("a", encoding="utf-8"))
        else:
            stream = sys.stdout
        log = run_mod.EventLog(
            stream,
            schedule=schedule.schedule.name,
            host=claims.host,
            errors_to_stderr=args.log_file is not None,
        )
        runner = run_mod.Runner(schedule, base, claims, log, database_url=url, only=args.item)
        metrics = None
        if args.metrics_file or args.metrics_port:
            from .metrics import Metrics

            store = getattr(claims, "store", None)
            metrics = Metrics(schedule, base, store)
            if args.metrics_port and args.loop:
                metrics.serve(args.metrics_port, args.metrics_address)

        def after(summary: run_mod.RunSummary) -> None:
            if metrics is not None:
                metrics.record(summary.ran)
                if args.metrics_file:
                    metrics.write(args.metrics_file)
            if args.json:
                print(json.dumps(summary.to_json(), default=str))

        run_mod.install_stop_handlers(runner)
        if args.loop:
            return run_mod.loop(runner, args.interval, after)
        summary = runner.run_once()
        after(summary)
        if summary.unreachable is not None:
            print(f"ERROR: {summary.unreachable}", file=sys.stderr)
            print("hint: nothing was claimed; the next run tries again", file=sys.stderr)
        return summary.exit_code


def cmd_status(args: argparse.Namespace) -> int:
    from .status import collect, render

    schedule, _base = _load(args.schedule)
    url = _database_url(args.database_url)
    if not url:
        raise KickassError(
            "status reads item_runs in the database: no database URL here",
            hint="run it where KICKASS_DATABASE_URL is set, or open the schedule health "
            "dashboard (grafana/)",
        )
    from kickass_db.schedule_store import ScheduleStore

    with ScheduleStore(url) as store:
        st = collect(schedule, store)
    _out(args.json, st.to_json(), render(st))
    return 0


def cmd_crontab(args: argparse.Namespace) -> int:
    schedule, base = _load(args.schedule)
    cfg = args.config
    if cfg is None and os.environ.get(config.ENV_CONFIG):
        cfg = Path(os.environ[config.ENV_CONFIG])
    cmd = cron.command(args.schedule, log_file=args.log_file, config=cfg, kickass=args.kickass)
    name = schedule.schedule.name
    if args.systemd:
        units = cron.systemd_units(name, cmd, working_dir=base)
        if args.install:
            directory = args.unit_dir or Path.home() / ".config/systemd/user"
            for p in cron.install_units(units, directory):
                print(f"wrote {p}")
            print(
                "enable it: systemctl --user daemon-reload && systemctl --user enable --now "
                f"kickass-schedule-{name}.timer"
            )
        else:
            for fname, text in units.items():
                print(f"# {fname}\n{text}")
        return 0
    lines = cron.cron_lines(name, cmd)
    if args.install:
        cron.install(name, lines, user=args.user)
        print(f"installed in the crontab of {args.user or 'the current user'}:")
    print("\n".join(lines))
    return 0
