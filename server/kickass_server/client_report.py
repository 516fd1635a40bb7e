"""What a volunteer client reports about itself, checked before it is stored.

Two bodies (issue 11):

* ``reassembly`` in ``POST /api/v1/sessions``: the client's reassembly limits
  and counters before the session, and ``split_credit`` (the client does flow
  control of the split phase: probe_core). ``parse_announced``.
* ``POST /api/v1/sessions/<id>/report`` at the end of a session: its
  reassembly summary (counters during and after the split phase, the budget,
  the ranges of sequence numbers measured while its kernel refused fragments)
  and, with the opt-in privileged observation, what every probe looked like
  before reassembly. ``parse_report``.

Everything here is untrusted input: numbers are bounded integers, free-form
parts are bounded in size and kinds of value, ranges lie inside the plan, and
compressed arrays are decompressed to exactly the plan's length, never more.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

LIMIT_KEYS = ("high_thresh", "low_thresh", "time_s")
SAMPLE_KEYS = ("reqds", "oks", "fails", "timeouts", "overlaps", "memory", "queues")
MAX_SPLIT_CREDIT = 10_000_000
MAX_INT = 2**63 - 1
MAX_RANGES = 4096
# A free-form summary: at most this many values (objects, lists and scalars).
MAX_NODES = 2000
MAX_KEY_CHARS = 64
MAX_TEXT_CHARS = 200
OBSERVATION_ENCODING = "zlib-base64-v1"
_BAD_TEXT = re.compile("[\x00-\x1f\x7f\ud800-\udfff]")


class ReportError(ValueError):
    """A client report that is not acceptable (HTTP 400)."""


def _int(value: Any, what: str, *, low: int = 0, high: int = MAX_INT, null: bool = True) -> Any:
    if value is None and null:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ReportError(f"{what} must be a whole number in {low}..{high}")
    return value


def _ints(d: Any, keys: tuple[str, ...], what: str) -> dict[str, int | None] | None:
    if d is None:
        return None
    if not isinstance(d, dict):
        raise ReportError(f"{what} must be an object")
    return {k: _int(d.get(k), f"{what}.{k}") for k in keys}


def parse_announced(value: Any) -> dict[str, Any] | None:
    """The ``reassembly`` object of a session request (None if absent)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ReportError("reassembly must be an object")
    out: dict[str, Any] = {
        "limits": _ints(value.get("limits"), LIMIT_KEYS, "reassembly.limits"),
        "before": _ints(value.get("before"), SAMPLE_KEYS, "reassembly.before"),
    }
    credit = _int(value.get("split_credit"), "reassembly.split_credit", high=MAX_SPLIT_CREDIT)
    if credit is not None:
        out["split_credit"] = credit
    return out


def sanitize(value: Any, what: str) -> Any:
    """A bounded copy of free-form JSON: objects, lists, bounded numbers,
    short printable text; ReportError on anything else or too much."""
    budget = [MAX_NODES]

    def walk(v: Any, where: str) -> Any:
        budget[0] -= 1
        if budget[0] < 0:
            raise ReportError(f"{what} is too large")
        if v is None or isinstance(v, bool):
            return v
        if isinstance(v, int):
            return _int(v, where, low=-MAX_INT)
        if isinstance(v, float):
            if not math.isfinite(v):
                raise ReportError(f"{where} is not a finite number")
            return v
        if isinstance(v, str):
            if len(v) > MAX_TEXT_CHARS or _BAD_TEXT.search(v):
                raise ReportError(f"{where} is not short printable text")
            return v
        if isinstance(v, list):
            return [walk(x, f"{where}[]") for x in v]
        if isinstance(v, dict):
            out = {}
            for k, x in v.items():
                if len(k) > MAX_KEY_CHARS or _BAD_TEXT.search(k):
                    raise ReportError(f"{where} has a bad key")
                out[k] = walk(x, f"{where}.{k}")
            return out
        raise ReportError(f"{where} is not JSON")

    return walk(value, what)


def parse_ranges(value: Any, total_probes: int) -> list[tuple[int, int]]:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_RANGES:
        raise ReportError(f"invalid_ranges must be a list of at most {MAX_RANGES} ranges")
    out = []
    for r in value:
        if not isinstance(r, list) or len(r) != 2:
            raise ReportError("each invalid range must be [first, end]")
        a = _int(r[0], "invalid range start", high=total_probes, null=False)
        b = _int(r[1], "invalid range end", high=total_probes, null=False)
        if a >= b:
            raise ReportError("an invalid range is empty or reversed")
        out.append((a, b))
    return out


def _unpack(text: Any, size: int, what: str) -> bytes:
    if not isinstance(text, str):
        raise ReportError(f"{what} must be base64 text")
    try:
        packed = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise ReportError(f"{what} is not base64") from None
    d = zlib.decompressobj()
    try:
        # Never more than the plan's length: a decompression bomb stops here.
        raw = d.decompress(packed, size + 1)
    except zlib.error:
        raise ReportError(f"{what} is not zlib data") from None
    if len(raw) != size or not d.eof:
        raise ReportError(f"{what} must decompress to exactly {size} bytes")
    return raw


@dataclass(frozen=True)
class Observations:
    """Per probe: IP length of the fragment at offset 0, and fragments seen."""

    seqs: list[int]
    leading: list[int]
    fragments: list[int]


def parse_observations(value: Any, total_probes: int) -> tuple[dict | None, Observations | None]:
    """(summary, per-probe observations) of ``fragment_observation``."""
    if value is None:
        return None, None
    if not isinstance(value, dict):
        raise ReportError("fragment_observation must be an object")
    summary = sanitize(value.get("summary"), "fragment_observation.summary")
    if value.get("leading") is None:
        return summary, None
    if value.get("encoding") != OBSERVATION_ENCODING:
        raise ReportError(f"fragment_observation.encoding must be {OBSERVATION_ENCODING!r}")
    leading = _unpack(value.get("leading"), 2 * total_probes, "fragment_observation.leading")
    fragments = _unpack(value.get("fragments"), total_probes, "fragment_observation.fragments")
    obs = Observations([], [], [])
    for seq in range(total_probes):
        n = fragments[seq]
        if n:
            ip_len = int.from_bytes(leading[2 * seq : 2 * seq + 2], "big")
            obs.seqs.append(seq)
            obs.leading.append(min(ip_len, 0x7FFF))  # smallint
            obs.fragments.append(n)
    return summary, obs


@dataclass(frozen=True)
class ClientReport:
    metadata: dict[str, Any]
    invalid_ranges: list[tuple[int, int]]
    observations: Observations | None


def parse_report(body: Mapping[str, Any], total_probes: int) -> ClientReport:
    metadata: dict[str, Any] = {}
    reasm = sanitize(body.get("reassembly"), "reassembly")
    if reasm is not None:
        if not isinstance(reasm, dict):
            raise ReportError("reassembly must be an object")
        metadata["reassembly"] = {"client": reasm}
    ranges = parse_ranges(body.get("invalid_ranges"), total_probes)
    summary, obs = parse_observations(body.get("fragment_observation"), total_probes)
    if summary is not None:
        metadata["fragment_observation"] = summary
    return ClientReport(metadata, ranges, obs)
