"""The live state of one study session in the core, and the frozen copy the HTTP side reads.

``ProbeRun`` is the engine's state of one session (the database's row of it
is ``kickass_db.models.SessionRow``): its handshake, where it is in its plan
(plan_iter.py), its window and the client's split credit (credit.py), and
what waits to be persisted. Its own queries say whether it may send now
(``may_send``: probing, not asked to end, probes left, a place in the
window, credit for a split). The HTTP API only ever sees a ``RunSnapshot``.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

from kickass_core.pacing import PacingLane
from kickass_core.plan import SPLIT, WHOLE, ProbePlan
from kickass_core.states import CREATED, PROBING
from kickass_core.study_events import OutcomeEntry

from ..packets import SessionPackets
from ..policy import AdmissionTicket
from ..rtt_estimator import RttEstimator
from ..window import WindowController

# The client's flow-control mode that counts splits in flight (announced as
# ``reassembly.credit_mode``; older clients send an absolute limit).
IN_FLIGHT = "in-flight"


@dataclass
class ReassemblyLog:
    """What a flow-controlled run learnt from its client's REPORTs."""

    initial_credit: int | None
    reports: int = 0
    last_report_seq: int = -1
    max_memory: int = 0
    high_thresh: int | None = None
    refused: int = 0
    credit_waits: int = 0
    credit_wait_s: float = 0.0
    waiting_since: float | None = None
    ranges: list[tuple[int, int]] = field(default_factory=list)

    def to_json(self, invalid: Mapping[str, int]) -> dict[str, object]:
        return {
            "budget": "client-credit",
            "initial_credit": self.initial_credit,
            "reports": self.reports,
            "max_memory": self.max_memory,
            "high_thresh": self.high_thresh,
            "refused": self.refused,
            "credit_waits": self.credit_waits,
            "credit_wait_s": round(self.credit_wait_s, 3),
            "invalid_ranges": [list(r) for r in self.ranges],
            "invalid": dict(invalid),
        }


@dataclass(frozen=True)
class RunSnapshot:
    """A consistent, immutable copy of one run, for the HTTP threads."""

    session_id: str
    state: str
    source_address: str
    peer: tuple[str, int] | None
    total_probes: int
    sent: int
    acked: int
    phase_sent: Mapping[str, int]
    phase_acked: Mapping[str, int]
    outstanding: int
    handshake_rtt_ms: float | None
    timeout_ms: float
    end_requested: bool
    end_reason: str | None
    split_limit: int | None = None
    invalid: Mapping[str, int] = field(default_factory=dict)
    # Probes that may be in flight now: the plan's window, or the adaptive one.
    window: int = 1


class _PendingChallenge(NamedTuple):
    token: bytes
    sent_at: float
    local_ip: str


