"""`kickass export VIEW --format csv|parquet`: one analysis view to a dated file.

    kickass export v_flow_results --format parquet --since 2026-11-01 -o exports/
    kickass export v_verdicts_by_source --format csv --source atlas --campaign eu-1 --json

The work is ``kickass_analysis.export.export_view`` (imported when the
command runs, so pyarrow does not slow every other `kickass` command down).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from datetime import UTC, datetime
from types import FrameType

FORMATS = ("csv", "parquet")  # kickass_analysis.export.FORMATS, without importing it

DESCRIPTION = """\
Export one analysis view (a public v_* view) to a dated CSV or Parquet file
in DIR, streamed in constant memory, with FILE.schema.json beside it: the
columns with their PostgreSQL and Arrow types, the filters, the row count,
the file's sha256, the export time and the database's alembic revision.
Files appear under their final names only when complete.

Times are ISO 8601 (2026-11-25, 2026-11-25T03:12, ...Z or +01:00; without an
offset, UTC); the window is since <= time < until. An unknown VIEW lists the
exportable ones. Both formats come from PostgreSQL's COPY: CSV is its
COPY ... (FORMAT csv, FORCE_QUOTE *) as it is, NULL an unquoted empty field
and "" an empty string; Parquet is that CSV read by Arrow with each column's
type (analysis/README.md)."""


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "export",
        help="export an analysis view (v_*) to a dated CSV or Parquet file",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  kickass export v_flow_results --format parquet --since 2026-11-01 -o exports/\n"
        "  kickass export v_verdicts_by_source --format csv --source atlas --json",
    )
    p.add_argument("view", metavar="VIEW", help="the view, e.g. v_session_summary")
    p.add_argument("--format", required=True, choices=FORMATS, help="csv or parquet")
    p.add_argument("--since", type=_time, metavar="T", help="rows dated at or after T")
    p.add_argument("--until", type=_time, metavar="T", help="rows dated before T")
    p.add_argument(
        "--source",
        type=_source,
        metavar="SOURCE",
        help="only rows of this study source (the registered ones: volunteer, atlas, ...)",
    )
    p.add_argument("--campaign", metavar="C", help="only rows of this Atlas campaign")
    p.add_argument(
        "-o", "--output", metavar="DIR", default=".", help="directory (default: current)"
    )
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    p.add_argument(
        "--database-url",
        help="PostgreSQL URL (default: $KICKASS_DATABASE_URL, "
        "else database_url in the $KICKASS_CONFIG file)",
    )
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from .export import export_view

    # SIGTERM (a scheduler, systemd) leaves like Ctrl-C: partial files removed.
    signal.signal(signal.SIGTERM, _terminate)

    def progress(rows: int, seconds: float) -> None:
        rate = rows / seconds if seconds > 0 else 0.0
        print(
            f"export {args.view}: {rows:,} rows in {seconds:.1f} s ({rate:,.0f} rows/s)",
            file=sys.stderr,
            flush=True,
        )

    result = export_view(
        args.database_url,
        args.view,
        args.format,
        args.output,
        since=args.since,
        until=args.until,
        source=args.source,
        campaign=args.campaign,
        progress=progress,
    )
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(
            f"exported {result.rows:,} rows of {result.view} to {result.data_path} "
            f"({result.bytes:,} bytes, {result.seconds:.1f} s; schema: {result.schema_path})"
        )
    return 0


def _terminate(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _source(value: str) -> str:
    # Checked against the registry only when given: loading it imports every
    # source's package, which `kickass export --help` need not pay for.
    from kickass_core import sources

    if value not in sources.names():
        raise argparse.ArgumentTypeError(
            f"no study source {value!r} here; the registered ones: "
            + (", ".join(sources.names()) or "none")
        )
    return value


def _time(value: str) -> datetime:
    try:
        t = datetime.fromisoformat(value.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"not an ISO 8601 time: {value!r} (e.g. 2026-11-25 or 2026-11-25T03:12Z)"
        ) from exc
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t
