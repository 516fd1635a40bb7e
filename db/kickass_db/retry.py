"""The one retry policy of every database writer (ARCHITECTURE.md, "Nothing measured vanishes").

The StudyStore, the ordered writer thread and the telemetry ingest all retry the
same failures the same way: only ``DatabaseUnavailable`` (the database is
restarting or unreachable) is worth retrying; everything else is a bug or
bad data and is raised at once. Delays double from ``initial`` to ``cap``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kickass_core.errors import KickassError

log = logging.getLogger("kickass.db")

T = TypeVar("T")


class DatabaseUnavailable(KickassError):
    """The database cannot be reached right now; the same call may succeed later."""


@dataclass(frozen=True)
class RetryPolicy:
    initial: float = 0.2
    factor: float = 2.0
    cap: float = 5.0
    # None: retry until stopped (the writer thread); else give up after this long.
    deadline: float | None = None

    def delays(self) -> Callable[[], float]:
        state = {"next": self.initial}

        def step() -> float:
            d = state["next"]
            state["next"] = min(d * self.factor, self.cap)
            return d

        return step


DEFAULT = RetryPolicy()


def retry(
    op: Callable[[], T],
    policy: RetryPolicy = DEFAULT,
    *,
    what: str = "database write",
    stop: Callable[[], bool] | None = None,
    sleep: Callable[[float], object] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """Run ``op``, retrying while it raises DatabaseUnavailable.

    Gives up (re-raising the last DatabaseUnavailable) once ``policy.deadline``
    has passed or ``stop()`` says so.
    """
    next_delay = policy.delays()
    start = clock()
    while True:
        try:
            return op()
        except DatabaseUnavailable as exc:
            delay = next_delay()
            out_of_time = policy.deadline is not None and clock() - start + delay > policy.deadline
            if out_of_time or (stop is not None and stop()):
                raise
            log.warning("%s failed (%s); retrying in %.1fs", what, exc.message, delay)
            sleep(delay)


def unavailable(what: str, exc: BaseException) -> DatabaseUnavailable:
    """A driver exception as the DatabaseUnavailable every writer retries."""
    reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return DatabaseUnavailable(
        f"database unavailable ({what}): {reason[0] if reason else type(exc).__name__}",
        hint="the call is safe to retry once the database is back",
    )
