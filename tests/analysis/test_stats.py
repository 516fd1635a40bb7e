"""The statistics module against known answers."""

from __future__ import annotations

import math
import random

import pytest
from kickass_analysis import stats


def test_wilson_known_answers() -> None:
    # k = 0 of n: [0, z^2 / (n + z^2)].
    low, high = stats.wilson(0, 10)
    assert low == 0.0 and high == pytest.approx(3.8415 / 13.8415, abs=1e-4)
    # Symmetric around 1/2 at k = n/2; the textbook 95% interval of 50/100.
    low, high = stats.wilson(50, 100)
    assert (low, high) == (pytest.approx(0.4038, abs=1e-4), pytest.approx(0.5962, abs=1e-4))
    assert stats.wilson(10, 10)[1] == pytest.approx(1.0)
    assert all(math.isnan(x) for x in stats.wilson(0, 0))


def test_drop_rates_carry_their_intervals() -> None:
    r = stats.drop(200, 150)
    assert (r.sent, r.lost, r.rate) == (200, 50, 0.25)
    assert r.low < 0.25 < r.high
    rows = stats.with_intervals([{"ip_len": 44, "sent": 10, "acked": 10}])
    assert rows[0]["drop_low"] == 0.0 and 0 < rows[0]["drop_high"] < 0.31


def test_buckets_are_the_views() -> None:
    assert [stats.size_bucket(n) for n in (1, 10, 11, 100, 101, 1000, 1001)] == [
        "1-10", "1-10", "11-100", "11-100", "101-1000", "101-1000", "1001+",
    ]  # fmt: skip


def test_fct_summary_counts_failures_as_censored() -> None:
    s = stats.fct_summary([100.0, 200.0, None, 300.0])
    assert (s.flows, s.completed, s.completion_rate) == (4, 3, 0.75)
    assert s.mean_ms == pytest.approx(200.0) and s.p50_ms == pytest.approx(200.0)
    empty = stats.fct_summary([None, None])
    assert empty.completed == 0 and empty.mean_ms is None


def test_speedup_on_matched_flows() -> None:
    rng = random.Random(4)
    # Kick-Ass FCT k, the baseline 2k with 10% noise: the geometric mean is 2.
    pairs = [
        (k, 2 * k * math.exp(rng.gauss(0, 0.1))) for k in (rng.uniform(50, 500) for _ in range(400))
    ]
    s = stats.speedup(pairs)
    assert s.matched == s.pairs == 400
    assert s.estimate == pytest.approx(2.0, rel=0.02)
    assert s.low < 2.0 < s.high and s.high - s.low < 0.05
    # Identical arms: exactly 1, an interval of width 0.
    same = stats.speedup([(x, x) for x in (10.0, 20.0, 30.0)])
    assert same.estimate == pytest.approx(1.0) and same.low == pytest.approx(1.0)


def test_a_failure_on_either_side_leaves_the_ratio_and_shows_in_completion() -> None:
    s = stats.speedup([(100.0, 200.0), (None, 200.0), (100.0, None), (50.0, 100.0)])
    assert (s.matched, s.pairs) == (2, 4)
    assert s.estimate == pytest.approx(2.0)
    assert s.completion_kickass == 0.75 and s.completion_baseline == 0.75
    none = stats.speedup([(None, 1.0)])
    assert none.estimate is None and none.completion_kickass == 0.0


def test_the_bootstrap_is_reproducible() -> None:
    pairs = [(float(i), float(i) * (1.5 + (i % 7) / 10)) for i in range(1, 60)]
    assert stats.speedup(pairs) == stats.speedup(pairs)


def test_ecdf() -> None:
    xs, ys = stats.ecdf([0.5, None, 1.0, 0.0, float("nan")])
    assert xs == [0.0, 0.5, 1.0] and ys == pytest.approx([1 / 3, 2 / 3, 1.0])
