"""Writing a folder of the archive in one snapshot of the database.

A day's files (``_write_day``: a probe_outcomes day's sessions' sidecar
first) or a settled Atlas campaign's (``write_campaign``), read in one
read-only REPEATABLE READ transaction (``_snapshot``) through the export's
``write_parquet``, with the checks PostgreSQL computes in the same snapshot;
published at once (``publish.publish_dir``) with the manifest written last,
or the folder already published kept when it verifies and holds what the
database holds (``_dataset``). A partial folder a killed attempt left is
swept by the next (``_sweep``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import psycopg
from kickass_core.errors import KickassError
from kickass_db import engine as db
from kickass_db.archive_store import (
    CAMPAIGN_SELECT,
    CHECKS,
    SIDECAR,
    SIDECAR_SELECT,
    ArchiveStore,
    bounds,
    pg_checks,
    relation,
    same_checks,
)
from kickass_db.partitions import PARTITIONED
from psycopg import sql
from sqlalchemy import Connection, text

from .. import __version__, export, publish
from .layout import (
    ATLAS,
    MANIFEST,
    ROW_GROUP_ROWS,
    SCHEMA_VERSION,
    Key,
    Progress,
    _inject,
    _sha256,
    dataset_dir,
    part_name,
)
from .verifying import Dataset, _verify

PARQUET = {
    "compression": export.PARQUET_COMPRESSION,
    "source": "COPY (FORMAT csv) parsed by pyarrow.csv with the columns' types",
}


@dataclass
class Written:
    """A day's files as published (or found published and kept)."""

    manifest: dict[str, Any]
    manifest_sha256: str
    rows: int
    bytes: int
    files: int
    wrote: bool  # False: the files already published were kept
    seconds: float


def _sweep(root: Path, folders: Iterable[str], key: Key) -> None:
    """The partial folders a killed attempt at ``key`` left (this process holds it)."""
    name = dataset_dir(root, SIDECAR, key).name
    for folder in folders:
        parent = root / folder
        if not parent.is_dir():
            continue
        for entry in parent.iterdir():
            found = publish.partial_of(entry)
            if found is not None and found[0] == name:
                with contextlib.suppress(FileNotFoundError):
                    _remove(entry)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _query_columns(raw: psycopg.Connection[Any], select: str) -> list[export.Column]:
    """A query's columns with their types, as the export describes a view's."""
    with raw.cursor() as cur:
        cur.execute(sql.SQL("SELECT * FROM ({}) q LIMIT 0").format(sql.SQL(select)))
        described = [(d.name, int(d.type_code)) for d in cur.description or ()]
        cur.execute(
            "SELECT oid::bigint, typname, format_type(oid, NULL) FROM pg_type WHERE oid = ANY(%s)",
            ([oid for _, oid in described],),
        )
        types = {int(oid): (str(name), str(fmt)) for oid, name, fmt in cur.fetchall()}
    return [export.Column(name, types[oid][1], types[oid][0], oid) for name, oid in described]


def _write_day(
    engine: Any, root: Path, table: str, day: date, tag: str, progress: Progress | None
) -> Written:
    """The day's files (and a probe_outcomes day's sidecar), written in one
    REPEATABLE READ snapshot, or kept when published ones verify and hold what
    the database holds. Only while the partition is attached."""
    t0 = time.monotonic()
    _sweep(root, (table, SIDECAR), ("day", day.isoformat()))
    low, high = bounds(day)
    name = relation(table, day)
    key = ("day", day.isoformat())
    where = {
        "range": {"from": low.isoformat(), "to": high.isoformat()},
        "partition_key": PARTITIONED[table],
    }
    with _snapshot(engine, tag) as (conn, raw, context):
        sidecar: Dataset | None = None
        wrote = False
        if table == "probe_outcomes":
            select = SIDECAR_SELECT.format(low=low.isoformat(), high=high.isoformat())
            sidecar, made = _dataset(
                conn, raw, root, SIDECAR, key, select, f"({select}) x", None, context, progress,
                {**where, "partition_key": "created_at"},
            )  # fmt: skip
            wrote |= made
        order = ", ".join(CHECKS[table].order)
        select = f"SELECT * FROM {name} ORDER BY {order}"
        data, made = _dataset(
            conn, raw, root, table, key, select, name, sidecar, context, progress, where
        )
        wrote |= made
    return Written(
        data.manifest, data.manifest_sha256, data.rows, data.bytes, data.files, wrote,
        time.monotonic() - t0,
    )  # fmt: skip


@contextlib.contextmanager
def _snapshot(
    engine: Any, tag: str
) -> Iterator[tuple[Connection, psycopg.Connection[Any], dict[str, Any]]]:
    """One read-only REPEATABLE READ transaction: the rows, their checks and the
    revision of everything written in it are one snapshot of the database."""
    with engine.connect() as conn:
        conn = conn.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)
        with conn.begin():
            export.text_settings(conn)
            raw = conn.connection.driver_connection
            assert isinstance(raw, psycopg.Connection)
            context = {
                "revision": export.alembic_revision(conn),
                "written_at": conn.execute(text("SELECT transaction_timestamp()")).scalar_one(),
                "tag": tag,
            }
            yield conn, raw, context


