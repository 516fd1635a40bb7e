"""The per-session verdict on fragment viability, and its rule.

Inputs are the pooled counts of each phase. The rule, in order:

1. ``inconclusive`` if either phase has fewer than ``MIN_SENT`` probes sent
   (the session ended early), or if more than half of the *whole* probes were
   lost (the path is too lossy to tell fragments apart from plain loss).
2. ``fragment-intolerant`` if at least 90% of the split datagrams were lost
   while the whole packets mostly got through: something on the path drops
   fragments.
3. ``fragments-ok`` if the split drop rate is within the paper's bound: a
   datagram in two fragments has two chances to be lost, so at most
   ``1 - (1 - whole)^2`` (about twice the whole drop rate), plus three
   binomial standard errors of slack for small samples.
4. otherwise ``inconclusive``: fragments are lost more than plain loss
   explains, but not so often that the path blocks them.
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


@dataclass(frozen=True)
class Verdict:
    verdict: str
    reason: str


def drop_rate(sent: int, acked: int) -> float | None:
    return None if sent == 0 else 1.0 - acked / sent


def pool(rows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Counts of several sizes or splits pooled into one drop rate (missing counts are 0)."""
    sent = acked = 0
    for r in rows:
        sent += r.get("sent") or 0
        acked += r.get("acked") or 0
    return {"sent": sent, "acked": acked, "drop_rate": drop_rate(sent, acked)}


def decide(whole_sent: int, whole_acked: int, split_sent: int, split_acked: int) -> Verdict:
    if whole_sent < MIN_SENT or split_sent < MIN_SENT:
        return Verdict(
            INCONCLUSIVE,
            f"too few probes (whole {whole_sent}, split {split_sent}; need {MIN_SENT} each)",
        )
    whole = 1.0 - whole_acked / whole_sent
    split = 1.0 - split_acked / split_sent
    if whole > MAX_WHOLE_DROP:
        return Verdict(INCONCLUSIVE, f"path too lossy: {whole:.1%} of whole packets lost")
    if split >= INTOLERANT_SPLIT_DROP:
        return Verdict(
            FRAGMENT_INTOLERANT,
            f"{split:.1%} of fragmented datagrams lost against {whole:.1%} of whole packets",
        )
    bound = 1.0 - (1.0 - whole) ** 2
    slack = 3.0 * math.sqrt(max(bound * (1.0 - bound), 1.0 / split_sent) / split_sent)
    if split <= bound + slack:
        return Verdict(
            FRAGMENTS_OK,
            f"split drop {split:.1%} within two-fragment bound {bound:.1%} (+{slack:.1%})",
        )
    return Verdict(
        INCONCLUSIVE,
        f"split drop {split:.1%} above two-fragment bound {bound:.1%} (+{slack:.1%}) "
        "but below the intolerant threshold",
    )
