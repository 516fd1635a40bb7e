"""A result joined to the responder's reply log: its result row and per-echo outcomes.

The reply log has, per request that reached the responder, the requester
address, ICMP id, sequence number, the attempt (a re-used sequence number is
a new attempt), what it sent and when. For one result:

1. candidate *runs*: log rows of the measurement's target and request
   length from the probe's address (``from``, or its registered one) within
   the run's time (``timestamp`` - packets x interval .. ``timestamp``, plus
   ``JOIN_SLACK_S`` for clocks), grouped per ICMP id;
2. the result's x and rtt entries, in order, are the run's sequence numbers
   s0, s0 + 1, ...; everything follows from s0: an x's sequence number had
   one request (a row of ours there is a *lost* reply, no row an
   *unanswered* request); an rtt's had one or more attempts, the probe
   accepted the last one (or, for an RTT above the interval, an earlier one)
   and the others' replies were *lost*; rows on the sequence number after
   the last rtt are *lost* replies the run ended on. Before the first reply
   each entry is one packet slot, so those rows' times must line up with
   the packet interval; the rest are placed by their times;
3. s0 is unknown (a real probe continues its sequence numbers from run to
   run): every s0 under which the log fits the result is a candidate (the
   run sent one request per packet: our rows plus the x entries without
   one are at most that many). One fits: ``exact``. Several fit (only when
   some of the run's requests never reached us): the one whose timing best
   matches the end-of-run timestamp; below ``MIN_TIMED_INTERVAL_S`` all tie
   on timing and the late replies decide. A candidate that leaves more late
   replies than the chosen one without a reply of ours given up on before
   them is no rival. The rivals left make it ``ambiguous``: our replies
   (the logged requests), acked (the rtt entries) and unanswered are the
   same under every candidate; which split an acked reply had may differ,
   and ``late`` by at most the result's duplicate entries. None fits:
   ``inconsistent`` (the log lacks rows: the responder was down); no row at
   all: ``no-log`` (then nothing of the result enters a drop rate: without
   our log the replies may have been the kernel's). Firmware that reported
   counts only: ``aggregate``.

Per echo request that gives: ``acked``, ``lost``, ``late`` (lost, then a
late reply came back, listed as a duplicate), ``unanswered`` (the request
never reached the responder, or was over its caps) and ``error``; only the
first three are about our replies and enter drop rates, as the volunteers'
server-sent probes do. Every result has ``packets`` outcomes.

A result that cannot be read or joined gets a row with ``join_status``
``invalid`` and a reason a person can read, without outcomes
(``invalid_row``): a fetch never stops on one, and its window's watermark
commits. A readable copy of it, later, takes its place
(``AtlasStore.store_window``).

Pure: no database, no network (the rows are ``kickass_atlas.rows``).
"""

from __future__ import annotations

import bisect
import logging
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kickass_core.plan import WHOLE

from ..campaign import wire_ip_len
from ..rows import LoggedReply, OutcomeRow, ResultRow
from .parse import (
    ERROR,
    MAX_ERROR_CHARS,
    REPLY,
    TIMEOUT,
    ParsedResult,
    ResultInvalid,
    Slot,
    _int,
)

log = logging.getLogger("kickass.atlas")

# Rows may lie this much outside a run's nominal time: the probe's clock
# against the responder's (probes are synchronised, within a second or two).
JOIN_SLACK_S = 3.0
# A run of another ICMP id whose timing fits the result this much worse than
# the best one's is not a rival alignment (a neighbouring run's tail).
RIVAL_RUN_S = 1.0
# Below this packet interval, request times say nothing about packet slots.
MIN_TIMED_INTERVAL_S = 0.05
# Atlas ping sequence numbers are 8-bit (u_int8_t seq in ping.c).
SEQ_MOD = 256


@dataclass(frozen=True)
class MeasurementSpec:
    """What the join needs to know of a measurement (a row of atlas_measurements)."""

    msm_id: int
    campaign_id: int
    phase: str
    target: str
    ip_len: int
    packets: int
    packet_interval_ms: int
    size: int | None = None  # the Atlas size asked for (None: ip_len - 28)

    @property
    def request_len(self) -> int:
        """The IP length of the probe's echo requests on the wire: the probe
        pads data shorter than its own 32-byte record."""
        return wire_ip_len(self.ip_len - 28 if self.size is None else self.size)

    @property
    def interval_s(self) -> float:
        return self.packet_interval_ms / 1000.0

    @property
    def run_len_s(self) -> float:
        return self.packets * self.interval_s

    @staticmethod
    def from_row(row: Mapping[str, Any]) -> MeasurementSpec:
        return MeasurementSpec(
            msm_id=int(row["msm_id"]),
            campaign_id=int(row["campaign_id"]),
            phase=row["phase"],
            target=str(row["target"]),
            ip_len=int(row["ip_len"]),
            packets=int(row["packets"]),
            packet_interval_ms=int(row["packet_interval_ms"]),
            size=int(row["size"]) if row.get("size") is not None else None,
        )


