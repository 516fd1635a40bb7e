"""A write-ahead journal of Store calls, so nothing measured vanishes in a shutdown.

The probe engine hands its writes (outcomes, state changes) to the
``OrderedWriter``; each write is appended here, as data, *before* the writer
tries the database, and marked done once the database confirmed it. What is
still open when the server stops — the database was down at SIGTERM, or the
process was killed — is replayed into the database at the next start (every
Store write is idempotent), before orphaned sessions are closed.

A journal file is NDJSON: ``{"seq": n, "call": {...}}`` for a write and
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
from collections.abc import Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from .retry import DatabaseUnavailable
from .store import ProbeOutcome, Store

log = logging.getLogger("kickass.db.journal")

# Outcome entries travel as lists in this order (the engine core's OutcomeEntry).
OUTCOME_FIELDS = (
    "seq", "phase", "ip_len", "outcome", "sent_at", "acked_at", "ack_count", "received_len",
    "observed_frag_size", "reassembly_invalid",
)  # fmt: skip


def outcomes_call(
    session_id: str, entries: Sequence[Sequence[Any]], wall: datetime, mono: float
) -> dict[str, Any]:
    """A record_outcomes call; times stay monotonic, with the anchor mapping them to UTC."""
    return {
        "method": "record_outcomes",
        "session_id": session_id,
        "anchor": [wall.isoformat(), mono],
        "entries": [list(e) for e in entries],
    }


def outcome_rows(call: dict[str, Any]) -> list[ProbeOutcome]:
    wall = datetime.fromisoformat(call["anchor"][0])
    mono = float(call["anchor"][1])

    def at(t: float) -> datetime:
        return wall - timedelta(seconds=mono - t)

    rows = []
    for raw in call["entries"]:
        e = dict(zip(OUTCOME_FIELDS, raw, strict=False))
        acked = e.get("acked_at")
        rows.append(
            ProbeOutcome(
                seq=e["seq"],
                phase=e["phase"],
                ip_len=e["ip_len"],
                sent_at=at(e["sent_at"]),
                outcome=e["outcome"],
                acked_at=None if acked is None else at(acked),
                rtt_ms=None if acked is None else (acked - e["sent_at"]) * 1000.0,
                ack_count=e["ack_count"],
                received_len=e["received_len"],
                observed_frag_size=e["observed_frag_size"],
                reassembly_invalid=bool(e.get("reassembly_invalid", False)),
            )
        )
    return rows


def apply(store: Store, call: dict[str, Any]) -> None:
    """Carry out one journaled call (idempotent, like every Store write)."""
    method = call["method"]
    sid = call["session_id"]
    if method == "record_outcomes":
        store.record_outcomes(sid, outcome_rows(call))
    elif method == "heartbeat":
        store.heartbeat(sid, call["sent"], call["acked"])
    elif method == "mark_probing":
        store.mark_probing(sid, call["probe_address"], call["probe_port"], call["rtt_ms"])
    elif method == "finish_session":
        store.finish_session(
            sid,
            call["state"],
            call["verdict"],
            call["verdict_reason"],
            call["end_reason"],
            call.get("reassembly"),
            call.get("window"),
        )
    else:
        raise ValueError(f"unknown journaled call {method!r}")


class Journal:
    """This process's journal file (one per run, in ``directory``)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"journal-{os.getpid()}-{time.time_ns()}.ndjson"
        self._f = self.path.open("a", encoding="utf-8")
        # Held while this process lives: a server starting beside it (another
        # instance sharing the directory) must not replay or remove a live journal.
        fcntl.flock(self._f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._lock = threading.Lock()
        self.open_writes = 0

    def append(self, seq: int, call: dict[str, Any]) -> None:
        line = json.dumps({"seq": seq, "call": call}, separators=(",", ":"))
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()
            self.open_writes += 1

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


def open_calls(path: Path) -> list[dict[str, Any]]:
    """Calls in a journal file that were never marked done, in order."""
    calls: dict[int, dict[str, Any]] = {}
    with path.open(encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut by a crash: it was never confirmed either
            if "done" in rec:
                calls.pop(rec["done"], None)
            elif "seq" in rec:
                calls[rec["seq"]] = rec["call"]
    return [calls[k] for k in sorted(calls)]


def replay(store: Store, directory: str | Path, skip: Path | None = None) -> dict[str, int]:
    """Store what earlier runs journaled but never stored; remove their files.

    A call that fails for good (not an outage) is logged and set aside in
    ``failed-<file>`` rather than retried forever; an outage stops the replay
    with the file kept, for the next start.
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
            _replay_file(store, d, path, counts)
    return counts


def _replay_file(store: Store, d: Path, path: Path, counts: dict[str, int]) -> None:
    calls = open_calls(path)
    failed = []
    for call in calls:
        try:
            apply(store, call)
            counts["replayed"] += 1
        except DatabaseUnavailable:
            raise
        except Exception as exc:
            log.error("journaled write could not be stored (%s): %s", call.get("method"), exc)
            failed.append(call)
    if failed:
        (d / f"failed-{path.name}").write_text(
            "".join(json.dumps(c) + "\n" for c in failed), encoding="utf-8"
        )
        counts["failed"] += len(failed)
    path.unlink()
    counts["files"] += 1
