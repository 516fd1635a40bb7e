"""The platform's statistics, in one place: notebooks, the report, the
volunteer's page, the dashboards' rollups and the benchmarks all call these,
so a number is the same wherever it is shown.

* Drop rates with Wilson score intervals (good at small counts and at 0 and 1).
* The verdict's test, its power and the excess over the two-fragment bound:
  imported from ``kickass_core.verdict`` (the rule lives with the verdict).
* Flow sizes in the paper's buckets; FCT summaries with completion rates
  (a failed flow is censored, never silently dropped).
* The trials' speedup, defined on *matched* flows: the same flow (same pair,
  same index: the same size and start offset) under each of two arms. Per
  size bucket, the geometric mean of FCT(baseline) / FCT(Kick-Ass) over the
  pairs where both completed. Its interval is over *period pairs*, not flows:
  the flows of one pair of periods share that time's conditions (cross
  traffic, the machines' load), so they are not independent draws. A t
  interval (C - 1 degrees of freedom) on the cluster-robust standard error
  of the mean log ratio (CR1), C the number of clusters: period pairs that
  ran at overlapping times are one cluster (see ``rollups.pair_clusters``).
  An interval from flows treated as independent (or a percentile bootstrap
  over few pairs) covers far less than it claims;
  ``test_the_interval_covers_what_it_claims`` measures both.
* Beside it, the comparison that keeps the flows an arm failed to finish
  (``sooner``): the share of matched flows that finished sooner under
  Kick-Ass, a flow that did not finish ranked slower than any that did. The
  matched speedup leaves those pairs out, so it flatters whichever arm fails
  more; why a rank and not a restricted mean is in ``sooner``'s docstring.
* Empirical CDFs (time in Kick-Ass mode).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from kickass_core.verdict import (  # noqa: F401 - re-exported: the one rule, imported not moved
    Excess,
    Verdict,
    decide,
    detectable_excess,
    drop_rate,
    excess,
    two_fragment_bound,
)
from scipy.stats import t as student_t

Z95 = 1.959963984540054
SIZE_BUCKETS = ("1-10", "11-100", "101-1000", "1001+")
LEVEL = 0.95  # the speedup interval's confidence level
# The paper's numbers, shown beside ours wherever ours are.
PAPER = {
    "clients": 405,
    "countries": 62,
    "intolerant_share": 0.083,
    "max_split_to_whole": 2.0,
    "speedup_low": 1.2,
    "speedup_high": 4.0,
}


# -- drop rates ----------------------------------------------------------------------------


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for ``k`` events in ``n`` trials (NaN for n = 0)."""
    if n <= 0:
        return (math.nan, math.nan)
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (max(0.0, centre - half), min(1.0, centre + half))


@dataclass(frozen=True)
class Rate:
    """A drop rate with its 95% Wilson interval."""

    sent: int
    lost: int
    rate: float
    low: float
    high: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def drop(sent: int, acked: int) -> Rate:
    """The drop rate of ``sent`` probes of which ``acked`` came back."""
    lost = max(0, sent - acked)
    low, high = wilson(lost, sent)
    return Rate(sent, lost, lost / sent if sent else math.nan, low, high)


