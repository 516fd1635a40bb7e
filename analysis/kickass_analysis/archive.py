"""The Parquet archive of the raw tables' days, and their retirement (issue 28 part 3).

A day of ``probe_outcomes`` (by its sessions' ``created_at``) or of
``router_telemetry`` (by ``recorded_at``) is one partition (migration 0022).
Once it is older than ``keep_raw_days`` (probe_outcomes 30, router_telemetry
7) it leaves the database for files, in Hive layout, which DuckDB and Spark
read as they are::

    ROOT/probe_outcomes/day=2026-11-01/part-00000.parquet
    ROOT/probe_outcomes/day=2026-11-01/_manifest.json
    ROOT/sessions/day=2026-11-01/...        the sidecar: the day's sessions
    ROOT/router_telemetry/day=2026-11-01/...

**Files.** The partition's rows in its primary key's order, through the
export's machinery (``export.write_parquet``: PostgreSQL's COPY parsed by
Arrow with each column's type from the catalogue, zstd), in row groups of at
least ``ROW_GROUP_ROWS`` (128 Ki) rows. The columns are the table's own, so
``restore`` puts the rows back as they were. Beside them ``_manifest.json``,
on the conventions of the export's ``.schema.json``: ``schema_version``, the
database's ``alembic_revision``, the columns with their PostgreSQL and Arrow
types, per file its path, rows, bytes and sha256, and the day's ``checks``
(``kickass_db.archive_store.CHECKS``: rows, rows per outcome or marking mode,
the sum of seq or t, the least and greatest of each time, rows per flag),
computed by PostgreSQL in the snapshot the rows were read in, and computed
again from the files by every verification. A probe_outcomes day's manifest
names its sessions' sidecar (``kickass_db.archive_store.SIDECAR_SELECT``: no
address, no cookie hash, the client key salted and hashed) and that
manifest's sha256.

**Publishing.** A day's files and its manifest (written last) go into a
hidden folder ``.day=D.partial-TAG``, each forced to disk, and the folder
is renamed to ``day=D`` (``publish.publish_dir``): no file is ever under a
final name without its manifest. A partial folder left by a killed attempt
is removed by the next attempt at that day (one archiver per day: an
advisory lock).

**Retirement** (``retire``; the scheduled ``housekeeping`` runs it), per day:

1. claim the day (``ArchiveStore.claim``), only when nothing blocks it: every
   session of a probe_outcomes day final with its durable counts (a live one
   blocks, and is reported), every second of a router_telemetry day rolled up
   into ``router_telemetry_1s``. From the claim on a late write for the day
   is refused: a client report gets HTTP 409, a replayed batch goes to the
   writer's ``failed-*``, and ``ensure_day_partition`` never makes it again;
2. write the files (or keep those already published, when they verify and
   their checks equal the database's), record them (``written``);
3. read them back from disk and verify them (sha256, rows, the checks from
   the files against the manifest's), record it (``verified``);
4. ``DETACH PARTITION ... CONCURRENTLY``;
5. verify again (the files, and the detached table's checks against the
   manifest's: a difference attaches the day again, and nothing is dropped),
   then ``DROP`` it, its row marked dropped in the same transaction.

A process killed between any two steps leaves a state the next run finishes,
and never a dropped day without a verified row. ``KICKASS_ARCHIVE_INJECT``
(``POINT`` or ``POINT:kill``) stops a retirement at one of
``INJECTION_POINTS``: the crash-safety tests use it.

``verify`` needs no database: it checks every manifest and file under a
root (a researcher's copy). ``restore`` puts a retired day back from its
files (and, with ``recount``, writes its sessions' durable counts again).

A settled Atlas campaign's outcomes go to ``ROOT/atlas_outcomes/campaign=NAME/``
the same way (``write_campaign``; the scheduled ``atlas`` item calls it once
the campaign is settled), and stay in the database: Atlas tables are never
dropped. A snapshot that still holds what the database holds is kept.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
from kickass_core.errors import KickassError
from kickass_db import engine as db
from kickass_db.archive_store import (
    ABSENT,
    ATTACHED,
    CAMPAIGN_SELECT,
    CHECKS,
    DETACHED,
    PENDING,
    SIDECAR,
    SIDECAR_SELECT,
    ArchiveStore,
    bounds,
    iso,
    pg_checks,
    relation,
    same_checks,
)
from kickass_db.models.archive import ARCHIVED_TABLES
from kickass_db.partitions import PARTITIONED
from psycopg import sql
from sqlalchemy import Connection, text
from sqlalchemy.exc import DBAPIError

from . import __version__, export, publish

SCHEMA_VERSION = 1
MANIFEST = "_manifest.json"
ROW_GROUP_ROWS = 128 * 1024
# Days kept raw in the database, per table (the settings' defaults).
KEEP_RAW_DAYS: dict[str, int] = {"probe_outcomes": 30, "router_telemetry": 7}
ATLAS = "atlas_outcomes"  # a settled campaign's snapshot, never dropped from the database
FOLDERS = (*ARCHIVED_TABLES, SIDECAR, ATLAS)
INJECT_ENV = "KICKASS_ARCHIVE_INJECT"
INJECTION_POINTS = (
    "after-first-file", "before-manifest", "after-manifest", "after-verify", "after-detach",
)  # fmt: skip
PARQUET = {
    "compression": export.PARQUET_COMPRESSION,
    "source": "COPY (FORMAT csv) parsed by pyarrow.csv with the columns' types",
}
_DAY = re.compile(r"day=(\d{4}-\d{2}-\d{2})")
_CAMPAIGN = re.compile(r"campaign=(.+)")
# What one folder of a table holds: a day, or (atlas_outcomes) a campaign.
Key = tuple[str, str]


class InjectedFault(Exception):
    """A retirement stopped at an injection point (``INJECT_ENV``)."""


def _inject(point: str) -> None:
    want = os.environ.get(INJECT_ENV)
    if not want:
        return
    name, _, how = want.partition(":")
    if name != point:
        return
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise InjectedFault(point)


def day_dir(root: Path, folder: str, day: date) -> Path:
    return dataset_dir(root, folder, ("day", day.isoformat()))


def campaign_dir(root: Path, campaign: str) -> Path:
    return dataset_dir(root, ATLAS, ("campaign", campaign))


def dataset_dir(root: Path, folder: str, key: Key) -> Path:
    """``ROOT/<folder>/<name>=<value>``, the value escaped as Hive partitions are
    (DuckDB, Spark and Arrow read it back unescaped)."""
    return root / folder / f"{key[0]}={urllib.parse.quote(key[1], safe='')}"


def part_name(n: int) -> str:
    return f"part-{n:05d}.parquet"


# -- verifying (no database) ----------------------------------------------------------------


@dataclass
class Dataset:
    """One verified folder: a day of a table or its sessions' sidecar, or a
    campaign's Atlas outcomes."""

    folder: str
    key: Key
    path: Path
    manifest: dict[str, Any] = field(default_factory=dict)
    manifest_sha256: str = ""
    rows: int = 0
    bytes: int = 0
    files: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def day(self) -> date | None:
        return _date(self.key[1]) if self.key[0] == "day" else None

    def to_json(self) -> dict[str, Any]:
        return {
            "table": self.folder,
            self.key[0]: self.key[1],
            "path": str(self.path),
            "rows": self.rows,
            "bytes": self.bytes,
            "files": self.files,
            "manifest_sha256": self.manifest_sha256,
            "problems": self.problems,
        }