@dataclass
class LoggedRun:
    """The replies we sent to one probe's ping (one requester address and ICMP id)."""

    dst: str
    icmp_id: int
    replies: list[LoggedReply]  # requests, oldest first (duplicated copies left out)
    copies: list[LoggedReply] = field(default_factory=list)  # replies to duplicated requests

    @property
    def start(self) -> float:
        return self.replies[0].sent_at


class LogIndex:
    """The reply log rows of a window, per requester address, by time."""

    def __init__(self, replies: Iterable[LoggedReply]) -> None:
        by_dst: dict[str, list[LoggedReply]] = defaultdict(list)
        for r in replies:
            by_dst[r.dst_address].append(r)
        self._rows = {a: sorted(rows, key=lambda r: r.sent_at) for a, rows in by_dst.items()}
        self._times = {a: [r.sent_at for r in rows] for a, rows in self._rows.items()}

    def between(self, address: str, lo: float, hi: float) -> list[LoggedReply]:
        times = self._times.get(address)
        if not times:
            return []
        return self._rows[address][bisect.bisect_left(times, lo) : bisect.bisect_right(times, hi)]


def runs_near(
    res: ParsedResult,
    log_index: LogIndex,
    spec: MeasurementSpec,
    probe_addresses: Mapping[int, str | None],
) -> list[LoggedRun]:
    """The log rows that may be ``res``'s run, one run per address and ICMP id."""
    lo = res.timestamp - spec.run_len_s - JOIN_SLACK_S
    hi = res.timestamp + 1.0 + JOIN_SLACK_S
    addresses = sorted({a for a in (res.from_address, probe_addresses.get(res.prb_id)) if a})
    groups: dict[tuple[str, int], LoggedRun] = {}
    for address in addresses:
        for r in log_index.between(address, lo, hi):
            run = groups.get((address, r.icmp_id))
            if run is None:
                run = groups[(address, r.icmp_id)] = LoggedRun(address, r.icmp_id, [])
            (run.copies if r.duplicate else run.replies).append(r)
    return sorted((g for g in groups.values() if g.replies), key=lambda g: (g.dst, g.icmp_id))


@dataclass
class _Shape:
    """What a result's entries say about its run, sequence number by sequence number."""

    kinds: list[str]  # per sequence index: TIMEOUT or REPLY
    rtts: list[float | None]  # per sequence index
    positions: list[int]  # per sequence index: its entry's position among x/rtt/error
    errors: list[int]  # positions of the error entries
    error_exact: list[bool]  # per error entry: its position is its packet slot
    exact_slot: list[bool]  # per sequence index: the position is the request's packet slot
    tail_allowed: bool  # requests on the sequence number after the last entry are possible
    first_reply_single: bool  # the first reply's sequence number had exactly one request
    # Per late reply (a duplicate with an RTT of at least the packet
    # interval): how many sequence indices came before it.
    late_before: list[int] = field(default_factory=list)

    @staticmethod
    def of(
        slots: Sequence[Slot], dups: Sequence[tuple[int, float | None]], interval_ms: int
    ) -> _Shape:
        kinds: list[str] = []
        rtts: list[float | None] = []
        positions: list[int] = []
        errors: list[int] = []
        error_exact: list[bool] = []
        exact: list[bool] = []
        got_reply = False
        error_seen = False
        # Firmware older than the seq re-use writes an x for every lost packet,
        # after a reply too: then every entry is one packet slot.
        first_reply = next((i for i, s in enumerate(slots) if s.kind == REPLY), len(slots))
        classic = any(s.kind == TIMEOUT for s in slots[first_reply:])
        first_reply_single = False
        for pos, s in enumerate(slots):
            if s.kind == ERROR:
                errors.append(pos)
                error_exact.append(classic or (not error_seen and not got_reply))
                error_seen = True
                continue
            exact_here = classic or (not error_seen and not got_reply)
            if s.kind == REPLY and not got_reply and not error_seen:
                first_reply_single = True
            kinds.append(s.kind)
            rtts.append(s.rtt_ms)
            positions.append(pos)
            exact.append(exact_here)
            if s.kind == REPLY:
                got_reply = True
        late_before = [
            sum(1 for s in slots[:before] if s.kind != ERROR)
            for before, rtt in dups
            if rtt is not None and rtt >= interval_ms > 0
        ]
        return _Shape(
            kinds,
            rtts,
            positions,
            errors,
            error_exact,
            exact,
            got_reply and not classic,
            first_reply_single,
            late_before,
        )

    def exact(self, j: int) -> bool:
        """Is sequence index ``j``'s entry position its request's packet slot?"""
        return 0 <= j < len(self.kinds) and self.exact_slot[j]

    def min_slot(self, j: int) -> int:
        """The earliest packet slot a request of sequence index ``j`` can have:
        every entry before its own took at least one."""
        if j < len(self.positions):
            return self.positions[j]
        return (max(self.positions + self.errors) + 1) if self.positions or self.errors else 0


