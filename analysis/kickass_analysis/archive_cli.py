"""`kickass archive write|verify|retire|list|restore`: the raw tables' days as Parquet.

    kickass archive retire --archive /srv/kickass/archive
    kickass archive verify /mnt/copy-of-the-archive          # no database needed
    kickass archive restore probe_outcomes 2026-11-01 --recount
    kickass archive campaign eu-1                            # a settled Atlas campaign
    kickass archive analyze /mnt/copy --engine duckdb -o results/   # the views, from the files

The work is ``kickass_analysis.archive`` (imported when the command runs, so
pyarrow does not slow every other `kickass` command down). Settings:
``archive`` (the root folder: --archive > $KICKASS_ARCHIVE > ``archive`` in
the $KICKASS_CONFIG file) and ``keep_raw_days`` per table (--keep-raw-days
TABLE=N > $KICKASS_KEEP_RAW_DAYS as ``TABLE=N,...`` > a ``keep_raw_days``
table in the file > probe_outcomes 30, router_telemetry 7).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Mapping
from datetime import date, datetime
from pathlib import Path
from types import FrameType
from typing import Any

from kickass_core import config
from kickass_core.cli import group
from kickass_core.errors import KickassError

TABLES = ("probe_outcomes", "router_telemetry")  # kickass_db.models.archive.ARCHIVED_TABLES
ENGINES = ("duckdb", "spark")  # archive_analysis.ENGINES
KEEP_RAW_DAYS = {"probe_outcomes": 30, "router_telemetry": 7}  # archive.KEEP_RAW_DAYS

DESCRIPTION = """\
The raw tables' days (probe_outcomes by their sessions' day, router_telemetry
by recorded_at) as Parquet files in ROOT/<table>/day=YYYY-MM-DD/, each folder
with its _manifest.json (columns and types, every file's rows, bytes and
sha256, and checks computed both in PostgreSQL and from the files), a
probe_outcomes day with its sessions in ROOT/sessions/day=... (no address,
no cookie hash). retire writes, verifies, records, detaches and drops every
day older than keep_raw_days (a day with a live session stays, and is
named); verify needs no database (a researcher's copy); restore puts a day
back; analyze computes the study's views from a verified archive with DuckDB
or Spark, no database either (analysis/README.md)."""


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sub = group(
        subparsers,
        "archive",
        help="the raw tables' days as verified Parquet: write, verify, retire, list, restore",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )

    def common(q: argparse.ArgumentParser, database: bool = True, root: bool = True) -> None:
        if root:
            q.add_argument(
                "--archive",
                metavar="ROOT",
                help="the archive's root folder (default: $KICKASS_ARCHIVE, else archive "
                "in the $KICKASS_CONFIG file)",
            )
        if database:
            q.add_argument(
                "--database-url",
                help="PostgreSQL URL (default: $KICKASS_DATABASE_URL, "
                "else database_url in the $KICKASS_CONFIG file)",
            )
        q.add_argument("--json", action="store_true", help="print a JSON summary on stdout")

    q = sub.add_parser("write", help="archive one day (and verify it) without retiring it")
    q.add_argument("table", choices=TABLES)
    q.add_argument("day", type=_day, metavar="DAY", help="YYYY-MM-DD (UTC)")
    common(q)
    q.set_defaults(func=cmd_write)

    q = sub.add_parser("verify", help="check every manifest and file (no database)")
    q.add_argument("root", nargs="?", metavar="ROOT", help="the archive (default: the setting)")
    common(q, database=False, root=False)
    q.set_defaults(func=cmd_verify)

    q = sub.add_parser("retire", help="archive, verify, detach and drop the days past keeping")
    q.add_argument("--table", action="append", choices=TABLES, help="only this table (repeat)")
    q.add_argument(
        "--keep-raw-days",
        action="append",
        default=[],
        metavar="TABLE=N",
        help="days kept raw (default probe_outcomes=30, router_telemetry=7)",
    )
    common(q)
    q.set_defaults(func=cmd_retire)

    q = sub.add_parser("list", help="the days archived, as the database recorded them")
    q.add_argument("--table", choices=TABLES)
    common(q, root=False)
    q.set_defaults(func=cmd_list)

    q = sub.add_parser(
        "campaign", help="a settled Atlas campaign's outcomes as Parquet (never dropped)"
    )
    q.add_argument("name", metavar="CAMPAIGN", help="the campaign's name")
    common(q)
    q.set_defaults(func=cmd_campaign)

    q = sub.add_parser(
        "analyze",
        help="the study's views computed from a verified archive by DuckDB or Spark (no database)",
        description="Computes from the archive's files what the study views show "
        "(v_whole_drop, v_split_drop, v_session_summary, the verdicts, v_size_drop_all, "
        "v_split_drop_all, both *_by_source views, the latest verdict per client) and writes "
        "each as OUT/<name>.parquet with <name>.parquet.schema.json beside it. The archive is "
        "verified first; OUT must be a new folder.",
    )
    q.add_argument("root", metavar="DIR", help="the archive's root folder (or a copy of it)")
    q.add_argument("--engine", required=True, choices=ENGINES, help="duckdb or spark")
    q.add_argument(
        "--master",
        metavar="URL",
        help="Spark's master, e.g. spark://host:7077 (default: local[2], or spark-submit's)",
    )
    q.add_argument("-o", "--output", required=True, metavar="OUT", help="a new folder for them")
    q.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    q.set_defaults(func=cmd_analyze)

    q = sub.add_parser("restore", help="put a retired day back from its files")
    q.add_argument("table", choices=TABLES)
    q.add_argument("day", type=_day, metavar="DAY", help="YYYY-MM-DD (UTC)")
    q.add_argument(
        "--recount",
        action="store_true",
        help="write the day's sessions' durable counts again from the restored rows",
    )
    common(q)
    q.set_defaults(func=cmd_restore)


def archive_root(flag: str | None, file: Mapping[str, Any] | None = None) -> Path:
    """The archive's root folder: flag > $KICKASS_ARCHIVE > the config file."""
    value = config.resolve(
        "archive", flag, file=config.load_file(None) if file is None else file, parse=str
    )
    if not value:
        raise KickassError(
            "no archive folder given",
            hint="pass --archive ROOT, set KICKASS_ARCHIVE, or archive in the config file",
        )
    return Path(value).expanduser()


def keep_raw_days(flags: list[str], file: Mapping[str, Any] | None = None) -> dict[str, int]:
    """Days kept raw per table: flags > $KICKASS_KEEP_RAW_DAYS > the file > defaults."""
    out = dict(KEEP_RAW_DAYS)
    data = config.load_file(None) if file is None else file
    table = data.get("keep_raw_days")
    if isinstance(table, Mapping):
        out.update(_keep(f"{k}={v}" for k, v in table.items()))
    env = config.resolve("keep_raw_days", None, environ=None, parse=str)
    if isinstance(env, str) and env:
        out.update(_keep(env.split(",")))
    out.update(_keep(flags))
    return out


def _keep(items: Any) -> dict[str, int]:
    out = {}
    for item in items:
        name, sep, n = str(item).strip().partition("=")
        if not sep or name not in TABLES or not n.strip().isdigit():
            raise KickassError(
                f"not a keep_raw_days setting: {item!r}",
                hint=f"TABLE=DAYS with TABLE one of {', '.join(TABLES)}, e.g. probe_outcomes=30",
            )
        out[name] = int(n)
    return out


def cmd_write(args: argparse.Namespace) -> int:
    from . import archive

    _terminate_as_interrupt()
    result = archive.write(
        args.database_url, archive_root(args.archive), args.table, args.day, progress=_progress
    )
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        what = "written" if result.files_written else "already written (kept)"
        print(
            f"{args.table} {args.day}: {result.rows:,} rows, {result.bytes:,} bytes, {what}, "
            "verified"
        )
    return 0


def cmd_campaign(args: argparse.Namespace) -> int:
    from . import archive

    _terminate_as_interrupt()
    written = archive.write_campaign(
        args.database_url, archive_root(args.archive), args.name, progress=_progress
    )
    if args.json:
        print(json.dumps({"campaign": args.name, "rows": written.rows, "bytes": written.bytes,
                          "written": written.wrote,
                          "manifest_sha256": written.manifest_sha256}, indent=2))  # fmt: skip
    else:
        what = "written" if written.wrote else "already archived (kept)"
        print(f"campaign {args.name}: {written.rows:,} rows, {written.bytes:,} bytes, {what}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from . import archive

    root = Path(args.root) if args.root else archive_root(None)
    report = archive.verify_archive(root)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        for d in report.datasets:
            status = "ok" if d.ok else "BAD"
            print(f"{status:3} {d.folder}/{d.path.name}: {d.rows:,} rows, {d.bytes:,} bytes")
        for problem in report.all_problems():
            print(f"problem: {problem}", file=sys.stderr)
        total = sum(d.rows for d in report.datasets)
        print(
            f"{len(report.datasets)} folders, {total:,} rows: "
            + ("every file verified" if report.ok else f"{len(report.all_problems())} problems")
        )
    return 0 if report.ok else 1


def cmd_retire(args: argparse.Namespace) -> int:
    from . import archive

    _terminate_as_interrupt()
    result = archive.retire(
        args.database_url,
        archive_root(args.archive),
        keep_raw_days(args.keep_raw_days),
        tables=args.table,
        progress=_progress,
    )
    if args.json:
        print(json.dumps(result.to_json(), indent=2, default=str))
    else:
        for d in result.days:
            line = f"{d.table} {d.day}: {d.outcome}"
            if d.dropped:
                line += f" ({d.rows:,} rows, {d.bytes:,} bytes archived)"
            if d.reasons:
                line += ": " + "; ".join(d.reasons)
            print(line)
        c = result.counts()
        print(
            f"{c['partitions_dropped']} days retired ({c['rows']:,} rows, {c['bytes']:,} bytes) "
            f"in {c['seconds']:.1f} s; lock ms: detach {c['lock_ms']['detach']}, "
            f"drop {c['lock_ms']['drop']}"
        )
    return 1 if result.failed else 0


def cmd_list(args: argparse.Namespace) -> int:
    from . import archive

    rows = archive.listing(args.database_url, args.table)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    for r in rows:
        print(
            f"{r['table_name']} {r['day']}: {archive.state_of(r)}, "
            f"{r['rows'] or 0:,} rows, {r['bytes'] or 0:,} bytes"
        )
    if not rows:
        print("no day archived yet")
    return 0


def cmd_analyze(args: argparse.Namespace) -> int:
    from . import archive_analysis

    _terminate_as_interrupt()
    if sys.stderr.isatty():
        print(f"analyze: {args.root} with {args.engine}", file=sys.stderr, flush=True)
    out = archive_analysis.analyze(args.root, args.engine, args.output, master=args.master)
    if args.json:
        print(json.dumps(out.to_json(), indent=2))
    else:
        for name, r in out.results.items():
            print(f"{name}: {r['rows']:,} rows")
        print(
            f"{len(out.results)} results in {out.out} ({out.engine} {out.engine_version}, "
            f"{out.seconds:.1f} s)"
        )
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    from . import archive

    _terminate_as_interrupt()
    out = archive.restore(
        args.database_url, archive_root(args.archive), args.table, args.day, recount=args.recount
    )
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(
            f"{args.table} {args.day}: {out['rows']:,} rows restored"
            + (
                f", {out['recounted_sessions']} sessions recounted"
                if "recounted_sessions" in out
                else ""
            )
        )
    return 0


def _progress(event: str, data: dict[str, Any]) -> None:
    if sys.stderr.isatty() and event == "writing":
        where = data.get("day") or data.get("campaign")
        print(f"{data['table']} {where}: {data['rows']:,} rows", file=sys.stderr, flush=True)


def _terminate_as_interrupt() -> None:
    # SIGTERM (a scheduler, systemd) leaves like Ctrl-C: partial folders removed.
    signal.signal(signal.SIGTERM, _terminate)


def _terminate(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _day(value: str) -> date:
    try:
        return datetime.strptime(value.strip(), "%Y-%m-%d").date()
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a day: {value!r} (YYYY-MM-DD)") from exc