@dataclass
class VerifyReport:
    root: Path
    datasets: list[Dataset] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # of the root and its folders
    partials: list[str] = field(default_factory=list)  # hidden partial files, not published

    @property
    def ok(self) -> bool:
        return not self.problems and all(d.ok for d in self.datasets)

    def all_problems(self) -> list[str]:
        return self.problems + [f"{d.path}: {p}" for d in self.datasets for p in d.problems]

    def to_json(self) -> dict[str, Any]:
        return {
            "root": str(self.root),
            "ok": self.ok,
            "partitions": [d.to_json() for d in self.datasets],
            "rows": sum(d.rows for d in self.datasets),
            "bytes": sum(d.bytes for d in self.datasets),
            "problems": self.all_problems(),
            "partials": self.partials,
        }


def verify_archive(root: str | os.PathLike[str]) -> VerifyReport:
    """Every manifest and file under ``root``, read from disk (no database):
    each file listed with its size and sha256, no file missing or unlisted,
    the rows and the checks the files hold equal to their manifest's, each
    probe_outcomes day's sidecar the one its manifest names."""
    base = Path(root)
    if not base.is_dir():
        raise KickassError(f"no archive at {base}", hint="give the archive's root folder")
    report = VerifyReport(base)
    for entry in sorted(base.iterdir()):
        if entry.name.startswith("."):
            report.partials.append(entry.name)
            continue
        if not entry.is_dir() or entry.name not in FOLDERS:
            report.problems.append(f"{entry}: unexpected (an archive holds {', '.join(FOLDERS)})")
            continue
        pattern, what = (_CAMPAIGN, "campaign=NAME") if entry.name == ATLAS else (_DAY, "day=D")
        for sub in sorted(entry.iterdir()):
            m = pattern.fullmatch(sub.name)
            if sub.name.startswith("."):
                report.partials.append(f"{entry.name}/{sub.name}")
            elif m is None or not sub.is_dir():
                report.problems.append(f"{sub}: unexpected (this table holds {what} folders)")
            else:
                key = (what.split("=")[0], urllib.parse.unquote(m[1]))
                report.datasets.append(_verify(base, entry.name, key))
    return report


