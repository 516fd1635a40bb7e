"""`kickass export`: one analysis view to a dated CSV or Parquet file, in constant memory.

Only the public ``v_*`` views are exportable (listed from the database, so a
view a migration adds is exportable at once); ``VIEWS`` says, for the views
it knows, which column dates a row (for ``since``/``until``) and which
source every row comes from when the view has no ``source`` column. A view
with a ``source`` or ``campaign`` column can be filtered on it.

How the rows travel, all inside one read-only REPEATABLE READ transaction
(the rows, the row count, the export time and the alembic revision are one
snapshot of the database):

* **Parquet**: a server-side cursor (psycopg 3 named cursor: ``DECLARE``,
  then ``FETCH`` of ``FETCH_ROWS`` rows at a time; one thread fetches the
  next batch while the caller converts the last one) into Arrow arrays,
  written as row groups of at most ``ROW_GROUP_BYTES`` of Arrow data by
  ``pyarrow.parquet.ParquetWriter``. Types: integers int64, real, double and
  numeric float64, boolean bool, timestamptz ``timestamp[us, tz=UTC]``
  (timestamp without time zone stays naive), date date32, and everything
  else (text, jsonb, inet, arrays, ...) as a string in PostgreSQL's own text
  form. Values travel in the text protocol, so a ``real`` reads back as the
  number PostgreSQL prints (12.345, not 12.345000267...), as in the CSV.
  NULLs stay NULL.
* **CSV**: PostgreSQL's own ``COPY (SELECT ...) TO STDOUT (FORMAT csv,
  HEADER, FORCE_QUOTE *)``, streamed to the file chunk by chunk (not a
  cursor: COPY is PostgreSQL's fastest stream, and its CSV is the one
  psql's ``\\copy`` writes). Every value is quoted except NULL, which is an
  unquoted empty field, so an empty string (``""``) and NULL differ; values
  are PostgreSQL's text output (timestamps ``2026-11-25 03:12:05.123+00``
  in UTC, booleans ``t``/``f``, jsonb as JSON text). The ``.schema.json``
  says how to read it back typed (its ``arrow_type`` per column).

Memory: one batch of rows, one row group of Arrow data and the Parquet
writer's footer (a few hundred bytes per row group and column) whatever the
number of rows (measured: tests/analysis/test_export.py, bench/export_bench.py).

Files: ``<view>[-<source>][-campaign-<c>][-since<T>][-until<T>]-<exported>.<ext>``
with times as ``20261125T031205Z``; the export time is the database's
transaction time. ``since`` is inclusive and ``until`` exclusive, so
consecutive windows (the scheduled ``export`` item) neither overlap nor
leave gaps. Beside it, ``<data file>.schema.json``: columns with their
PostgreSQL and Arrow types, the query and its filters, the row count, the
sha256 and size of the data file, the export time and the database's alembic
revision. Both are written under hidden ``.<name>.partial-<pid>`` names and
hard-linked to their final names only when complete (the schema first, so a
data file under its final name always has its schema beside it); an error,
Ctrl-C (or SIGTERM, which `kickass export` turns into one) removes the
partial files, SIGKILL can leave only a hidden partial file, and nothing is
ever written under a final name that already exists.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import psycopg
from kickass_core.errors import KickassError
from kickass_db import engine as db
from psycopg import sql
from psycopg.types.numeric import FloatLoader
from psycopg.types.string import TextLoader
from sqlalchemy import Connection, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from . import __version__

FORMATS = ("csv", "parquet")
SOURCES = ("volunteer", "atlas")
SCHEMA_VERSION = 1

FETCH_ROWS = 2_000  # rows per FETCH from the server-side cursor
ROW_GROUP_BYTES = 4 * 1024 * 1024  # Arrow bytes buffered before a Parquet row group is written
PARQUET_COMPRESSION = "zstd"
PROGRESS_EVERY_S = 2.0
STAMP = "%Y%m%dT%H%M%SZ"
PARQUET_SETTINGS = {"compression": PARQUET_COMPRESSION, "row_group_bytes": ROW_GROUP_BYTES}


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
) -> ExportResult:
    """Export ``view`` as ``fmt`` ('csv' or 'parquet') into ``directory`` (see the module doc).

    ``database_url`` None: $KICKASS_DATABASE_URL, else the config file.
    Naive ``since``/``until`` are taken as UTC. ``progress(rows, seconds)``
    is called at most every ``PROGRESS_EVERY_S`` seconds. Raises
    KickassError for anything the caller can act on.
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
                return _export(conn, view, fmt, out_dir, filters, progress, t0)
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
) -> ExportResult:
    conn.exec_driver_sql("SET LOCAL client_encoding TO 'UTF8'")
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
    revision = _alembic_revision(conn)
    raw = conn.connection.driver_connection
    assert isinstance(raw, psycopg.Connection)
    select: sql.Composed = sql.SQL("SELECT {} FROM {} AS v{}").format(
        sql.SQL(", ").join(sql.SQL("v.{}").format(sql.Identifier(c.name)) for c in columns),
        sql.Identifier("public", view),
        where,
    )

    out_dir.mkdir(parents=True, exist_ok=True)
    name = _file_name(view, fmt, filters, exported_at)
    data_path = out_dir / name
    schema_path = out_dir / (name + ".schema.json")
    for final in (data_path, schema_path):
        if final.exists():
            raise KickassError(
                f"{final} already exists",
                hint="an export of the same view and filters in the same second: run it again",
            )
    meter = _Meter(progress)
    data_tmp, schema_tmp = _partial(data_path), _partial(schema_path)
    try:
        if fmt == "csv":
            with open(data_tmp, "xb") as out:
                rows, digest = _write_csv(raw, select, out, meter)
                out.flush()
                os.fsync(out.fileno())
        else:
            rows = _write_parquet(raw, select, columns, data_tmp, meter)
            digest = _sha256_fsync(data_tmp)
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
            f.flush()
            os.fsync(f.fileno())
        # The schema first: a data file under its final name has its schema beside it.
        _publish(schema_tmp, schema_path)
        try:
            _publish(data_tmp, data_path)
        except BaseException:
            schema_path.unlink(missing_ok=True)
            raise
    finally:
        data_tmp.unlink(missing_ok=True)
        schema_tmp.unlink(missing_ok=True)
    _fsync_dir(out_dir)
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


