"""Each flow record field at its limits and just past them, read from the one
table of bounds (``kickass_core.flow_record.FIELDS``): a new field or a moved
bound is tested without editing the tests that use this (the validators'
agreement, and every endpoint against a real database)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import timedelta, timezone
from typing import Any

from kickass_core import flow_record, strictjson
from kickass_core.flow_record import Field

# The longest value each patterned field's pattern matches (max_len characters),
# given the trial it belongs to.
LONGEST: dict[str, Any] = {
    "flow_id": lambda tid: f"{tid}-{'9' * flow_record.FLOW_ID_DIGITS}",
    "congestion_control": lambda _tid: "c" * flow_record.CONGESTION_CONTROL_MAX_CHARS,
    "arm": lambda _tid: "tcp:cubic#" + "2" * (flow_record.ARM_MAX_CHARS - 10),
}


# One minute off UTC either way: the same wall time, a minute past a bound.
_WEST, _EAST = timezone(timedelta(minutes=-1)), timezone(timedelta(minutes=1))


@dataclass(frozen=True)
class Case:
    field: str
    value: Any
    ok: bool  # what both validators, and the server, must say
    what: str

    def __str__(self) -> str:
        return f"{self.field}={self.what}"


def json_object_of(size: int, max_keys: int) -> dict[str, str]:
    """An object of exactly ``size`` bytes of compact JSON, within every other
    bound of free-form JSON (keys, text length), in at most ``max_keys`` keys."""
    entry_max = 2 + 4 + 1 + 2 + strictjson.MAX_TEXT_CHARS + 1  # "k00":"...",
    keys = max(1, math.ceil((size - 2) / entry_max) + 1)
    assert keys <= max_keys, (size, keys)
    fixed = 2 + keys * len('"k00":""') + (keys - 1)
    chars = size - fixed
    assert 0 <= chars <= keys * strictjson.MAX_TEXT_CHARS, size
    out = {f"k{i:02d}": "x" * (chars // keys + (i < chars % keys)) for i in range(keys)}
    assert len(json.dumps(out, separators=(",", ":"))) == size
    return out


def cases_of(f: Field, trial_id: str) -> list[Case]:
    """``f`` at each of its limits (ok) and just past each (refused)."""
    out: list[Case] = []
    add = out.append
    if f.kind == "int":
        assert f.minimum is not None and f.maximum is not None, f.name
        lo, hi = int(f.minimum), int(f.maximum)
        add(Case(f.name, lo, True, "min"))
        add(Case(f.name, hi, True, "max"))
        add(Case(f.name, lo - 1, False, "min-1"))
        add(Case(f.name, hi + 1, False, "max+1"))
    elif f.kind == "float":
        assert f.minimum is not None and f.maximum is not None, f.name
        add(Case(f.name, float(f.minimum), True, "min"))
        add(Case(f.name, float(f.maximum), True, "max"))
        add(Case(f.name, math.nextafter(f.minimum, -math.inf), False, "below min"))
        add(Case(f.name, math.nextafter(f.maximum, math.inf), False, "above max"))
        # Every float, real or double: 0 or at least REAL_MIN (flow_record.real_ok).
        add(Case(f.name, flow_record.REAL_MIN, True, "smallest nonzero"))
        add(Case(f.name, math.nextafter(flow_record.REAL_MIN, 0), False, "below real"))
        add(Case(f.name, 5e-324, False, "smallest double"))
    elif f.kind == "str" and f.choices is not None:
        out += [Case(f.name, c, True, c) for c in f.choices]
        add(Case(f.name, f.choices[0].upper(), False, "not a choice"))
    elif f.kind == "str":
        assert f.max_len is not None, f"{f.name}: a text without a length bound"
        # A text without a pattern in two-byte characters: its bound counts characters.
        longest = LONGEST[f.name](trial_id) if f.pattern is not None else "é" * f.max_len
        assert len(longest) == f.max_len, f.name
        add(Case(f.name, longest, True, "longest"))
        add(Case(f.name, longest + longest[-1], False, "one too long"))
        add(Case(f.name, longest[:-1] + "\x00", False, "NUL"))
    elif f.kind == "time":
        latest, earliest = flow_record.TIME_MAX, flow_record.TIME_MIN
        add(Case(f.name, latest.isoformat(), True, "latest"))
        add(Case(f.name, earliest.isoformat(), True, "earliest"))
        add(Case(f.name, latest.replace(tzinfo=_WEST).isoformat(), False, "later in UTC"))
        add(Case(f.name, earliest.replace(tzinfo=_EAST).isoformat(), False, "earlier in UTC"))
        add(Case(f.name, "9999-12-31T23:59:59.999999-00:01", False, "year 10000 in UTC"))
        add(Case(f.name, "2026-11-25T12:00:00", False, "no offset"))
    elif f.kind == "object":
        assert f.max_len is not None and f.max_bytes is not None, f.name
        add(Case(f.name, {f"k{i}": i for i in range(f.max_len)}, True, "most keys"))
        add(Case(f.name, {f"k{i}": i for i in range(f.max_len + 1)}, False, "a key too many"))
        add(Case(f.name, json_object_of(f.max_bytes, f.max_len), True, "most bytes"))
        add(Case(f.name, json_object_of(f.max_bytes + 1, f.max_len), False, "a byte too many"))
        add(Case(f.name, {"k": strictjson.INT_MAX}, True, "largest integer"))
        add(Case(f.name, {"k": strictjson.INT_MAX + 1}, False, "integer past 64 bits"))
    else:
        assert f.kind == "bool", f"{f.name}: teach flow_limits its kind {f.kind}"
        out += [Case(f.name, True, True, "true"), Case(f.name, False, True, "false")]
        add(Case(f.name, 1, False, "1 for true"))
    add(Case(f.name, None, f.nullable, "null"))
    return out


def limit_cases(trial_id: str) -> list[Case]:
    return [c for f in flow_record.FIELDS for c in cases_of(f, trial_id)]