def verify_dataset(root: Path, folder: str, day: date) -> Dataset:
    """One day's folder against its manifest (see ``verify_archive``)."""
    return _verify(root, folder, ("day", day.isoformat()))


def _verify(root: Path, folder: str, key: Key) -> Dataset:
    path = dataset_dir(root, folder, key)
    out = Dataset(folder, key, path)
    manifest_path = path / MANIFEST
    try:
        blob = manifest_path.read_bytes()
    except FileNotFoundError:
        out.problems.append(f"no {MANIFEST}: its files are described by nothing")
        return out
    out.manifest_sha256 = _sha256(blob)
    try:
        manifest = json.loads(blob)
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        out.problems.append(f"{MANIFEST} is not readable JSON: {exc}")
        return out
    out.manifest = manifest
    if manifest.get("schema_version") != SCHEMA_VERSION:
        out.problems.append(f"{MANIFEST}: schema_version {manifest.get('schema_version')!r}")
        return out
    if manifest.get("table") != folder or manifest.get(key[0]) != key[1]:
        out.problems.append(
            f"{MANIFEST} describes {manifest.get('table')} {manifest.get(key[0])}, "
            f"not {folder} {key[1]}"
        )
    listed = {str(f.get("path")): f for f in manifest.get("files") or []}
    present = {p.name for p in path.iterdir() if p.name != MANIFEST}
    for name in sorted(present - set(listed)):
        out.problems.append(f"extra file {name} (in no manifest)")
    for name in sorted(set(listed) - present):
        out.problems.append(f"missing file {name}")
    columns = manifest.get("columns") or []
    readable: list[Path] = []
    for name, entry in sorted(listed.items()):
        if name not in present:
            continue
        file = path / name
        size = file.stat().st_size
        out.bytes += size
        out.files += 1
        if size != entry.get("bytes"):
            out.problems.append(f"{name}: {size} bytes, the manifest says {entry.get('bytes')}")
        if export.sha256_file(file) != entry.get("sha256"):
            out.problems.append(f"{name}: its sha256 is not the manifest's (the file changed)")
        problem = _parquet_problem(file, entry, columns)
        if problem:
            out.problems.append(f"{name}: {problem}")
        else:
            readable.append(file)
    rows = sum(int(f.get("rows") or 0) for f in listed.values())
    out.rows = rows
    if manifest.get("rows") != rows:
        out.problems.append(f"the manifest says {manifest.get('rows')} rows, its files list {rows}")
    if len(readable) == len(listed) and folder in CHECKS:
        found = file_checks(folder, readable)
        differ = same_checks(manifest.get("checks") or {}, found)
        if differ:
            out.problems.append(
                "the files' checks differ from the manifest's: " + "; ".join(differ)
            )
    sidecar = manifest.get("sidecar")
    if folder == "probe_outcomes":
        if not isinstance(sidecar, dict):
            out.problems.append("the manifest names no sessions sidecar")
        else:
            target = dataset_dir(root, SIDECAR, key) / MANIFEST
            try:
                actual = _sha256(target.read_bytes())
            except FileNotFoundError:
                out.problems.append(f"its sessions sidecar {target} is missing")
            else:
                if actual != sidecar.get("sha256"):
                    out.problems.append(f"its sessions sidecar {target} is not the one it names")
    return out


