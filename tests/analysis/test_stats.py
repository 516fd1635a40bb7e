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
    assert (low, high) == (pytest.approx(0.4038, abs=1e-4), pytest.approx(0.5962, abs=1e-4))  # type: ignore[comparison-overlap]  # approx equals a float
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


def test_sooner_without_failures_is_the_plain_paired_comparison() -> None:
    rng = random.Random(9)
    pairs = [(rng.uniform(50, 500), rng.uniform(50, 500)) for _ in range(300)]
    pairs += [(100.0, 100.0)] * 20  # ties count half
    labels = [i % 6 for i in range(len(pairs))]
    s = stats.sooner(pairs, labels)
    first = sum(k < b for k, b in pairs)
    assert s.estimate == pytest.approx((first + 0.5 * 20) / len(pairs))
    assert (s.pairs, s.clusters) == (320, 6)
    assert s.completion_kickass == s.completion_baseline == 1.0
    assert s.low < s.estimate < s.high
    # Identical arms: exactly one half, an interval of width 0.
    same = stats.sooner([(x, x) for x in (10.0, 20.0, 30.0)], ["a", "b", "c"])
    assert same.estimate == same.low == same.high == 0.5
    # Kick-Ass sooner in every flow: 1; a speedup above 1 in every flow agrees.
    faster = [(k, 2 * k) for k, _ in pairs]
    assert stats.sooner(faster, labels).estimate == 1.0
    assert stats.speedup(faster, labels).estimate == pytest.approx(2.0)


def test_sooner_ranks_a_flow_that_did_not_finish_slowest() -> None:
    s = stats.sooner([(None, 5.0), (5.0, None), (None, None), (1e6, 1.0)])
    # 0 (Kick-Ass failed), 1 (the baseline failed), a tie, 0 (a slow finish).
    assert s.estimate == pytest.approx(1.5 / 4)
    assert s.pairs == 4 and s.completion_kickass == 0.5 and s.completion_baseline == 0.5
    assert stats.sooner([]).estimate is None
    one = stats.sooner([(1.0, 2.0)] * 5, ["p0"] * 5)
    assert one.clusters == 1 and one.estimate == 1.0 and one.low is one.high is None
    with pytest.raises(ValueError, match="cluster labels"):
        stats.sooner([(1.0, 2.0)] * 5, ["p0"])


def _arms(
    rng: np.random.Generator, flows: int, ratio: float, fail_ka: float, fail_base: float
) -> list[tuple[float | None, float | None]]:
    """Matched flows: the baseline ``ratio`` times slower with noise; each
    arm's flow fails with its own probability."""
    ka = rng.uniform(50, 500, flows)
    base = ka * ratio * np.exp(rng.normal(0, 0.1, flows))
    ka_out = [None if f else float(x) for x, f in zip(ka, rng.random(flows) < fail_ka, strict=True)]
    base_out = [
        None if f else float(x) for x, f in zip(base, rng.random(flows) < fail_base, strict=True)
    ]
    return list(zip(ka_out, base_out, strict=True))


def test_when_one_arm_fails_flows_the_matched_speedup_and_sooner_diverge() -> None:
    """The matched speedup leaves out every pair with a failure, so it does
    not move when an arm fails flows; the share of flows finished sooner
    counts them against the arm that failed."""
    rng = np.random.default_rng(24)
    labels = np.repeat(np.arange(8), 100).tolist()
    even = _arms(rng, 800, 1.0, 0.0, 0.0)
    ka_fails = _arms(rng, 800, 1.0, 0.2, 0.0)
    base_fails = _arms(rng, 800, 1.0, 0.0, 0.2)
    for pairs in (even, ka_fails, base_fails):
        m = stats.speedup(pairs, labels)
        assert m.low < 1.0 < m.high  # matched: no difference, whoever fails
    s_even, s_ka, s_base = (stats.sooner(p, labels) for p in (even, ka_fails, base_fails))
    assert s_even.low < 0.5 < s_even.high
    assert s_ka.high < 0.5 and s_ka.estimate == pytest.approx(0.4, abs=0.04)
    assert s_base.low > 0.5 and s_base.estimate == pytest.approx(0.6, abs=0.04)
    # Kick-Ass 1.2x faster on the flows both finished, but it fails 60% of
    # them: the matched speedup says 1.2x, the flows say the baseline.
    flattered = _arms(rng, 800, 1.2, 0.6, 0.0)
    m = stats.speedup(flattered, labels)
    s = stats.sooner(flattered, labels)
    assert m.low > 1.1 and m.estimate == pytest.approx(1.2, rel=0.03)
    assert s.high < 0.5 and s.completion_kickass == pytest.approx(0.4, abs=0.05)


@pytest.mark.parametrize("clusters", [3, 8])
def test_the_sooner_interval_covers_what_it_claims(clusters: int) -> None:
    """As ``test_the_interval_covers_what_it_claims``, for ``sooner``: simulated
    A/A trials (the arms exchangeable, so the true share is 1/2), each
    period of a pair shifting its arm's log FCT (sd 0.03), each flow its
    own noise (sd 0.1), and failures: a flow fails when it takes longer than
    its limit (the slow ones: failures tied to speed) or at random (5%).
    The 95% interval must contain 1/2 in 95% of trials (within 2 points);
    flows treated as independent do not."""
    rng = np.random.default_rng(20261201)
    flows, trials = 40, 1000
    covered = naive = 0
    n = clusters * flows
    for _ in range(trials):
        size = rng.uniform(50, 500, n)
        limit = rng.uniform(300, 600, n)
        fcts = []
        for _arm in range(2):
            shift = np.repeat(rng.normal(0, 0.03, clusters), flows)
            t = size * np.exp(shift + rng.normal(0, 0.1, n))
            failed = (t > limit) | (rng.random(n) < 0.05)
            fcts.append([None if f else float(x) for x, f in zip(t, failed, strict=True)])
        pairs = list(zip(fcts[0], fcts[1], strict=True))
        labels = np.repeat(np.arange(clusters), flows).tolist()
        s = stats.sooner(pairs, labels)
        covered += s.low <= 0.5 <= s.high
        u = stats.sooner(pairs)
        naive += u.low <= 0.5 <= u.high
    assert 0.93 <= covered / trials <= 0.97, covered
    assert naive / trials < 0.8, naive


def test_ecdf() -> None:
    xs, ys = stats.ecdf([0.5, None, 1.0, 0.0, float("nan")])  # type: ignore[list-item]  # a NULL, as SQL gives it
    assert xs == [0.0, 0.5, 1.0] and ys == pytest.approx([1 / 3, 2 / 3, 1.0])
