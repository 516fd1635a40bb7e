"""The engine core's side of issue 11, on a simulated clock: flow control of
the split phase by the client's REPORTs, invalid probes from the ranges it
names, the grace before a flow-controlled run completes; and issue 16's split
credit that cannot deadlock (``IN_FLIGHT``): a split that times out frees its
credit as an acknowledged one does, so a path that drops every fragment runs
the split phase at the pace of its window."""

from __future__ import annotations

import heapq
import math
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

import pytest
from kickass_core import wire
from kickass_core.plan import ProbePlan
from kickass_server.policy import Policy
from kickass_server.probe_core import (
    IN_FLIGHT,
    REPORT_GRACE_S,
    OutcomeBatch,
    RunFinished,
    SendProbe,
    _cover,
    _uncovered,
)
from test_engine_core import Sim, Volunteer

# 4 repetitions of 8 whole sizes and 6 splits: seqs 0..31 whole, 32..55 split.
PLAN = ProbePlan.build(repetitions=4, step=256, window=4)
SPLIT0 = PLAN.split_from


class Credited(Volunteer):
    """A volunteer whose client announced flow control at admission."""

    def __init__(
        self, sim: Sim, plan: ProbePlan, credit: int, credit_mode: str | None = None
    ) -> None:
        self.sim = sim
        self.addr = ("198.51.100.7", 40000)
        new = sim.core.admit(
            sim.now, plan, self.addr[0], split_credit=credit, credit_mode=credit_mode
        )
        sim.core.register(sim.now, new.session_id)
        self.sid = new.session_id
        self.tag = bytes.fromhex(new.session_id)
        self.cookie = new.cookie
        self.plan = plan
        self.measured = 0
        self.report_seq = 0

    def report(self, limit: int, invalid=(), addr=None, seq=None, refused=0, memory=1000):  # noqa: ANN001, ANN201
        self.report_seq += 1
        msg = wire.Report(
            self.tag,
            self.report_seq if seq is None else seq,
            split_limit=limit,
            frag_memory=memory,
            frag_high_thresh=4 << 20,
            refused=refused,
            invalid=tuple(invalid),
        )
        return self.send(msg.encode(), addr)


def run_acking(sim: Sim, v: Volunteer, lose: AbstractSet[int] = frozenset()) -> None:
    sim.on_probe = lambda p: None if p.seq in lose else v.ack(p.seq)


def test_no_split_beyond_the_credit_until_a_report_raises_it() -> None:
    sim = Sim()
    v = Credited(sim, PLAN, credit=3)
    run_acking(sim, v)
    v.handshake()
    sim.advance(1.0)
    assert v.probes() == list(range(SPLIT0 + 3))  # whole phase, then 3 splits
    assert v.snap().split_limit == SPLIT0 + 3
    # A report from another address or a stale one changes nothing.
    v.report(SPLIT0 + 10, addr=("198.51.100.7", 40001))
    v.report(SPLIT0 + 3, seq=5)
    v.report(SPLIT0 + 10, seq=4)
    sim.advance(1.0)
    assert len(v.probes()) == SPLIT0 + 3
    v.report(SPLIT0 + 8, seq=6)
    sim.advance(1.0)
    assert v.probes() == list(range(SPLIT0 + 8))
    v.report(wire.NO_LIMIT, seq=7)
    sim.advance(1.0)
    assert v.probes() == list(range(PLAN.total_probes))
    assert sim.core.stats()["counters"]["stale_reports"] == 1


def test_a_flow_controlled_run_completes_after_the_report_grace() -> None:
    sim = Sim()
    v = Credited(sim, PLAN, credit=100)
    run_acking(sim, v)
    v.handshake()
    sim.advance(0.01)
    assert v.snap().sent == PLAN.total_probes and v.finished() is None
    sim.advance(REPORT_GRACE_S)
    done = v.finished()
    assert done is not None and done.state == "complete" and done.verdict == "fragments-ok"
    assert done.reassembly["initial_credit"] == 100
    # A plain run (no credit announced) completes at once (covered in
    # test_engine_core); the grace costs a flow-controlled client half a second.