def _parquet_problem(file: Path, entry: Mapping[str, Any], columns: list[Any]) -> str | None:
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    try:
        meta = pq.ParquetFile(file)
    except Exception as exc:  # noqa: BLE001 - any damage reads as an error of the file
        return f"not a readable Parquet file ({type(exc).__name__}: {exc})"
    if meta.metadata.num_rows != entry.get("rows"):
        return f"holds {meta.metadata.num_rows} rows, the manifest says {entry.get('rows')}"
    names = [c.get("name") for c in columns]
    if meta.schema_arrow.names != names:
        return f"its columns {meta.schema_arrow.names} are not the manifest's {names}"
    return None


def file_checks(folder: str, files: Iterable[Path]) -> dict[str, Any]:
    """The day's checks computed from its files (``pg_checks`` computes them in
    PostgreSQL): a boolean flag counts true rows, any other non-NULL ones."""
    import pyarrow as pa
    import pyarrow.compute as pc  # type: ignore[import-untyped]
    import pyarrow.parquet as pq

    spec = CHECKS[folder]
    wanted = [spec.group, *([spec.total] if spec.total else []), *spec.times, *spec.flags]
    rows = 0
    groups: Counter[str] = Counter()
    int_total = 0
    float_totals: list[float] = []
    total_is_float = False
    seen_total = False
    lows: dict[str, Any] = {}
    highs: dict[str, Any] = {}
    flags: Counter[str] = Counter()
    for path in files:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=ROW_GROUP_ROWS, columns=wanted):
            rows += batch.num_rows
            for item in pc.value_counts(batch.column(spec.group)).to_pylist():
                groups[_key(item["values"])] += int(item["counts"])
            if spec.total:
                col = batch.column(spec.total)
                if col.null_count < len(col):
                    seen_total = True
                if pa.types.is_floating(col.type):
                    total_is_float = True
                    float_totals.append(math.fsum(col.drop_null().to_pylist()))
                else:
                    int_total += int(pc.sum(col).as_py() or 0)
            for t in spec.times:
                mm = pc.min_max(batch.column(t))
                low, high = mm["min"].as_py(), mm["max"].as_py()
                if low is not None and (t not in lows or low < lows[t]):
                    lows[t] = low
                if high is not None and (t not in highs or high > highs[t]):
                    highs[t] = high
            for f in spec.flags:
                col = batch.column(f)
                if pa.types.is_boolean(col.type):
                    flags[f] += int(pc.sum(col).as_py() or 0)
                else:
                    flags[f] += len(col) - col.null_count
    out: dict[str, Any] = {"rows": rows, f"by_{spec.group}": dict(sorted(groups.items()))}
    if spec.total:
        total: int | float | None = None
        if seen_total:
            total = math.fsum(float_totals) if total_is_float else int_total
        out[f"sum_{spec.total}"] = total
    for t in spec.times:
        out[f"min_{t}"] = iso(lows.get(t))
        out[f"max_{t}"] = iso(highs.get(t))
    for f in spec.flags:
        out[f"rows_{f}"] = flags[f]
    return out


