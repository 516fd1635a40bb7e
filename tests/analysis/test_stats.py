"""The statistics module against known answers."""

from __future__ import annotations

import math
import random

import numpy as np
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


def test_the_interval_is_over_clusters_and_needs_two() -> None:
    # Two period pairs whose flows all say 1.1 and 0.9: the flows agree
    # within each pair, the pairs do not, and the interval is the pairs'.
    pairs = [(100.0, 110.0)] * 50 + [(100.0, 90.0)] * 50
    labels = ["p0"] * 50 + ["p1"] * 50
    by_pair = stats.speedup(pairs, labels)
    by_flow = stats.speedup(pairs)
    assert by_pair.clusters == 2 and by_flow.clusters == 100
    assert by_pair.estimate == pytest.approx(math.sqrt(1.1 * 0.9))
    assert by_pair.low < 0.9 and by_pair.high > 1.1  # t with 1 degree of freedom: wide
    assert 0.97 < by_flow.low < by_flow.high < 1.02  # flows as independent: falsely sure
    # One period pair: the arms' difference and that period's conditions are
    # one thing; no interval.
    one = stats.speedup(pairs, ["p0"] * 100)
    assert one.clusters == 1 and one.estimate is not None and one.low is one.high is None
    # Failed flows leave their cluster's count, not the cluster.
    failed = stats.speedup([(None, 1.0), (1.0, 2.0), (1.0, 2.0)], ["a", "b", "c"])
    assert failed.clusters == 2 and failed.matched == 2
    with pytest.raises(ValueError, match="cluster labels"):
        stats.speedup(pairs, labels[:3])


def _percentile_bootstrap(means: np.ndarray, rng: np.random.Generator) -> tuple[float, float]:
    draws = means[rng.integers(0, len(means), size=(2000, len(means)))].mean(axis=1)
    low, high = np.percentile(draws, [2.5, 97.5])
    return float(low), float(high)


@pytest.mark.parametrize("clusters", [3, 8])
def test_the_interval_covers_what_it_claims(clusters: int) -> None:
    """Simulated A/A trials, true speedup 1: each period pair shifts its
    flows' log ratio by a period effect (sd 0.03: the machine's load, cross
    traffic), each flow by its own noise (sd 0.1). The 95% interval must
    contain 1 in 95% of trials (within 2 points: 1,000 trials give a
    binomial sd of 0.7 points). The two intervals it replaced do not: flows
    treated as independent, and a percentile bootstrap over few pairs."""
    rng = np.random.default_rng(20261127)
    flows, trials = 40, 1000
    covered = naive = boot = 0
    for _ in range(trials):
        shift = np.repeat(rng.normal(0, 0.03, clusters), flows)
        logs = shift + rng.normal(0, 0.1, clusters * flows)
        ka = rng.uniform(50, 500, clusters * flows)
        pairs = list(zip(ka.tolist(), (ka * np.exp(logs)).tolist(), strict=True))
        labels = np.repeat(np.arange(clusters), flows).tolist()
        s = stats.speedup(pairs, labels)
        covered += s.low <= 1.0 <= s.high
        n = stats.speedup(pairs)
        naive += n.low <= 1.0 <= n.high
        low, high = _percentile_bootstrap(logs.reshape(clusters, flows).mean(axis=1), rng)
        boot += low <= 0.0 <= high
    assert 0.93 <= covered / trials <= 0.97, covered
    assert naive / trials < 0.75, naive  # 0.64 (3 clusters), 0.67 (8) here
    if clusters == 3:
        assert boot / trials < 0.85, boot  # 0.72 here: the 27 resamples' extremes


def test_ecdf() -> None:
    xs, ys = stats.ecdf([0.5, None, 1.0, 0.0, float("nan")])
    assert xs == [0.0, 0.5, 1.0] and ys == pytest.approx([1 / 3, 2 / 3, 1.0])
