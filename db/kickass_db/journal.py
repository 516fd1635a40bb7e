"""A write-ahead journal of typed records, so nothing measured vanishes in a shutdown.

The ``OrderedWriter`` appends each record it is handed (a study event, say),
as JSON, *before* it tries the database, and marks it done once the database
confirmed it. What is still open when the server stops — the database was
down at SIGTERM, or the process was killed — is replayed into the database at
the next start (every store write is idempotent), before orphaned sessions
are closed. The records' codec is their own module's (for the study:
``kickass_core.study_events.to_json``/``from_json``); the journal only keeps lines.

A journal file is NDJSON: ``{"seq": n, "record": {...}}`` for a write and
``{"done": n}`` once it is stored. It lives in the page cache as soon as it is
written (a killed process loses nothing already appended); ``fsync`` happens
on close and when it is rotated, not per write.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Generic, TypeVar

from .retry import DatabaseUnavailable

log = logging.getLogger("kickass.db.journal")

R = TypeVar("R")


class Journal(Generic[R]):
    """This process's journal file (one per run, in ``directory``); ``encode``
    turns a record into the JSON object kept of it."""

    def __init__(self, directory: str | Path, encode: Callable[[R], Mapping[str, Any]]) -> None:
        self.encode = encode
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"journal-{os.getpid()}-{time.time_ns()}.ndjson"
        self._f = self.path.open("a", encoding="utf-8")
        # Held while this process lives: a server starting beside it (another
        # instance sharing the directory) must not replay or remove a live journal.
        fcntl.flock(self._f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._lock = threading.Lock()
        self.open_writes = 0

    def append(self, seq: int, record: R) -> None:
        line = json.dumps({"seq": seq, "record": self.encode(record)}, separators=(",", ":"))
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()
            self.open_writes += 1

    def set_aside(self, record: R, reason: BaseException) -> None:
        """Keep a record the database refused for good in ``failed-<journal>``."""
        line = json.dumps({"record": self.encode(record), "reason": str(reason)[:500]})
        with self._lock, (self.dir / f"failed-{self.path.name}").open("a") as f:
            f.write(line + "\n")

    def done(self, seq: int) -> None:
        with self._lock:
            self._f.write(f'{{"done":{seq}}}\n')
            self._f.flush()
            self.open_writes -= 1
            if self.open_writes == 0:
                # Everything written so far is in the database: start afresh,
                # so the file stays small on a long-running server.
                self._f.truncate(0)
                self._f.seek(0)

    def close(self) -> int:
        """Close; returns how many writes stay open (kept for the next start)."""
        with self._lock:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            if self.open_writes == 0:
                self.path.unlink(missing_ok=True)
            return self.open_writes


def open_records(path: Path) -> list[Any]:
    """Records (as JSON, objects unless the file was tampered with) in a journal
    file that were never marked done, in order."""
    records: dict[int, Any] = {}
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            try:
                rec = json.loads(line)
            except ValueError:
                # A line cut by a crash: it was never confirmed either.
                log.warning("%s line %d: not JSON, skipped: %.80r", path.name, number, line)
                continue
            if isinstance(rec, dict) and _is_seq(rec.get("done")):
                records.pop(rec["done"], None)
            elif isinstance(rec, dict) and _is_seq(rec.get("seq")):
                # "call": a journal of an older server, set aside at replay.
                records[rec["seq"]] = rec.get("record", rec.get("call"))
            else:
                log.warning(
                    "%s line %d: not a journal entry, skipped: %.80r", path.name, number, line
                )
    return [records[k] for k in sorted(records)]


def _is_seq(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def replay(
    directory: str | Path,
    decode: Callable[[Mapping[str, Any]], R],
    apply: Callable[[R], object],
    skip: Path | None = None,
) -> dict[str, int]:
    """Store what earlier runs journaled but never stored; remove their files.

    Each open record is decoded and applied as the writer would have. One
    that fails for good (undecodable, or refused: not an outage) is logged
    and set aside in ``failed-<file>`` rather than retried forever; an outage
    stops the replay with the file kept, for the next start.
    """
    d = Path(directory)
    counts = {"files": 0, "replayed": 0, "failed": 0}
    if not d.is_dir():
        return counts
    for path in sorted(d.glob("journal-*.ndjson")):
        if skip is not None and path.resolve() == skip.resolve():
            continue
        try:
            handle = path.open("r+", encoding="utf-8")
        except FileNotFoundError:
            continue  # its owner finished and removed it meanwhile
        with handle:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live server's journal: not ours to replay
            _replay_file(d, path, decode, apply, counts)
    return counts


def _replay_file(
    d: Path,
    path: Path,
    decode: Callable[[Mapping[str, Any]], R],
    apply: Callable[[R], object],
    counts: dict[str, int],
) -> None:
    failed = []
    for obj in open_records(path):
        try:
            apply(decode(obj))
            counts["replayed"] += 1
        except DatabaseUnavailable:
            raise
        except Exception as exc:
            kind = obj.get("type") if isinstance(obj, dict) else type(obj).__name__
            log.error("journaled write could not be stored (%s): %s", kind, exc)
            failed.append({"record": obj, "reason": str(exc)[:500]})
    if failed:
        with (d / f"failed-{path.name}").open("a", encoding="utf-8") as f:
            f.write("".join(json.dumps(c) + "\n" for c in failed))
        counts["failed"] += len(failed)
    path.unlink()
    counts["files"] += 1


def _flocked_inodes() -> set[tuple[int, int]]:
    """(device, inode) of every file someone holds a flock on (/proc/locks):
    how ``pending`` tells a live journal without taking its lock, which could
    make a server starting at that moment put off its replay."""
    held: set[tuple[int, int]] = set()
    try:
        text = Path("/proc/locks").read_text()
    except OSError:
        return held
    for line in text.splitlines():
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" ("->" marks waiters)
        if "->" in parts or len(parts) < 6 or parts[1] != "FLOCK":
            continue
        try:
            major, minor, inode = parts[5].split(":")
            held.add((os.makedev(int(major, 16), int(minor, 16)), int(inode)))
        except ValueError:
            continue
    return held


def pending(directory: str | Path) -> dict[str, int]:
    """What a journal directory holds that no live process owns: files whose
    writer is gone with records never stored (replayed by that server's next
    start), and records set aside as refused. Reads only; never removes, never
    locks."""
    d = Path(directory)
    out = {"live": 0, "unreplayed_files": 0, "unreplayed_records": 0,
           "failed_files": 0, "failed_records": 0}  # fmt: skip
    if not d.is_dir():
        return out
    held = _flocked_inodes()
    for path in sorted(d.glob("journal-*.ndjson")):
        try:
            st = path.stat()
            if (st.st_dev, st.st_ino) in held:
                out["live"] += 1  # its writer holds it
                continue
            records = open_records(path)
        except FileNotFoundError:
            continue  # replayed and removed meanwhile
        if records:
            out["unreplayed_files"] += 1
            out["unreplayed_records"] += len(records)
    for path in sorted(d.glob("failed-*")):
        try:
            with path.open("rb") as f:
                out["failed_records"] += sum(1 for _ in f)
            out["failed_files"] += 1
        except FileNotFoundError:
            continue
    return out