def _key(value: Any) -> str:
    return "null" if value is None else str(value)


# -- writing (one snapshot of the database) ----------------------------------------------


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


# -- retiring -------------------------------------------------------------------------------

Progress = Callable[[str, dict[str, Any]], None]


@dataclass
class DayResult:
    table: str
    day: date
    outcome: str  # retired | written | blocked | busy | failed
    rows: int = 0
    bytes: int = 0
    files_written: bool = False
    verified: bool = False
    dropped: bool = False
    write_s: float = 0.0
    verify_s: float = 0.0
    detach_ms: float = 0.0
    drop_ms: float = 0.0
    reasons: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "table": self.table,
            "day": self.day.isoformat(),
            "outcome": self.outcome,
            "rows": self.rows,
            "bytes": self.bytes,
            "files_written": self.files_written,
            "verified": self.verified,
            "dropped": self.dropped,
            "write_s": round(self.write_s, 3),
            "verify_s": round(self.verify_s, 3),
            "detach_ms": round(self.detach_ms, 1),
            "drop_ms": round(self.drop_ms, 1),
            "reasons": self.reasons,
        }


@dataclass
class RetireResult:
    root: Path
    days: list[DayResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failed(self) -> list[DayResult]:
        return [d for d in self.days if d.outcome == "failed"]

    @property
    def blocked(self) -> list[DayResult]:
        return [d for d in self.days if d.outcome == "blocked"]

    def counts(self) -> dict[str, Any]:
        """What the housekeeping item records in ``item_runs``."""
        dropped = [d for d in self.days if d.dropped]
        return {
            "partitions_written": sum(d.files_written for d in self.days),
            "partitions_verified": sum(d.verified for d in self.days),
            "partitions_dropped": len(dropped),
            "rows": sum(d.rows for d in dropped),
            "bytes": sum(d.bytes for d in dropped),
            "seconds": round(self.seconds, 3),
            "lock_ms": {
                "detach": round(sum(d.detach_ms for d in self.days), 1),
                "drop": round(sum(d.drop_ms for d in self.days), 1),
                "drop_max": round(max((d.drop_ms for d in self.days), default=0.0), 1),
            },
            "blocked": [
                {"table": d.table, "day": d.day.isoformat(), "reasons": d.reasons}
                for d in self.blocked
            ],
            "failed": [
                {"table": d.table, "day": d.day.isoformat(), "reasons": d.reasons}
                for d in self.failed
            ],
        }

    def to_json(self) -> dict[str, Any]:
        return {"root": str(self.root), **self.counts(), "days": [d.to_json() for d in self.days]}


def retire(
    database_url: str | None,
    root: str | os.PathLike[str],
    keep_raw_days: Mapping[str, int] | None = None,
    *,
    tables: Iterable[str] | None = None,
    tag: str | None = None,
    progress: Progress | None = None,
    stop: Callable[[], bool] | None = None,
) -> RetireResult:
    """Retire every day of ``tables`` (default: both) older than its
    ``keep_raw_days`` (``KEEP_RAW_DAYS`` for a table not given), and finish
    any retirement a killed run left (see the module doc). A day something
    blocks is reported and left; a day that fails is reported and the others
    go on. ``stop()`` is asked between days."""
    t0 = time.monotonic()
    base = Path(root)
    keep = {**KEEP_RAW_DAYS, **(keep_raw_days or {})}
    chosen = list(tables or ARCHIVED_TABLES)
    for table in chosen:
        _check_table(table)
        if keep[table] < 0:
            raise KickassError(f"keep_raw_days of {table} must be 0 or more, got {keep[table]}")
    tag = tag or f"p{os.getpid()}"
    out = RetireResult(base)
    store = ArchiveStore(database_url)
    try:
        db.check_connection(store.engine)
        today = store.today()
        for table in chosen:
            for day in store.candidates(table, today - timedelta(days=keep[table])):
                if stop is not None and stop():
                    out.seconds = time.monotonic() - t0
                    return out
                if day >= today:
                    continue  # never a day still being filled (an unfinished claim, say)
                result = _retire_day(store, base, table, day, tag, progress)
                out.days.append(result)
                if progress is not None:
                    progress(result.outcome, result.to_json())
    finally:
        store.close()
    out.seconds = time.monotonic() - t0
    return out


def _retire_day(
    store: ArchiveStore, root: Path, table: str, day: date, tag: str, progress: Progress | None
) -> DayResult:
    out = DayResult(table, day, "retired")
    if not store.lock_day(table, day):
        out.outcome = "busy"
        out.reasons.append("another archiver is working on this day")
        return out
    try:
        _steps(store, root, table, day, tag, progress, out)
    except (KickassError, DBAPIError) as exc:
        out.outcome = "failed"
        out.reasons.append(_reason(exc))
        # Still attached (nothing detached or dropped): its late writes are
        # taken again until the next retirement claims it.
        with contextlib.suppress(KickassError, DBAPIError):
            if store.state(table, day) == ATTACHED:
                store.release(table, day)
    finally:
        store.unlock_day(table, day)
    return out


def _steps(
    store: ArchiveStore,
    root: Path,
    table: str,
    day: date,
    tag: str,
    progress: Progress | None,
    out: DayResult,
) -> None:
    state = store.state(table, day)
    row = store.row(table, day)
    if state == ATTACHED:
        if row is None or row["claimed_at"] is None:
            blockers = store.claim(table, day)
            if blockers:
                out.outcome = "blocked"
                out.reasons = blockers
                return
        written = _write_day(store.engine, root, table, day, tag, progress)
        out.files_written, out.write_s = written.wrote, written.seconds
        out.rows, out.bytes = written.rows, written.bytes
        store.written(
            table, day, rows=written.rows, size=written.bytes, files=written.files,
            manifest_sha256=written.manifest_sha256,
        )  # fmt: skip
        _inject("after-manifest")
        _verify_recorded(store, root, table, day, out)
        _inject("after-verify")
        out.detach_ms += store.detach(table, day)
        _inject("after-detach")
        state = DETACHED
    elif state == PENDING:
        out.detach_ms += store.detach(table, day)  # FINALIZE
        state = DETACHED
    if state == DETACHED:
        row = store.row(table, day)
        if row is None or row["verified_at"] is None:
            raise KickassError(
                f"{relation(table, day)} is detached without a verified archive: not dropped",
                hint=f"attach it again (ALTER TABLE {table} ATTACH PARTITION ...) and retire it",
            )
        if row["detached_at"] is None:
            store.detach(table, day)  # its row marked detached
        # Verified again before the drop: the files as recorded, and the
        # detached table holding exactly what they hold. Either failing, the
        # day is attached again (the next retirement writes its files anew).
        try:
            data = _verify_recorded(store, root, table, day, out, record=False)
        except KickassError as exc:
            store.reattach(table, day, exc.message)  # raises
        differ = same_checks(data.manifest["checks"], store.checks(table, day))
        if differ:
            store.reattach(table, day, "; ".join(differ[:3]))  # raises
        out.drop_ms += store.drop(table, day, data.manifest_sha256)
        out.dropped = True
        out.rows, out.bytes = data.rows, data.bytes
        return
    if state == ABSENT:
        if row is not None and row["dropped_at"] is not None:
            out.outcome = "retired"
            out.rows, out.bytes = int(row["rows"] or 0), int(row["bytes"] or 0)
            return
        raise KickassError(
            f"{relation(table, day)} is gone, but its archive row says it was not dropped",
            hint="kickass archive verify checks its files; kickass archive restore puts it back",
        )


def _verify_recorded(
    store: ArchiveStore, root: Path, table: str, day: date, out: DayResult, record: bool = True
) -> Dataset:
    """The day's files read back from disk and verified, and their manifest
    the one the database recorded; ``record``: its row marked verified."""
    t0 = time.monotonic()
    data = verify_dataset(root, table, day)
    out.verify_s += time.monotonic() - t0
    if not data.ok:
        raise KickassError(
            f"the archive of {table} {day} does not verify: " + "; ".join(data.problems[:5]),
            hint="the day stays in the database; kickass archive verify names every problem",
        )
    row = store.row(table, day)
    if row is None or row["manifest_sha256"] != data.manifest_sha256:
        raise KickassError(
            f"the manifest of {table} {day} is not the one the database recorded",
            hint="it changed after it was written; the day stays in the database",
        )
    if record:
        store.verified(table, day, data.manifest_sha256)
    out.verified = True
    return data


def write(
    database_url: str | None,
    root: str | os.PathLike[str],
    table: str,
    day: date,
    *,
    tag: str | None = None,
    progress: Progress | None = None,
) -> DayResult:
    """Archive one day without retiring it: its files written (or kept),
    verified, recorded; the partition stays, and late writes are still
    taken (a retire later writes the day again if they change it)."""
    _check_table(table)
    base = Path(root)
    out = DayResult(table, day, "written")
    store = ArchiveStore(database_url)
    try:
        db.check_connection(store.engine)
        if day >= store.today():
            raise KickassError(
                f"{table} {day} is still being filled", hint="archive a day before today"
            )
        if store.state(table, day) != ATTACHED:
            raise KickassError(
                f"{table} has no partition of {day} in the database",
                hint="kickass archive list shows the days archived",
            )
        blockers = store.blockers(table, day)
        if blockers:
            raise KickassError(
                f"{table} {day} cannot be archived yet: " + "; ".join(blockers[:5]),
                hint="a live session's day is archived once it is final",
            )
        if not store.lock_day(table, day):
            raise KickassError(f"another archiver is working on {table} {day}")
        try:
            store.note(table, day)
            written = _write_day(store.engine, base, table, day, tag or f"p{os.getpid()}", progress)
            out.files_written, out.write_s = written.wrote, written.seconds
            out.rows, out.bytes = written.rows, written.bytes
            store.written(
                table, day, rows=written.rows, size=written.bytes, files=written.files,
                manifest_sha256=written.manifest_sha256,
            )  # fmt: skip
            _verify_recorded(store, base, table, day, out)
        finally:
            store.unlock_day(table, day)
    finally:
        store.close()
    return out


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
    import pyarrow.csv as pacsv  # type: ignore[import-untyped]
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


def _check_table(table: str) -> None:
    if table not in ARCHIVED_TABLES:
        raise KickassError(
            f"{table!r} is not archived by day", hint=f"one of: {', '.join(ARCHIVED_TABLES)}"
        )


def _date(value: str) -> date:
    return datetime.strptime(value, "%Y-%m-%d").date()


def _sha256(blob: bytes) -> str:
    import hashlib

    return hashlib.sha256(blob).hexdigest()


def _reason(exc: BaseException) -> str:
    if isinstance(exc, KickassError):
        return exc.message + (f" (hint: {exc.hint})" if exc.hint else "")
    if isinstance(exc, DBAPIError):
        return (str(exc.orig or exc).strip().splitlines() or [type(exc).__name__])[0]
    return str(exc)
