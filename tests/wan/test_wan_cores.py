"""Pure cores of the wide-area trials: workload, schedule, spool (no sockets, no clock)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kickass_wan.trials.schedule import KICKASS, TCP, interleaved
from kickass_wan.trials.spool import Spool
from kickass_wan.trials.workload import Workload, flows


def test_paper_workload_has_the_papers_moments() -> None:
    w = Workload(seed=7, mean_gap_s=0.01)
    sizes = [f.size_packets for f in flows(w, duration_s=400.0)]
    assert len(sizes) > 30_000
    assert min(sizes) >= 1 and max(sizes) <= 2000
    # Heavy tail: the mean is ~100 packets though most flows are small.
    assert 90 <= statistics.fmean(sizes) <= 110, statistics.fmean(sizes)
    # Pareto's median is x_m * 2^(1/shape), rounded up to whole packets.
    want = math.ceil(w.scale() * 2 ** (1 / w.shape))
    assert abs(statistics.median(sizes) - want) <= 2, (statistics.median(sizes), want)
    assert statistics.median(sizes) < statistics.fmean(sizes)  # right-skewed
    assert max(sizes) == 2000  # the bound is reached
    # The floor every result states: the scale that gives a mean of 100 is
    # 45.7 packets, so no flow is shorter than 46 though the range reads 1..2000.
    assert w.scale() == pytest.approx(45.68, abs=0.01)
    assert min(sizes) == math.ceil(w.scale()) == 46


def test_literal_workload_is_the_papers_range_as_documented() -> None:
    """Workload.literal(): 1..2000 packets, shape 1.8, scale 1, sizes rounded
    down, so P(size >= k) = k^-1.8 for every whole k and the mean is
    sum(k^-1.8, k = 1..2000) = 1.88 packets; a drawn workload has them."""
    w = Workload.literal(seed=7, mean_gap_s=0.01)
    assert (w.min_packets, w.max_packets, w.shape, w.scale()) == (1, 2000, 1.8, 1.0)
    survival = {k: k**-1.8 for k in range(1, 2001)}  # P(size >= k)
    mean = sum(survival.values())
    assert w.mean_packets == pytest.approx(mean, rel=1e-12)
    assert 1.87 < w.mean_packets < 1.89
    sizes = [f.size_packets for f in flows(w, duration_s=400.0)]
    n = len(sizes)
    assert n > 30_000
    assert min(sizes) == 1 and max(sizes) <= 2000
    # The sample mean within 4 standard errors of the law's (E[S^2] = sum (2k - 1) P(S >= k)).
    variance = sum((2 * k - 1) * p for k, p in survival.items()) - mean**2
    assert abs(statistics.fmean(sizes) - mean) <= 4 * math.sqrt(variance / n)
    # The shape: the share of flows of at least k packets is k^-1.8, within 4 binomial SE.
    for k in (1, 2, 3, 4, 8, 16, 32):
        p = survival[k]
        share = sum(s >= k for s in sizes) / n
        assert abs(share - p) <= 4 * math.sqrt(p * (1 - p) / n) + 1e-12, (k, share, p)
    # Stored and rebuilt (as a trial's parameters are), it draws the same flows.
    again = Workload(**w.to_json())
    assert again == w and list(flows(again, 60.0, stream=3)) == list(flows(w, 60.0, stream=3))


def test_default_workload_parameters_are_stored_as_before() -> None:
    # Trials stored before sizes could be rounded down carry no "rounding":
    # the default still writes none, so their parameters (and the rollups'
    # grouping by workload) match today's, and rebuilding one draws the same flows.
    w = Workload(seed=11)
    assert "rounding" not in w.to_json()
    assert list(flows(Workload(**w.to_json()), 60.0, stream=1)) == list(flows(w, 60.0, stream=1))


def test_gaps_are_exponential_with_the_configured_mean() -> None:
    w = Workload(seed=3, mean_gap_s=0.5)
    starts = [f.start_s for f in flows(w, duration_s=5000.0)]
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert 0.47 <= statistics.fmean(gaps) <= 0.53
    # Exponential: the standard deviation equals the mean.
    assert 0.9 <= statistics.pstdev(gaps) / statistics.fmean(gaps) <= 1.1


def test_workload_is_reproducible_per_seed_and_stream() -> None:
    w = Workload(seed=11)
    assert list(flows(w, 60.0, stream=2)) == list(flows(w, 60.0, stream=2))
    assert list(flows(w, 60.0, stream=1)) != list(flows(w, 60.0, stream=2))


@pytest.mark.parametrize(
    "bad",
    [
        dict(shape=1.0),
        dict(min_packets=0),
        dict(mean_packets=5000),
        dict(mean_gap_s=0),
        dict(rounding="nearest"),
    ],
)
def test_bad_workloads_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        Workload(**bad)


@given(
    dests=st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=4, unique=True),
    pairs=st.integers(1, 20),
    seed=st.integers(0, 1000),
)
def test_schedule_interleaves_every_destination_in_pairs(
    dests: list[str], pairs: int, seed: int
) -> None:
    sched = interleaved(dests, pairs=pairs, period_s=120.0, seed=seed)
    assert len(sched) == 2 * pairs * len(dests)
    # Back to back, in time order.
    for a, b in zip(sched, sched[1:], strict=False):
        assert b.start_s == pytest.approx(a.start_s + 120.0)
    for dest in dests:
        mine = [p for p in sched if p.destination == dest]
        for pair in range(pairs):
            assert sorted(p.protocol for p in mine if p.pair == pair) == [KICKASS, TCP]


def test_schedule_order_is_randomised_but_reproducible() -> None:
    firsts = [interleaved(["a"], pairs=1, seed=s)[0].protocol for s in range(200)]
    assert 70 <= firsts.count(KICKASS) <= 130
    assert interleaved(["a", "b"], pairs=5, seed=4) == interleaved(["a", "b"], pairs=5, seed=4)


def test_spool_keeps_records_until_confirmed(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "out")
    spool.put("trial", "t1", {"x": 1})
    for i in range(5):
        spool.put("flow", f"f{i}", {"i": i})
    assert spool.count() == 6
    again = Spool(tmp_path / "out")  # a restarted runner sees the same outbox
    assert [r["id"] for r in again.pending("flow")] == [f"f{i}" for i in range(5)]
    again.done("flow", ["f0", "f1", "nope"])
    assert [r["id"] for r in again.pending()] == ["t1", "f2", "f3", "f4"]
    spool.put("flow", "f2", {"i": 2, "again": True})  # re-put replaces, never duplicates
    assert sum(r["id"] == "f2" for r in spool.pending()) == 1
    with pytest.raises(ValueError):
        spool.put("flow", "../evil", {})


def test_a_closed_loop_draws_the_open_loops_flows_with_their_off_times() -> None:
    """The paper's on-off senders (III-B): the same draws as the open loop,
    each flow carrying the off time before it (from the previous flow's end)."""
    from dataclasses import replace

    from kickass_wan.trials.workload import pair_flows

    w = Workload(mean_packets=694.0, mean_gap_s=8.0, seed=13)
    closed = replace(w, loop="closed")
    a, b = pair_flows(w, 0, 90.0), pair_flows(closed, 0, 90.0)
    assert [(f.start_s, f.size_packets) for f in a] == [(f.start_s, f.size_packets) for f in b]
    assert all(f.off_s is None for f in a)
    offs = [f.off_s for f in b]
    assert offs[0] == pytest.approx(b[0].start_s)
    for prev, f in zip(b, b[1:], strict=False):
        assert f.off_s == pytest.approx(f.start_s - prev.start_s)
    assert closed.to_json()["loop"] == "closed" and "loop" not in w.to_json()
    assert closed.offered_load_bps() is None
    assert w.offered_load_bps() == pytest.approx(694.0 * 1440 * 8 / 8.0)
    with pytest.raises(ValueError, match="loop"):
        Workload(loop="sideways")


def test_the_arm_grammar() -> None:
    """kickass[:handshake][/cc][@tcpNN], tcp[:cc]: names keep what they named."""
    from kickass_wan.trials.schedule import parse_arms

    arms = parse_arms(
        ["kickass", "kickass/newreno", "kickass:paper/cubic", "kickass@tcp50", "tcp:cubic"]
    )
    assert [a.name for a in arms] == [
        "kickass", "kickass/newreno", "kickass:paper", "kickass@tcp50", "tcp:cubic",
    ]  # fmt: skip
    assert [a.transport_cc for a in arms] == ["cubic", "newreno", "cubic", "cubic", None]
    assert [a.tcp_share for a in arms] == [0, 0, 0, 0.5, 0]
    # A mixed arm's TCP flows run the trial's kernel congestion control.
    assert arms[3].congestion_control == "cubic" and arms[0].congestion_control is None
    for bad in ("kickass/bbr", "tcp/newreno", "tcp@tcp50", "kickass@tcp0", "kickass@tcp100"):
        with pytest.raises(ValueError):
            parse_arms([bad])


def test_an_arms_handshake_is_one_of_the_flow_records() -> None:
    """One tuple of handshakes, the flow record's: an arm and a round's settings
    take each and nothing else."""
    from typing import get_args

    from kickass_core import flow_record
    from kickass_wan.trials import schedule
    from kickass_wan.trials.service import RoundSettings

    assert schedule.HANDSHAKES is flow_record.HANDSHAKES  # type: ignore[attr-defined]  # the schedule's name, checked to be the core's
    arms = schedule.parse_arms([f"kickass:{hs}" for hs in flow_record.HANDSHAKES])
    assert [a.handshake for a in arms] == list(flow_record.HANDSHAKES)
    with pytest.raises(ValueError, match="handshake"):
        schedule.parse_arms(["kickass:other"])
    assert get_args(RoundSettings.model_fields["handshake"].annotation) == flow_record.HANDSHAKES


def test_the_congestion_controls_an_arm_names_are_defined_once() -> None:
    """The flow record's congestion controls (kickass_core.flow_record) are the arms',
    their grammar's and the server's: a TCP arm runs the kernel's, a Kick-Ass arm's
    TCP mode the transport's, CUBIC the default of both."""
    import re
    from typing import get_args

    from kickass_core import flow_record
    from kickass_server.schemas import TrialPeriod
    from kickass_wan.trials import schedule

    assert schedule.CONGESTION_CONTROLS is flow_record.CONGESTION_CONTROLS  # type: ignore[attr-defined]  # the schedule's name, checked to be the core's
    assert schedule.TRANSPORT_CONGESTION_CONTROLS is flow_record.TRANSPORT_CONGESTION_CONTROLS  # type: ignore[attr-defined]  # the schedule's name, checked to be the core's
    transport = flow_record.TRANSPORT_CONGESTION_CONTROLS
    kernel = flow_record.CONGESTION_CONTROLS
    arms = schedule.parse_arms(
        [f"kickass/{cc}" for cc in transport] + [f"tcp:{cc}" for cc in kernel]
    )
    assert [a.transport_cc for a in arms[: len(transport)]] == list(transport)
    assert [a.congestion_control for a in arms[len(transport) :]] == list(kernel)
    default = flow_record.DEFAULT_CONGESTION_CONTROL
    [ka, tcp] = schedule.default_arms()
    assert (ka.transport_cc, tcp.congestion_control) == (default, default)
    for cc in (*transport, *kernel):
        assert cc in schedule.ARM_GRAMMAR
    with pytest.raises(ValueError, match=re.escape(schedule.ARM_GRAMMAR)):
        schedule.parse_arms(["udp"])
    literal, _none = get_args(TrialPeriod.model_fields["transport_cc"].annotation)
    assert get_args(literal) == transport


def test_a_mixed_periods_tcp_flows_are_the_same_in_every_period_of_a_pair() -> None:
    from kickass_wan.trials.workload import pair_flows, tcp_share_indices

    w = Workload(seed=3)
    fl = pair_flows(w, 2, 200.0)
    half = tcp_share_indices(w, 2, fl, 0.5)
    assert half == tcp_share_indices(w, 2, fl, 0.5)
    assert 0.35 < len(half) / len(fl) < 0.65
    assert tcp_share_indices(w, 3, fl, 0.5) != half  # another pair, other flows
    assert tcp_share_indices(w, 2, fl, 0.0) == frozenset()
