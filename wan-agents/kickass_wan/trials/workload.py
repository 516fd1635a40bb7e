"""The paper's workload (sections III-B, IV-A): on-off senders, exponential gaps, Pareto flow sizes.

Two ways a sender's flows follow each other (``Workload.loop``):

* ``closed``, the paper's senders (III-B: "Senders begin in off mode, waiting
  for a time drawn from an exponential distribution. When the time expires,
  the sender begins a flow ... and runs until completion. After the flow is
  finished, it switches to the off state and repeats"): a flow starts its
  off time after the previous one *ended*, so a slow protocol thins out its
  own load, as on the paper's testbed;
* ``open``: a flow starts its gap after the previous one *started*, whatever
  became of it; the offered load is fixed by the workload (a slow protocol
  faces a longer queue of flows, not fewer of them).

Flow sizes are bounded Pareto in packets of 1500 bytes, shape ~1.8, scale
chosen so the mean is ~100 packets, rounded up to whole packets and clamped
to [min, max]. Read the bounds with care: with mean 100 and shape 1.8 the
Pareto's scale is 45.7 packets, so no flow is shorter than 46 packets
although the range is written 1..2000 (a defensible reading of the paper,
which gives the range, the mean and the shape; every result shown says so).

``Workload.literal()`` is the paper's range taken literally instead: the
scale at ``min_packets`` (1) and sizes rounded *down*, so that
P(size >= k) = k^-shape for every whole k: 71% of the flows are of one
packet, and the mean is what the shape gives, 1.88 packets for 1..2000
(rounded up, as the default, no flow would be of one packet and the mean
would be 2.8 against the 2.2 of the continuous law).

Everything is drawn from one seeded generator per stream, so a trial's flows
are reproducible from its stored parameters alone, and both periods of a
pair replay the same flows (``pair_flows``).
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

PACKET_BYTES = 1500
# Application bytes a full 1500-byte Kick-Ass DATA datagram carries (ka-transport:
# 20 IP + 8 UDP + 32 header + 1440). Both protocols move exactly these bytes,
# so a flow of N packets is the same transfer over Kick-Ass and over TCP.
APP_BYTES_PER_PACKET = 1440
ROUNDINGS = ("ceil", "floor")
LOOPS = ("open", "closed")


@dataclass(frozen=True)
class Workload:
    min_packets: int = 1
    max_packets: int = 2000
    shape: float = 1.8
    mean_packets: float = 100.0
    mean_gap_s: float = 0.5
    seed: int = 1
    # None: the scale that gives ``mean_packets``; else the Pareto scale
    # itself (``literal()``: the paper's range taken literally).
    scale_packets: float | None = None
    # How a drawn size becomes whole packets: "ceil" (never below the scale)
    # or "floor" (``literal()``: the scale itself occurs).
    rounding: str = "ceil"
    # "open" (a gap from one flow's start to the next) or "closed" (the
    # paper's on-off senders: an off time from one flow's end to the next).
    loop: str = "open"

    def __post_init__(self) -> None:
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {', '.join(ROUNDINGS)}")
        if self.loop not in LOOPS:
            raise ValueError(f"loop must be one of {', '.join(LOOPS)}")
        if not 1 <= self.min_packets <= self.max_packets:
            raise ValueError("need 1 <= min_packets <= max_packets")
        if self.shape <= 1.0:
            raise ValueError("shape must be above 1 (the mean is infinite otherwise)")
        if not self.min_packets < self.mean_packets < self.max_packets:
            raise ValueError("mean_packets must lie strictly between min and max")
        if self.mean_gap_s <= 0:
            raise ValueError("mean_gap_s must be positive")

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        # Rounding up is what every trial before the field existed drew: left
        # out, their stored parameters (and the rollups' grouping by workload)
        # stay as they were.
        if self.rounding == "ceil":
            del out["rounding"]
        # Open loop likewise: what every trial before the field existed ran.
        if self.loop == "open":
            del out["loop"]
        return out

    def offered_load_bps(self) -> float | None:
        """What one sender offers on average, in application bits per second:
        mean size over mean gap for an open loop; None for a closed loop,
        whose load depends on how fast its flows finish (the trial stores
        what each period really carried)."""
        if self.loop == "closed":
            return None
        return self.mean_packets * APP_BYTES_PER_PACKET * 8.0 / self.mean_gap_s

    @classmethod
    def literal(cls, **kw: Any) -> Workload:
        """The paper's 1..2000 packets taken literally: the Pareto scale at the
        minimum (1 packet) and sizes rounded down, so P(size >= k) =
        (min / k)^shape for every whole k from the minimum on; the mean follows
        from the shape (1.88 packets for 1..2000, shape 1.8) instead of being 100."""
        w = replace(cls(**kw), scale_packets=None)
        lo, hi = w.min_packets, w.max_packets
        return replace(
            w,
            scale_packets=float(lo),
            rounding="floor",
            mean_packets=_floor_mean(float(lo), w.shape, lo, hi),
        )

    def scale(self) -> float:
        """Pareto scale x_m giving the configured mean once truncated to [min, max]
        (or ``scale_packets`` when set)."""
        if self.scale_packets is not None:
            return self.scale_packets
        return _scale(self.mean_packets, self.shape, self.min_packets, self.max_packets)


# Once per workload: the bisection costs about 0.25 s of CPU (0.4 M steps),
# paid once per period before, and a trial runner drawing its first period's
# flows after the clock started began it a second late on a loaded host.
@functools.cache
def _scale(mean: float, alpha: float, lo_packets: int, hi_packets: int) -> float:
    lo, hi = float(lo_packets), float(hi_packets)
    # The truncated mean grows with x_m: bisect.
    a, b = 1e-6, mean
    for _ in range(200):
        mid = (a + b) / 2
        if _truncated_mean(mid, alpha, lo, hi) < mean:
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


def _floor_mean(xm: float, alpha: float, lo: int, hi: int) -> float:
    """Mean of round-down(Pareto(xm, alpha)) clamped to [lo, hi], exactly:
    E[S] = lo + sum over whole k in (lo, hi] of P(S >= k) = (xm / k)^alpha."""
    return lo + sum(min(1.0, float((xm / k) ** alpha)) for k in range(lo + 1, hi + 1))


@dataclass(frozen=True)
class Flow:
    index: int
    # Open loop: the offset from the period's start. Closed loop: the earliest
    # it may start (the off times so far, as if every flow took no time).
    start_s: float
    size_packets: int
    # Closed loop: the off time before this flow, counted from the end of the
    # sender's previous flow (from the period's start for its first).
    off_s: float | None = None

    @property
    def size_bytes(self) -> int:
        return self.size_packets * APP_BYTES_PER_PACKET


# Each sender's flows come from its own random streams: the pair's stream + this x sender index.
SENDER_STREAM_STRIDE = 100_000
DESTINATION_STREAM_STRIDE = 1_000


def pair_flows(
    w: Workload, pair: int, duration_s: float, sender_index: int = 0, destination_index: int = 0
) -> list[Flow]:
    """The flows sender ``sender_index`` starts in every period of pair
    ``pair`` towards destination ``destination_index``: each arm of the pair
    replays exactly these (sizes and start offsets). The one definition the
    runner, the dry run and the tests share."""
    stream = pair + DESTINATION_STREAM_STRIDE * destination_index
    return list(flows(w, duration_s, stream=stream + SENDER_STREAM_STRIDE * sender_index))


def tcp_share_indices(
    w: Workload,
    pair: int,
    flows: list[Flow],
    share: float,
    sender_index: int = 0,
    destination_index: int = 0,
) -> frozenset[int]:
    """Which of a pair's flows run as TCP in a period that gives ``share`` of
    them to TCP (a Kick-Ass arm's ``@tcpNN``): drawn per flow from the seed,
    so every period of the pair picks the same flows."""
    if share <= 0:
        return frozenset()
    stream = pair + DESTINATION_STREAM_STRIDE * destination_index
    stream += SENDER_STREAM_STRIDE * sender_index
    return frozenset(
        f.index for f in flows if random.Random(f"{w.seed}:tcp:{stream}:{f.index}").random() < share
    )


def flows(w: Workload, duration_s: float, stream: int = 0) -> Iterator[Flow]:
    """The flows one on-off sender may start within ``duration_s`` seconds.

    ``stream`` separates senders (and periods) sharing one workload seed.
    Open loop: the gap is measured from one flow's start to the next, so a
    slow flow does not thin out the load. Closed loop (the paper's senders):
    each flow carries its off time, counted from the previous flow's end; the
    list holds every flow that could start if flows took no time (how many
    really run depends on the protocol), the same draws as an open loop's.
    """
    rng = random.Random(f"{w.seed}:{stream}")
    xm = w.scale()
    gap = rng.expovariate(1.0 / w.mean_gap_s)
    t = gap
    i = 0
    while t < duration_s:
        u = 1.0 - rng.random()  # (0, 1]
        x = xm / u ** (1.0 / w.shape)
        size = math.floor(x) if w.rounding == "floor" else math.ceil(x)
        off = gap if w.loop == "closed" else None
        yield Flow(i, t, max(w.min_packets, min(w.max_packets, size)), off)
        i += 1
        gap = rng.expovariate(1.0 / w.mean_gap_s)
        t += gap
