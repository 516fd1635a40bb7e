"""The Atlas tables' rows as plain records: a reply log row as the join reads
it, a result and its per-echo outcomes as the join makes them and the store
writes them (``store.AtlasStore``). Apart from the store so that the join
(``ingest.join``) needs no database code.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True, slots=True)
class LoggedReply:
    """A reply log row, as the join reads it."""

    dst_address: str
    icmp_id: int
    icmp_seq: int
    phase: str
    ip_len: int
    sent_at: float  # unix seconds
    attempt: int = 0
    duplicate: bool = False


@dataclass(frozen=True, slots=True)
class ResultRow:
    msm_id: int
    prb_id: int
    result_at: datetime
    campaign_id: int
    firmware: int | None
    from_address: str | None
    dst_address: str | None
    size: int | None
    sent: int | None
    rcvd: int | None
    dup: int | None
    join_status: str
    raw: dict[str, Any]
    stored_at: datetime | None = None
    origin: str = "fetch"
    join_error: str | None = None


@dataclass(frozen=True, slots=True)
class OutcomeRow:
    msm_id: int
    prb_id: int
    result_at: datetime
    packet_index: int
    campaign_id: int
    phase: str
    ip_len: int | None
    outcome: str
    rtt_ms: float | None
    ack_count: int
    icmp_seq: int | None
    replied_at: datetime | None
    error: str | None
    attempt: int | None = None
