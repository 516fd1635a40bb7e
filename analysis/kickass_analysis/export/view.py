"""``export_view``: one view to its files, in one snapshot of the database.

The export proper, composing the rest of the package: the filters
(filters.py), the catalogue and COPY (readers.py), a format (formats.py) and
the files (files.py), published the one way ``kickass_analysis.publish`` does
it, the schema first.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime
from pathlib import Path

import psycopg
from kickass_core import sources
from kickass_core.errors import KickassError
from kickass_db import engine as db
from psycopg import sql
from sqlalchemy import Connection, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from .. import __version__, publish
from .files import SCHEMA_VERSION, ExportResult, _exists, _file_name, _published
from .filters import Filters, _utc, _where
from .formats import (
    CSV_CONVENTIONS,
    FORMATS,
    PARQUET_SETTINGS,
    _write_csv,
    sha256_file,
    write_parquet,
)
from .readers import (
    Meter,
    Progress,
    _columns,
    _views,
    _views_with,
    alembic_revision,
    text_settings,
)


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
    if source is not None and source not in sources.names():
        raise KickassError(
            f"unknown source {source!r}",
            hint=f"one of: {', '.join(sources.names())} (the study sources registered here)",
        )
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
