"""The interleaved trial schedule: alternating Kick-Ass and TCP periods per destination.

Each *pair* holds one period of each protocol, in an order drawn from the
seed (as flent shuffles its batches), so slow drift and order effects cancel
across pairs. The schedule is data: it is stored with the trial and the
runner only executes it.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

KICKASS = "kickass"
TCP = "tcp"
PROTOCOLS = (KICKASS, TCP)


@dataclass(frozen=True)
class Period:
    index: int
    pair: int
    destination: str
    protocol: str
    start_s: float
    duration_s: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def interleaved(
    destinations: list[str],
    *,
    pairs: int,
    period_s: float = 120.0,
    gap_s: float = 0.0,
    seed: int = 1,
    protocols: tuple[str, ...] = PROTOCOLS,
) -> list[Period]:
    """Per destination, ``pairs`` pairs of (Kick-Ass, TCP) periods, back to back.

    ``protocols`` narrows a run to one of them (a TCP-only baseline, say).

    Destinations take turns pair by pair, so every destination sees the same
    slow drift of the day.
    """
    if pairs < 1 or period_s <= 0 or gap_s < 0:
        raise ValueError("need pairs >= 1, period_s > 0, gap_s >= 0")
    if not destinations or len(set(destinations)) != len(destinations):
        raise ValueError("need distinct destinations")
    if (
        not protocols
        or not set(protocols) <= set(PROTOCOLS)
        or len(set(protocols)) != len(protocols)
    ):
        raise ValueError(f"protocols must be distinct names from {PROTOCOLS}")
    rng = random.Random(seed)
    out: list[Period] = []
    t = 0.0
    for pair in range(pairs):
        for dest in destinations:
            order = list(protocols)
            rng.shuffle(order)
            for proto in order:
                out.append(Period(len(out), pair, dest, proto, t, period_s))
                t += period_s + gap_s
    return out
