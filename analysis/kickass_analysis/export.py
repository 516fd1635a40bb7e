"""`kickass export`: one analysis view to a dated CSV or Parquet file, in constant memory.

Only the public ``v_*`` views are exportable (listed from the database, so a
view a migration adds is exportable at once); ``VIEWS`` says, for the views
it knows, which column dates a row (for ``since``/``until``) and which
source every row comes from when the view has no ``source`` column. A view
with a ``source`` or ``campaign`` column can be filtered on it.

How the rows travel, all inside one read-only REPEATABLE READ transaction
(the rows, the row count, the export time and the alembic revision are one
snapshot of the database):

* **Parquet**: PostgreSQL's ``COPY (SELECT ...) TO STDOUT (FORMAT csv)``,
  parsed by Arrow's C++ CSV reader (``pyarrow.csv.open_csv``) with every
  column's type given from the catalogue (nothing inferred), and written as
  row groups of at most ``ROW_GROUP_BYTES`` of Arrow data by
  ``pyarrow.parquet.ParquetWriter``. The calling thread runs the COPY and
  hands its rows over in blocks of ``COPY_BLOCK_BYTES`` (at most
  ``COPY_BLOCKS_AHEAD`` waiting); one thread parses and writes them. Not a
  server-side cursor (the first version): it made a Python object of every
  value, and that alone took 3x as long as COPY of a cheap view
  (bench/README.md).
  Types: integers int64, real, double and numeric float64, boolean bool,
  timestamptz ``timestamp[us, tz=UTC]`` (timestamp without time zone stays
  naive), date date32, and everything else (text, jsonb, inet, arrays, ...)
  as a string in PostgreSQL's own text form. Values are PostgreSQL's text
  output, so a ``real`` reads back as the number PostgreSQL prints (12.345,
  not 12.345000267...), as in the CSV. NULL is COPY's unquoted empty field
  and an empty string its quoted ``""``, so NULLs stay NULL and ``''`` stays
  ``''``. A value Arrow cannot hold in its column's type (an infinite or BC
  timestamp, a year after 9999) is an error naming it: such a view exports
  as CSV.
* **CSV**: PostgreSQL's own ``COPY (SELECT ...) TO STDOUT (FORMAT csv,
  HEADER, FORCE_QUOTE *)``, streamed to the file in blocks of
  ``COPY_BLOCK_BYTES`` (not a cursor: COPY is PostgreSQL's fastest stream,
  and its CSV is the one psql's ``\\copy`` writes). Every value is quoted
  except NULL, which is an unquoted empty field, so an empty string
  (``""``) and NULL differ; values are PostgreSQL's text output (timestamps
  ``2026-11-25 03:12:05.123+00`` in UTC, booleans ``t``/``f``, jsonb as
  JSON text). The ``.schema.json``
  says how to read it back typed (its ``arrow_type`` per column).

Both run with DateStyle ISO and extra_float_digits 1 (whatever the server's
defaults), so dates are ISO 8601 and a float's text is the shortest that
reads back exactly.

Memory: a few blocks of COPY's output, one row group of Arrow data and the
Parquet writer's footer (a few hundred bytes per row group and column)
whatever the number of rows (measured: tests/analysis/test_export.py,
bench/export_bench.py).

Files: ``<view>[-<source>][-campaign-<c>][-since<T>][-until<T>]-<exported>.<ext>``
with times as ``20261125T031205Z``; the export time is the database's
transaction time. ``since`` is inclusive and ``until`` exclusive, so
consecutive windows (the scheduled ``export`` item) neither overlap nor
leave gaps. A caller that exports windows names the file by its window
alone (``window_name``: no export time): an export of a window already
published is then not done again, its publication is returned
(``already_published``), so a window is published once however many
attempts it takes. Beside the data file, ``<data file>.schema.json``:
columns with their PostgreSQL and Arrow types, the query and its filters,
the row count, the sha256 and size of the data file, the export time and
the database's alembic revision. Both are published the one way
``kickass_analysis.publish`` does it (a hidden ``.<name>.partial-<tag>``
file, forced to disk, hard-linked to its final name when complete; the tag
is the process id, or the scheduled run's attempt), the schema first, so a
data file under its final name always has its schema beside it; an error,
Ctrl-C (or SIGTERM, which `kickass export` turns into one) removes the
partial files, SIGKILL can leave only hidden partial files (the scheduled
export sweeps those of dead attempts), and nothing is ever written under a
final name that already exists (but a schema a dead attempt published
without its data file, which the next attempt's replaces).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import queue
import re
import select
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, NoReturn

import psycopg
from kickass_core.errors import KickassError
from kickass_db import engine as db
from psycopg import pq, sql
from sqlalchemy import Connection, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from . import __version__, publish

FORMATS = ("csv", "parquet")
SOURCES = ("volunteer", "atlas")
SCHEMA_VERSION = 1

COPY_BLOCK_BYTES = 1024 * 1024  # COPY output handed on (to the file, to Arrow) at a time
COPY_BLOCKS_AHEAD = 2  # Parquet: blocks the COPY may run ahead of the parser
ARROW_READ_BYTES = 2**31 - 1  # Arrow's block_size (an int32): see _Converter
ROW_GROUP_BYTES = 4 * 1024 * 1024  # Arrow bytes buffered before a Parquet row group is written
PARQUET_COMPRESSION = "zstd"
PROGRESS_EVERY_S = 2.0
STAMP = "%Y%m%dT%H%M%SZ"
PARQUET_SETTINGS = {
    "compression": PARQUET_COMPRESSION,
    "row_group_bytes": ROW_GROUP_BYTES,
    "source": "COPY (FORMAT csv) parsed by pyarrow.csv with the columns' types",
}


@dataclass(frozen=True)
class ViewSpec:
    """What a view's rows are, for the filters.

    ``time``: the view's column that dates a row; ``session_time``: the row's
    time is its session's ``created_at`` (read from ``v_session_summary`` by
    ``session_id``: the export reads views only, so the views-only reader
    role can run it); neither: the view pools all time and takes no
    ``since``/``until``. ``source``: every row comes from this source (views
    with a ``source`` column are filtered on it instead).
    """

    time: str | None = None
    session_time: bool = False
    source: str | None = None


# The views this module knows. Any other ``v_*`` view is still exportable, unfiltered by time.
VIEWS: dict[str, ViewSpec] = {
    "v_session_summary": ViewSpec(time="created_at", source="volunteer"),
    "v_whole_drop": ViewSpec(session_time=True, source="volunteer"),
    "v_split_drop": ViewSpec(session_time=True, source="volunteer"),
    "v_client_verdicts": ViewSpec(time="latest_finished_at", source="volunteer"),
    "v_size_drop_all": ViewSpec(source="volunteer"),
    "v_split_drop_all": ViewSpec(source="volunteer"),
    "v_size_drop_by_source": ViewSpec(),
    "v_split_drop_by_source": ViewSpec(),
    "v_verdicts_by_source": ViewSpec(time="finished_at"),
    "v_atlas_whole_drop": ViewSpec(source="atlas"),
    "v_atlas_split_drop": ViewSpec(source="atlas"),
    "v_atlas_measurements": ViewSpec(time="created_at", source="atlas"),
    "v_flow_results": ViewSpec(time="started_at"),
    "v_flow_summary": ViewSpec(),
    "v_trial_periods": ViewSpec(time="period_started_at"),
    "v_trial_speedups": ViewSpec(time="computed_at"),
    "v_router_telemetry": ViewSpec(time="recorded_at"),
    "v_item_runs": ViewSpec(time="due_at"),
    # 0012: the rollups (dashboards, report).
    "v_session_rollup": ViewSpec(time="created_at", source="volunteer"),
    "v_verdicts_rollup": ViewSpec(time="finished_at"),
    "v_drop_rollup": ViewSpec(time="day"),  # a row's time: the start of its day
    "v_flow_hourly": ViewSpec(time="hour"),
    "v_flow_summary_rollup": ViewSpec(),
    "v_router_runs": ViewSpec(time="started_at"),
    "v_router_telemetry_1s": ViewSpec(time="at"),
    "v_router_telemetry_1m": ViewSpec(time="at"),
    "v_atlas_campaigns": ViewSpec(time="created_at", source="atlas"),
    "v_item_health": ViewSpec(),
    "v_rollup_status": ViewSpec(),
}

# PostgreSQL type (pg_type.typname) -> Arrow type; anything else is a string.
ARROW_TYPES: dict[str, str] = {
    "int2": "int64",
    "int4": "int64",
    "int8": "int64",
    "oid": "int64",
    "float4": "double",
    "float8": "double",
    "numeric": "double",
    "bool": "bool",
    "timestamptz": "timestamp[us, tz=UTC]",
    "timestamp": "timestamp[us]",
    "date": "date32[day]",
}
STRING = "string"

CSV_CONVENTIONS = {
    "header": True,
    "delimiter": ",",
    "quote": '"',
    "encoding": "utf-8",
    "null": 'an unquoted empty field; every other value is quoted, so an empty string is ""',
    "values": "PostgreSQL's text output (COPY ... FORMAT csv, FORCE_QUOTE *): timestamps "
    "like 2026-11-25 03:12:05.123456+00 (UTC), booleans t/f, jsonb as JSON text",
}


@dataclass(frozen=True)
class Column:
    name: str
    postgresql_type: str  # format_type(): 'timestamp with time zone', 'double precision', ...
    typname: str  # pg_type.typname: 'timestamptz', 'float8', ...
    oid: int

    @property
    def arrow_type(self) -> str:
        return ARROW_TYPES.get(self.typname, STRING)

    def to_json(self) -> dict[str, str]:
        return {
            "name": self.name,
            "postgresql_type": self.postgresql_type,
            "arrow_type": self.arrow_type,
        }


@dataclass(frozen=True)
class Filters:
    since: datetime | None = None
    until: datetime | None = None
    source: str | None = None
    campaign: str | None = None

    def to_json(self) -> dict[str, str | None]:
        return {
            "since": self.since.isoformat() if self.since else None,
            "until": self.until.isoformat() if self.until else None,
            "source": self.source,
            "campaign": self.campaign,
        }


@dataclass(frozen=True)
class ExportResult:
    """One export: the data file and its schema beside it."""

    view: str
    format: str
    data_path: Path
    schema_path: Path
    rows: int
    bytes: int  # size of the data file
    seconds: float
    sha256: str
    exported_at: datetime
    alembic_revision: str | None
    filters: dict[str, str | None] = field(default_factory=dict)
    # Published before this call (by an earlier attempt at the same window).
    already_published: bool = False

    @property
    def paths(self) -> tuple[Path, Path]:
        """The data file and its ``.schema.json``."""
        return (self.data_path, self.schema_path)

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "view": self.view,
            "format": self.format,
            "path": str(self.data_path),
            "schema_path": str(self.schema_path),
            "rows": self.rows,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 3),
            "rows_per_s": round(self.rows_per_s, 1),
            "sha256": self.sha256,
            "exported_at": self.exported_at.isoformat(),
            "alembic_revision": self.alembic_revision,
            "filters": self.filters,
        }


Progress = Callable[[int, float], None]  # (rows so far, seconds so far)


def export_view(
    database_url: str | None,
    view: str,
    fmt: str,
    directory: str | os.PathLike[str],
    since: datetime | None = None,
    until: datetime | None = None,
    source: str | None = None,
    campaign: str | None = None,
    *,
    progress: Progress | None = None,
    name: str | None = None,
    tag: str | None = None,
) -> ExportResult:
    """Export ``view`` as ``fmt`` ('csv' or 'parquet') into ``directory`` (see the module doc).

    ``database_url`` None: $KICKASS_DATABASE_URL, else the config file.
    Naive ``since``/``until`` are taken as UTC. ``progress(rows, seconds)``
    is called at most every ``PROGRESS_EVERY_S`` seconds. ``name``: the
    data file's name, saying what it holds (``window_name``); a file
    already published under it is this export, done before (returned, not
    exported again). Without it the name carries the export time, and an
    existing file is an error. ``tag``: names this attempt's partial files
    (default: the process id). Raises KickassError for anything the caller
    can act on.
    """
    if fmt not in FORMATS:
        raise KickassError(f"unknown export format {fmt!r}", hint=f"one of: {', '.join(FORMATS)}")
    if source is not None and source not in SOURCES:
        raise KickassError(f"unknown source {source!r}", hint=f"one of: {', '.join(SOURCES)}")
    t0 = time.monotonic()
    filters = Filters(_utc(since), _utc(until), source, campaign)
    if filters.since and filters.until and filters.since >= filters.until:
        raise KickassError(
            f"--since {filters.since.isoformat()} is not before "
            f"--until {filters.until.isoformat()}",
            hint="the window is since <= time < until",
        )
    out_dir = Path(directory)
    url = db.resolve_database_url(database_url)
    engine = db.make_engine(url, poolclass=NullPool)
    try:
        db.check_connection(engine)
        with engine.connect() as conn:
            conn = conn.execution_options(
                isolation_level="REPEATABLE READ", postgresql_readonly=True
            )
            with conn.begin():
                return _export(conn, view, fmt, out_dir, filters, progress, t0, name, tag)
    except DBAPIError as exc:
        reason = str(exc.orig or exc).strip().splitlines()[0]
        raise KickassError(
            f"export of {view} failed: {reason}",
            hint=f"database {db.describe_url(url)}; nothing was written",
        ) from exc
    except psycopg.Error as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise KickassError(
            f"export of {view} failed: {reason}",
            hint=f"database {db.describe_url(url)}; nothing was written",
        ) from exc
    except OSError as exc:
        raise KickassError(
            f"cannot write the export of {view} in {out_dir}: {exc.strerror or exc}",
            hint="choose a writable directory with room for it (-o DIR); nothing was left there",
        ) from exc
    finally:
        engine.dispose()


def exportable_views(database_url: str | None = None) -> list[str]:
    """The ``v_*`` views of schema public, sorted."""
    engine = db.make_engine(db.resolve_database_url(database_url), poolclass=NullPool)
    try:
        db.check_connection(engine)
        with engine.connect() as conn:
            return _views(conn)
    finally:
        engine.dispose()


# -- one export ---------------------------------------------------------------------------


def _export(
    conn: Connection,
    view: str,
    fmt: str,
    out_dir: Path,
    filters: Filters,
    progress: Progress | None,
    t0: float,
    name: str | None,
    tag: str | None,
) -> ExportResult:
    text_settings(conn)
    views = _views(conn)
    if view not in views:
        raise KickassError(
            f"no exportable view {view!r}",
            hint="exportable views: " + (", ".join(views) or "none (run: kickass db upgrade)"),
        )
    columns = _columns(conn, view)
    where, applied = _where(
        view, {c.name for c in columns}, filters, lambda column: _views_with(conn, column)
    )
    exported_at: datetime = conn.execute(text("SELECT transaction_timestamp()")).scalar_one()
    revision = alembic_revision(conn)
    raw = conn.connection.driver_connection
    assert isinstance(raw, psycopg.Connection)
    select: sql.Composed = sql.SQL("SELECT {} FROM {} AS v{}").format(
        sql.SQL(", ").join(sql.SQL("v.{}").format(sql.Identifier(c.name)) for c in columns),
        sql.Identifier("public", view),
        where,
    )

    out_dir.mkdir(parents=True, exist_ok=True)
    by_window = name is not None
    if name is None:
        name = _file_name(view, fmt, filters, exported_at)
    elif "/" in name or name.startswith(".") or not name.endswith("." + fmt):
        raise ValueError(f"not an export file name: {name!r}")
    data_path = out_dir / name
    schema_path = out_dir / (name + ".schema.json")
    if by_window and data_path.exists():
        return _published(view, fmt, data_path, schema_path)
    # A schema alone under a window's name is a dead attempt's (it died
    # between the two links): this attempt's replaces it.
    orphan = by_window and schema_path.exists()
    for final in (data_path, schema_path):
        if final.exists() and not orphan:
            raise KickassError(
                f"{final} already exists",
                hint="an export of the same view and filters in the same second: run it again",
            )
    meter = Meter(progress)
    tag = tag or str(os.getpid())
    data_tmp = publish.partial_path(data_path, tag)
    schema_tmp = publish.partial_path(schema_path, tag)
    try:
        if fmt == "csv":
            with open(data_tmp, "xb") as out:
                rows, digest = _write_csv(raw, select, out, meter)
        else:
            rows = write_parquet(raw, select, view, columns, data_tmp, meter)
            digest = sha256_file(data_tmp)
        size = data_tmp.stat().st_size
        seconds = time.monotonic() - t0
        meter.done(rows)
        schema = {
            "kickass_export": SCHEMA_VERSION,
            "view": view,
            "format": fmt,
            "data_file": data_path.name,
            "rows": rows,
            "bytes": size,
            "sha256": digest,
            "exported_at": exported_at.isoformat(),
            "alembic_revision": revision,
            "filters": {**filters.to_json(), **applied},
            "query": select.as_string(raw),
            "columns": [c.to_json() for c in columns],
            **({"csv": CSV_CONVENTIONS} if fmt == "csv" else {"parquet": PARQUET_SETTINGS}),
            "kickass_analysis_version": __version__,
        }
        with open(schema_tmp, "x", encoding="utf-8") as f:
            json.dump(schema, f, indent=2, ensure_ascii=False)
            f.write("\n")
        # The schema first: a data file under its final name has its schema beside it.
        if not publish.publish(schema_tmp, schema_path, replace=orphan):
            if by_window and data_path.exists():
                return _published(view, fmt, data_path, schema_path)
            _exists(schema_path)
        try:
            published = publish.publish(data_tmp, data_path)
        except BaseException:
            schema_path.unlink(missing_ok=True)
            raise
        if not published:
            # Another attempt at the same window published its data meanwhile
            # (only a run taken for dead while it lived can): its file stands.
            if by_window:
                return _published(view, fmt, data_path, schema_path)
            schema_path.unlink(missing_ok=True)
            _exists(data_path)
    finally:
        data_tmp.unlink(missing_ok=True)
        schema_tmp.unlink(missing_ok=True)
    return ExportResult(
        view=view,
        format=fmt,
        data_path=data_path,
        schema_path=schema_path,
        rows=rows,
        bytes=size,
        seconds=seconds,
        sha256=digest,
        exported_at=exported_at,
        alembic_revision=revision,
        filters=filters.to_json(),
    )


def text_settings(conn: Connection) -> None:
    """The text COPY carries, whatever the server's defaults (this transaction only)."""
    conn.exec_driver_sql("SET LOCAL client_encoding TO 'UTF8'")
    # ISO dates (Arrow parses them), floats shortest-exact.
    conn.exec_driver_sql("SET LOCAL DateStyle TO 'ISO, MDY'")
    conn.exec_driver_sql("SET LOCAL extra_float_digits TO 1")