@dataclass
class _Fit:
    """One way (run, first sequence number) to lay the log over a result."""

    run: LoggedRun
    s0: int
    index: list[int]  # per run reply: its sequence index (-1: none fits)
    violations: int
    score: float  # seconds between the predicted and the reported end of the run
    anchor: float | None  # run start + one-way delay, from the slot-exact rows
    # The sequence evidence, where times cannot tell alignments apart: late
    # replies with no reply of ours before them that the probe gave up on
    # (each needs the path to have delayed a copy of an accepted reply by a
    # whole interval), and late replies that must share one (a late reply
    # duplicated on the path).
    unexplained: int = 0
    repeated: int = 0


def _seq_index(seq: int, s0: int, mod: int) -> int:
    return (seq - s0) % mod


def _fit(res: ParsedResult, shape: _Shape, run: LoggedRun, s0: int, spec: MeasurementSpec) -> _Fit:
    mod = SEQ_MOD if max(r.icmp_seq for r in run.replies) < SEQ_MOD else 65536
    n_seq = len(shape.kinds)
    last = n_seq if shape.tail_allowed else n_seq - 1
    index: list[int] = []
    violations = 0
    previous = -1
    for r in run.replies:
        j = _seq_index(r.icmp_seq, s0, mod)
        if j > last or j < previous:  # a probe's sequence number never goes back
            violations += 1
            j = -1
        else:
            previous = j
        index.append(j)
    per_index = Counter(j for j in index if j >= 0)
    for j, kind in enumerate(shape.kinds):
        count = per_index.get(j, 0)
        if kind == TIMEOUT and count > 1:  # a timed-out sequence number is never re-sent
            violations += count - 1
        elif kind == REPLY and count == 0:
            violations += 1  # the probe accepted a reply we never sent
    if shape.first_reply_single:
        first = shape.kinds.index(REPLY)
        violations += max(0, per_index.get(first, 0) - 1)
    # The run sent one request per packet but the errors': every row of ours
    # is one, and so is every x without a row (it never reached us).
    unanswered = sum(
        1 for j, kind in enumerate(shape.kinds) if kind == TIMEOUT and per_index.get(j, 0) == 0
    )
    requests = len(run.replies) + unanswered
    if requests > spec.packets - len(shape.errors):
        violations += requests - (spec.packets - len(shape.errors))
    # Replies of ours the probe gave up on, per sequence index: a late
    # reply answers one of those before it (once, unless duplicated).
    given_up = [
        per_index.get(j, 0) - (0 if kind == TIMEOUT else min(1, per_index.get(j, 0)))
        for j, kind in enumerate(shape.kinds)
    ]
    unexplained = repeated = used = 0
    for before in sorted(shape.late_before):
        candidates = sum(given_up[:before])
        if candidates == 0:
            unexplained += 1
        elif used < candidates:
            used += 1
        else:
            repeated += 1
    interval = spec.interval_s
    anchor: float | None = None
    score = math.inf
    if interval >= MIN_TIMED_INTERVAL_S:
        # Rows of slot-exact entries: their time minus slot x interval is the
        # run's start (+ one-way delay) for every one of them.
        starts = [
            r.sent_at - shape.positions[j] * interval
            for r, j in zip(run.replies, index, strict=True)
            if shape.exact(j)
        ]
        if starts:
            anchor = statistics.median(starts)
            violations += sum(1 for t in starts if abs(t - anchor) > 0.35 * interval)
            # Every other row lies within the run's packets.
            for r, j in zip(run.replies, index, strict=True):
                slot = (r.sent_at - anchor) / interval
                if not -0.5 <= slot <= spec.packets - 0.5 or (
                    j >= 0 and slot < shape.min_slot(j) - 0.5
                ):
                    violations += 1
            rtts = [x for x in shape.rtts if x is not None]
            delay = statistics.median(rtts) / 2000.0 if rtts else 0.0
            end = anchor - delay + spec.packets * interval
            # The firmware's time(NULL) at the run's end: within [ts, ts + 1).
            score = abs(end - (res.timestamp + 0.5))
        else:
            span = (run.replies[-1].sent_at - run.replies[0].sent_at) / interval
            if span > spec.packets - 1 + 0.5:
                violations += 1
            score = abs(run.replies[-1].sent_at - res.timestamp)
    return _Fit(run, s0, index, violations, score, anchor, unexplained, repeated)