def _dataset(
    conn: Connection,
    raw: psycopg.Connection[Any],
    root: Path,
    folder: str,
    key: Key,
    select: str,
    source: str,
    sidecar: Dataset | None,
    context: Mapping[str, Any],
    progress: Progress | None,
    where: Mapping[str, Any],
) -> tuple[Dataset, bool]:
    """One folder (a day, or a campaign): kept if published and equal to the
    database's rows (by its checks, and its sidecar the current one), else
    written anew. ``where``: what the manifest says of the rows' origin."""
    columns = _query_columns(raw, select)
    booleans = {c.name for c in columns if c.typname == "bool"}
    checks = pg_checks(conn, CHECKS[folder], source, booleans)
    final = dataset_dir(root, folder, key)
    label = f"{folder} {key[1]}"
    if final.exists():
        found = _verify(root, folder, key)
        same = (
            found.ok
            and not same_checks(found.manifest.get("checks") or {}, checks)
            and [c.to_json() for c in columns] == found.manifest.get("columns")
            and (sidecar is None or found.manifest["sidecar"]["sha256"] == sidecar.manifest_sha256)
        )
        if same:
            return found, False
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = publish.partial_path(final, context["tag"])
    aside: Path | None = None
    try:
        staging.mkdir()
        part = staging / part_name(0)

        def tick(rows: int, seconds: float) -> None:
            if progress is not None:
                progress("writing", {"table": folder, key[0]: key[1], "rows": rows})

        rows = export.write_parquet(
            raw,
            sql.Composed([sql.SQL(select)]),
            label,
            columns,
            part,
            export.Meter(tick),
            row_group_rows=ROW_GROUP_ROWS,
        )
        _inject("after-first-file")
        if rows != checks["rows"]:
            raise KickassError(
                f"the archive of {label} got {rows} rows, PostgreSQL counted {checks['rows']}",
                hint="nothing was published; please report this",
            )
        size = part.stat().st_size
        files = [
            {"path": part.name, "rows": rows, "bytes": size, "sha256": export.sha256_file(part)}
        ]
        manifest: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "table": folder,
            key[0]: key[1],
            **where,
            "written_at": context["written_at"].isoformat(),
            "alembic_revision": context["revision"],
            "query": select,
            "columns": [c.to_json() for c in columns],
            "parquet": {**PARQUET, "row_group_rows": ROW_GROUP_ROWS},
            "rows": rows,
            "files": files,
            "checks": checks,
            "kickass_analysis_version": __version__,
        }
        if sidecar is not None:
            manifest["sidecar"] = {
                "path": f"../../{SIDECAR}/{final.name}/{MANIFEST}",
                "sha256": sidecar.manifest_sha256,
                "rows": sidecar.rows,
            }
        _inject("before-manifest")
        blob = (json.dumps(manifest, indent=2, ensure_ascii=False) + "\n").encode()
        with open(staging / MANIFEST, "xb") as f:
            f.write(blob)
        if final.exists():
            # Published before and not what the database holds now (the
            # partition is still attached: the database is the authority).
            aside = publish.partial_path(final, context["tag"] + "_replaced")
            os.rename(final, aside)
        if not publish.publish_dir(staging, final):
            raise KickassError(
                f"{final} appeared while it was written",
                hint="another archiver wrote the day; run the retire again",
            )
    except OSError as exc:
        raise KickassError(
            f"cannot write the archive of {label} in {final.parent}: {exc.strerror or exc}",
            hint="give the archive room (or another folder); the day stays in the database",
        ) from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            _remove(staging)
        if aside is not None:
            with contextlib.suppress(FileNotFoundError):
                _remove(aside)
    out = Dataset(folder, key, final, manifest, _sha256(blob), rows, size, 1)
    return out, True


def write_campaign(
    database_url: str | None,
    root: str | os.PathLike[str],
    campaign: str,
    *,
    tag: str | None = None,
    progress: Progress | None = None,
) -> Written:
    """A settled Atlas campaign's outcomes as ``ROOT/atlas_outcomes/campaign=NAME/``
    (the scheduled ``atlas`` item writes it once the campaign is settled), or
    the snapshot already there kept when it still holds what the database
    holds (it is written again when late results changed them). The rows stay
    in the database: Atlas tables are never dropped."""
    base = Path(root)
    key = ("campaign", campaign)
    store = ArchiveStore(database_url)
    try:
        db.check_connection(store.engine)
        campaign_id = store.campaign_id(campaign)
        if campaign_id is None:
            raise KickassError(
                f"no Atlas campaign {campaign!r}", hint="kickass atlas status lists the campaigns"
            )
        if not store.lock_campaign(campaign_id):
            raise KickassError(f"another archiver is writing the campaign {campaign!r}")
        try:
            t0 = time.monotonic()
            _sweep(base, (ATLAS,), key)
            base.mkdir(parents=True, exist_ok=True)
            source = CAMPAIGN_SELECT.format(campaign_id=int(campaign_id))
            select = f"{source} ORDER BY {', '.join(CHECKS[ATLAS].order)}"
            where = {"partition_key": "campaign_id", "campaign_id": int(campaign_id)}
            with _snapshot(store.engine, tag or f"p{os.getpid()}") as (conn, raw, context):
                data, made = _dataset(
                    conn, raw, base, ATLAS, key, select, f"({source}) x", None, context,
                    progress, where,
                )  # fmt: skip
        finally:
            store.unlock_campaign(campaign_id)
    finally:
        store.close()
    return Written(
        data.manifest, data.manifest_sha256, data.rows, data.bytes, data.files, made,
        time.monotonic() - t0,
    )  # fmt: skip
