"""The paper's workload (section IV-A): on-off senders, exponential gaps, Pareto flow sizes.

Flow sizes are bounded Pareto in packets of 1500 bytes: 1..2000 packets, shape
~1.8, scale chosen so the mean is ~100 packets. Everything is drawn from one
seeded generator, so a trial's flows are reproducible from its stored
parameters alone.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

PACKET_BYTES = 1500
# Application bytes a full 1500-byte Kick-Ass DATA datagram carries (ka-transport:
# 20 IP + 8 UDP + 32 header + 1440). Both protocols move exactly these bytes,
# so a flow of N packets is the same transfer over Kick-Ass and over TCP.
APP_BYTES_PER_PACKET = 1440


@dataclass(frozen=True)
class Workload:
    min_packets: int = 1
    max_packets: int = 2000
    shape: float = 1.8
    mean_packets: float = 100.0
    mean_gap_s: float = 0.5
    seed: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_packets <= self.max_packets:
            raise ValueError("need 1 <= min_packets <= max_packets")
        if self.shape <= 1.0:
            raise ValueError("shape must be above 1 (the mean is infinite otherwise)")
        if not self.min_packets < self.mean_packets < self.max_packets:
            raise ValueError("mean_packets must lie strictly between min and max")
        if self.mean_gap_s <= 0:
            raise ValueError("mean_gap_s must be positive")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def scale(self) -> float:
        """Pareto scale x_m giving the configured mean once truncated to [min, max]."""
        lo, hi = float(self.min_packets), float(self.max_packets)
        # The truncated mean grows with x_m: bisect.
        a, b = 1e-6, self.mean_packets
        for _ in range(200):
            mid = (a + b) / 2
            if _truncated_mean(mid, self.shape, lo, hi) < self.mean_packets:
                a = mid
            else:
                b = mid
        return (a + b) / 2


def _truncated_mean(xm: float, alpha: float, lo: float, hi: float) -> float:
    """Mean of round-up(Pareto(xm, alpha)) clamped to [lo, hi], numerically."""

    # Integrate the clamped variable's survival function: E[X] = lo + ∫_lo^hi S(x) dx.
    def survival(x: float) -> float:
        return 1.0 if x < xm else (xm / x) ** alpha

    n = 2000
    total = 0.0
    # Geometric grid: the tail matters most near lo.
    for i in range(n):
        x0 = lo * (hi / lo) ** (i / n)
        x1 = lo * (hi / lo) ** ((i + 1) / n)
        total += (survival(x0) + survival(x1)) / 2 * (x1 - x0)
    return lo + total


@dataclass(frozen=True)
class Flow:
    index: int
    start_s: float  # offset from the period's start
    size_packets: int

    @property
    def size_bytes(self) -> int:
        return self.size_packets * APP_BYTES_PER_PACKET


# Each sender's flows come from its own random streams: period index + this x sender index.
SENDER_STREAM_STRIDE = 100_000


def period_flows(
    w: Workload, period_index: int, duration_s: float, sender_index: int = 0
) -> list[Flow]:
    """The flows sender ``sender_index`` starts in period ``period_index``:
    the one definition the runner, the dry run and the tests share."""
    return list(flows(w, duration_s, stream=period_index + SENDER_STREAM_STRIDE * sender_index))


def flows(w: Workload, duration_s: float, stream: int = 0) -> Iterator[Flow]:
    """The flows one on-off sender starts within ``duration_s`` seconds.

    ``stream`` separates senders (and periods) sharing one workload seed.
    The gap is measured from one flow's start to the next (open loop, as the
    paper's senders), so a slow flow does not thin out the load.
    """
    rng = random.Random(f"{w.seed}:{stream}")
    xm = w.scale()
    t = rng.expovariate(1.0 / w.mean_gap_s)
    i = 0
    while t < duration_s:
        u = 1.0 - rng.random()  # (0, 1]
        size = math.ceil(xm / u ** (1.0 / w.shape))
        yield Flow(i, t, max(w.min_packets, min(w.max_packets, size)))
        i += 1
        t += rng.expovariate(1.0 / w.mean_gap_s)
