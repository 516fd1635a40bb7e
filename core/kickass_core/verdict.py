"""The per-session verdict on fragment viability, its rule, and its statistics.

Inputs are the pooled counts of each phase. ``*_acked`` counts every probe
the client acknowledged, in time or late: the verdict asks whether datagrams
arrive, and an acknowledgement after the probe's timeout proves one did (a
client descheduled for a moment, on a loaded machine, acknowledges a whole
window late). The drop rates shown beside it keep the paper's rule, late
counts as lost, and report late on their own. Probes measured while the
client's own kernel refused fragments (its reassembly memory was full:
``IpReasmFails`` rising, see ``kickass_probe.reassembly``) are *invalid*: they
say nothing about the path, so they are left out of ``sent`` and counted
apart (``whole_invalid``, ``split_invalid``). The rule, in order:

0. ``inconclusive`` if more than ``MAX_INVALID_FRACTION`` of the split
   probes are invalid: the client's kernel, not the path, decided too much.
1. ``inconclusive`` if either phase has fewer than ``MIN_SENT`` valid probes
   (the session ended early), or if more than half of the *whole* probes were
   lost (the path is too lossy to tell fragments apart from plain loss).
2. ``fragment-intolerant`` if at least 90% of the split datagrams were lost
   while the whole packets mostly got through: something on the path drops
   fragments.
3. ``fragments-ok`` if the split drop rate is within the paper's bound: a
   datagram in two fragments has two chances to be lost, so at most
   ``b = 1 - (1 - whole)^2`` (about twice the whole drop rate), plus three
   binomial standard errors of slack for small samples.
4. otherwise ``inconclusive``: fragments are lost more than plain loss
   explains, but not so often that the path blocks them.

The statistical test behind rule 3
----------------------------------

It is a one-sided test of H0 "a split is lost no more often than two
independent whole packets" (split drop <= b), rejected when the observed split
drop exceeds ``b + 3 * SE`` with ``SE = sqrt(max(b (1 - b), 1/n) / n)`` and
``n`` the valid split probes. ``b`` is estimated from the whole phase and
treated as known; with about as many whole as split probes the bound's own
sampling error would make the test somewhat less strict than 3 SE suggests,
but the bound is itself conservative (next paragraph), which more than makes
up for it on any path with some loss.

*Blind spot.* Whole loss includes the loss of the ACK on the way back, and the
bound counts that ACK loss twice. With loss ``p`` per direction a split of
two fragments is lost with probability ``1 - (1 - p)^3`` but the bound is
``1 - (1 - p)^4``: fragment-specific loss up to about ``p`` (2 points at 2%
per direction) reads as ``fragments-ok`` whatever the number of probes. That
is why ``excess`` below is reported with every verdict.

*Power* (excess split loss over ``b`` that the rule detects with 80%
probability: ``(3 + 0.84) * SE``), in percentage points:

    ===============  ===============  ================  ==================
    whole drop       quick plan       10 repetitions    paper plan
                     (n = 230 splits) (n = 1,820)       (n = 18,200)
    ===============  ===============  ================  ==================
    0%               1.7              0.2               0.02
    1%               3.5              1.3               0.4
    4%               6.8              2.4               0.8
    10%              9.9              3.5               1.1
    ===============  ===============  ================  ==================

*The excess, with a confidence interval.* ``excess`` reports
``split drop - b`` (negative: less loss than two independent whole packets
would explain) with a two-sided 95% interval from the delta method:
``Var = s (1 - s) / n_split + (2 (1 - w))^2 w (1 - w) / n_whole``, where the
rates in the variance (not the estimate) count one lost and one delivered
probe more in each phase (Agresti and Caffo's adjustment), so that a session
without any loss still gets an interval of honest width. An interval entirely
above 0 is fragment-specific loss; its width says how much the session could
have missed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

FRAGMENTS_OK = "fragments-ok"
FRAGMENT_INTOLERANT = "fragment-intolerant"
INCONCLUSIVE = "inconclusive"
VERDICTS = (FRAGMENTS_OK, FRAGMENT_INTOLERANT, INCONCLUSIVE)

MIN_SENT = 20
MAX_WHOLE_DROP = 0.5
INTOLERANT_SPLIT_DROP = 0.9
# Above this share of invalid split probes the verdict is inconclusive.
MAX_INVALID_FRACTION = 0.05
# Standard errors of slack in rule 3, and the normal quantiles used to state
# the test's power and the excess's interval.
SLACK_SE = 3.0
Z_POWER_80 = 0.8416
Z_CI_95 = 1.96


@dataclass(frozen=True)
class Verdict:
    verdict: str
    reason: str


@dataclass(frozen=True)
class Excess:
    """Split drop rate minus the two-fragment bound, with a 95% interval."""

    estimate: float
    low: float
    high: float

    def to_json(self) -> dict[str, float]:
        return {"estimate": self.estimate, "low": self.low, "high": self.high}


def drop_rate(sent: int, acked: int) -> float | None:
    return None if sent == 0 else 1.0 - acked / sent


def pool(rows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Counts of several sizes or splits pooled into one drop rate (missing counts are 0)."""
    sent = acked = 0
    for r in rows:
        sent += r.get("sent") or 0
        acked += r.get("acked") or 0
    return {"sent": sent, "acked": acked, "drop_rate": drop_rate(sent, acked)}


