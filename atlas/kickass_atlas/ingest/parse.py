"""An Atlas ping result line, read: its entries in order (``Slot``), its duplicates.

Sagan (``ripe.atlas.sagan``) reads each result and evens out the firmware
differences (before 4460 ``addr``/``name``; before 4570 an ICMP ``size`` 8
bytes larger); each of its packets is read beside the raw entry it came
from, since Sagan cannot tell ``{"x"}`` from ``{"error"}``. What the
firmware writes: the package's docstring.

Pure: no database, no network.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ripe.atlas.sagan.base import ParsingDict
from ripe.atlas.sagan.ping import PingResult

REPLY, TIMEOUT, ERROR = "reply", "timeout", "error"
MAX_ERROR_CHARS = 500


class ResultIgnored(Exception):
    """A line that is not a usable IPv4 ping result (the message says why)."""


class ResultInvalid(ResultIgnored):
    """A result that names its measurement, probe and time but cannot be read:
    stored as ``invalid`` if it is one of ours."""

    def __init__(
        self, reason: str, msm_id: int, prb_id: int, timestamp: int, raw: dict[str, Any]
    ) -> None:
        super().__init__(reason)
        self.msm_id, self.prb_id, self.timestamp, self.raw = msm_id, prb_id, timestamp, raw


@dataclass(slots=True)
class Slot:
    """One x, rtt or error entry of a result (not a duplicate), in order."""

    kind: str  # reply | timeout | error
    rtt_ms: float | None = None
    error: str | None = None


@dataclass
class ParsedResult:
    msm_id: int
    prb_id: int
    timestamp: int
    firmware: int | None
    from_address: str | None
    dst_address: str | None
    size: int | None  # ICMP data bytes, firmware-corrected (the probe's last reply's)
    sent: int | None
    rcvd: int | None
    dup: int | None
    raw: dict[str, Any]
    slots: list[Slot] | None  # None: the firmware reported counts only
    dups: list[tuple[int, float | None]] = field(default_factory=list)  # (slots before, rtt)
    stored_at: int | None = None  # Atlas's stored_timestamp


def _int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None


def identify(raw: Mapping[str, Any]) -> tuple[int, int, int] | None:
    """(msm_id, prb_id, timestamp) of a result line, if it names all three."""
    ids = (_int(raw.get("msm_id")), _int(raw.get("prb_id")), _int(raw.get("timestamp")))
    if ids[0] is None or ids[1] is None or ids[2] is None:
        return None
    return ids[0], ids[1], ids[2]


def parse_result(line: str | Mapping[str, Any]) -> ParsedResult:
    """One Atlas result (a JSON line or its dict). ResultIgnored if it is not
    an IPv4 ping result; ResultInvalid if it is one that cannot be read."""
    if isinstance(line, str):
        try:
            raw = json.loads(line)
        except ValueError as exc:
            raise ResultIgnored(f"not JSON: {exc}") from None
    else:
        raw = dict(line)
    if not isinstance(raw, dict) or raw.get("type") != "ping":
        raise ResultIgnored(
            f"not a ping result (type {raw.get('type') if isinstance(raw, dict) else None!r})"
        )
    ids = identify(raw)
    if ids is None:
        raise ResultIgnored("no msm_id, prb_id or timestamp")
    msm_id, prb_id, timestamp = ids
    try:
        return _parse(raw, msm_id, prb_id, timestamp)
    except ResultIgnored:
        raise
    except Exception as exc:  # anything Sagan or a malformed line throws
        raise ResultInvalid(
            f"unreadable result: {why_unreadable(raw, exc)}"[:MAX_ERROR_CHARS],
            msm_id,
            prb_id,
            timestamp,
            raw,
        ) from None


class _Unreadable(ValueError):
    """A result line this module cannot read; the message says why."""


def _what(value: object) -> str:
    """A JSON value as a person would name it: ``the text "abc"``."""
    shown = json.dumps(value, default=str)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    if value is None:
        return "null"
    if isinstance(value, bool):
        return shown
    if isinstance(value, str):
        return f"the text {shown}"
    if isinstance(value, int | float):
        return f"the number {shown}"
    if isinstance(value, list):
        return f"a list {shown}"
    return f"an object {shown}" if isinstance(value, Mapping) else shown


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def why_unreadable(raw: Mapping[str, Any], exc: Exception) -> str:
    """Why a result line cannot be read, for a person (stored as its
    ``join_error``): the first field that is not what the probe firmware
    writes, else what the parser said."""
    if isinstance(exc, _Unreadable):
        return str(exc)
    entries = raw.get("result")
    if entries is not None and not isinstance(entries, list):
        return f'"result" is {_what(entries)}, not a list of per-packet entries'
    for i, entry in enumerate(entries or [], start=1):
        if not isinstance(entry, Mapping):
            return f'entry {i} of "result" is {_what(entry)}, not an object'
        if "rtt" in entry and not _is_number(entry["rtt"]):
            return (
                f'the rtt of entry {i} of "result" is {_what(entry["rtt"])}, '
                "not a number of milliseconds"
            )
    for name in ("fw", "af", "size", "sent", "rcvd", "dup"):
        value = raw.get(name)
        if value is not None and not (_is_number(value) and float(value).is_integer()):
            return f'"{name}" is {_what(value)}, not a whole number'
    for name in ("from", "dst_addr", "src_addr"):
        value = raw.get(name)
        if value is not None and not isinstance(value, str):
            return f'"{name}" is {_what(value)}, not an address'
    return f"the result parser (Sagan) failed: {type(exc).__name__}: {exc}"


def _parse(raw: dict[str, Any], msm_id: int, prb_id: int, timestamp: int) -> ParsedResult:
    r = PingResult(
        raw, on_error=ParsingDict.ACTION_IGNORE, on_malformation=ParsingDict.ACTION_IGNORE
    )
    if r.af == 6 or (isinstance(raw.get("dst_addr"), str) and ":" in raw["dst_addr"]):
        raise ResultIgnored("an IPv6 result (the study is about IPv4 fragments)")
    entries = raw.get("result")
    slots: list[Slot] | None = None
    dups: list[tuple[int, float | None]] = []
    if isinstance(entries, list):
        if len(r.packets) != len(entries):
            raise _Unreadable(f"{len(entries)} entries, Sagan read {len(r.packets)}")
        slots = []
        for packet, entry in zip(r.packets, entries, strict=True):
            entry = entry if isinstance(entry, Mapping) else {}
            if packet.dup:
                dups.append((len(slots), packet.rtt))
            elif packet.rtt is not None:
                slots.append(Slot(REPLY, rtt_ms=packet.rtt))
            elif "rtt" in entry:  # an RTT of 0.0, which Sagan reads as none
                slots.append(Slot(REPLY, rtt_ms=float(entry["rtt"])))
            elif "x" in entry:
                slots.append(Slot(TIMEOUT))
            elif "error" in entry:
                slots.append(Slot(ERROR, error=str(entry["error"])[:MAX_ERROR_CHARS]))
            else:
                slots.append(Slot(ERROR, error=f"unrecognised entry {json.dumps(entry)[:200]}"))
    elif entries is not None:
        raise _Unreadable(f'"result" is {_what(entries)}, not a list of per-packet entries')
    elif not (isinstance(raw.get("sent"), int) and isinstance(raw.get("rcvd"), int)):
        # The archives' "measurement attempted, nothing came of it" lines.
        raise _Unreadable('neither per-packet entries ("result") nor counts ("sent", "rcvd")')
    dst = raw.get("dst_addr") if isinstance(raw.get("dst_addr"), str) else None
    return ParsedResult(
        msm_id=msm_id,
        prb_id=prb_id,
        timestamp=timestamp,
        firmware=r.firmware,
        from_address=r.origin or None,
        dst_address=dst or r.destination_address,
        size=r.packet_size,
        sent=r.packets_sent,
        rcvd=r.packets_received,
        dup=r.duplicates,
        raw=raw,
        slots=slots,
        dups=dups,
        stored_at=_int(raw.get("stored_timestamp")),
    )
