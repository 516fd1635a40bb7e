"""The probe engine's sans-IO core: every protocol decision, and no IO at all.

``ProbeCore`` is fed the current time with everything that happens —
datagrams ``on_datagram(now, addr, data, local_ip)``, timers ``on_timer(now)``
whenever ``next_deadline()`` has passed, and the HTTP side's calls (``admit``,
``register``, ``cancel``, ``end``, ``touch``) — and answers with a list of
actions, in the order they must happen:

* what to send: ``SendDatagram`` (CHALLENGE and DONE on the probe UDP socket)
  and ``SendProbe`` (a probe's raw IP packets: one, or two fragments);
* what to persist: ``RunProbing``, ``OutcomeBatch``, ``Heartbeat``,
  ``RunFinished`` (``kickass_core.study_events``: the one definition the
  database's writer, journal and store read).

No sockets, threads, clock reads or database in here: the shell
(``engine.ProbeEngine``) owns those, and tests drive this class on a
simulated clock (quinn-proto / boringtun style; the volunteer client's
``ProbeSession`` is the same shape).

The engine's live state of one study session is a ``ProbeRun`` (the
database's row of it is ``kickass_db.models.SessionRow``). The HTTP API only
ever sees a ``RunSnapshot``: a frozen copy.

Handshake (ARCHITECTURE.md, "The probe protocol"): HELLO must carry the session's secret
cookie; the answer is a CHALLENGE smaller than the HELLO, to the HELLO's
source; probes start only after the ECHO of that challenge arrives from the
same address:port. A spoofed HELLO therefore costs its victim one small
packet, and nothing larger than what arrived is ever sent to an unproven
address.

Probing: W probes in flight, each with its own timeout (``RttEstimator``),
paced by ``Pacer``. In an adaptive run a probe older than the estimator's
``window_timeout`` (RFC 6298's RTO, a little over half the study's timeout) no
longer counts against W: it is presumed lost for the window, not for the
study, whose outcome waits for the timeout, nor for the split credit, which
protects the client's memory. A fixed window (``--window N``, stop-and-wait at
1) keeps its meaning: at most N probes unresolved. W is the plan's window, or,
for an adaptive plan, what the run's ``WindowController`` (window.py) allows
up to it: it grows from the measured RTT and shrinks on a standing queue or on
loss the window causes, and paces the run to the access-link rate. A client
that announced flow control (``split_credit`` at admission) also bounds the
split phase: its REPORTs (about 20 per second) carry ``split_limit``, and no
split probe with a higher seq is sent, so the study's own unfinished datagrams
never fill the client's reassembly memory (kickass_probe.reassembly explains
the budget). REPORTs also name ranges of
seqs measured while the client's kernel refused fragments: a probe there that
was not acknowledged is *invalid* (``reassembly_invalid``), not lost, and
stays out of the verdict's counts. Such a run finishes ``REPORT_GRACE_S``
after its last probe resolved, so the client's last REPORT can still arrive.
No ACK before the timeout: ``lost`` (the paper's rule); an ACK after it
turns the probe ``late``; duplicates are counted. A probe the shell could not
put on the wire is handed back (``probes_not_sent``) and
never counted as sent, so a full socket buffer is not mistaken for path loss.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import math
import secrets
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

from kickass_core import verdict as verdicts
from kickass_core import wire
from kickass_core.pacing import Pacer, PacingLane
from kickass_core.plan import SPLIT, WHOLE, ProbePlan, plan_bytes
from kickass_core.states import (
    ACKED,
    COMPLETE,
    CREATED,
    ENDED,
    EXPIRED,
    FINAL_STATES,
    INCOMPLETE,
    LATE,
    LOST,
    PROBING,
)
from kickass_core.study_events import (
    Heartbeat,
    OutcomeBatch,
    OutcomeEntry,
    RunFinished,
    RunProbing,
    StudyEvent,
)

from .packets import SessionPackets
from .policy import Admission, AdmissionDenied, AdmissionTicket, Policy
from .rtt_estimator import RttEstimator
from .window import WindowController

# The client's flow-control mode that counts splits in flight (announced as
# ``reassembly.credit_mode``; older clients send an absolute limit).
IN_FLIGHT = "in-flight"

# Outcome batches and progress counters go to the database at most this often
# per run: one statement per batch instead of one per ACK.
FLUSH_INTERVAL_S = 0.5
# A finished run stays in memory this long so late and duplicate ACKs are
# still recorded; then it is forgotten (the database has everything).
FINISHED_GRACE_S = 60.0
# Probes per run per round: small bursts in turn, so no run starves another
# and the pacer stays the only limit on the aggregate.
PROBE_BURST = 8
# After the raw socket's buffer filled up: wait this long before sending again.
SEND_RETRY_S = 0.001
# After a hard send error for one peer (no route, firewall): hold that run.
SEND_ERROR_HOLD_S = 0.1
# How often the admission's hourly windows are swept for forgotten addresses.
SWEEP_INTERVAL_S = 60.0
# A run with flow control finishes this long after its last probe resolved:
# the client reports every 50 ms, so its last word on refused fragments is in.
REPORT_GRACE_S = 0.5
# Invalid ranges a run keeps (each REPORT names up to 4; merged when adjacent).
MAX_INVALID_RANGES = 4096

# Per-seq probe state (one byte per probe of the plan).
_UNSENT, _OUT, _ACKED, _LOST, _LATE = 0, 1, 2, 3, 4

COUNTERS = (
    "datagrams",
    "malformed",
    "unknown_session",
    "bad_cookie",
    "hello_ignored",
    "challenges_sent",
    "bad_echo",
    "wrong_peer",
    "peer_migrations",
    "acks",
    "late_acks",
    "dup_acks",
    "stray_acks",
    "probes_sent",
    "probes_not_sent",
    "paced",
    "admission_denied",
    "polls_without_cookie",
    "reports",
    "stale_reports",
    "credit_waits",
    "window_paced",
)


# -- outputs ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SendDatagram:
    """A UDP datagram on the probe socket, from ``src`` (the address the peer
    wrote to) to ``addr``."""

    addr: tuple[str, int]
    data: bytes
    src: str | None = None


@dataclass(frozen=True, slots=True)
class SendProbe:
    """One probe's IP packets (a whole packet, or a split's two fragments) for
    the raw socket. If they cannot be sent, hand the action back through
    ``ProbeCore.probes_not_sent``."""

    session_id: str
    seq: int
    dst: str
    packets: tuple[bytes, ...]


Transmit = SendDatagram | SendProbe
Action = Transmit | StudyEvent


@dataclass(frozen=True)
class Admitted:
    """A session the admission accepted and the database has yet to store."""

    session_id: str
    cookie: bytes
    cookie_hash: bytes
    plan: ProbePlan
    source_address: str


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


# -- the live state of one session --------------------------------------------------


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


def _uncovered(ranges: list[tuple[int, int]], first: int, end: int) -> list[tuple[int, int]]:
    """The parts of [first, end) outside the sorted, disjoint ``ranges``."""
    out, at = [], first
    for a, b in ranges:
        if b <= at:
            continue
        if a >= end:
            break
        if a > at:
            out.append((at, a))
        at = max(at, b)
        if at >= end:
            break
    if at < end:
        out.append((at, end))
    return out


def _cover(ranges: list[tuple[int, int]], first: int, end: int) -> None:
    """Add [first, end) to the sorted, disjoint ``ranges`` (merging), bounded
    by MAX_INVALID_RANGES: beyond it the last two merge, and the gap between
    them counts as walked (the client's end-of-session report, which the store
    applies, still marks anything there)."""
    merged = []
    placed = False
    for a, b in ranges:
        if b < first:
            merged.append((a, b))
        elif a > end:
            if not placed:
                merged.append((first, end))
                placed = True
            merged.append((a, b))
        else:
            first, end = min(first, a), max(end, b)
    if not placed:
        merged.append((first, end))
        merged.sort()
    while len(merged) > MAX_INVALID_RANGES:
        (a, _), (_, d) = merged[-2], merged.pop()
        merged[-1] = (a, d)
    ranges[:] = merged


# -- the core -------------------------------------------------------------------------


class ProbeCore:
    """All sessions of one server: handshake, probing, timeouts, pacing, expiry."""

    def __init__(
        self,
        policy: Policy,
        now: float,
        *,
        probe_port: int = 0,
        random_bytes: Callable[[int], bytes] = secrets.token_bytes,
    ) -> None:
        self.policy = policy
        # The probes' UDP source port: the shell sets it once the socket is bound.
        self.probe_port = probe_port
        self._random = random_bytes
        self.admission = Admission(policy)
        self.pacer = Pacer(policy.pps_per_address, policy.pps_per_prefix, policy.pps_global, now)
        self.runs: dict[str, ProbeRun] = {}
        self._by_tag: dict[bytes, ProbeRun] = {}
        self._admitted: dict[str, ProbeRun] = {}  # admitted, not yet stored
        # Runs that may send now but for pacing (a full window or the end of
        # the plan takes a run out, an ACK or a timeout brings it back):
        # timers and deadlines look only at these. Insertion order is the
        # round-robin order.
        self._ready: dict[str, ProbeRun] = {}
        self._timers: list[tuple[float, str, int]] = []  # (deadline, session_id, seq)
        # (window timeout, session_id, seq): when a probe stops holding its window place.
        self._window_timers: list[tuple[float, str, int]] = []
        self._lifecycle_due = math.inf
        self._next_flush = math.inf
        self._next_sweep = now + SWEEP_INTERVAL_S
        self._send_hold_until = -math.inf
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)

    # -- the HTTP side ----------------------------------------------------------------

    def admit(
        self,
        now: float,
        plan: ProbePlan,
        source_address: str,
        *,
        split_credit: int | None = None,
        credit_mode: str | None = None,
    ) -> Admitted:
        """Admission for a new session (AdmissionDenied if refused). The run
        exists only once ``register``ed, after the database stored it; if
        that fails, ``cancel`` gives the admission back. ``split_credit``:
        the client does flow control of the split phase (REPORTs), and this
        many splits may go before its first REPORT arrives. ``credit_mode``
        ``IN_FLIGHT``: the credit bounds splits in flight (see ProbeRun)."""
        nbytes = plan_bytes(plan)
        reason = self.admission.check(source_address, nbytes, now)
        if reason:
            self.counters["admission_denied"] += 1
            raise AdmissionDenied(reason)
        ticket = self.admission.admit(source_address, nbytes, now)
        while True:
            tag = self._random(wire.SESSION_TAG_LEN)
            if tag not in self._by_tag and tag.hex() not in self._admitted:
                break
        cookie = self._random(wire.COOKIE_LEN)
        p = self.policy
        run = ProbeRun(
            session_id=tag.hex(),
            tag=tag,
            cookie_hash=hashlib.sha256(cookie).digest(),
            plan=plan,
            source_address=source_address,
            ticket=ticket,
            rtt=RttEstimator(p.min_timeout_ms / 1000.0, p.max_timeout_ms / 1000.0),
            ip_id=int.from_bytes(self._random(2), "big") % 0xFFFF + 1,
        )
        if split_credit is not None:
            credit = max(0, split_credit)
            run.split_limit = min(plan.total_probes, plan.split_from + credit)
            run.reasm = ReassemblyLog(initial_credit=credit)
            run.credit_mode = IN_FLIGHT if credit_mode == IN_FLIGHT else None
        self._admitted[run.session_id] = run
        return Admitted(run.session_id, cookie, run.cookie_hash, plan, source_address)

    def register(self, now: float, session_id: str) -> None:
        """The database holds the session: from now on its HELLO is answered."""
        run = self._admitted.pop(session_id)
        run.created = now
        run.expires = now + self.policy.handshake_timeout_s
        self.runs[session_id] = run
        self._by_tag[run.tag] = run
        self._lifecycle_due = min(self._lifecycle_due, run.expires)

    def cancel(self, session_id: str) -> None:
        """The database did not store the session: as if it was never asked for."""
        run = self._admitted.pop(session_id, None)
        if run is not None:
            self.admission.refund(run.ticket)

    def end(self, now: float, session_id: str, cookie: bytes) -> str:
        """The owner asks to stop: no new probes; outstanding ones get their
        timeout, then the run finishes ``ended``. Returns 'ended',
        'not-found', 'forbidden' or 'already-final'."""
        run = self.runs.get(session_id)
        if run is None:
            return "not-found"
        if not run.ok_cookie(cookie):
            return "forbidden"
        if run.state in FINAL_STATES:
            return "already-final"
        if run.end_requested is None:
            run.end_requested = "client-ended"
            self._ready.pop(session_id, None)
        self._lifecycle_due = min(self._lifecycle_due, now)
        return "ended"

    def touch(self, now: float, session_id: str, cookie: bytes | None) -> bool:
        """The owner polled over HTTP: alive even if no probe gets through (a
        fragment-dropping path acknowledges nothing for a whole phase). Only
        the cookie proves ownership: anyone may read a session's results, and
        a stranger's polls must not keep an abandoned session alive."""
        run = self.runs.get(session_id)
        if run is None or run.state in FINAL_STATES:
            return False
        if cookie is None or not run.ok_cookie(cookie):
            self.counters["polls_without_cookie"] += 1
            return False
        run.last_seen = max(run.last_seen, now)
        return True

    def snapshot(self, session_id: str) -> RunSnapshot | None:
        run = self.runs.get(session_id)
        return None if run is None else run.snapshot()

    def stats(self) -> dict[str, object]:
        live = [r for r in self.runs.values() if r.state not in FINAL_STATES]
        return {
            "counters": dict(self.counters),
            "sessions_live": len(live),
            "sessions_probing": sum(1 for r in live if r.state == PROBING),
            "sessions_remembered": len(self.runs),
            "pacing_buckets": self.pacer.buckets(),
        }

    # -- datagrams ------------------------------------------------------------------------

    def on_datagram(
        self, now: float, addr: tuple[str, int], data: bytes, local_ip: str
    ) -> list[Action]:
        """One datagram from ``addr`` to our ``local_ip``. Anything malformed,
        unknown or unauthorised is dropped silently (and counted)."""
        out: list[Action] = []
        self.counters["datagrams"] += 1
        try:
            msg = wire.decode(data)
        except wire.WireError:
            self.counters["malformed"] += 1
            return out
        run = self._by_tag.get(msg.session_tag)
        # A finished run lingers so late and duplicate ACKs are still
        # accounted; nothing else reaches it.
        if run is None or (
            run.state in FINAL_STATES and not isinstance(msg, wire.Ack | wire.Report)
        ):
            self.counters["unknown_session"] += 1
            return out
        if isinstance(msg, wire.Hello):
            self._on_hello(now, run, msg, len(data), addr, local_ip, out)
        elif isinstance(msg, wire.Echo):
            self._on_echo(now, run, msg, addr, out)
        elif isinstance(msg, wire.Ack):
            self._on_ack(now, run, msg, addr, out)
        elif isinstance(msg, wire.Report):
            self._on_report(now, run, msg, addr)
        else:
            self.counters["malformed"] += 1  # server-to-client kinds never come in
        return out

    def _on_hello(
        self,
        now: float,
        run: ProbeRun,
        msg: wire.Hello,
        size: int,
        addr: tuple[str, int],
        local_ip: str,
        out: list[Action],
    ) -> None:
        if not run.ok_cookie(msg.cookie):
            self.counters["bad_cookie"] += 1
            return
        if run.peer == addr:
            self.counters["hello_ignored"] += 1  # already proven: a late retransmission
            return
        if run.challenges_sent >= self.policy.max_challenges_per_session:
            self.counters["hello_ignored"] += 1
            return
        pending = run.challenges.get(addr)
        # A retransmitted HELLO gets the same token: the client may echo
        # whichever challenge reaches it.
        token = pending.token if pending else self._random(wire.CHALLENGE_LEN)
        reply = wire.Challenge(run.tag, token).encode()
        if len(reply) > size:  # never amplify (decode() already enforces HELLO_MIN_LEN)
            self.counters["hello_ignored"] += 1
            return
        # The RTT seed is measured from the latest challenge to its echo.
        run.challenges[addr] = _PendingChallenge(token, now, local_ip)
        run.challenges_sent += 1
        self.counters["challenges_sent"] += 1
        out.append(SendDatagram(addr, reply, local_ip))

    def _on_echo(
        self, now: float, run: ProbeRun, msg: wire.Echo, addr: tuple[str, int], out: list[Action]
    ) -> None:
        pending = run.challenges.get(addr)
        if pending is None or not hmac.compare_digest(pending.token, msg.token):
            self.counters["bad_echo"] += 1
            return
        del run.challenges[addr]
        if run.peer == addr:
            return
        if run.lane is not None:
            self.pacer.release(run.lane)
        if run.peer is not None:
            # A NAT rebinding: the owner (cookie) proved a new address.
            self.counters["peer_migrations"] += 1
        run.peer = addr
        run.local_ip = pending.local_ip
        run.packets = None  # built again for the new peer
        run.lane = self.pacer.lane(addr[0], now)
        if run.state != CREATED:
            return
        rtt = max(now - pending.sent_at, 1e-4)
        n = run.plan.total_probes
        run.codes = bytearray(n)
        run.ack_counts = bytearray(n)
        run.invalid = bytearray(n)
        run.sent_at = array("d", bytes(8 * n))
        run.acked_at = array("d", bytes(8 * n))
        run.state = PROBING
        run.handshake_rtt_ms = rtt * 1000.0
        run.rtt.seed(rtt)
        if run.plan.adaptive:
            run.ctl = WindowController(
                run.plan.window,
                now,
                rate_bps=self.policy.adaptive_rate_bps,
                initial_window=self.policy.adaptive_initial_window,
                rtt_seed=rtt,
            )
        run.last_seen = now
        run.expires = now + self.policy.max_session_s
        self._make_ready(run)
        self._lifecycle_due = min(
            self._lifecycle_due, run.expires, now + self.policy.silence_timeout_s
        )
        self._arm_flush(now)
        out.append(RunProbing(run.session_id, addr[0], addr[1], rtt * 1000.0))

    def _on_ack(
        self, now: float, run: ProbeRun, msg: wire.Ack, addr: tuple[str, int], out: list[Action]
    ) -> None:
        if addr != run.peer:
            self.counters["wrong_peer"] += 1
            return
        seq = msg.seq
        if seq >= len(run.codes) or run.codes[seq] == _UNSENT:
            self.counters["stray_acks"] += 1
            return
        self.counters["acks"] += 1
        run.last_seen = max(run.last_seen, now)
        code = run.codes[seq]
        run.ack_counts[seq] = min(255, run.ack_counts[seq] + 1)
        if msg.observed_frag_size not in (0, wire.FRAG_SIZE_UNKNOWN) and seq < run.plan.split_from:
            run.min_fragmented_whole = min(run.min_fragmented_whole, self._ip_len(run, seq))
        if code == _OUT:
            sent_at = run.outstanding.pop(seq)
            run.presumed_lost.discard(seq)
            run.rtt.sample(max(now - sent_at, 0.0))
            if run.ctl is not None:
                run.ctl.on_ack(now, seq, max(now - sent_at, 0.0))
            run.codes[seq] = _ACKED
            run.acked_at[seq] = now
            run.acked += 1
            run.phase_acked[self._phase(run, seq)] += 1
            self._record(now, run, seq, ACKED, msg)
            self._settle(now, run, out)
            self._make_ready(run)
        elif code == _LOST:
            if run.invalid and run.invalid[seq]:
                run.phase_invalid[self._phase(run, seq)] -= 1
            run.codes[seq] = _LATE
            run.acked_at[seq] = now
            run.phase_late[self._phase(run, seq)] += 1
            self.counters["late_acks"] += 1
            self._record(now, run, seq, LATE, msg)
        else:
            self.counters["dup_acks"] += 1
            self._record(now, run, seq, ACKED if code == _ACKED else LATE, msg)

    def _on_report(
        self, now: float, run: ProbeRun, msg: wire.Report, addr: tuple[str, int]
    ) -> None:
        """The client's reassembly memory: new credit, refused-fragment ranges."""
        if addr != run.peer or run.state == CREATED:
            self.counters["wrong_peer"] += 1
            return
        if run.reasm is None:
            # A client that did not announce flow control at admission: it
            # starts with its first REPORT.
            run.reasm = ReassemblyLog(initial_credit=None)
        log = run.reasm
        self.counters["reports"] += 1
        run.last_seen = max(run.last_seen, now)
        for first, end in msg.invalid:
            self._mark_invalid(now, run, first, end)
        if msg.report_seq <= log.last_report_seq:
            self.counters["stale_reports"] += 1
            return
        log.last_report_seq = msg.report_seq
        log.reports += 1
        if msg.frag_memory != wire.UNKNOWN_U32:
            log.max_memory = max(log.max_memory, msg.frag_memory)
        if msg.frag_high_thresh != wire.UNKNOWN_U32:
            log.high_thresh = msg.frag_high_thresh
        log.refused = max(log.refused, msg.refused)
        if run.state != PROBING:
            return
        # In IN_FLIGHT mode the limit is split_from + credit (never capped: the
        # credit is what counts); else an absolute bound on the next seq.
        run.split_limit = (
            msg.split_limit
            if run.credit_mode == IN_FLIGHT
            else min(msg.split_limit, run.plan.total_probes)
        )
        self._credit_wait(now, run)
        self._make_ready(run)

    def _credit_wait(self, now: float, run: ProbeRun) -> None:
        """Account the time a run waits for credit (the client's memory full)."""
        log = run.reasm
        if log is None:
            return
        waiting = run.credit_blocked() and run.next_seq < run.plan.total_probes
        if waiting and log.waiting_since is None:
            log.waiting_since = now
            log.credit_waits += 1
            self.counters["credit_waits"] += 1
        elif not waiting and log.waiting_since is not None:
            log.credit_wait_s += now - log.waiting_since
            log.waiting_since = None

    def _mark_invalid(self, now: float, run: ProbeRun, first: int, end: int) -> None:
        """Probes in [first, end) were measured while the client's kernel
        refused fragments: those not acknowledged are invalid, not lost.

        Every REPORT repeats its ranges (20 a second): only the part of a
        range not covered before is walked, so a repeated range costs nothing.
        """
        log = run.reasm
        assert log is not None
        first, end = max(0, first), min(end, len(run.codes))
        if first >= end:
            return
        for a, b in _uncovered(log.ranges, first, end):
            for seq in range(a, b):
                if run.invalid[seq] or not self._refusable(run, seq):
                    continue
                run.invalid[seq] = 1
                if run.codes[seq] == _LOST:
                    run.phase_invalid[self._phase(run, seq)] += 1
                    self._record(now, run, seq, LOST, None)
        _cover(log.ranges, first, end)

    def _refusable(self, run: ProbeRun, seq: int) -> bool:
        """Could a full reassembly memory have refused this probe? Splits
        always; whole packets only from a size the path fragments."""
        return seq >= run.plan.split_from or self._ip_len(run, seq) >= run.min_fragmented_whole

    @staticmethod
    def _phase(run: ProbeRun, seq: int) -> str:
        return SPLIT if seq >= run.plan.split_from else WHOLE

    @staticmethod
    def _ip_len(run: ProbeRun, seq: int) -> int:
        """``plan.probe(seq).ip_len`` in O(1) and without the per-plan table
        (``ProbePlan.seq_ip_len``), whose first use costs tens of
        milliseconds of the probe clock for every new session."""
        plan = run.plan
        first_split = plan.split_from
        if seq < first_split:
            return plan.whole[seq % len(plan.whole)]
        return plan.split[(seq - first_split) % len(plan.split)]

    def _record(
        self, now: float, run: ProbeRun, seq: int, outcome: str, ack: wire.Ack | None
    ) -> None:
        """Queue one probe's whole row. A seq recorded again (late or duplicate
        ACK) rewrites the row, so the store's last-word-wins upsert loses
        nothing recorded earlier."""
        run.pending.append(
            OutcomeEntry(
                seq,
                self._phase(run, seq),
                self._ip_len(run, seq),
                outcome,
                run.sent_at[seq],
                None if outcome == LOST else run.acked_at[seq],
                run.ack_counts[seq],
                None if ack is None else ack.received_len,
                # Unknown (the client's system cannot observe it) is NULL.
                None
                if ack is None or ack.observed_frag_size == wire.FRAG_SIZE_UNKNOWN
                else ack.observed_frag_size,
                # Only a probe that never arrived can be invalid: a late one
                # got through, whatever the kernel refused meanwhile.
                outcome == LOST and bool(run.invalid) and bool(run.invalid[seq]),
            )
        )
        self._arm_flush(now)

    def _arm_flush(self, now: float) -> None:
        if self._next_flush == math.inf:
            self._next_flush = now + FLUSH_INTERVAL_S

    def _settle(self, now: float, run: ProbeRun, out: list[Action]) -> None:
        """Finish a probing run at once when nothing is left in flight and
        either the plan is done or its owner asked to end."""
        if run.state != PROBING or run.outstanding:
            return
        if run.end_requested is not None:
            self._finish(now, run, ENDED, run.end_requested, out)
        elif run.next_seq >= run.plan.total_probes:
            if run.reasm is None:
                self._finish(now, run, COMPLETE, None, out)
            elif run.complete_at is None:
                # The client's last REPORT (refused fragments) may be on its way.
                run.complete_at = now + REPORT_GRACE_S
                self._lifecycle_due = min(self._lifecycle_due, run.complete_at)

    # -- time -------------------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """When ``on_timer`` must run next (None: only an input can change anything)."""
        d = min(self._lifecycle_due, self._next_flush, self._next_sweep)
        if self._timers:
            d = min(d, self._timers[0][0])
        if self._window_timers:
            d = min(d, self._window_timers[0][0])
        for run in self._ready.values():
            if run.may_send() and run.lane is not None:
                ready = max(
                    self.pacer.ready_at(run.lane), run.send_hold_until, self._send_hold_until
                )
                if run.ctl is not None:
                    ready = max(ready, run.ctl.send_at)
                d = min(d, ready)
        return None if d == math.inf else d

    def on_timer(self, now: float) -> list[Action]:
        out: list[Action] = []
        self._expire_probes(now, out)
        self._send_probes(now, out)
        if now >= self._lifecycle_due:
            self._lifecycle(now, out)
        if now >= self._next_flush:
            self.flush_into(out)
        if now >= self._next_sweep:
            self.admission.sweep(now)
            self._next_sweep = now + SWEEP_INTERVAL_S
        return out

    def _expire_probes(self, now: float, out: list[Action]) -> None:
        window_timers = self._window_timers
        while window_timers and window_timers[0][0] <= now:
            _, sid, seq = heapq.heappop(window_timers)
            run = self.runs.get(sid)
            if run is None or run.codes[seq] != _OUT:
                continue
            due = run.outstanding[seq] + run.rtt.window_timeout
            if now < due:
                heapq.heappush(window_timers, (due, sid, seq))
                continue
            run.presumed_lost.add(seq)
            self._make_ready(run)
        timers = self._timers
        while timers and timers[0][0] <= now:
            _, sid, seq = heapq.heappop(timers)
            run = self.runs.get(sid)
            if run is None or run.codes[seq] != _OUT:
                continue  # acknowledged, or never really sent
            sent_at = run.outstanding[seq]
            due = sent_at + run.rtt.timeout
            if now < due:
                # The timeout grew since this probe left; honour the current one.
                heapq.heappush(timers, (due, sid, seq))
                continue
            del run.outstanding[seq]
            run.presumed_lost.discard(seq)
            run.codes[seq] = _LOST
            if run.ctl is not None:
                run.ctl.on_loss(now, seq)
            if run.invalid and run.invalid[seq]:
                run.phase_invalid[self._phase(run, seq)] += 1
            self._record(now, run, seq, LOST, None)
            self._settle(now, run, out)
            self._make_ready(run)

    def _send_probes(self, now: float, out: list[Action]) -> None:
        if now < self._send_hold_until:
            return
        active = []
        for sid, run in list(self._ready.items()):
            if not run.may_send():
                del self._ready[sid]
            elif now >= run.send_hold_until:
                active.append(run)
        while active:
            still = []
            for run in active:
                lane = run.lane
                assert lane is not None
                n = 0
                while n < PROBE_BURST and run.may_send():
                    if run.ctl is not None and now < run.ctl.send_at:
                        self.counters["window_paced"] += 1
                        break
                    if not self.pacer.try_take(lane, now):
                        self.counters["paced"] += 1
                        break
                    self._send_one(now, run, out)
                    n += 1
                if n:
                    # To the back of the line: when tokens trickle in one at a
                    # time (a shared /24 or global bucket), the next one goes
                    # to a run that did not send now, instead of always to
                    # the oldest run.
                    del self._ready[run.session_id]
                    if run.may_send():
                        self._ready[run.session_id] = run
                if n == PROBE_BURST:
                    still.append(run)
            active = still

    def _make_ready(self, run: ProbeRun) -> None:
        if run.may_send() and run.session_id not in self._ready:
            self._ready[run.session_id] = run

    def _send_one(self, now: float, run: ProbeRun, out: list[Action]) -> None:
        peer, local_ip = run.peer, run.local_ip
        assert peer is not None and local_ip is not None
        seq = run.next_seq
        phase = self._phase(run, seq)
        if run.packets is None:
            run.packets = SessionPackets(local_ip, peer[0], self.probe_port, peer[1], run.tag)
        run.ip_id = run.ip_id % 0xFFFF + 1
        packets = run.packets.render(phase, self._ip_len(run, seq), seq, run.ip_id)
        run.next_seq += 1
        run.codes[seq] = _OUT
        run.outstanding[seq] = now
        run.sent_at[seq] = now
        run.sent += 1
        run.phase_sent[phase] += 1
        self.counters["probes_sent"] += 1
        heapq.heappush(self._timers, (now + run.rtt.timeout, run.session_id, seq))
        self._arm_flush(now)
        out.append(SendProbe(run.session_id, seq, peer[0], tuple(packets)))
        if run.ctl is not None:
            heapq.heappush(self._window_timers, (now + run.rtt.window_timeout, run.session_id, seq))
            nbytes = sum(len(p) for p in packets)
            run.ctl.on_send(now, seq, phase, self._ip_len(run, seq), nbytes, run.in_window())
        if run.reasm is not None:
            self._credit_wait(now, run)

    def probes_not_sent(
        self, now: float, probes: list[SendProbe], *, buffer_full: bool = False
    ) -> None:
        """The shell could not put these probes on the wire: undo them, so a
        probe that never left is never counted as lost. ``buffer_full`` (the
        raw socket would block) pauses all sending briefly; otherwise (a hard
        error for those peers) their runs pause a little longer.

        Probes are undone newest first; the shell reports, for each run, every
        probe from the first failed one on (a suffix of what it was given).
        """
        for p in reversed(probes):
            run = self.runs.get(p.session_id)
            if run is None or run.state != PROBING:
                continue
            seq = p.seq
            if seq != run.next_seq - 1 or run.codes[seq] != _OUT:
                continue  # not the newest probe: leave it to its timeout
            del run.outstanding[seq]
            run.presumed_lost.discard(seq)
            if run.ctl is not None:
                run.ctl.on_unsent(seq, sum(len(pkt) for pkt in p.packets))
            run.codes[seq] = _UNSENT
            run.next_seq = seq
            run.sent -= 1
            run.phase_sent[self._phase(run, seq)] -= 1
            self.counters["probes_sent"] -= 1
            self.counters["probes_not_sent"] += 1
            if run.lane is not None:
                self.pacer.give_back(run.lane)
            if not buffer_full:
                run.send_hold_until = now + SEND_ERROR_HOLD_S
            self._make_ready(run)
        if buffer_full:
            self._send_hold_until = now + SEND_RETRY_S

    # -- life cycle ------------------------------------------------------------------------

    def _lifecycle(self, now: float, out: list[Action]) -> None:
        p = self.policy
        due = math.inf
        for sid, run in list(self.runs.items()):
            if run.state == CREATED:
                if run.end_requested is not None:
                    self._finish(now, run, ENDED, run.end_requested, out)
                elif now >= run.expires:
                    self._finish(now, run, EXPIRED, "no return-routability proof in time", out)
                else:
                    due = min(due, run.expires)
            elif run.state == PROBING:
                silent_at = run.last_seen + p.silence_timeout_s
                if run.end_requested is not None and not run.outstanding:
                    self._finish(now, run, ENDED, run.end_requested, out)
                elif run.next_seq >= run.plan.total_probes and not run.outstanding:
                    if run.complete_at is None or now >= run.complete_at:
                        self._finish(now, run, COMPLETE, None, out)
                    else:
                        due = min(due, run.complete_at)
                elif now >= silent_at:
                    self._finish(now, run, INCOMPLETE, "client-silent", out)
                elif now >= run.expires:
                    self._finish(now, run, INCOMPLETE, "max-session-time", out)
                else:
                    due = min(due, silent_at, run.expires)
            if run.finished_at is not None:
                if now >= run.finished_at + FINISHED_GRACE_S:
                    self._forget(sid, run, out)
                else:
                    due = min(due, run.finished_at + FINISHED_GRACE_S)
        self._lifecycle_due = due

    def _finish(
        self, now: float, run: ProbeRun, state: str, end_reason: str | None, out: list[Action]
    ) -> None:
        # Probes still in flight when a run ends early were sent but never
        # resolved: record them lost, so what was sent is what was stored.
        for seq in sorted(run.outstanding):
            run.codes[seq] = _LOST
            if run.invalid and run.invalid[seq]:
                run.phase_invalid[self._phase(run, seq)] += 1
            self._record(now, run, seq, LOST, None)
        run.outstanding.clear()
        run.presumed_lost.clear()
        if state == EXPIRED:
            v = verdicts.Verdict(verdicts.INCONCLUSIVE, "no probes were sent")
        else:
            inv = run.phase_invalid
            late = run.phase_late
            v = verdicts.decide(
                run.phase_sent[WHOLE] - inv[WHOLE],
                run.phase_acked[WHOLE] + late[WHOLE],
                run.phase_sent[SPLIT] - inv[SPLIT],
                run.phase_acked[SPLIT] + late[SPLIT],
                whole_invalid=inv[WHOLE],
                split_invalid=inv[SPLIT],
                late=late[WHOLE] + late[SPLIT],
            )
        reasm = None
        if run.reasm is not None:
            if run.reasm.waiting_since is not None:
                run.reasm.credit_wait_s += now - run.reasm.waiting_since
                run.reasm.waiting_since = None
            reasm = run.reasm.to_json(run.phase_invalid)
        window = None if run.ctl is None else run.ctl.summary(now)
        self._flush_run(run, out)
        run.state = state
        run.end_reason = end_reason
        run.finished_at = now
        out.append(
            RunFinished(run.session_id, state, v.verdict, v.reason, end_reason, reasm, window)
        )
        self.admission.release(run.ticket)
        if run.lane is not None:
            self.pacer.release(run.lane)
            run.lane = None
        run.packets = None
        run.challenges.clear()
        self._ready.pop(run.session_id, None)
        if run.peer is not None:
            out.append(SendDatagram(run.peer, wire.Done(run.tag).encode(), run.local_ip))
        self._lifecycle_due = min(self._lifecycle_due, now + FINISHED_GRACE_S)

    def _forget(self, sid: str, run: ProbeRun, out: list[Action]) -> None:
        self._flush_run(run, out)  # a late ACK of the last moment
        del self.runs[sid]
        self._by_tag.pop(run.tag, None)

    def shutdown(self, now: float, reason: str = "server-shutdown") -> list[Action]:
        """Finish every live run ``incomplete`` and flush everything."""
        out: list[Action] = []
        for run in list(self.runs.values()):
            if run.state not in FINAL_STATES:
                self._finish(now, run, INCOMPLETE, reason, out)
        for sid in list(self._admitted):
            self.cancel(sid)
        self.flush_into(out)
        return out

    # -- persistence -----------------------------------------------------------------------

    def flush(self) -> list[Action]:
        """Every pending outcome and progress counter, now (before a reader
        must see them, e.g. the HTTP API waiting for a final state)."""
        out: list[Action] = []
        self.flush_into(out)
        return out

    def flush_into(self, out: list[Action]) -> None:
        for run in self.runs.values():
            self._flush_run(run, out)
        self._next_flush = math.inf

    def _flush_run(self, run: ProbeRun, out: list[Action]) -> None:
        if run.pending:
            out.append(OutcomeBatch(run.session_id, tuple(run.pending)))
            run.pending = []
        if run.state == PROBING and run.reported != (run.sent, run.acked):
            run.reported = (run.sent, run.acked)
            out.append(Heartbeat(run.session_id, run.sent, run.acked))
