"""An ordered writer thread: callers hand it typed records and go on; it keeps
every pending record, in order, and stores each with ``apply`` (a store's
method), retrying while the database is away (``retry.RetryPolicy``), so a
database restart loses nothing.

With a ``Journal``, each record is journaled before it is tried and marked
done once stored. ``close`` waits a bounded time for the backlog; what the
database could not take by then stays in the journal for the next start, and
``close`` says how much.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from .journal import Journal
from .retry import DEFAULT, DatabaseUnavailable, RetryPolicy, retry

log = logging.getLogger("kickass.db")

R = TypeVar("R")


class _Marker:
    """Not a record: ``sync`` waits for it to come out of the queue."""

    def __init__(self) -> None:
        self.reached = threading.Event()


class OrderedWriter(Generic[R]):
    def __init__(
        self,
        apply: Callable[[R], object],
        *,
        journal: Journal[R] | None = None,
        max_backlog: int = 100_000,
        policy: RetryPolicy = DEFAULT,
        name: str = "kickass-db-writer",
    ) -> None:
        self.apply = apply
        self.q: queue.Queue[tuple[int, R | _Marker] | None] = queue.Queue(max_backlog)
        self.policy = policy
        self.journal = journal
        self.failures = 0
        self.dropped = 0
        self.unwritten = 0
        self._seq = 0
        self._seq_lock = threading.Lock()
        self._closing = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    @property
    def journal_path(self) -> Path | None:
        return None if self.journal is None else self.journal.path

    def submit(self, record: R) -> None:
        """Queue ``record`` (journaled first, when there is a journal)."""
        with self._seq_lock:
            self._seq += 1
            seq = self._seq
            if self.journal is not None:
                self.journal.append(seq, record)
        self.q.put((seq, record))

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            seq, record = item
            if isinstance(record, _Marker):
                record.reached.set()
                continue
            if self._closing.is_set():
                self.unwritten += 1  # left in the journal (or reported by close)
                continue
            try:
                retry(
                    self._counted(record),
                    self.policy,
                    what="database write",
                    stop=self._closing.is_set,
                )
            except DatabaseUnavailable:
                self.unwritten += 1  # closing while the database is away
                continue
            except Exception as exc:
                # A write that can never succeed (unknown session, invalid
                # row) must not block every later write behind it; with a
                # journal it is set aside in a file beside it, not lost.
                self.failures += 1
                self.dropped += 1
                log.exception("database write dropped")
                if self.journal is not None:
                    self.journal.set_aside(record, exc)
            if self.journal is not None:
                self.journal.done(seq)

    def _counted(self, record: R) -> Callable[[], None]:
        def run() -> None:
            try:
                self.apply(record)
            except DatabaseUnavailable:
                self.failures += 1
                raise

        return run

    def sync(self, timeout: float = 10.0) -> bool:
        """Wait until everything submitted so far is written."""
        marker = _Marker()
        self.q.put((0, marker))
        return marker.reached.wait(timeout)

    def close(self, timeout: float = 30.0) -> int:
        """Stop after at most ``timeout`` seconds; returns the writes not stored.

        Those are kept in the journal (replayed at the next start) when there
        is one; without a journal they are lost, and the log says how many.
        """
        deadline = time.monotonic() + timeout
        drained = self.sync(max(0.0, deadline - time.monotonic()))
        if not drained:
            self._closing.set()
        self.q.put(None)
        self.thread.join(max(1.0, deadline - time.monotonic()))
        left = self.unwritten
        if self.journal is not None:
            kept = self.journal.close()
            if kept:
                log.warning(
                    "%d database writes could not be stored before shutdown: kept in %s, "
                    "stored at the next start",
                    kept,
                    self.journal.path,
                )
            return kept
        if left:
            log.error("%d database writes could not be stored before shutdown: lost", left)
        return left