_VIEWS = text(r"""
SELECT viewname FROM pg_views
WHERE schemaname = 'public' AND viewname LIKE 'v\_%'
ORDER BY viewname
""")

_VIEWS_WITH = text(r"""
SELECT table_name FROM information_schema.columns
WHERE table_schema = 'public' AND table_name LIKE 'v\_%' AND column_name = :column
  AND table_name IN (SELECT viewname FROM pg_views WHERE schemaname = 'public')
ORDER BY table_name
""")

_COLUMNS = text("""
SELECT a.attname, format_type(a.atttypid, a.atttypmod), t.typname, a.atttypid::bigint
FROM pg_attribute a
JOIN pg_class c ON c.oid = a.attrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
JOIN pg_type t ON t.oid = a.atttypid
WHERE n.nspname = 'public' AND c.relname = :view AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum
""")


def _views(conn: Connection) -> list[str]:
    return [str(r[0]) for r in conn.execute(_VIEWS)]


def _views_with(conn: Connection, column: str) -> list[str]:
    return [str(r[0]) for r in conn.execute(_VIEWS_WITH, {"column": column})]


def _columns(conn: Connection, view: str) -> list[Column]:
    return [
        Column(str(name), str(pg_type), str(typname), int(oid))
        for name, pg_type, typname, oid in conn.execute(_COLUMNS, {"view": view})
    ]


