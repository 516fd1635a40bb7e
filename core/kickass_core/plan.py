"""The fragment-viability study as data: which probes a session sends.

Phase ``whole``: unfragmented packets of IP length 44, 52, ..., 1500 (plus
1480, the paper's figure). Phase ``split``: 1500-byte datagrams cut in two,
leading fragment IP length 44, 52, ..., 1492. Each size ``repetitions``
times. Probes go round-robin over sizes (every size once, then again), so a
burst of path loss spreads over all sizes instead of wiping out one.
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


class PlanError(ValueError):
    """A plan the protocol cannot carry out (bad step, empty phase...)."""


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

    @staticmethod
    def build(
        repetitions: int = 100,
        step: int = 8,
        window: int = 1,
        phases: tuple[str, ...] | list[str] = PHASES,
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
    def from_json(d: dict[str, Any]) -> ProbePlan:
        if d.get("version") != PLAN_VERSION:
            raise PlanError(f"unsupported plan version {d.get('version')}")
        return ProbePlan(
            repetitions=int(d["repetitions"]),
            step=int(d["step"]),
            window=int(d["window"]),
            phases=tuple(d["phases"]),
            whole=tuple(int(x) for x in d["whole"]),
            split=tuple(int(x) for x in d["split"]),
        )


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
