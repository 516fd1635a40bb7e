"""The fragment-viability study as data: which probes a session sends.

Phase ``whole``: unfragmented packets of IP length 44, 52, ..., 1500 (plus
1480, the paper's figure). Phase ``split``: 1500-byte datagrams cut in two,
leading fragment IP length 44, 52, ..., 1492. Each size ``repetitions``
times. Probes go round-robin over sizes (every size once, then again), so a
burst of path loss spreads over all sizes instead of wiping out one.

``window`` is the number of probes in flight. With ``adaptive`` false (every
plan before issue 11 part 4, and ``--window N``) it is exactly that, always:
W=1 is the paper's stop-and-wait. With ``adaptive`` true it is the most the
server may have in flight, and the server's window controller
(kickass_server.window) chooses how many up to it from the measured RTT and
the losses. A plan stored or sent without the key is not adaptive.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

from .rate import FRAGMENT_UNIT, FULL_PACKET_LEN, IPV4_HEADER_LEN

PLAN_VERSION = 1
MIN_IP_LEN = 44  # 20 IP + 8 UDP + 16-byte probe header
UDP_HEADER_LEN = 8
WHOLE = "whole"
SPLIT = "split"
PHASES = (WHOLE, SPLIT)
PAPER_WHOLE_MAX = 1480
# The largest plan any server may offer. A server's policy sets its own limits
# within these (kickass_server.policy refuses a configuration above them), and
# the request schema (kickass_server.schemas.PlanRequest) refuses a request
# above them before the policy is asked. 2,000 repetitions of the finest plan
# (step 8: 366 sizes) are 732,000 probes, fewer than a volunteer's client
# accepts (kickass_probe.session.MAX_PLAN_PROBES, 1,000,000).
MAX_REPETITIONS = 2000
# Probes in flight: 16 times the default policy's 64, 1.5 MB of probes.
MAX_WINDOW = 1024


class PlanError(ValueError):
    """A plan the protocol cannot carry out (bad step, empty phase...)."""


class UnsupportedPlan(PlanError):
    """A well-formed plan from a newer version (unknown version or phase)."""


class PlanTooLarge(PlanError):
    def __init__(self, total: int, limit: int) -> None:
        shown = f"{total:,}" if total < 10**18 else "an absurdly large number of"
        super().__init__(f"the plan has {shown} probes, more than {limit:,}")
        self.total = total
        self.limit = limit


def whole_ip_lens(step: int) -> list[int]:
    sizes = list(range(MIN_IP_LEN, FULL_PACKET_LEN + 1, step))
    for must in (PAPER_WHOLE_MAX, FULL_PACKET_LEN):
        if must not in sizes:
            sizes.append(must)
    return sorted(sizes)


def split_leading_ip_lens(step: int) -> list[int]:
    # The leading fragment's payload must be a multiple of 8 and leave at
    # least 8 bytes for the second fragment.
    return list(range(MIN_IP_LEN, FULL_PACKET_LEN - FRAGMENT_UNIT + 1, step))


@dataclass(frozen=True)
class Probe:
    seq: int
    phase: str
    ip_len: int  # whole: packet IP length; split: leading fragment IP length

    @property
    def udp_payload_len(self) -> int:
        datagram_ip_len = self.ip_len if self.phase == "whole" else FULL_PACKET_LEN
        return datagram_ip_len - IPV4_HEADER_LEN - UDP_HEADER_LEN


@dataclass(frozen=True)
class ProbePlan:
    repetitions: int = 100
    step: int = 8
    window: int = 1
    phases: tuple[str, ...] = PHASES
    whole: tuple[int, ...] = field(default=())
    split: tuple[int, ...] = field(default=())
    # True: ``window`` is the maximum, the server adapts within it.
    adaptive: bool = False

    @staticmethod
    def build(
        repetitions: int = 100,
        step: int = 8,
        window: int = 1,
        phases: tuple[str, ...] | list[str] = PHASES,
        adaptive: bool = False,
    ) -> ProbePlan:
        if step <= 0 or step % FRAGMENT_UNIT:
            raise PlanError(f"step must be a positive multiple of 8 bytes, got {step}")
        if repetitions < 1:
            raise PlanError("repetitions must be at least 1")
        if window < 1:
            raise PlanError("window must be at least 1")
        phases = tuple(phases)
        if not phases or any(p not in PHASES for p in phases):
            raise PlanError(f"phases must be a non-empty subset of {PHASES}, got {phases}")
        return ProbePlan(
            repetitions=repetitions,
            step=step,
            window=window,
            phases=phases,
            whole=tuple(whole_ip_lens(step)) if "whole" in phases else (),
            split=tuple(split_leading_ip_lens(step)) if "split" in phases else (),
            adaptive=bool(adaptive),
        )

    @staticmethod
    def quick() -> ProbePlan:
        """A few-second plan for impatient volunteers: coarse sizes, 10 each."""
        return ProbePlan.build(repetitions=10, step=64, window=8)

    def sizes(self, phase: str) -> tuple[int, ...]:
        return self.whole if phase == "whole" else self.split

    @cached_property
    def total_probes(self) -> int:
        return self.repetitions * (len(self.whole) + len(self.split))

    def probe(self, seq: int) -> Probe:
        if not 0 <= seq < self.total_probes:
            raise IndexError(f"seq {seq} outside plan of {self.total_probes} probes")
        n_whole = self.repetitions * len(self.whole)
        if seq < n_whole:
            return Probe(seq, "whole", self.whole[seq % len(self.whole)])
        i = seq - n_whole
        return Probe(seq, "split", self.split[i % len(self.split)])

    @cached_property
    def seq_ip_len(self) -> list[int]:
        """ip_len of every seq, for hot loops that cannot afford probe()."""
        return [self.probe(i).ip_len for i in range(self.total_probes)]

    @cached_property
    def split_from(self) -> int:
        """First seq of the split phase (== total_probes without one)."""
        return self.repetitions * len(self.whole)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["version"] = PLAN_VERSION
        d["order"] = "round-robin"
        d["total_probes"] = self.total_probes
        d["phases"] = list(self.phases)
        d["whole"] = list(self.whole)
        d["split"] = list(self.split)
        return d

    @staticmethod
    def from_json(d: Any, max_probes: int | None = None) -> ProbePlan:
        """A plan read back from JSON, checked field by field before anything is built.

        Plans cross trust boundaries (the client follows the server's; the
        database keeps them), so every count must be a real integer (not a
        bool, a float or a string), sizes must be ones the protocol can send,
        and ``max_probes`` bounds what a reader will allocate for the plan.
        """
        if not isinstance(d, dict):
            raise PlanError("plan is not an object")
        if d.get("version") != PLAN_VERSION:
            raise UnsupportedPlan(f"unsupported plan version {str(d.get('version'))[:40]}")
        repetitions = _count(d, "repetitions")
        step = _count(d, "step")
        window = _count(d, "window")
        # Absent in every plan from before issue 11 part 4: a fixed window.
        adaptive = d.get("adaptive", False)
        if not isinstance(adaptive, bool):
            raise PlanError("plan.adaptive is not true or false")
        phases = d.get("phases")
        if (
            not isinstance(phases, list)
            or not phases
            or not all(isinstance(p, str) for p in phases)
            or len(set(phases)) != len(phases)
        ):
            raise PlanError("plan.phases is not a list of distinct phase names")
        unknown = [p for p in phases if p not in PHASES]
        if unknown:
            raise UnsupportedPlan(f"unknown phase {unknown[0][:40]!r}")
        whole = _sizes(d, "whole", MIN_IP_LEN, FULL_PACKET_LEN)
        # A leading fragment leaves at least 8 bytes for the second one.
        split = _sizes(d, "split", MIN_IP_LEN, FULL_PACKET_LEN - FRAGMENT_UNIT)
        total = repetitions * (len(whole) + len(split))
        if total == 0:
            raise PlanError("the plan has no probes")
        if max_probes is not None and total > max_probes:
            raise PlanTooLarge(total, max_probes)
        return ProbePlan(
            repetitions=repetitions,
            step=step,
            window=window,
            phases=tuple(phases),
            whole=whole,
            split=split,
            adaptive=adaptive,
        )


def _count(d: dict[str, Any], key: str) -> int:
    value = d.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlanError(f"plan.{key} is not a whole number of at least 1")
    return value


def _sizes(d: dict[str, Any], key: str, low: int, high: int) -> tuple[int, ...]:
    value = d.get(key)
    if not isinstance(value, list):
        raise PlanError(f"plan.{key} is not a list of sizes")
    ok = len(value) <= high - low + 1 and all(
        isinstance(v, int) and not isinstance(v, bool) and low <= v <= high for v in value
    )
    if not ok:
        raise PlanError(f"plan.{key} has sizes outside {low}..{high} bytes")
    if len(set(value)) != len(value):
        raise PlanError(f"plan.{key} lists a size twice")
    return tuple(value)


def expected_max_fragment(leading_ip_len: int) -> int:
    """IP length of the largest fragment of an intact split (what
    IP_RECVFRAGSIZE reports when the split arrived as sent)."""
    second = FULL_PACKET_LEN - (leading_ip_len - IPV4_HEADER_LEN)
    return max(leading_ip_len, second)


def plan_bytes(plan: ProbePlan) -> int:
    """IP bytes the plan puts on the wire (a split datagram costs its second header)."""
    return plan.repetitions * (
        sum(plan.whole) + len(plan.split) * (FULL_PACKET_LEN + IPV4_HEADER_LEN)
    )
