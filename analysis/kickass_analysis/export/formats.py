"""The formats: CSV (PostgreSQL's own COPY) and Parquet (COPY's CSV through Arrow).

CSV is COPY ... (FORMAT csv, HEADER, FORCE_QUOTE *) streamed to the file
(``CSV_CONVENTIONS``: what the schema file says of it); Parquet is COPY's
plain CSV parsed by Arrow's C++ reader in a thread of its own with every
column's type given (``_BlockStream``, ``_Converter``) and written in row
groups (``write_parquet``, which the archive uses too). Both read COPY
through readers.py; the module doc of ``kickass_analysis.export`` says why.
"""

from __future__ import annotations

import hashlib
import io
import queue
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import psycopg
from kickass_core.errors import KickassError
from psycopg import sql

from .readers import STRING, Column, Meter, _copy

FORMATS = ("csv", "parquet")

COPY_BLOCKS_AHEAD = 2  # Parquet: blocks the COPY may run ahead of the parser
ARROW_READ_BYTES = 2**31 - 1  # Arrow's block_size (an int32): see _Converter
ROW_GROUP_BYTES = 4 * 1024 * 1024  # Arrow bytes buffered before a Parquet row group is written
PARQUET_COMPRESSION = "zstd"
PARQUET_SETTINGS = {
    "compression": PARQUET_COMPRESSION,
    "row_group_bytes": ROW_GROUP_BYTES,
    "source": "COPY (FORMAT csv) parsed by pyarrow.csv with the columns' types",
}

CSV_CONVENTIONS = {
    "header": True,
    "delimiter": ",",
    "quote": '"',
    "encoding": "utf-8",
    "null": 'an unquoted empty field; every other value is quoted, so an empty string is ""',
    "values": "PostgreSQL's text output (COPY ... FORMAT csv, FORCE_QUOTE *): timestamps "
    "like 2026-11-25 03:12:05.123456+00 (UTC), booleans t/f, jsonb as JSON text",
}


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
    import pyarrow as pa  # lazily: `kickass` starts fast

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
        import pyarrow.csv as pacsv
        import pyarrow.parquet as pq

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


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
