"""Putting a retired day back from its files, and what the database recorded of the days.

``restore`` (``kickass archive restore``): the day's files verified first,
their rows copied in (``_copy_in``) and their checks compared with the
manifest's before the partition is attached, in one transaction;
``listing`` and ``state_of`` (``kickass archive list``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import date
from pathlib import Path
from typing import Any

import psycopg
from kickass_core.errors import KickassError
from kickass_db import engine as db
from kickass_db.archive_store import ArchiveStore, same_checks
from psycopg import sql
from sqlalchemy import Connection

from .layout import _check_table
from .verifying import verify_dataset


def restore(
    database_url: str | None,
    root: str | os.PathLike[str],
    table: str,
    day: date,
    *,
    recount: bool = False,
) -> dict[str, Any]:
    """Put a retired day back from its files (verified first, and its rows'
    checks against the manifest's before the partition is attached), in one
    transaction; late writes for it are taken again. ``recount``: the day's
    final sessions' durable counts written again from the restored rows."""
    _check_table(table)
    base = Path(root)
    store = ArchiveStore(database_url)
    try:
        db.check_connection(store.engine)
        row = store.row(table, day)
        if row is None or row["verified_at"] is None:
            raise KickassError(
                f"{table} {day} has no verified archive", hint="kickass archive list shows them"
            )
        data = verify_dataset(base, table, day)
        if not data.ok:
            raise KickassError(
                f"the archive of {table} {day} does not verify: " + "; ".join(data.problems[:5]),
                hint="nothing was restored",
            )
        if data.manifest_sha256 != row["manifest_sha256"]:
            raise KickassError(
                f"the manifest of {table} {day} is not the one the database recorded",
                hint="nothing was restored",
            )
        files = [data.path / f["path"] for f in data.manifest["files"]]
        names = [c["name"] for c in data.manifest["columns"]]

        def fill(conn: Connection, name: str) -> None:
            _copy_in(conn, name, names, files)

        def check(checks: dict[str, Any]) -> list[str]:
            return same_checks(data.manifest["checks"], checks)

        out = store.restore(table, day, fill, check, recount=recount)
    finally:
        store.close()
    return {"table": table, "day": day.isoformat(), **out}


def _copy_in(conn: Connection, name: str, columns: list[str], files: list[Path]) -> None:
    """The files' rows into ``name`` by COPY (Arrow writes them as CSV:
    NULL an unquoted empty field, an empty string a quoted one)."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    raw = conn.connection.driver_connection
    assert isinstance(raw, psycopg.Connection)
    statement = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT csv)").format(
        sql.Identifier(name), sql.SQL(", ").join(sql.Identifier(c) for c in columns)
    )
    options = pacsv.WriteOptions(include_header=False)
    with raw.cursor() as cur, cur.copy(statement) as copy:
        for path in files:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=65536, columns=columns):
                sink = pa.BufferOutputStream()
                pacsv.write_csv(pa.Table.from_batches([batch]), sink, write_options=options)
                copy.write(sink.getvalue().to_pybytes())


def listing(database_url: str | None, table: str | None = None) -> list[dict[str, Any]]:
    """The days archived, as the database recorded them."""
    if table is not None:
        _check_table(table)
    store = ArchiveStore(database_url)
    try:
        db.check_connection(store.engine)
        return store.listing(table)
    finally:
        store.close()


def state_of(row: Mapping[str, Any]) -> str:
    """One word for where an archived day is."""
    for column, word in (
        ("dropped_at", "retired"), ("detached_at", "detached"), ("verified_at", "verified"),
        ("written_at", "written"), ("claimed_at", "claimed"),
    ):  # fmt: skip
        if row.get(column) is not None:
            if word == "verified" and row.get("claimed_at") is None:
                return "archived" if row.get("restored_at") is None else "restored"
            return word
    return "restored" if row.get("restored_at") is not None else "noted"