def test_refused_ranges_make_lost_probes_invalid_not_lost() -> None:
    sim = Sim()
    v = Credited(sim, PLAN, credit=100)
    lose = {SPLIT0 + i for i in range(6)}  # the first round of splits
    run_acking(sim, v, lose)
    v.handshake()
    while v.snap().sent < PLAN.total_probes or v.snap().outstanding:
        sim.advance(0.01)  # until the lost ones time out
    assert v.finished() is None  # the grace: the client's last word may come
    v.report(wire.NO_LIMIT, invalid=[(SPLIT0 + 2, SPLIT0 + 9)], refused=4)
    sim.advance(REPORT_GRACE_S)
    done = v.finished()
    assert done is not None
    rows = v.rows()
    invalid = {s for s, e in rows.items() if e.reassembly_invalid}
    assert invalid == {SPLIT0 + 2, SPLIT0 + 3, SPLIT0 + 4, SPLIT0 + 5}  # acked ones stay valid
    assert all(rows[s].outcome == "lost" for s in invalid)
    assert done.reassembly["invalid"] == {"whole": 0, "split": 4}
    assert done.reassembly["refused"] == 4
    # 4 of 24 splits invalid: more than 5%, so the verdict says why.
    assert done.verdict == "inconclusive" and "refused fragments" in done.verdict_reason


def test_a_late_ack_of_an_invalid_probe_makes_it_valid_again() -> None:
    sim = Sim()
    v = Credited(sim, PLAN, credit=100)
    lose = {SPLIT0}
    run_acking(sim, v, lose)
    v.handshake()
    sim.advance(0.2)  # SPLIT0 timed out
    v.report(wire.NO_LIMIT, invalid=[(SPLIT0, SPLIT0 + 1)])
    assert v.snap().invalid["split"] == 1
    v.ack(SPLIT0)  # it did arrive after all: late, not invalid
    assert v.snap().invalid["split"] == 0
    sim.advance(REPORT_GRACE_S + 0.1)
    row = v.rows()[SPLIT0]
    assert row.outcome == "late" and not row.reassembly_invalid


def test_credit_waits_are_accounted() -> None:
    sim = Sim()
    v = Credited(sim, PLAN, credit=0)
    run_acking(sim, v)
    v.handshake()
    sim.advance(0.5)
    v.report(SPLIT0)  # still no credit: the client's memory is full
    sim.advance(2.0)
    v.report(wire.NO_LIMIT)
    sim.advance(1.0)
    done = v.finished()
    assert done is not None
    assert done.reassembly["credit_waits"] == 1
    assert 2.0 <= done.reassembly["credit_wait_s"] <= 2.6
    assert sim.core.stats()["counters"]["credit_waits"] == 1


def test_reports_of_a_client_that_announced_nothing_start_flow_control() -> None:
    sim = Sim()
    v = Volunteer(sim, PLAN)
    v.handshake()  # four whole probes out, not acknowledged yet
    v.send(wire.Report(v.tag, 1, split_limit=SPLIT0 + 1).encode())
    run_acking(sim, v)
    for seq in v.probes():
        v.ack(seq)
    sim.advance(1.0)
    assert v.probes() == list(range(SPLIT0 + 1))
    batches = [b for b in sim.of(OutcomeBatch) if b.session_id == v.sid]
    assert batches and not any(e.reassembly_invalid for b in batches for e in b.entries)
    assert all(isinstance(a, SendProbe) for a in sim.of(SendProbe))


def test_ranges_are_walked_once() -> None:
    ranges: list[tuple[int, int]] = []
    assert _uncovered(ranges, 10, 20) == [(10, 20)]
    _cover(ranges, 10, 20)
    _cover(ranges, 30, 40)
    assert _uncovered(ranges, 5, 45) == [(5, 10), (20, 30), (40, 45)]
    assert _uncovered(ranges, 12, 18) == []
    _cover(ranges, 18, 31)
    assert ranges == [(10, 40)]


def test_a_repeated_report_records_nothing_again() -> None:
    sim = Sim()
    v = Credited(sim, PLAN, credit=100)
    run_acking(sim, v, {SPLIT0, SPLIT0 + 1})
    v.handshake()
    sim.advance(0.2)
    v.report(wire.NO_LIMIT, invalid=[(SPLIT0, SPLIT0 + 4)])
    sim.take(sim.core.flush())
    before = sum(len(b.entries) for b in sim.of(OutcomeBatch))
    for _ in range(20):
        v.report(wire.NO_LIMIT, invalid=[(SPLIT0, SPLIT0 + 4)])
    sim.take(sim.core.flush())
    assert sum(len(b.entries) for b in sim.of(OutcomeBatch)) == before
    assert v.snap().invalid["split"] == 2


# -- IN_FLIGHT credit (issue 16 item 1) ---------------------------------------------------


@pytest.mark.parametrize("fate", ["acknowledged", "timed out"])
def test_in_flight_a_timed_out_split_frees_its_credit_as_an_acknowledged_one(fate: str) -> None:
    """One credit: one split in flight. However the split in flight is
    resolved, the next goes at that instant, and the credit binds again."""
    sim = Sim()
    v = Credited(sim, PLAN, credit=1, credit_mode=IN_FLIGHT)
    sent_at: dict[int, float] = {}

    def client(p: SendProbe) -> None:
        sent_at[p.seq] = sim.now
        if p.seq < SPLIT0:
            v.ack(p.seq)  # every whole probe, at once

    sim.on_probe = client
    v.handshake()
    run = sim.core.runs[v.sid]
    for seq in range(SPLIT0, PLAN.total_probes):
        assert v.probes() == list(range(seq + 1)), seq  # this split, none beyond
        assert run.splits_in_flight() == 1 and run.credit_blocked()
        if fate == "acknowledged":
            sim.advance(0.03)  # within the timeout (at least 50 ms)
            resolved = sim.now
            v.ack(seq)
        else:
            timeout = run.rtt.timeout
            while seq in run.outstanding:  # to its timeout, deadline by deadline
                deadline = sim.core.next_deadline()
                assert deadline is not None
                sim.now = deadline
                sim.timers()
            resolved = sent_at[seq] + timeout
        if seq + 1 < PLAN.total_probes:
            assert sent_at[seq + 1] == pytest.approx(resolved, abs=1e-9), (seq, fate)
    sim.advance(REPORT_GRACE_S + 0.1)
    done = v.finished()
    assert done is not None and done.state == "complete"
    splits = PLAN.total_probes - SPLIT0
    snap = v.snap()
    assert snap.phase_sent["split"] == splits
    assert snap.phase_acked["split"] == (splits if fate == "acknowledged" else 0)
    rows = v.rows()
    lost = sum(1 for seq in range(SPLIT0, PLAN.total_probes) if rows[seq].outcome == "lost")
    assert lost == (0 if fate == "acknowledged" else splits)  # every split accounted


@dataclass
class SplitPhase:
    """What a path did to the split phase: when each split left, how it ended."""

    sends: list[float] = field(default_factory=list)
    max_in_flight: int = 0
    timeout: float = math.nan
    finished: RunFinished | None = None
    end: float = math.nan  # when the simulation stopped

    def per_second(self) -> list[int]:
        """Splits sent in each whole simulated second from the first split
        to the last (a finished run) or to the end of the simulation."""
        start = self.sends[0]
        seconds = int((self.sends[-1] if self.finished else self.end) - start)
        counts = [0] * seconds
        for t in self.sends:
            i = int(t - start)
            if i < seconds:
                counts[i] += 1
        return counts


def split_phase(
    *,
    drop_splits: bool,
    credit: int,
    credit_mode: str | None = IN_FLIGHT,
    window: int = 8,
    rtt: float = 0.1,
    limit_s: float = 120.0,
) -> SplitPhase:
    """A fixed-window plan of 600 splits behind a path of ``rtt`` that drops
    every split (or none), and a client whose reassembly memory stays empty:
    every 50 ms a REPORT with ``credit`` credits (IN_FLIGHT: split_from +
    credit; the absolute mode: past the highest seq received)."""
    plan = ProbePlan.build(repetitions=100, step=256, window=window)
    sim = Sim(Policy(max_session_s=10**6, silence_timeout_s=10**6))
    v = Credited(sim, plan, credit=credit, credit_mode=credit_mode)
    out = SplitPhase()
    acks: list[tuple[float, int]] = []  # (arrival at the server, seq)
    highest = -1

    def path(p: SendProbe) -> None:
        if p.seq >= plan.split_from:
            out.sends.append(sim.now)
            run = sim.core.runs[v.sid]
            out.max_in_flight = max(out.max_in_flight, run.splits_in_flight())
            if drop_splits:
                return
        heapq.heappush(acks, (sim.now + rtt, p.seq))

    sim.on_probe = path
    v.handshake(rtt)
    next_report = sim.now
    end = sim.now + limit_s
    while v.finished() is None and sim.now < end:
        deadline = sim.core.next_deadline()
        t = min(math.inf if deadline is None else deadline, next_report)
        if acks:
            t = min(t, acks[0][0])
        sim.now = max(sim.now, min(t, end))
        if acks and acks[0][0] <= sim.now:
            _, seq = heapq.heappop(acks)
            highest = max(highest, seq)
            v.ack(seq)
        elif next_report <= sim.now:
            if credit_mode == IN_FLIGHT:
                v.report(plan.split_from + credit)
            else:
                v.report(max(highest + 1, plan.split_from) + credit)
            next_report += 0.05
        elif deadline is not None and deadline <= sim.now:
            sim.timers()
    if sim.core.runs.get(v.sid) is not None:
        out.timeout = sim.core.runs[v.sid].rtt.timeout
    out.finished = v.finished()
    out.end = sim.now
    return out


def test_in_flight_a_path_dropping_every_split_sends_at_the_windows_pace() -> None:
    """8 probes in flight at 100 ms RTT. A clean path resolves each split in
    one RTT: 80 splits a second. A path that drops every split resolves each
    at its timeout (2 x SRTT + 4 x RTTVAR, about 200 ms once the whole phase
    has measured a steady RTT): 8 / 0.2 = 40 a second, every second, so the
    600 splits take at most twice as long. The credit (64) never binds."""
    clean = split_phase(drop_splits=False, credit=64)
    dropped = split_phase(drop_splits=True, credit=64)
    for phase in (clean, dropped):
        assert phase.finished is not None and phase.finished.state == "complete"
        assert len(phase.sends) == 600 and phase.max_in_flight <= 8
    timeout = dropped.timeout
    assert 0.2 <= timeout < 0.21
    # Each of the 8 slots of the window sends once per timeout.
    low, high = 8 * math.floor(1 / timeout), 8 * math.ceil(1 / timeout)
    assert all(low <= n <= high for n in dropped.per_second()), dropped.per_second()
    assert all(n == 80 for n in clean.per_second()), clean.per_second()
    took = dropped.sends[-1] - dropped.sends[0]
    took_clean = clean.sends[-1] - clean.sends[0]
    assert took <= 2 * took_clean * timeout / 0.2 + timeout, (took, took_clean)


def test_in_flight_credit_below_the_window_paces_a_dropping_path_by_the_credit() -> None:
    dropped = split_phase(drop_splits=True, credit=3)
    assert dropped.finished is not None and dropped.finished.state == "complete"
    assert len(dropped.sends) == 600 and dropped.max_in_flight == 3
    low, high = 3 * math.floor(1 / dropped.timeout), 3 * math.ceil(1 / dropped.timeout)
    assert all(low <= n <= high for n in dropped.per_second()), dropped.per_second()


def test_an_absolute_limit_stalls_on_a_path_dropping_every_split() -> None:
    """The control: the older absolute limit (highest seq received + 1 +
    credits) on the same path sends its first credits of splits and then
    nothing, as issue 16 found; the per-second count above sees that."""
    stalled = split_phase(drop_splits=True, credit=64, credit_mode=None, limit_s=30.0)
    assert stalled.finished is None and len(stalled.sends) == 64
    per_second = stalled.per_second()
    assert len(per_second) >= 15 and per_second[2:] == [0] * (len(per_second) - 2)
