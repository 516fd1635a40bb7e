"""Result lines recorded from the real RIPE Atlas probe ping, with their truth.

``data/evping-results.ndjson`` holds 82 runs of ``busybox evping`` (the
oracle in ../shared/oracles) between two network namespaces, each with the
tcpdump truth of its probe-side interface: every echo request that left
(ICMP id, sequence number, IP length, time) and every reply that arrived
whole. The paths dropped replies (50 %, all, all after the first, every
fourth, the first three), lost 10 % each way, dropped fragments, duplicated
replies or requests; a user-space responder delayed, altered or doubled
chosen replies. ``raw`` is the line the probe printed. See data/README.md.

``reply_log`` is what `kickass atlas responder` would have logged for a run:
a row per request that reached the responder and was answered (attempt
numbers as the responder counts them, byte-identical copies as duplicates),
at the time it answered — as it arrived: the user-space responder's delays
stand for a slow path, not for a slow responder. It is faithful
(``faithful``) where the recording shows which requests reached the
responder: every scenario but the lossy one, where a request lost on the
way in is indistinguishable in the probe-side capture.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

from kickass_atlas.store import LoggedReply

DATA = Path(__file__).resolve().parent / "data" / "evping-results.ndjson"
PROBE_ADDRESS, TARGET = "10.77.0.2", "10.77.0.1"
# Scenarios whose capture shows every request that reached the responder.
UNFAITHFUL = {"loss10_each_way"}


@functools.cache
def records() -> tuple[dict[str, Any], ...]:
    return tuple(json.loads(line) for line in DATA.read_text().splitlines() if line.strip())


def probe_line(rec: dict[str, Any]) -> dict[str, Any]:
    raw = rec["raw"]
    assert raw.startswith("RESULT ")
    line: dict[str, Any] = json.loads(raw[len("RESULT ") :])
    return line


def _arg(rec: dict[str, Any], flag: str, default: int) -> int:
    args = rec["args"]
    return int(args[args.index(flag) + 1]) if flag in args else default


def packets(rec: dict[str, Any]) -> int:
    return _arg(rec, "-c", 3)


def interval_ms(rec: dict[str, Any]) -> int:
    return _arg(rec, "-i", 1000)


def request_len(rec: dict[str, Any]) -> int:
    """The requests' IP length on the wire (the probe pads small sizes)."""
    return int(rec["truth"]["requests"][0][2]) if rec["truth"]["requests"] else 60


def faithful(rec: dict[str, Any]) -> bool:
    return rec["scenario"] not in UNFAITHFUL


_OP = re.compile(r"(\w+)(?:=(\d+))?(?:@([\d,]+))?")


def _ops(rec: dict[str, Any], request_no: int) -> list[tuple[str, int | None]]:
    """The user-space responder's operations on request ``request_no`` (from 1)."""
    out = []
    for spec in rec.get("responder") or []:
        m = _OP.fullmatch(spec)
        assert m, spec
        which = {int(x) for x in m.group(3).split(",")} if m.group(3) else None
        if which is None or request_no in which:
            out.append((m.group(1), int(m.group(2)) if m.group(2) else None))
    return out


def reply_log(
    rec: dict[str, Any], *, address: str = PROBE_ADDRESS, shift: float = 0.0
) -> list[LoggedReply]:
    """The responder's log rows for the run, ``shift`` seconds later."""
    rows: list[LoggedReply] = []
    last_seq, attempt = -1, 0
    previous: tuple[int, float] | None = None
    for n, (icmp_id, seq, ip_len, t) in enumerate(rec["truth"]["requests"], start=1):
        if any(op == "drop" for op, _ in _ops(rec, n)):
            continue  # the responder never answered it
        # A copy of the previous request (nft's dup, same sequence number,
        # microseconds apart) is a duplicate, not a re-send.
        duplicate = previous is not None and previous[0] == seq and t - previous[1] < 0.01
        if not duplicate:
            attempt = attempt + 1 if seq == last_seq else 0
            last_seq = seq
        previous = (seq, t)
        rows.append(
            LoggedReply(
                address,
                int(icmp_id),
                int(seq),
                "whole",
                int(ip_len),
                t + 0.0002 + shift,
                attempt=attempt,
                duplicate=duplicate,
            )
        )
    return rows
