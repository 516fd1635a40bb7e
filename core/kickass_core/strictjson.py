"""JSON from untrusted peers, parsed once the same way everywhere.

Python's json module accepts NaN and Infinity (not JSON), turns 1e400 into
infinity, and recurses per nesting level, so a deep document raises
RecursionError from deep inside the parser. ``loads`` refuses all of these
with a ValueError naming the problem, checking the nesting before parsing.
Used by the server's HTTP API, the trial-upload API and the volunteer client.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from typing import Any

MAX_DEPTH = 32
# CPython 3.11 (and 3.9.14+, 3.10.7+) refuse to convert integer literals of
# more than 4300 digits (quadratic time: CVE-2020-10735). An older 3.9 or
# 3.10, which the volunteer's one-file client may run on, does not: there the
# parser gets the same bound, so a hostile reply cannot stall it either.
INT_MAX_DIGITS = 4300


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
