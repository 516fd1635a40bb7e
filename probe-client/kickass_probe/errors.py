"""The volunteer client's domain exception (the platform's KickassError with an exit code).

Every failure a volunteer can act on is raised as ProbeError and printed by
the CLI as ``ERROR: message`` plus a ``hint:`` line, never as a traceback.
"""

from __future__ import annotations

from kickass_core.errors import KickassError

EXIT_OK = 0
# Could not measure: server down, bad reply, UDP blocked, rate-limited...
EXIT_ERROR = 1
# Bad command line, or no consent given: nothing was sent.
EXIT_USAGE = 2
# The measurement started but did not finish (server vanished, session
# expired or was ended by the server): partial results were printed.
EXIT_INCOMPLETE = 3
# Ctrl-C: the session was ended early and partial results were printed.
# Like shells, the client reports a stop by signal N as 128 + N.
EXIT_INTERRUPTED = 130
# SIGTERM (kill, a service manager): handled exactly like Ctrl-C.
EXIT_TERMINATED = 143


class ProbeError(KickassError):
    """A failure printed as ``ERROR: message`` (+ hint) with the client's exit code."""

    def __init__(self, message: str, hint: str | None = None, exit_code: int = EXIT_ERROR) -> None:
        super().__init__(message, hint)
        self.exit_code = exit_code