def _fits(res: ParsedResult, shape: _Shape, run: LoggedRun, spec: MeasurementSpec) -> list[_Fit]:
    """Every first sequence number the run's first row allows. That row is
    the first request that reached us: every earlier one was unanswered, so
    timed out before any reply, an x. Its index is at most the number of
    leading x entries (one more is tried, for the inconsistent)."""
    mod = SEQ_MOD if max(r.icmp_seq for r in run.replies) < SEQ_MOD else 65536
    first = run.replies[0].icmp_seq
    lead = next((j for j, kind in enumerate(shape.kinds) if kind != TIMEOUT), len(shape.kinds))
    last = min(len(shape.kinds), lead + 1)
    return [_fit(res, shape, run, (first - k) % mod, spec) for k in range(last + 1)]


def _result_row(
    res: ParsedResult, spec: MeasurementSpec, status: str, origin: str, error: str | None = None
) -> ResultRow:
    return ResultRow(
        msm_id=res.msm_id,
        prb_id=res.prb_id,
        result_at=datetime.fromtimestamp(res.timestamp, UTC),
        campaign_id=spec.campaign_id,
        firmware=res.firmware,
        from_address=res.from_address,
        dst_address=res.dst_address,
        size=res.size,
        sent=res.sent if res.sent is not None else spec.packets,
        rcvd=res.rcvd,
        dup=res.dup,
        join_status=status,
        raw=res.raw,
        stored_at=datetime.fromtimestamp(res.stored_at, UTC) if res.stored_at else None,
        origin=origin,
        join_error=error,
    )


@dataclass
class _Out:
    """One outcome before it gets its packet slot."""

    outcome: str
    ip_len: int | None
    want_slot: float | None = None
    rtt_ms: float | None = None
    ack_count: int = 0
    reply: LoggedReply | None = None
    error: str | None = None
    seq_index: int = -1


def join_one(
    res: ParsedResult,
    log_index: LogIndex,
    spec: MeasurementSpec,
    probe_addresses: Mapping[int, str | None],
    origin: str = "fetch",
) -> tuple[ResultRow, list[OutcomeRow]]:
    """The stored rows of one result: a pure function of the result and the
    log, so that any batching or order of results stores the same rows."""
    runs = runs_near(res, log_index, spec, probe_addresses)
    nominal = spec.request_len
    if res.slots is None:
        run = min(runs, key=lambda g: abs(g.replies[-1].sent_at - res.timestamp), default=None)
        return _result_row(res, spec, "aggregate", origin), _rows(
            res, spec, _aggregate(res, run, spec, nominal)
        )
    shape = _Shape.of(res.slots, res.dups, spec.packet_interval_ms)
    if not runs:
        return _result_row(res, spec, "no-log", origin), _rows(res, spec, _no_log(res, spec))
    if not shape.kinds:  # only errors: nothing was sent, yet we logged replies
        fit = _Fit(runs[0], 0, [-1] * len(runs[0].replies), 1, math.inf, None)
        candidates = [fit]
    else:
        candidates = [f for run in runs for f in _fits(res, shape, run, spec)]
    valid = [f for f in candidates if f.violations == 0]
    if valid:
        # Below the timing resolution every alignment of a run has the same
        # score: the late replies decide. An alignment that leaves more of
        # them than the chosen one without a reply of ours to answer is no
        # rival; one that makes two share a reply is the less likely, but a
        # rival still.
        timed = spec.interval_s >= MIN_TIMED_INTERVAL_S
        best = min(
            valid,
            key=lambda f: (
                (f.score, f.unexplained, f.repeated)
                if timed
                else (f.unexplained, f.repeated, f.score),
                f.run.dst,
                f.run.icmp_id,
                f.s0,
            ),
        )
        # Another alignment of the same run leaves which reply was acked
        # open; another run competes only as close in time (two probes behind
        # one address), not the tail of a neighbouring run in the window.
        rivals = [
            f
            for f in valid
            if f is not best
            and f.unexplained <= best.unexplained
            and (f.run is best.run or f.score - best.score < RIVAL_RUN_S)
        ]
        status = "ambiguous" if rivals else "exact"
    else:
        best = min(
            candidates, key=lambda f: (f.violations, f.score, f.run.dst, f.run.icmp_id, f.s0)
        )
        status = "inconsistent"
    return _result_row(res, spec, status, origin), _rows(res, spec, _assign(res, shape, best, spec))