def _alembic_revision(conn: Connection) -> str | None:
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


def _file_name(view: str, fmt: str, filters: Filters, exported_at: datetime) -> str:
    parts = [view]
    if filters.source:
        parts.append(filters.source)
    if filters.campaign is not None:
        parts.append("campaign-" + (re.sub(r"[^A-Za-z0-9._]+", "_", filters.campaign)[:60] or "_"))
    if filters.since:
        parts.append("since" + _stamp(filters.since))
    if filters.until:
        parts.append("until" + _stamp(filters.until))
    parts.append(_stamp(exported_at))
    return "-".join(parts) + "." + fmt


def _stamp(t: datetime) -> str:
    return t.astimezone(UTC).strftime(STAMP)


def _utc(t: datetime | None) -> datetime | None:
    if t is None:
        return None
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


# -- CSV: PostgreSQL's COPY ---------------------------------------------------------------


def _write_csv(
    raw: psycopg.Connection[Any], select: sql.Composed, out: IO[bytes], meter: _Meter
) -> tuple[int, str]:
    digest = hashlib.sha256()
    copy_sql = sql.SQL("COPY ({}) TO STDOUT (FORMAT csv, HEADER true, FORCE_QUOTE *)").format(
        select
    )
    lines = 0
    with raw.cursor() as cur:
        try:
            with cur.copy(copy_sql) as copy:
                for chunk in copy:
                    data = bytes(chunk)
                    out.write(data)
                    digest.update(data)
                    lines += data.count(b"\n")
                    # Lines, not rows, while it runs (a value may hold a newline).
                    meter.tick(max(lines - 1, 0))
        except BaseException:
            # Stop the server's side of the COPY, so leaving the block does not
            # wait for the rest of the view to stream by.
            with contextlib.suppress(Exception):
                raw.cancel_safe()
            raise
        rows = cur.rowcount
    return rows, digest.hexdigest()