def alembic_revision(conn: Connection) -> str | None:
    """The database's revision; None when there is none or the role may not read it
    (the views-only reader role)."""
    readable = conn.execute(
        text(
            "SELECT to_regclass('public.alembic_version') IS NOT NULL "
            "AND has_table_privilege('public.alembic_version', 'SELECT')"
        )
    ).scalar_one()
    if not readable:
        return None
    value = conn.execute(text("SELECT version_num FROM public.alembic_version")).scalar()
    return None if value is None else str(value)


def _where(
    view: str, columns: set[str], filters: Filters, having: Callable[[str], list[str]]
) -> tuple[sql.Composable, dict[str, str | None]]:
    """The WHERE clause of the filters (values as literals: COPY takes no parameters)
    and how each was applied, for the schema file. ``having(column)``: the views
    with that column, for the hints."""
    spec = VIEWS.get(view, ViewSpec())
    clauses: list[sql.Composable] = []
    applied: dict[str, str | None] = {"time": None}
    if filters.since or filters.until:
        if spec.time:
            target: sql.Composable = sql.SQL("v.{}").format(sql.Identifier(spec.time))
            applied["time"] = spec.time
        elif spec.session_time and "session_id" in columns:
            target = sql.SQL("s.created_at")
            applied["time"] = "created_at of the row's session (v_session_summary)"
        else:
            timed = sorted(v for v, s in VIEWS.items() if s.time or s.session_time)
            raise KickassError(
                f"{view} has no time column to filter with --since/--until"
                + (" (it pools all time)" if view in VIEWS else ""),
                hint="views with a time: " + ", ".join(timed),
            )
        window: list[sql.Composable] = []
        if filters.since:
            window.append(sql.SQL("{} >= {}").format(target, sql.Literal(filters.since)))
        if filters.until:
            window.append(sql.SQL("{} < {}").format(target, sql.Literal(filters.until)))
        condition = sql.SQL(" AND ").join(window)
        if spec.time:
            clauses.append(condition)
        else:
            clauses.append(
                sql.SQL(
                    "v.session_id IN (SELECT s.session_id FROM public.v_session_summary AS s "
                    "WHERE {})"
                ).format(condition)
            )
    if filters.source:
        if "source" in columns:
            clauses.append(sql.SQL("v.source = {}").format(sql.Literal(filters.source)))
        elif spec.source != filters.source:
            what = f"only {spec.source} rows" if spec.source else "no volunteer or Atlas rows"
            raise KickassError(
                f"{view} holds {what}: --source {filters.source} would select nothing",
                hint="views with a source column: "
                + ", ".join(having("source"))
                + "; "
                + "; ".join(
                    f"{src} rows only: " + ", ".join(v for v, x in VIEWS.items() if x.source == src)
                    for src in SOURCES
                ),
            )
    if filters.campaign is not None:
        if "campaign" not in columns:
            raise KickassError(
                f"{view} has no campaign column to filter with --campaign",
                hint="views with a campaign column: " + ", ".join(having("campaign")),
            )
        clauses.append(sql.SQL("v.campaign = {}").format(sql.Literal(filters.campaign)))
    if not clauses:
        return sql.SQL(""), applied
    return sql.SQL(" WHERE ") + sql.SQL(" AND ").join(clauses), applied