def _assign(res: ParsedResult, shape: _Shape, fit: _Fit, spec: MeasurementSpec) -> list[_Out]:
    interval = spec.interval_s
    whole = spec.phase == WHOLE
    outs: list[_Out] = []
    by_index: dict[int, list[LoggedReply]] = defaultdict(list)
    unplaced: list[LoggedReply] = []
    for r, j in zip(fit.run.replies, fit.index, strict=True):
        (by_index[j] if j >= 0 else unplaced).append(r)

    def want(r: LoggedReply) -> float | None:
        return None if fit.anchor is None else (r.sent_at - fit.anchor) / interval

    def ours(r: LoggedReply, outcome: str, j: int, **kw: Any) -> _Out:
        return _Out(outcome, r.ip_len, want(r), reply=r, seq_index=j, **kw)

    accepted: dict[int, _Out] = {}
    for j, kind in enumerate(shape.kinds):
        rows = by_index.get(j, [])
        if kind == TIMEOUT:
            outs += [ours(r, "lost", j) for r in rows]
            if not rows:
                slot = float(shape.positions[j]) if shape.exact(j) else None
                outs.append(_Out("unanswered", nominal_len(spec), slot, seq_index=j))
            continue
        rtt = shape.rtts[j]
        if not rows:
            # The probe accepted a reply our log lacks (the fit counted it as
            # a violation): kept as acked, but in no drop rate.
            outs.append(_Out("acked", None, rtt_ms=rtt, ack_count=1, seq_index=j))
            continue
        pick = len(rows) - 1
        if rtt is not None and interval > 0 and rtt >= spec.packet_interval_ms:
            # Accepted late: the reply to an attempt that many intervals earlier.
            target = rows[-1].sent_at - math.floor(rtt / spec.packet_interval_ms) * interval
            pick = min(range(len(rows)), key=lambda i: (abs(rows[i].sent_at - target), -i))
        for i, r in enumerate(rows):
            if i == pick:
                out = ours(r, "acked", j, rtt_ms=rtt, ack_count=1)
                accepted[j] = out
                outs.append(out)
            else:
                outs.append(ours(r, "lost", j))
    tail = len(shape.kinds)
    outs += [ours(r, "lost", tail) for r in by_index.get(tail, [])]
    outs += [ours(r, "lost", -1) for r in unplaced]
    _attribute_duplicates(res, shape, outs, accepted, fit, spec)
    slots = res.slots or []
    outs += [
        _Out("error", None, float(pos) if exact else None, error=slots[pos].error)
        for pos, exact in zip(shape.errors, shape.error_exact, strict=True)
    ]
    requests = sum(1 for o in outs if o.outcome != "error")
    for _ in range(max(0, spec.packets - len(shape.errors) - requests)):
        outs.append(_Out("unanswered", nominal_len(spec)))
    # An inconsistent fit can place more requests than the run sent: our
    # replies are facts, the unanswered placeholders go first.
    surplus = sum(1 for o in outs if o.outcome != "error") - (spec.packets - len(shape.errors))
    while surplus > 0 and any(o.outcome == "unanswered" for o in outs):
        outs.remove(next(o for o in reversed(outs) if o.outcome == "unanswered"))
        surplus -= 1
    if not whole:
        for o in outs:
            if o.reply is None:
                o.ip_len = None  # a split no reply of ours tells
    return outs


