"""Ctrl-C and SIGTERM: one clean, bounded way out that keeps the volunteer's result.

Python's default SIGINT handling raises KeyboardInterrupt wherever the main
thread happens to be: inside the shutdown itself (the partial result is
lost), inside the write of the JSON to stdout (truncated output plus a
traceback), between a lock's acquire and its release. So during a
measurement the handler here only *counts*, and the code looks at the count
where stopping is safe (the runner's tick, the wait for an HTTP reply). The
handler raises only in ``raise_now`` mode, before any session exists (the
consent prompt), where there is nothing to lose.

What the volunteer gets (``presses`` = distinct signals, see DEBOUNCE_S):

1. the runner ends the session with the server (bounded: END_BUDGET_S in
   runner.py) and prints the partial result;
2. a note on stderr: still ending the session, press again to stop waiting;
3. the client stops waiting for the server and prints what it received itself;
4+. a note; the result being written is never cut short.

SIGTERM (``kill``, a service manager, ``docker stop``) is handled exactly like
Ctrl-C; the exit code is 128 + the signal number (130 for SIGINT, 143 for
SIGTERM), as shells report a death by that signal.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

# Signals closer together than this are one press: a volunteer hammering
# Ctrl-C three times in a row means "stop" once, and must not skip ending the
# session with the server (which normally takes a fraction of a second).
DEBOUNCE_S = 0.3
# At this many presses the client stops waiting for the server.
HARD_STOP_PRESSES = 3
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)

# What the client is doing, for the notes the handler prints.
RUNNING = "running"
STOPPING = "stopping"
WRITING = "writing"


class Interrupted(KeyboardInterrupt):
    """Raised (never by the handler during a measurement) to unwind to the stop path.

    A KeyboardInterrupt subclass so that code written for plain Ctrl-C
    handles it, and no ``except Exception`` on the way swallows it.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal_label(signum))
        self.signum = signum


def signal_label(signum: int | None) -> str:
    if signum is None or signum == signal.SIGINT:
        return "Ctrl-C"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _stderr_note(text: str) -> None:
    # os.write, not sys.stderr: the handler may run while the main thread is
    # inside a sys.stderr write, and a second write on the same buffered
    # stream from the handler raises "reentrant call" at a random place.
    with contextlib.suppress(OSError):
        os.write(2, text.encode("utf-8", "replace"))


class StopSignals:
    """Counts SIGINT/SIGTERM; the runner and the CLI read ``presses``.

    Not installed it never fires on its own; ``trigger`` simulates a signal
    (tests, embedding in a program that has its own handlers).
    """

    def __init__(
        self,
        *,
        note: Callable[[str], None] = _stderr_note,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.presses = 0
        self.signals = 0
        self.signum: int | None = None
        # Before a session exists: raise at the first signal (see module doc).
        self.raise_now = False
        self.stage = RUNNING
        self._note = note
        self._clock = clock
        self._last_at: float | None = None
        self._previous: dict[int, Any] = {}

    # -- installation ----------------------------------------------------------------

    def install(self) -> bool:
        """Take over SIGINT and SIGTERM; False where that is impossible.

        Python allows signal handlers only in the main thread; run from
        another thread (embedded), the client keeps the default behaviour.
        """
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in HANDLED_SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except (OSError, ValueError):
                continue
        return bool(self._previous)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            with contextlib.suppress(OSError, ValueError, TypeError):
                signal.signal(sig, previous)
        self._previous.clear()

    # -- state -------------------------------------------------------------------------

    @property
    def requested(self) -> bool:
        return self.presses > 0

    @property
    def label(self) -> str:
        return signal_label(self.signum)

    @property
    def exit_code(self) -> int:
        # 128 + signal number, the shell convention (130 for Ctrl-C).
        return 128 + int(self.signum if self.signum is not None else signal.SIGINT)

    def interrupted(self) -> Interrupted:
        return Interrupted(self.signum if self.signum is not None else signal.SIGINT)

    def trigger(self, signum: int = signal.SIGINT) -> None:
        """Behave as if ``signum`` had arrived (the handler itself)."""
        self._handle(signum, None)

    # -- the handler -------------------------------------------------------------------

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        # Keep this tiny: it runs between two bytecodes of the main thread.
        self.signals += 1
        now = self._clock()
        # Measured from the last counted press, not the last signal: a key
        # held down still reaches the hard stop, a quick burst does not.
        if self._last_at is not None and now - self._last_at < DEBOUNCE_S:
            return
        self._last_at = now
        self.presses += 1
        if self.signum is None:
            self.signum = signum
        if self.raise_now:
            # Once: the exception itself is what stops the client.
            self.raise_now = False
            raise Interrupted(signum)
        text = self._text(self.presses)
        if text:
            self._note(f"kickass-probe: {text}\n")

    def _text(self, presses: int) -> str | None:
        again = "press Ctrl-C" if self.signum == signal.SIGINT else f"send {self.label}"
        if self.stage == WRITING:
            return "printing the result; it will not be cut short" if presses > 1 else None
        if presses == 1:
            return None  # the runner says what it does at once
        if presses == 2:
            return (
                "still ending the session with the server (a few seconds at most); "
                f"{again} once more to stop waiting for it"
            )
        if presses == HARD_STOP_PRESSES:
            return "not waiting for the server any more: printing what this client received"
        return "already stopping: the result is being printed"