def window_name(
    view: str,
    fmt: str,
    since: datetime | None = None,
    until: datetime | None = None,
    *,
    source: str | None = None,
    campaign: str | None = None,
    at: datetime | None = None,
) -> str:
    """The data file's name of an export of one window: the view, its
    filters and its bounds, and no export time, so every attempt at the
    window names the same file. ``at`` labels an export of a view that pools
    all time (it has no window) with the time it stands for (the scheduled
    run's due time)."""
    name = _file_name(view, fmt, Filters(_utc(since), _utc(until), source, campaign), None)
    if at is None:
        return name
    return name.removesuffix("." + fmt) + "-at" + _stamp(at) + "." + fmt


def _file_name(view: str, fmt: str, filters: Filters, exported_at: datetime | None) -> str:
    parts = [view]
    if filters.source:
        parts.append(filters.source)
    if filters.campaign is not None:
        parts.append("campaign-" + (re.sub(r"[^A-Za-z0-9._]+", "_", filters.campaign)[:60] or "_"))
    if filters.since:
        parts.append("since" + _stamp(filters.since))
    if filters.until:
        parts.append("until" + _stamp(filters.until))
    if exported_at is not None:
        parts.append(_stamp(exported_at))
    return "-".join(parts) + "." + fmt


def _stamp(t: datetime) -> str:
    return t.astimezone(UTC).strftime(STAMP)