@dataclass(eq=False)
class ProbeRun:
    """The engine's live state of one study session. Mutable; lives in the core only."""

    session_id: str
    tag: bytes
    cookie_hash: bytes
    plan: ProbePlan
    source_address: str
    ticket: AdmissionTicket
    rtt: RttEstimator
    ip_id: int
    created: float = 0.0
    expires: float = 0.0
    state: str = CREATED
    peer: tuple[str, int] | None = None
    local_ip: str | None = None
    challenges: dict[tuple[str, int], _PendingChallenge] = field(default_factory=dict)
    challenges_sent: int = 0
    handshake_rtt_ms: float | None = None
    next_seq: int = 0
    outstanding: dict[int, float] = field(default_factory=dict)  # seq -> send time
    # Outstanding probes past the window timeout (adaptive runs only): they
    # leave W, not the split credit.
    presumed_lost: set[int] = field(default_factory=set)
    # Per-seq arrays, allocated when probing starts: an unproven session
    # costs no memory proportional to its plan.
    codes: bytearray = field(default_factory=bytearray)
    ack_counts: bytearray = field(default_factory=bytearray)
    # 1 = measured while the client's kernel refused fragments (REPORT ranges)
    invalid: bytearray = field(default_factory=bytearray)
    sent_at: array[float] = field(default_factory=lambda: array("d"))
    acked_at: array[float] = field(default_factory=lambda: array("d"))
    sent: int = 0
    acked: int = 0
    phase_sent: dict[str, int] = field(default_factory=lambda: {WHOLE: 0, SPLIT: 0})
    phase_acked: dict[str, int] = field(default_factory=lambda: {WHOLE: 0, SPLIT: 0})
    # Acknowledged after their timeout: recorded late (lost by the paper's
    # rule), delivered for the verdict.
    phase_late: dict[str, int] = field(default_factory=lambda: {WHOLE: 0, SPLIT: 0})
    # Probes marked invalid and not acknowledged, per phase (out of phase_sent).
    phase_invalid: dict[str, int] = field(default_factory=lambda: {WHOLE: 0, SPLIT: 0})
    # Flow control (None: the client sent none): split seqs below this may go.
    split_limit: int | None = None
    # IN_FLIGHT flow control (the client asked for it at admission): the
    # REPORT's limit is split_from + credit, and at most ``credit`` splits are
    # in flight; a split frees its credit when it is resolved, acknowledged or
    # timed out, so a path that drops every fragment does not stall.
    credit_mode: str | None = None
    reasm: ReassemblyLog | None = None
    # An adaptive plan's window (None: the plan's window, fixed).
    ctl: WindowController | None = None
    # Smallest whole IP length an ACK showed fragmented (a small-MTU hop):
    # lost whole probes from it up can be refused by a full reassembly memory too.
    min_fragmented_whole: int = 1 << 16
    # A flow-controlled run whose plan is done finishes at this time.
    complete_at: float | None = None
    last_seen: float = 0.0  # last ACK from the peer, or the owner's HTTP poll
    packets: SessionPackets | None = None
    lane: PacingLane | None = None
    send_hold_until: float = -math.inf
    pending: list[OutcomeEntry] = field(default_factory=list)
    reported: tuple[int, int] = (-1, -1)  # (sent, acked) of the last Heartbeat
    end_requested: str | None = None
    end_reason: str | None = None
    finished_at: float | None = None

    def ok_cookie(self, cookie: bytes) -> bool:
        return hmac.compare_digest(hashlib.sha256(cookie).digest(), self.cookie_hash)

    def may_send(self) -> bool:
        return (
            self.state == PROBING
            and self.end_requested is None
            and self.next_seq < self.plan.total_probes
            and self.in_window() < self.window()
            and not self.credit_blocked()
        )

    def window(self) -> int:
        return self.plan.window if self.ctl is None else self.ctl.window

    def in_window(self) -> int:
        """Probes holding a place in the window: outstanding, not presumed lost."""
        return len(self.outstanding) - len(self.presumed_lost)

    def credit_blocked(self) -> bool:
        """The next probe is a split the client has not given credit for."""
        if self.split_limit is None or self.next_seq < self.plan.split_from:
            return False
        if self.credit_mode == IN_FLIGHT:
            credit = self.split_limit - self.plan.split_from
            return self.splits_in_flight() >= credit
        return self.next_seq >= self.split_limit

    def splits_in_flight(self) -> int:
        """Split probes sent and not yet resolved (at most the window's worth)."""
        first = self.plan.split_from
        return sum(1 for seq in self.outstanding if seq >= first)

    def snapshot(self) -> RunSnapshot:
        return RunSnapshot(
            session_id=self.session_id,
            state=self.state,
            source_address=self.source_address,
            peer=self.peer,
            total_probes=self.plan.total_probes,
            sent=self.sent,
            acked=self.acked,
            phase_sent=MappingProxyType(dict(self.phase_sent)),
            phase_acked=MappingProxyType(dict(self.phase_acked)),
            outstanding=len(self.outstanding),
            handshake_rtt_ms=self.handshake_rtt_ms,
            timeout_ms=self.rtt.timeout * 1000.0,
            end_requested=self.end_requested is not None,
            end_reason=self.end_reason,
            split_limit=self.split_limit,
            invalid=MappingProxyType(dict(self.phase_invalid)),
            window=self.window(),
        )