# -- Parquet: a server-side cursor into Arrow row groups ----------------------------------


def _write_parquet(
    raw: psycopg.Connection[Any],
    select: sql.Composed,
    columns: Sequence[Column],
    path: Path,
    meter: _Meter,
) -> int:
    import pyarrow as pa  # type: ignore[import-untyped]  # lazily: `kickass` starts fast
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    schema = pa.schema([(c.name, _arrow(pa, c.arrow_type)) for c in columns])
    # Rows convert as one struct array (tuples in field order), in C++, no transposing here.
    row_type = pa.struct(list(schema))
    rows = 0
    pending: list[Any] = []  # RecordBatches of the row group being filled
    pending_bytes = 0
    with (
        raw.cursor(name="kickass_export") as cur,
        pq.ParquetWriter(str(path), schema, compression=PARQUET_COMPRESSION) as writer,
    ):
        for c in columns:
            if c.arrow_type == STRING:
                cur.adapters.register_loader(c.oid, TextLoader)  # jsonb, inet, ... as text
            elif c.typname == "numeric":
                cur.adapters.register_loader(c.oid, FloatLoader)
        cur.execute(select)
        with _Prefetch(cur, FETCH_ROWS) as batches:
            for batch in batches:
                record = pa.RecordBatch.from_struct_array(pa.array(batch, type=row_type))
                pending.append(record)
                pending_bytes += record.nbytes
                rows += len(batch)
                if pending_bytes >= ROW_GROUP_BYTES:
                    _write_row_group(pa, writer, pending)
                    pending, pending_bytes = [], 0
                meter.tick(rows)
            if pending:
                _write_row_group(pa, writer, pending)
    return rows


def _write_row_group(pa: Any, writer: Any, batches: list[Any]) -> None:
    table = pa.Table.from_batches(batches)
    writer.write_table(table, row_group_size=table.num_rows)


def _arrow(pa: Any, name: str) -> Any:
    return {
        "int64": pa.int64(),
        "double": pa.float64(),
        "bool": pa.bool_(),
        "timestamp[us, tz=UTC]": pa.timestamp("us", tz="UTC"),
        "timestamp[us]": pa.timestamp("us"),
        "date32[day]": pa.date32(),
        STRING: pa.string(),
    }[name]


class _Prefetch:
    """Iterates over a cursor's rows in batches, FETCHing the next batch in a
    thread while the caller converts the last one (the server computes while
    the client converts; one batch ahead, so memory stays bounded)."""

    def __init__(self, cursor: psycopg.ServerCursor[Any], rows: int) -> None:
        self._cursor = cursor
        self._rows = rows
        self._queue: queue.Queue[list[Any] | BaseException] = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kickass-export-fetch", daemon=True)

    def __enter__(self) -> Iterator[list[Any]]:
        self._thread.start()
        return self._batches()

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self._stop.set()
        if exc_type is not None:
            # The consumer failed or was interrupted: cancel a FETCH under way (the
            # first one of a sorting view can take minutes) instead of waiting for it.
            with contextlib.suppress(Exception):
                self._cursor.connection.cancel_safe()
        self._thread.join()

    def _batches(self) -> Iterator[list[Any]]:
        while True:
            item = self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if not item:
                return
            yield item

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                batch = self._cursor.fetchmany(self._rows)
                self._put(batch)
                if not batch:
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the consuming thread
            self._put(exc)

    def _put(self, item: list[Any] | BaseException) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue


# -- files ---------------------------------------------------------------------------------


def _partial(final: Path) -> Path:
    """The hidden name ``final`` is written under until it is complete."""
    return final.with_name(f".{final.name}.partial-{os.getpid()}")


def _publish(partial: Path, final: Path) -> None:
    """``partial`` under its final name, by a hard link: atomic, and never
    replacing a file already there."""
    try:
        os.link(partial, final)
    except FileExistsError as exc:
        raise KickassError(
            f"{final} already exists",
            hint="an export of the same view and filters in the same second: run it again",
        ) from exc


def _sha256_fsync(path: Path) -> str:
    """The file's sha256, after forcing it to disk."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Meter:
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
