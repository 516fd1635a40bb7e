"""An ordered writer thread: callers hand it writes and go on; it keeps every
pending write, in order, and retries while the database is away
(``retry.RetryPolicy``), so a database restart loses nothing.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from .retry import DEFAULT, DatabaseUnavailable, RetryPolicy, retry

log = logging.getLogger("kickass.db")


class OrderedWriter:
    def __init__(
        self,
        max_backlog: int = 100_000,
        policy: RetryPolicy = DEFAULT,
        name: str = "kickass-db-writer",
    ) -> None:
        self.q: queue.Queue[Callable[[], None] | None] = queue.Queue(max_backlog)
        self.policy = policy
        self.failures = 0
        self.dropped = 0
        self._closing = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, op: Callable[[], None]) -> None:
        self.q.put(op)

    def _run(self) -> None:
        while True:
            op = self.q.get()
            if op is None:
                return
            try:
                retry(self._counted(op), self.policy, what="database write")
            except Exception:
                # A write that can never succeed (unknown session, invalid
                # row) must not block every later write behind it.
                self.failures += 1
                self.dropped += 1
                log.exception("database write dropped")

    def _counted(self, op: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                op()
            except DatabaseUnavailable:
                self.failures += 1
                raise

        return run

    def sync(self, timeout: float = 10.0) -> bool:
        """Wait until everything submitted so far is written."""
        done = threading.Event()
        self.submit(done.set)
        return done.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        self.q.put(None)
        self.thread.join(timeout)
