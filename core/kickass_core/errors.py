"""The one domain exception of the platform (ARCHITECTURE.md, "Errors").

Every command prints a KickassError as ``ERROR: message`` plus a ``hint:``
line and exits non-zero, never with a traceback. Subsystems subclass it (the
volunteer client's ProbeError adds an exit code; the database's
DatabaseUnavailable marks a failure worth retrying).
"""

from __future__ import annotations


class KickassError(Exception):
    """A failure the user can act on: printed as ``ERROR: msg`` plus a hint."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def render(self) -> str:
        """The lines a command prints to stderr for this error."""
        text = f"ERROR: {self.message}"
        return f"{text}\nhint: {self.hint}" if self.hint else text