def two_fragment_bound(whole_drop: float) -> float:
    """Drop rate of a datagram in two fragments when each fragment is lost as
    often as a whole packet, independently: ``1 - (1 - whole)^2``."""
    return 1.0 - (1.0 - whole_drop) ** 2


def slack(bound: float, split_sent: int) -> float:
    """Rule 3's slack: ``SLACK_SE`` binomial standard errors at the bound."""
    return SLACK_SE * math.sqrt(max(bound * (1.0 - bound), 1.0 / split_sent) / split_sent)


def detectable_excess(whole_drop: float, split_sent: int, z_power: float = Z_POWER_80) -> float:
    """Excess split loss over the bound that rule 3 detects with the power of
    ``z_power`` (default 80%): ``(SLACK_SE + z_power) * SE``."""
    if split_sent <= 0:
        return math.inf
    return slack(two_fragment_bound(whole_drop), split_sent) * (SLACK_SE + z_power) / SLACK_SE


def excess(whole_sent: int, whole_acked: int, split_sent: int, split_acked: int) -> Excess | None:
    """Split drop minus the two-fragment bound, with its 95% interval (None
    without probes in both phases). The same formula is in the database view
    ``v_session_summary`` (migration 0007), and this is the same arithmetic,
    term by term in its order, so the verdict, the view and the archive's
    engines (``kickass_analysis.archive_analysis``) give the same doubles:
    a count over a count is the correctly rounded quotient, as PostgreSQL's
    division of the two as double precision is, and ``**`` on floats is C's
    ``pow``, as PostgreSQL's ``^`` is."""
    if whole_sent <= 0 or split_sent <= 0:
        return None
    w = (whole_sent - whole_acked) / whole_sent
    s = (split_sent - split_acked) / split_sent
    est = s - two_fragment_bound(w)
    # Agresti-Caffo: one more lost and one more delivered probe per phase.
    wa = (whole_sent - whole_acked + 1) / (whole_sent + 2)
    sa = (split_sent - split_acked + 1) / (split_sent + 2)
    var = sa * (1.0 - sa) / split_sent + (2.0 * (1.0 - wa)) ** 2 * wa * (1.0 - wa) / whole_sent
    half = Z_CI_95 * math.sqrt(var)
    return Excess(est, est - half, est + half)


def decide(
    whole_sent: int,
    whole_acked: int,
    split_sent: int,
    split_acked: int,
    *,
    split_invalid: int = 0,
    whole_invalid: int = 0,
    late: int = 0,
) -> Verdict:
    """The verdict from valid counts (``*_sent`` exclude invalid probes;
    ``*_acked`` include the ``late`` ones, which the reason then mentions)."""
    invalid_note = ""
    if late:
        invalid_note = f"; {late} probes acknowledged after their timeout, counted as delivered"
    if split_invalid or whole_invalid:
        invalid_note += (
            f"; {split_invalid + whole_invalid} probes invalid (the client's kernel refused "
            "fragments: reassembly memory full)"
        )
        total_split = split_sent + split_invalid
        if total_split and split_invalid > MAX_INVALID_FRACTION * total_split:
            return Verdict(
                INCONCLUSIVE,
                f"the client's kernel refused fragments (reassembly memory full): "
                f"{split_invalid} of {total_split} split probes invalid",
            )
    if whole_sent < MIN_SENT or split_sent < MIN_SENT:
        return Verdict(
            INCONCLUSIVE,
            f"too few probes (whole {whole_sent}, split {split_sent}; need {MIN_SENT} each)"
            + invalid_note,
        )
    whole = 1.0 - whole_acked / whole_sent
    split = 1.0 - split_acked / split_sent
    if whole > MAX_WHOLE_DROP:
        return Verdict(
            INCONCLUSIVE, f"path too lossy: {whole:.1%} of whole packets lost" + invalid_note
        )
    if split >= INTOLERANT_SPLIT_DROP:
        return Verdict(
            FRAGMENT_INTOLERANT,
            f"{split:.1%} of fragmented datagrams lost against {whole:.1%} of whole packets"
            + invalid_note,
        )
    bound = two_fragment_bound(whole)
    extra = slack(bound, split_sent)
    if split <= bound + extra:
        return Verdict(
            FRAGMENTS_OK,
            f"split drop {split:.1%} within two-fragment bound {bound:.1%} (+{extra:.1%})"
            + invalid_note,
        )
    return Verdict(
        INCONCLUSIVE,
        f"split drop {split:.1%} above two-fragment bound {bound:.1%} (+{extra:.1%}) "
        "but below the intolerant threshold" + invalid_note,
    )