def _utc(t: datetime | None) -> datetime | None:
    if t is None:
        return None
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


# -- COPY's output, in blocks ----------------------------------------------------------------


def _copy(
    raw: psycopg.Connection[Any],
    statement: sql.Composed,
    sink: Callable[[bytearray], None],
    meter: Meter,
    header: bool,
) -> int:
    """Runs ``statement`` (a COPY ... TO STDOUT) and hands its output to ``sink`` in
    blocks of about COPY_BLOCK_BYTES; returns PostgreSQL's row count.

    Read from libpq directly (the connection's documented ``pgconn``), as
    psycopg's own COPY reader does, but a whole buffer of rows per wait:
    PostgreSQL sends every row as one message, and psycopg's ``Copy`` spends
    a generator and a wait on each, which made it the slowest part of an
    export of a cheap view (bench/README.md). The file write, the hash and
    Arrow's parser then see a block at a time. An error or Ctrl-C cancels the
    COPY and reads it to its end, so the connection can roll back."""
    pgconn = raw.pgconn
    pgconn.send_query(statement.as_bytes(raw))
    try:
        first = _result(pgconn)
        if first is None or first.status != pq.ExecStatus.COPY_OUT:
            _raise_for(first, pgconn)
        sent = _copy_out(pgconn, sink, meter, 1 if header else 0)
        final = _result(pgconn)
        if final is None or final.status != pq.ExecStatus.COMMAND_OK:
            _raise_for(final, pgconn)
        rows = final.command_tuples
        while _result(pgconn) is not None:  # none expected after a COPY; read to the end
            pass
    except BaseException:
        with contextlib.suppress(Exception):
            raw.cancel_safe(timeout=5.0)
        with contextlib.suppress(Exception):
            _drain(pgconn, time.monotonic() + 10.0)
        raise
    return sent if rows is None else rows


