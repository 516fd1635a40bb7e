"""The one domain exception every `kickass` command reports as ``ERROR: ...``."""

from __future__ import annotations


class KickassError(Exception):
    """A failure the operator can act on: printed as ``ERROR: msg`` plus a hint, exit 2."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint
