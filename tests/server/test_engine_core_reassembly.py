"""The engine core's side of issue 11, on a simulated clock: flow control of
the split phase by the client's REPORTs, invalid probes from the ranges it
names, the grace before a flow-controlled run completes."""

from __future__ import annotations

from kickass_core import wire
from kickass_core.plan import ProbePlan
from kickass_server.probe_core import (
    REPORT_GRACE_S,
    OutcomeBatch,
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

    def __init__(self, sim: Sim, plan: ProbePlan, credit: int) -> None:
        self.sim = sim
        self.addr = ("198.51.100.7", 40000)
        new = sim.core.admit(sim.now, plan, self.addr[0], split_credit=credit)
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


def run_acking(sim: Sim, v: Volunteer, lose: set[int] = frozenset()) -> None:  # noqa: B006
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