def _copy_out(
    pgconn: pq.abc.PGconn, sink: Callable[[bytearray], None], meter: Meter, skip: int
) -> int:
    """The COPY's rows to ``sink`` until its end; returns the rows (less ``skip`` header lines).

    Each row is copied into the block at once, so libpq's buffer of it is freed at
    once (holding a block's rows and joining them cost half as much again)."""
    block = bytearray()
    get = pgconn.get_copy_data
    messages = 0
    while True:
        nbytes, data = get(1)
        if nbytes > 0:
            block += data
            messages += 1
            if len(block) >= COPY_BLOCK_BYTES:
                sink(block)  # the sink's to keep: a new block is started
                block = bytearray()
            continue
        if nbytes < 0:
            break  # the end (-1), or an error (-2) the final result tells
        # Nothing buffered: a moment to report progress, then wait for the server.
        meter.tick(max(messages - skip, 0))
        _wait_readable(pgconn, None)
        pgconn.consume_input()
    if block:
        sink(block)
    return max(messages - skip, 0)


def _wait_readable(pgconn: pq.abc.PGconn, deadline: float | None) -> bool:
    """Waits for the server (interruptible: Ctrl-C raises here); False at the deadline."""
    timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
    readable, _, _ = select.select([pgconn.socket], [], [], timeout)
    return bool(readable)


def _result(pgconn: pq.abc.PGconn) -> pq.abc.PGresult | None:
    """The next result of the query sent, waiting for it."""
    while pgconn.is_busy():
        _wait_readable(pgconn, None)
        pgconn.consume_input()
    return pgconn.get_result()


def _raise_for(result: pq.abc.PGresult | None, pgconn: pq.abc.PGconn) -> NoReturn:
    """Raises the psycopg error (its class by SQLSTATE, as psycopg raises it) of a failed COPY."""
    if result is None:
        raise psycopg.OperationalError(pgconn.get_error_message() or "no result from the COPY")
    if result.status not in (pq.ExecStatus.FATAL_ERROR, pq.ExecStatus.NONFATAL_ERROR):
        status = pq.ExecStatus(result.status).name
        raise psycopg.ProgrammingError(f"unexpected {status} from a COPY ... TO STDOUT")
    sqlstate = (result.error_field(pq.DiagnosticField.SQLSTATE) or b"").decode("ascii", "replace")
    cls: type[psycopg.Error] = psycopg.DatabaseError
    with contextlib.suppress(KeyError):
        cls = psycopg.errors.lookup(sqlstate)
    raise cls(result.get_error_message(), info=result)


def _drain(pgconn: pq.abc.PGconn, deadline: float) -> None:
    """Reads a cancelled or failed COPY to its end, so the connection can roll back;
    gives up at the deadline (the connection is then closed with the engine)."""
    # The rest of its rows, if it is still sending them (psycopg raises
    # "no COPY in progress" once it has ended).
    with contextlib.suppress(psycopg.OperationalError):
        while (nbytes := pgconn.get_copy_data(1)[0]) >= 0:
            if nbytes == 0:
                if not _wait_readable(pgconn, deadline):
                    return
                pgconn.consume_input()
    # Then its results, to the last.
    while True:
        while pgconn.is_busy():
            if not _wait_readable(pgconn, deadline):
                return
            pgconn.consume_input()
        if pgconn.get_result() is None:
            return


# -- CSV: PostgreSQL's COPY ---------------------------------------------------------------


def _write_csv(
    raw: psycopg.Connection[Any], select: sql.Composed, out: IO[bytes], meter: Meter
) -> tuple[int, str]:
    digest = hashlib.sha256()
    copy_sql = sql.SQL("COPY ({}) TO STDOUT (FORMAT csv, HEADER true, FORCE_QUOTE *)").format(
        select
    )

    def sink(block: bytearray) -> None:
        out.write(block)
        digest.update(block)

    rows = _copy(raw, copy_sql, sink, meter, header=True)
    return rows, digest.hexdigest()


