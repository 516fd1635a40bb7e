"""What a volunteer client reports about itself, checked against its session.

The bodies' types and bounds are declared in schemas.py (``SessionRequest``
carries the announced reassembly memory, ``ClientReportBody`` the
end-of-session report). What only the session can tell is checked here:
ranges of sequence numbers lie inside the plan, and the privileged
observation's compressed arrays decompress to exactly the plan's length,
never more (a decompression bomb stops at the plan's size).
"""

from __future__ import annotations

import base64
import binascii
import zlib
from dataclasses import dataclass
from typing import Any

from .schemas import OBSERVATION_ENCODING, ClientReportBody, FragmentObservation


class ReportError(ValueError):
    """A client report that does not fit its session (HTTP 400)."""


def parse_ranges(ranges: list[list[int]] | None, total_probes: int) -> list[tuple[int, int]]:
    out = []
    for first, end in ranges or ():
        if end > total_probes:
            raise ReportError(f"an invalid range ends past the plan's {total_probes} probes")
        if first >= end:
            raise ReportError("an invalid range is empty or reversed")
        out.append((first, end))
    return out


def _unpack(text: str | None, size: int, what: str) -> bytes:
    if text is None:
        raise ReportError(f"{what} is missing")
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


def parse_observations(
    value: FragmentObservation | dict[str, Any] | None, total_probes: int
) -> tuple[dict[str, Any] | None, Observations | None]:
    """(summary, per-probe observations) of ``fragment_observation``."""
    if value is None:
        return None, None
    if isinstance(value, dict):
        value = FragmentObservation.model_validate(value)
    if value.leading is None:
        return value.summary, None
    if value.encoding != OBSERVATION_ENCODING:
        raise ReportError(f"fragment_observation.encoding must be {OBSERVATION_ENCODING!r}")
    leading = _unpack(value.leading, 2 * total_probes, "fragment_observation.leading")
    fragments = _unpack(value.fragments, total_probes, "fragment_observation.fragments")
    obs = Observations([], [], [])
    for seq in range(total_probes):
        n = fragments[seq]
        if n:
            ip_len = int.from_bytes(leading[2 * seq : 2 * seq + 2], "big")
            obs.seqs.append(seq)
            obs.leading.append(min(ip_len, 0x7FFF))  # smallint
            obs.fragments.append(n)
    return value.summary, obs


@dataclass(frozen=True)
class ClientReport:
    metadata: dict[str, Any]
    invalid_ranges: list[tuple[int, int]]
    observations: Observations | None


def parse_report(body: ClientReportBody, total_probes: int) -> ClientReport:
    metadata: dict[str, Any] = {}
    if body.reassembly is not None:
        metadata["reassembly"] = {"client": body.reassembly}
    ranges = parse_ranges(body.invalid_ranges, total_probes)
    summary, obs = parse_observations(body.fragment_observation, total_probes)
    if summary is not None:
        metadata["fragment_observation"] = summary
    return ClientReport(metadata, ranges, obs)