def with_intervals(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rows with ``sent``/``acked`` (a view's) plus ``drop_low``/``drop_high``."""
    out = []
    for r in rows:
        sent, acked = int(r.get("sent") or 0), int(r.get("acked") or 0)
        rate = drop(sent, acked)
        out.append({**r, "drop_low": rate.low, "drop_high": rate.high})
    return out


def share(k: int, n: int) -> Rate:
    """A share (e.g. of fragment-intolerant clients) with its Wilson interval."""
    low, high = wilson(k, n)
    return Rate(n, k, k / n if n else math.nan, low, high)


# -- flows ---------------------------------------------------------------------------------


def size_bucket(size_packets: int) -> str:
    """The paper's flow-size buckets, in 1500-byte packets (as the views bucket them)."""
    if size_packets <= 10:
        return SIZE_BUCKETS[0]
    if size_packets <= 100:
        return SIZE_BUCKETS[1]
    if size_packets <= 1000:
        return SIZE_BUCKETS[2]
    return SIZE_BUCKETS[3]


@dataclass(frozen=True)
class FctSummary:
    flows: int
    completed: int
    completion_rate: float
    mean_ms: float | None
    p50_ms: float | None
    p95_ms: float | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def fct_summary(fct_ms: Sequence[float | None]) -> FctSummary:
    """FCTs of flows, ``None`` for one that did not complete (censored: it
    counts in ``flows`` and lowers ``completion_rate``, never in the means)."""
    done = np.array([x for x in fct_ms if x is not None], dtype=float)
    n = len(fct_ms)
    if done.size == 0:
        return FctSummary(n, 0, 0.0 if n else math.nan, None, None, None)
    return FctSummary(
        n,
        int(done.size),
        done.size / n,
        float(done.mean()),
        float(np.percentile(done, 50)),
        float(np.percentile(done, 95)),
    )


def _cluster_ids(clusters: Sequence[Hashable] | None, keep: np.ndarray) -> tuple[np.ndarray, int]:
    """Each kept flow's cluster as 0..C-1, and C (None: each flow its own)."""
    if clusters is None:
        n = int(np.count_nonzero(keep))
        return np.arange(n), n
    index: dict[Hashable, int] = {}
    ids = np.fromiter(
        (index.setdefault(m, len(index)) for m, k in zip(clusters, keep, strict=True) if k),
        dtype=np.int64,
    )
    return ids, len(index)


@dataclass(frozen=True)
class Speedup:
    """Baseline FCT over Kick-Ass FCT on matched flows (> 1: Kick-Ass faster)."""

    matched: int  # matched flows where both arms completed
    pairs: int  # matched flows in all
    estimate: float | None  # geometric mean of the ratios
    low: float | None  # the interval over clusters of period pairs; None below 2 clusters
    high: float | None
    completion_kickass: float | None
    completion_baseline: float | None
    clusters: int = 0  # independent clusters (period pairs) behind the interval

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def speedup(
    pairs: Sequence[tuple[float | None, float | None]],
    clusters: Sequence[Hashable] | None = None,
    *,
    level: float = LEVEL,
) -> Speedup:
    """``pairs``: (FCT under Kick-Ass, FCT under the baseline) of each matched
    flow, None where that arm did not complete. A pair with a failure on
    either side leaves the ratio (both halves) and shows in the completion
    rates. ``clusters``: each matched flow's cluster (its period pair, or the
    set of pairs that ran at the same time); None treats every flow as
    independent, which only flows from separate periods are."""
    n = len(pairs)
    if n == 0:
        return Speedup(0, 0, None, None, None, None, None)
    if clusters is not None and len(clusters) != n:
        raise ValueError(f"{len(clusters)} cluster labels for {n} matched flows")
    both = np.array(pairs, dtype=float)  # None -> nan
    ka_done = int(np.count_nonzero(~np.isnan(both[:, 0])))
    base_done = int(np.count_nonzero(~np.isnan(both[:, 1])))
    ok = ~np.isnan(both).any(axis=1) & (both > 0).all(axis=1)
    if not ok.any():
        return Speedup(0, n, None, None, None, ka_done / n, base_done / n)
    x = np.log(both[ok, 1]) - np.log(both[ok, 0])
    ids, c = _cluster_ids(clusters, ok)
    sums = np.bincount(ids, weights=x)
    counts = np.bincount(ids).astype(float)
    mean = float(sums.sum() / counts.sum())
    est = math.exp(mean)
    if c < 2:  # one period pair: its conditions and the arms' difference are one
        return Speedup(len(x), n, est, None, None, ka_done / n, base_done / n, c)
    # CR1: the ratio estimator's residual per cluster, small-sample factor C/(C-1).
    resid = sums - mean * counts
    se = math.sqrt(c / (c - 1) * float((resid**2).sum())) / float(counts.sum())
    half = float(student_t.ppf(0.5 + level / 2, c - 1)) * se
    low, high = math.exp(mean - half), math.exp(mean + half)
    return Speedup(len(x), n, est, low, high, ka_done / n, base_done / n, c)


@dataclass(frozen=True)
class Sooner:
    """The share of matched flows that finished sooner under Kick-Ass than
    under the baseline, ties counted half, a flow that did not finish ranked
    slower than any that did (> 0.5: Kick-Ass sooner more often)."""

    pairs: int  # matched flows compared
    estimate: float | None
    low: float | None  # the interval over clusters of period pairs; None below 2 clusters
    high: float | None
    completion_kickass: float | None  # over the pairs compared
    completion_baseline: float | None
    clusters: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def sooner(
    pairs: Sequence[tuple[float | None, float | None]],
    clusters: Sequence[Hashable] | None = None,
    *,
    level: float = LEVEL,
) -> Sooner:
    """``pairs`` and ``clusters`` as for ``speedup``: (FCT under Kick-Ass,
    FCT under the baseline) of each matched flow, None where that arm did not
    complete. Every pair counts: a score of 1 where the Kick-Ass twin
    finished first, 0 where the baseline's did, 1/2 for a tie; a twin that
    did not complete is slower than one that did, and two that did not are
    a tie. The estimate is the mean score, its interval the speedup's: a t
    interval (C - 1 degrees of freedom) on the cluster-robust standard error
    (CR1) over C clusters of period pairs, kept within [0, 1].

    Why a rank and not the restricted mean FCT (each failed flow counted as
    its time limit): a restricted mean needs each failed flow's limit on its
    FCT clock, and the flow record does not hold it. The runner cuts a flow
    at the earlier of its timeout and its period's deadline; the period's
    wall-clock start that deadline counts from is not stored (the trial's
    start stamp is taken before the first upload and token fetch), and a
    closed loop's flow is due when the one before it ended plus its off
    time, which no row holds: the limit would be a new field every sender
    must write, for a comparison that can do without it.
    The rank needs no limit: the twins of a pair are given the same time
    (the same timeout, the same offset in equally long periods, up to the
    arm's handicap and a period's late start, milliseconds), so a twin that
    finished within it was sooner than one cut at it. It also asks nothing
    of why a flow failed (no assumption that failures are unrelated to
    speed, as a Kaplan-Meier curve would). Its cost: it says how often
    Kick-Ass was sooner, not by how much (the matched speedup says that, on
    the flows both completed); a flow 1 ms slower and one that never
    finished weigh the same. With no failures it is the plain paired
    comparison; with identical arms it is exactly 1/2."""
    n = len(pairs)
    if n == 0:
        return Sooner(0, None, None, None, None, None)
    if clusters is not None and len(clusters) != n:
        raise ValueError(f"{len(clusters)} cluster labels for {n} matched flows")
    both = np.array(pairs, dtype=float)  # None -> nan
    ka, base = both[:, 0], both[:, 1]
    ka_done, base_done = ~np.isnan(ka), ~np.isnan(base)
    # A twin that did not complete is slower than any that did (inf > any
    # FCT), two that did not are a tie (inf == inf).
    ka_t = np.where(ka_done, ka, np.inf)
    base_t = np.where(base_done, base, np.inf)
    score = (ka_t < base_t) + 0.5 * (ka_t == base_t)
    ids, c = _cluster_ids(clusters, np.ones(n, dtype=bool))
    est = float(score.mean())
    completion = (float(ka_done.mean()), float(base_done.mean()))
    if c < 2:
        return Sooner(n, est, None, None, *completion, c)
    resid = np.bincount(ids, weights=score - est)
    se = math.sqrt(c / (c - 1) * float((resid**2).sum())) / n
    half = float(student_t.ppf(0.5 + level / 2, c - 1)) * se
    return Sooner(n, est, max(0.0, est - half), min(1.0, est + half), *completion, c)


def ecdf(values: Iterable[float]) -> tuple[list[float], list[float]]:
    """Sorted values and the share of values at or below each."""
    xs = np.sort(np.array([v for v in values if v is not None and not math.isnan(v)], dtype=float))
    if xs.size == 0:
        return [], []
    ys = np.arange(1, xs.size + 1) / xs.size
    return xs.tolist(), ys.tolist()


# -- drop rates per size, shares per group -------------------------------------------------


@dataclass(frozen=True)
class SizeRate:
    """The drop rate of one size (whole packet IP length, or a split's
    leading-fragment IP length), pooled over ``sessions`` contributors."""

    size: int
    sessions: int
    rate: Rate

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "sessions": self.sessions, **self.rate.to_json()}


def drop_by_size(rows: Iterable[Mapping[str, Any]], key: str = "ip_len") -> list[SizeRate]:
    """Rows with ``key``, ``sent`` and ``acked`` (a view's: one per session and
    size, or already pooled with a ``sessions`` count) pooled per size, each
    with its Wilson interval; sizes with nothing sent are left out."""
    sent: dict[int, int] = {}
    acked: dict[int, int] = {}
    contributors: dict[int, int] = {}
    for r in rows:
        size = int(r[key])
        sent[size] = sent.get(size, 0) + int(r.get("sent") or 0)
        acked[size] = acked.get(size, 0) + int(r.get("acked") or 0)
        n = r.get("sessions")
        contributors[size] = contributors.get(size, 0) + (1 if n is None else int(n))
    return [
        SizeRate(size, contributors[size], drop(sent[size], acked[size]))
        for size in sorted(sent)
        if sent[size] > 0
    ]


INTOLERANT = "fragment-intolerant"
CONCLUSIVE = ("fragments-ok", INTOLERANT)


@dataclass(frozen=True)
class GroupShare:
    """The share of fragment-intolerant clients of one group (a source, a
    country, a network): among the clients with a conclusive verdict, as the
    paper counts its 8.3% of 405; ``inconclusive`` ones are counted aside."""

    group: str
    clients: int  # with a conclusive verdict
    intolerant: int
    inconclusive: int
    share: Rate

    def to_json(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "clients": self.clients,
            "intolerant": self.intolerant,
            "inconclusive": self.inconclusive,
            "share": self.share.rate,
            "share_low": self.share.low,
            "share_high": self.share.high,
        }


def intolerant_share(verdicts: Iterable[str | None], group: str = "all") -> GroupShare:
    """The share of ``fragment-intolerant`` among conclusive ``verdicts``
    (one per client), with its Wilson interval; None (no verdict) is skipped."""
    conclusive = intolerant = inconclusive = 0
    for v in verdicts:
        if v in CONCLUSIVE:
            conclusive += 1
            intolerant += v == INTOLERANT
        elif v is not None:
            inconclusive += 1
    return GroupShare(group, conclusive, intolerant, inconclusive, share(intolerant, conclusive))


def intolerant_by_group(pairs: Iterable[tuple[str, str | None]]) -> list[GroupShare]:
    """(group, verdict) per client -> the share per group, largest group first."""
    by: dict[str, list[str | None]] = {}
    for group, verdict in pairs:
        by.setdefault(group, []).append(verdict)
    out = [intolerant_share(vs, g) for g, vs in by.items()]
    return sorted(out, key=lambda s: (-s.clients, s.group))


# -- flows by size, time in Kick-Ass mode -------------------------------------------------


def size_bin(size_packets: int) -> int:
    """Flow sizes in powers of two (the FCT-against-size figures' bins): the
    bin's lowest size, 1, 2, 4, 8, ... packets."""
    return 1 << max(0, int(size_packets).bit_length() - 1)


def fct_by_size_bin(flows: Iterable[tuple[int, float | None]]) -> dict[int, FctSummary]:
    """(size in packets, FCT or None when the flow did not complete) ->
    ``fct_summary`` per ``size_bin``, smallest bin first."""
    by: dict[int, list[float | None]] = {}
    for size, fct in flows:
        by.setdefault(size_bin(size), []).append(fct)
    return {b: fct_summary(by[b]) for b in sorted(by)}


@dataclass(frozen=True)
class KaModeTime:
    """Time in Kick-Ass mode of a set of flows: per flow the fraction of its
    FCT spent in Kick-Ass mode (the rest in TCP mode, paper §II-C)."""

    flows: int
    mean: float | None  # mean of the per-flow fractions
    median: float | None
    share_of_time: float | None  # total time in Kick-Ass mode / total FCT
    cdf: tuple[list[float], list[float]]

    def to_json(self) -> dict[str, Any]:
        return {
            "flows": self.flows,
            "mean": self.mean,
            "median": self.median,
            "share_of_time": self.share_of_time,
        }


def time_in_kickass_mode(
    fractions: Sequence[float | None], fct_ms: Sequence[float | None] | None = None
) -> KaModeTime:
    """``fractions``: each flow's ``ka_mode_fraction`` (None: not known, left
    out); ``fct_ms`` the flows' FCTs in the same order, for the share of all
    time (None: not computed)."""
    xs, ys = ecdf(f for f in fractions if f is not None)
    if not xs:
        return KaModeTime(0, None, None, None, ([], []))
    arr = np.array(xs, dtype=float)
    weighted: float | None = None
    if fct_ms is not None:
        pairs = [
            (f, t)
            for f, t in zip(fractions, fct_ms, strict=True)
            if f is not None and t is not None and t > 0
        ]
        total = sum(t for _, t in pairs)
        weighted = sum(f * t for f, t in pairs) / total if total > 0 else None
    return KaModeTime(int(arr.size), float(arr.mean()), float(np.median(arr)), weighted, (xs, ys))


def thin(n: int, max_points: int) -> list[int]:
    """At most ``max_points`` indices of ``range(n)`` evenly spread, first and
    last kept: what a figure plots of a long series (an ECDF of a million
    flows is drawn through a few hundred of its points)."""
    if n <= max_points:
        return list(range(n))
    if max_points <= 1:
        return [n - 1]
    # Integer rounding, half up: PostgreSQL's report_ka_mode keeps the same
    # ranks (migration 0014), so the report's CDF is the notebooks'.
    d = max_points - 1
    return sorted({(2 * i * (n - 1) + d) // (2 * d) for i in range(max_points)})