# -- Parquet: COPY's CSV through Arrow's parser into row groups -----------------------------


def write_parquet(
    raw: psycopg.Connection[Any],
    select: sql.Composed,
    view: str,
    columns: Sequence[Column],
    path: Path,
    meter: Meter,
    *,
    row_group_rows: int | None = None,
) -> int:
    """``select``'s rows (COPY ... TO STDOUT) into a Parquet file at ``path``;
    returns the rows. Row groups of about ``ROW_GROUP_BYTES`` of Arrow data,
    or with ``row_group_rows`` of at least that many rows each (but the last):
    the archive's, which readers split work by."""
    import pyarrow as pa  # type: ignore[import-untyped]  # lazily: `kickass` starts fast

    schema = pa.schema([(c.name, pa_type(pa, c.arrow_type)) for c in columns])
    # Plain CSV: NULL is an unquoted empty field, an empty string a quoted one
    # (PostgreSQL quotes a value equal to the NULL string); no header, the
    # names are given.
    copy_sql = sql.SQL("COPY ({}) TO STDOUT (FORMAT csv)").format(select)
    stream = _BlockStream(COPY_BLOCKS_AHEAD)
    converter = _Converter(stream, schema, path, row_group_rows)
    converter.start()
    try:
        sent = _copy(raw, copy_sql, stream.put, meter, header=False)
        stream.put(None)
        converter.join()
    except BaseException as exc:
        stream.abort()
        converter.join()
        stopped_the_copy = converter.error is not None and not isinstance(converter.error, _Aborted)
        if isinstance(exc, KeyboardInterrupt) or not stopped_the_copy:
            raise  # the COPY failed or was interrupted, and stopped the converter
        # The parser or the writer failed, and so stopped the COPY: its error is the cause.
    if converter.error is not None:
        if isinstance(converter.error, pa.ArrowInvalid):
            raise _unreadable(view, converter.error) from converter.error
        raise converter.error
    if converter.rows != sent:
        raise KickassError(
            f"export of {view} failed: PostgreSQL sent {sent} rows, "
            f"the Parquet file got {converter.rows}",
            hint="nothing was written; please report this with the view's definition",
        )
    return sent


def _unreadable(view: str, exc: Exception) -> KickassError:
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if "conversion error" not in reason:
        return KickassError(
            f"export of {view} failed: Arrow could not read COPY's CSV: {reason}",
            hint="nothing was written; please report this with the view's definition",
        )
    return KickassError(
        f"export of {view} failed: a value does not fit its Parquet column: {reason}",
        hint="e.g. an infinite or BC timestamp, or a year after 9999; the CSV export "
        "carries PostgreSQL's text as it is (--format csv); nothing was written",
    )


class _Aborted(Exception):
    """The other side of a _BlockStream gave up."""


class _BlockStream(io.RawIOBase):
    """COPY's output, put in blocks by the thread running the COPY, read as a file
    by Arrow's CSV reader in another; at most ``ahead`` blocks waiting, so memory
    stays bounded. ``abort()`` makes both sides raise _Aborted instead of waiting."""

    def __init__(self, ahead: int) -> None:
        super().__init__()
        self._queue: queue.Queue[bytearray | None] = queue.Queue(maxsize=ahead)
        self._aborted = threading.Event()
        self._block = bytearray()
        self._offset = 0
        self._eof = False

    def readable(self) -> bool:
        return True

    def put(self, block: bytearray | None) -> None:
        """One block, or None at the end."""
        while True:
            if self._aborted.is_set():
                raise _Aborted("the Parquet writer stopped")
            try:
                self._queue.put(block, timeout=0.1)
                return
            except queue.Full:
                continue

    def abort(self) -> None:
        self._aborted.set()

    def at_end(self) -> bool:
        """True when the stream holds nothing (waits for the first block)."""
        return not self._next()

    def _next(self) -> bool:
        while self._offset >= len(self._block):
            if self._eof:
                return False
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                if self._aborted.is_set():
                    raise _Aborted("the COPY stopped") from None
                continue
            if item is None:
                self._eof = True
                return False
            self._block, self._offset = item, 0
        return True

    def read(self, size: int = -1, /) -> bytearray:
        if not self._next():
            return bytearray()
        if self._offset == 0 and (size < 0 or size >= len(self._block)):
            self._offset = len(self._block)
            return self._block  # the whole block, not a copy of it
        end = len(self._block) if size < 0 else self._offset + size
        data = self._block[self._offset : end]
        self._offset += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


