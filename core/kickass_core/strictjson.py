"""JSON from untrusted peers, parsed once the same way everywhere.

Python's json module accepts NaN and Infinity (not JSON), turns 1e400 into
infinity, and recurses per nesting level, so a deep document raises
RecursionError from deep inside the parser. ``loads`` refuses all of these
with a ValueError naming the problem, checking the nesting before parsing.
Used by the server's HTTP API, the trial-upload API and the volunteer client.

``check_bounded`` is the other half: whether a parsed value, free-form JSON
bound for a ``jsonb`` column, is small and plain enough to store and to read
back (the server's request models and the trial runner's own check of a
flow record both call it, so they accept the same objects).

``read_lines`` reads newline-delimited JSON from a file or a pipe with a
bound on each line (``kickass telemetry ingest``, ``kickass atlas import``).
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable, Iterator
from typing import IO, Any

MAX_DEPTH = 32
# CPython 3.11 (and 3.9.14+, 3.10.7+) refuse to convert integer literals of
# more than 4300 digits (quadratic time: CVE-2020-10735). An older 3.9 or
# 3.10, which the volunteer's one-file client may run on, does not: there the
# parser gets the same bound, so a hostile reply cannot stall it either.
INT_MAX_DIGITS = 4300

# Bounds of free-form JSON (check_bounded): values in all, characters of a key
# and of a text value, and integers as a reader's 64-bit column takes them.
MAX_VALUES = 2000
MAX_KEY_CHARS = 64
MAX_TEXT_CHARS = 200
INT_MAX = 2**63 - 1
# C0 controls, DEL and lone surrogates: PostgreSQL text takes no NUL, UTF-8
# has no surrogates, and none of them belongs in a name, a message or a key.
UNPRINTABLE = re.compile("[\x00-\x1f\x7f\ud800-\udfff]")


def _bounded_int(literal: str) -> int:
    if len(literal.lstrip("-")) > INT_MAX_DIGITS:
        raise ValueError(f"integer of more than {INT_MAX_DIGITS} digits")
    return int(literal)


_PARSE_INT: Callable[[str], int] | None = (
    None if hasattr(sys, "get_int_max_str_digits") else _bounded_int
)


def nesting_depth(text: str, limit: int) -> int:
    """Deepest bracket nesting outside strings (stops counting past ``limit``)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    break
        elif ch in "]}":
            depth -= 1
    return deepest


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise ValueError(f"{literal[:20]} is out of range")
    return value


def loads(raw: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value in ``raw``, or ValueError (never RecursionError, NaN or infinity)."""
    text = raw.decode("utf-8") if isinstance(raw, bytes) else raw  # UnicodeDecodeError: ValueError
    if nesting_depth(text, max_depth) > max_depth:
        raise ValueError(f"JSON nested deeper than {max_depth} levels")
    try:
        return json.loads(
            text, parse_constant=_no_constant, parse_float=_finite_float, parse_int=_PARSE_INT
        )
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def check_bounded(value: Any, max_bytes: int, max_values: int = MAX_VALUES) -> None:
    """ValueError unless ``value`` is plain JSON that ``jsonb`` stores as it is
    and every reader reads back: printable keys and text of bounded length,
    64-bit integers, finite numbers, at most ``max_values`` values and
    ``max_bytes`` of compact JSON. Iterative: a deep value from a caller that
    did not parse it with ``loads`` cannot exhaust the stack."""
    left = max_values
    stack = [value]
    while stack:
        v = stack.pop()
        left -= 1
        if left < 0:
            raise ValueError(f"more than {max_values} values")
        if isinstance(v, str):
            if len(v) > MAX_TEXT_CHARS or UNPRINTABLE.search(v):
                raise ValueError(f"text must be printable and at most {MAX_TEXT_CHARS} characters")
        elif isinstance(v, bool) or v is None:
            continue
        elif isinstance(v, int):
            if not -INT_MAX <= v <= INT_MAX:
                raise ValueError("integers must fit in 64 bits")
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise ValueError("numbers must be finite")
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            for k, x in v.items():
                if not isinstance(k, str) or len(k) > MAX_KEY_CHARS or UNPRINTABLE.search(k):
                    raise ValueError(
                        f"keys must be printable text of at most {MAX_KEY_CHARS} characters"
                    )
                stack.append(x)
        else:
            raise ValueError(f"not plain JSON ({type(v).__name__})")
    if len(json.dumps(value, separators=(",", ":"))) > max_bytes:
        raise ValueError(f"more than {max_bytes} bytes of JSON")


def read_lines(
    stream: IO[bytes], max_bytes: int, copy: Callable[[bytes], None] | None = None
) -> Iterator[bytes]:
    """The lines of ``stream``, newline included, each cut after ``max_bytes``
    + 1 bytes: a longer line's rest is read and dropped (one endless line
    cannot fill the memory), and its reader tells it by its length. ``copy``
    gets every byte read, cut or not (``--tee``)."""
    while True:
        line = stream.readline(max_bytes + 1)
        if not line:
            return
        if copy is not None:
            copy(line)
        if len(line) > max_bytes and not line.endswith(b"\n"):
            while True:
                rest = stream.readline(1 << 16)
                if copy is not None and rest:
                    copy(rest)
                if not rest or rest.endswith(b"\n"):
                    break
        yield line
