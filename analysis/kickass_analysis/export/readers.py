"""The COPY readers: the catalogue an export reads, and COPY's output in blocks.

Inside the export's one read-only transaction: ``text_settings`` (the text
COPY carries, whatever the server's defaults), the exportable views and a
view's columns with their PostgreSQL and Arrow types (``Column``), the
database's alembic revision; then ``_copy``, a ``COPY ... TO STDOUT`` read
from libpq a whole buffer of rows per wait and handed to a sink (the file, or
Arrow's parser: formats.py) in blocks of about ``COPY_BLOCK_BYTES``, and the
``Meter`` that reports progress while it runs.
"""

from __future__ import annotations

import contextlib
import select
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import psycopg
from psycopg import pq, sql
from sqlalchemy import Connection, text

COPY_BLOCK_BYTES = 1024 * 1024  # COPY output handed on (to the file, to Arrow) at a time
PROGRESS_EVERY_S = 2.0

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


Progress = Callable[[int, float], None]  # (rows so far, seconds so far)


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