class _Converter(threading.Thread):
    """Parses a _BlockStream of COPY's CSV with Arrow (C++, the GIL released while it
    parses, so the COPY goes on beside it) and writes row groups of about
    ROW_GROUP_BYTES. Its exception, if any, is left in ``error`` (and the stream
    aborted, so the COPY stops)."""

    def __init__(
        self, stream: _BlockStream, schema: Any, path: Path, row_group_rows: int | None = None
    ) -> None:
        super().__init__(name="kickass-export-parquet", daemon=True)
        self._stream = stream
        self._schema = schema
        self._path = path
        self._row_group_rows = row_group_rows
        self.rows = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._convert()
        except BaseException as exc:  # noqa: BLE001 - handed to the thread running the COPY
            self.error = exc
            self._stream.abort()

    def _convert(self) -> None:
        import pyarrow as pa
        import pyarrow.csv as pacsv  # type: ignore[import-untyped]
        import pyarrow.parquet as pq  # type: ignore[import-untyped]

        schema = self._schema
        with pq.ParquetWriter(str(self._path), schema, compression=PARQUET_COMPRESSION) as writer:
            if self._stream.at_end():
                return  # Arrow refuses an empty CSV: an empty view is a file with no row group
            reader = pacsv.open_csv(
                self._stream,
                read_options=pacsv.ReadOptions(
                    column_names=schema.names,
                    # The most it asks for at once: more than any block (under
                    # COPY_BLOCK_BYTES plus one row, and a row is under 1 GiB), so
                    # every read is one whole block of whole rows. Arrow refuses a
                    # row spread over more than two reads, and reads only what
                    # _BlockStream has, so nothing of this size is allocated.
                    block_size=ARROW_READ_BYTES,
                    # Parsing runs in this thread: the COPY and PostgreSQL have the other cores.
                    use_threads=False,
                ),
                parse_options=pacsv.ParseOptions(newlines_in_values=True),
                convert_options=pacsv.ConvertOptions(
                    column_types={f.name: f.type for f in schema},
                    strings_can_be_null=True,
                    quoted_strings_can_be_null=False,
                    null_values=[""],
                    true_values=["t"],
                    false_values=["f"],
                ),
            )
            pending: list[Any] = []  # RecordBatches of the row group being filled
            pending_bytes = pending_rows = 0
            for batch in reader:
                pending.append(batch)
                pending_bytes += batch.nbytes
                pending_rows += batch.num_rows
                self.rows += batch.num_rows
                if (
                    pending_rows >= self._row_group_rows
                    if self._row_group_rows
                    else pending_bytes >= ROW_GROUP_BYTES
                ):
                    _write_row_group(pa, writer, pending)
                    pending, pending_bytes, pending_rows = [], 0, 0
            if pending:
                _write_row_group(pa, writer, pending)


def _write_row_group(pa: Any, writer: Any, batches: list[Any]) -> None:
    table = pa.Table.from_batches(batches)
    writer.write_table(table, row_group_size=table.num_rows)


def pa_type(pa: Any, name: str) -> Any:
    return {
        "int64": pa.int64(),
        "double": pa.float64(),
        "bool": pa.bool_(),
        "timestamp[us, tz=UTC]": pa.timestamp("us", tz="UTC"),
        "timestamp[us]": pa.timestamp("us"),
        "date32[day]": pa.date32(),
        STRING: pa.string(),
    }[name]


# -- files ---------------------------------------------------------------------------------


def _exists(final: Path) -> NoReturn:
    raise KickassError(
        f"{final} already exists",
        hint="an export of the same view and filters in the same second: run it again",
    )


def _published(view: str, fmt: str, data_path: Path, schema_path: Path) -> ExportResult:
    """The export already published under ``data_path``, as its schema describes it."""
    try:
        schema = json.loads(schema_path.read_text(encoding="utf-8"))
        size = data_path.stat().st_size
        ok = (
            schema.get("view") == view and schema.get("format") == fmt
            and schema.get("data_file") == data_path.name and schema.get("bytes") == size
        )  # fmt: skip
    except (OSError, ValueError, AttributeError):
        ok = False
    if not ok:
        raise KickassError(
            f"{data_path} is published, but {schema_path.name} does not describe it",
            hint="move both aside (or restore the schema) and run the export again",
        )
    return ExportResult(
        view=view,
        format=fmt,
        data_path=data_path,
        schema_path=schema_path,
        rows=int(schema["rows"]),
        bytes=size,
        seconds=0.0,
        sha256=str(schema["sha256"]),
        exported_at=datetime.fromisoformat(schema["exported_at"]),
        alembic_revision=schema.get("alembic_revision"),
        filters={k: schema["filters"].get(k) for k in ("since", "until", "source", "campaign")},
        already_published=True,
    )


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class Meter:
    """Calls ``progress(rows, seconds)`` at most every PROGRESS_EVERY_S seconds."""

    def __init__(self, progress: Progress | None) -> None:
        self._progress = progress
        self._t0 = time.monotonic()
        self._next = self._t0 + PROGRESS_EVERY_S
        self._reported = False

    def tick(self, rows: int) -> None:
        if self._progress is None:
            return
        now = time.monotonic()
        if now >= self._next:
            self._next = now + PROGRESS_EVERY_S
            self._reported = True
            self._progress(rows, now - self._t0)

    def done(self, rows: int) -> None:
        """A last report with the exact count, when the export was long enough to report."""
        if self._progress is not None and self._reported:
            self._progress(rows, time.monotonic() - self._t0)
