"""Retiring the raw days: claim, write, verify, record, detach, verify again, drop.

``retire`` (the scheduled ``housekeeping`` runs it) takes every day past
``keep_raw_days`` (``KEEP_RAW_DAYS`` by default) through its steps, each
recorded by ``kickass_db.archive_store.ArchiveStore``, and finishes any
retirement a killed run left; ``write`` archives one day without retiring
it. A day something blocks is reported and left, a day that fails is
reported (``DayResult``, ``RetireResult``) and the others go on.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import date, timedelta
from pathlib import Path
from typing import Any

from kickass_core.errors import KickassError
from kickass_db import engine as db
from kickass_db.archive_store import (
    ABSENT,
    ATTACHED,
    DETACHED,
    PENDING,
    ArchiveStore,
    relation,
    same_checks,
)
from kickass_db.models.archive import ARCHIVED_TABLES
from sqlalchemy.exc import DBAPIError

from .layout import Progress, _check_table, _inject
from .verifying import Dataset, verify_dataset
from .writing import Written, _write_day

# Days kept raw in the database, per table (the settings' defaults).
KEEP_RAW_DAYS: dict[str, int] = {"probe_outcomes": 30, "router_telemetry": 7}


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
        _record_written(store, table, day, written, out)
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


def _record_written(
    store: ArchiveStore, table: str, day: date, written: Written, out: DayResult
) -> None:
    """The day's files written: what it took in ``out``, its manifest in the database."""
    out.files_written, out.write_s = written.wrote, written.seconds
    out.rows, out.bytes = written.rows, written.bytes
    store.written(
        table, day, rows=written.rows, size=written.bytes, files=written.files,
        manifest_sha256=written.manifest_sha256,
    )  # fmt: skip


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
            _record_written(store, table, day, written, out)
            _verify_recorded(store, base, table, day, out)
        finally:
            store.unlock_day(table, day)
    finally:
        store.close()
    return out


def _reason(exc: BaseException) -> str:
    if isinstance(exc, KickassError):
        return exc.message + (f" (hint: {exc.hint})" if exc.hint else "")
    if isinstance(exc, DBAPIError):
        return (str(exc.orig or exc).strip().splitlines() or [type(exc).__name__])[0]
    return str(exc)