def nominal_len(spec: MeasurementSpec) -> int | None:
    """ip_len of an outcome without a reply of ours: the request's for whole
    sizes (the view's ``unanswered`` column), unknown for a split."""
    return spec.request_len if spec.phase == WHOLE else None


def _event_times(
    res: ParsedResult, shape: _Shape, accepted: Mapping[int, _Out], fit: _Fit, spec: MeasurementSpec
) -> list[float | None]:
    """When each x/rtt/error entry was written, on the responder's clock: an
    x when its packet's timer fired, an rtt when its reply came back (our
    reply's time plus the round trip); unknown for an error."""
    times: list[float | None] = [None] * len(res.slots or [])
    for j, pos in enumerate(shape.positions):
        out = accepted.get(j)
        if shape.kinds[j] == TIMEOUT:
            if fit.anchor is not None and shape.exact(j):
                times[pos] = fit.anchor + (pos + 1) * spec.interval_s
        elif out is not None and out.reply is not None:
            times[pos] = out.reply.sent_at + (out.rtt_ms or 0.0) / 2000.0
    return times


def _attribute_duplicates(
    res: ParsedResult,
    shape: _Shape,
    outs: list[_Out],
    accepted: Mapping[int, _Out],
    fit: _Fit,
    spec: MeasurementSpec,
) -> None:
    """A duplicate entry is a late reply when the sequence number it
    answered had passed: with an RTT of at least the packet interval it
    belongs to a lost reply of an earlier sequence number; with a shorter
    one, right after a reply the probe accepted from an earlier attempt (an
    RTT above the interval), to a re-send of that sequence number (a copy
    of the accepted reply would have the accepted one's RTT). That lost
    reply turns ``late``. Other duplicates are copies of a reply that
    arrived (a duplicated packet), counted in its ``ack_count``."""
    events = _event_times(res, shape, accepted, fit, spec)
    slots = res.slots or []
    interval_ms = spec.packet_interval_ms
    for before, rtt in res.dups:
        current = sum(1 for s in slots[:before] if s.kind != ERROR)
        if rtt is None:
            continue
        near = accepted.get(current - 1)
        if rtt >= interval_ms:
            lost = [o for o in outs if o.outcome in ("lost", "late") and 0 <= o.seq_index < current]
        elif near is not None and near.reply is not None and (near.rtt_ms or 0.0) >= interval_ms:
            first = near.reply.sent_at
            lost = [
                o
                for o in outs
                if o.outcome == "lost"
                and o.seq_index == current - 1
                and o.reply is not None
                and o.reply.sent_at > first
            ]
        else:
            lost = []
        if lost:
            # It came back between the entries around it: its request
            # left about ``rtt`` before that.
            prev = next((t for t in reversed(events[:before]) if t is not None), None)
            nxt = next((t for t in events[before:] if t is not None), None)
            known = [t for t in (prev, nxt) if t is not None]
            if known:
                sent = sum(known) / len(known) - rtt / 1000.0
            else:
                sent = max(o.reply.sent_at for o in lost if o.reply is not None)
            # A reply is late once: a lost one not yet late first.
            o = min(
                lost,
                key=lambda o: (
                    o.outcome == "late",
                    abs((o.reply.sent_at if o.reply else 0.0) - sent),
                ),
            )
            o.outcome = "late"
            o.ack_count += 1
            if o.rtt_ms is None:
                o.rtt_ms = rtt
            continue
        acked = [o for o in outs if o.outcome in ("acked", "late")]
        if acked:
            (near if near is not None else acked[-1]).ack_count += 1


def _no_log(res: ParsedResult, spec: MeasurementSpec) -> list[_Out]:
    """No reply of ours at all: the entries as the probe saw them, none in a
    drop rate (without our log an rtt may have been the kernel's reply)."""
    outs: list[_Out] = []
    for pos, s in enumerate(res.slots or []):
        if s.kind == REPLY:
            outs.append(_Out("acked", None, float(pos), rtt_ms=s.rtt_ms, ack_count=1))
        elif s.kind == TIMEOUT:
            outs.append(_Out("unanswered", None, float(pos)))
        else:
            outs.append(_Out("error", None, float(pos), error=s.error))
    for _ in range(max(0, spec.packets - len(outs))):
        outs.append(_Out("unanswered", None))
    return outs


def _aggregate(
    res: ParsedResult, run: LoggedRun | None, spec: MeasurementSpec, nominal: int
) -> list[_Out]:
    """Firmware that reported only counts: as many outcomes as it allows."""
    sent = res.sent or 0
    rcvd = min(res.rcvd or 0, sent)
    replied = len(run.replies) if run is not None else rcvd
    replied = min(max(replied, rcvd), sent)
    ip_len = nominal if spec.phase == WHOLE and run is not None else None
    return (
        [_Out("acked", ip_len, ack_count=1) for _ in range(rcvd)]
        + [_Out("lost", ip_len) for _ in range(replied - rcvd)]
        + [_Out("unanswered", nominal_len(spec)) for _ in range(sent - replied)]
    )


def _rows(res: ParsedResult, spec: MeasurementSpec, outs: list[_Out]) -> list[OutcomeRow]:
    """Each outcome gets a distinct packet slot: the one its time (or its
    entry) says where it can, the free ones in order for the rest."""
    n = max(spec.packets, len(outs))
    free = set(range(n))
    slot: dict[int, int] = {}
    wanted = sorted(
        (i for i, o in enumerate(outs) if o.want_slot is not None),
        key=lambda i: (outs[i].want_slot, i),
    )
    for i in wanted:
        w = outs[i].want_slot
        assert w is not None
        k = min(free, key=lambda s: (abs(s - w), s))
        slot[i] = k
        free.discard(k)
    rest = sorted(free)
    for i in range(len(outs)):
        if i not in slot:
            slot[i] = rest.pop(0)
    result_at = datetime.fromtimestamp(res.timestamp, UTC)
    rows = [
        OutcomeRow(
            msm_id=res.msm_id,
            prb_id=res.prb_id,
            result_at=result_at,
            packet_index=slot[i],
            campaign_id=spec.campaign_id,
            phase=spec.phase,
            ip_len=o.ip_len,
            outcome=o.outcome,
            rtt_ms=o.rtt_ms,
            ack_count=o.ack_count,
            icmp_seq=o.reply.icmp_seq if o.reply else None,
            replied_at=datetime.fromtimestamp(o.reply.sent_at, UTC) if o.reply else None,
            error=o.error,
            attempt=o.reply.attempt if o.reply else None,
        )
        for i, o in enumerate(outs)
    ]
    return sorted(rows, key=lambda r: r.packet_index)


def invalid_row(
    bad: ResultInvalid | ParsedResult, spec: MeasurementSpec, origin: str, reason: str
) -> ResultRow:
    """The row of a result of ours that could not be read or joined."""
    raw = bad.raw
    return ResultRow(
        msm_id=bad.msm_id,
        prb_id=bad.prb_id,
        result_at=datetime.fromtimestamp(bad.timestamp, UTC),
        campaign_id=spec.campaign_id,
        firmware=_int(raw.get("fw")),
        from_address=None,
        dst_address=None,
        size=None,
        sent=None,
        rcvd=None,
        dup=None,
        join_status="invalid",
        raw=raw,
        stored_at=_stored_at(raw),
        origin=origin,
        join_error=reason[:MAX_ERROR_CHARS],
    )


def _stored_at(raw: Mapping[str, Any]) -> datetime | None:
    t = _int(raw.get("stored_timestamp"))
    return datetime.fromtimestamp(t, UTC) if t else None


def join(
    results: Sequence[ParsedResult],
    replies: Iterable[LoggedReply],
    spec: MeasurementSpec,
    probe_addresses: Mapping[int, str | None],
    origin: str = "fetch",
) -> tuple[list[ResultRow], list[OutcomeRow]]:
    """Every result joined on its own (``join_one``); one that cannot be is
    ``invalid``, never an exception."""
    log_index = LogIndex(replies)
    rows: list[ResultRow] = []
    outcomes: list[OutcomeRow] = []
    for res in results:
        try:
            row, outs = join_one(res, log_index, spec, probe_addresses, origin)
        except Exception as exc:  # a bug must cost one result, not the window
            log.exception("result of probe %s at %s cannot be joined", res.prb_id, res.timestamp)
            reason = (
                "could not be joined to the reply log (a fault of this program, logged with "
                f"its traceback): {type(exc).__name__}: {exc}"
            )
            rows.append(invalid_row(res, spec, origin, reason))
            continue
        rows.append(row)
        outcomes.extend(outs)
    return rows, outcomes
