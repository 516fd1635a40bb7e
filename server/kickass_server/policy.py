"""Server policy: what a client may ask for, and how hard the server may send.

The probe server sends packets on request, so it must never become a flood
cannon. Three layers keep it honest:

* plan bounds — a session can only ask for a bounded number of probes;
* admission — concurrent and hourly session counts, and hourly bytes, per
  source address and per /24 (the unit one subscriber or one abuser controls);
* pacing — token buckets in packets/s per address, per /24 and globally,
  checked before every probe leaves.

Probes go only to an address that proved return routability (see engine.py);
these limits bound what even a proven address can draw.
"""

from __future__ import annotations

import ipaddress
import os
import time
from collections import defaultdict, deque
from dataclasses import dataclass, fields

from kickass_core.plan import PlanError, ProbePlan


@dataclass
class Policy:
    max_repetitions: int = 200
    max_window: int = 64
    min_step: int = 8
    sessions_per_address: int = 2  # concurrent
    sessions_per_prefix: int = 8  # concurrent, per /24
    sessions_per_address_hour: int = 20
    sessions_per_prefix_hour: int = 100
    bytes_per_address_hour: int = 200_000_000
    bytes_per_prefix_hour: int = 1_000_000_000
    pps_per_address: float = 5000.0
    pps_per_prefix: float = 20000.0
    pps_global: float = 50000.0
    max_sessions: int = 256  # concurrent, whole server
    handshake_timeout_s: float = 30.0  # HELLO+ECHO must complete within this
    silence_timeout_s: float = 30.0  # probing with no ACK at all for this long: client gone
    max_session_s: float = 3 * 3600.0
    max_challenges_per_session: int = 8
    min_timeout_ms: float = 50.0
    max_timeout_ms: float = 3000.0

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Policy:
        """Every field as ``KICKASS_POLICY_<FIELD>`` (upper case)."""
        env = os.environ if environ is None else environ
        kwargs: dict[str, object] = {}
        for f in fields(cls):
            raw = env.get(f"KICKASS_POLICY_{f.name.upper()}")
            if raw is not None:
                kwargs[f.name] = float(raw) if f.type in ("float", float) else int(raw)
        return cls(**kwargs)  # type: ignore[arg-type]

    def plan_from_request(self, body: dict) -> ProbePlan:
        """Build the plan a client asked for, within bounds; PlanError otherwise."""
        if body.get("quick"):
            return ProbePlan.quick()
        repetitions = int(body.get("repetitions", 100))
        step = int(body.get("step", 8))
        window = int(body.get("window", 1))
        phases = body.get("phases", ["whole", "split"])
        if repetitions > self.max_repetitions:
            raise PlanError(
                f"repetitions {repetitions} above the server limit {self.max_repetitions}"
            )
        if window > self.max_window:
            raise PlanError(f"window {window} above the server limit {self.max_window}")
        if step < self.min_step:
            raise PlanError(f"step {step} below the server limit {self.min_step}")
        return ProbePlan.build(repetitions=repetitions, step=step, window=window, phases=phases)


def prefix_of(address: str) -> str:
    ip = ipaddress.ip_address(address)
    plen = 24 if ip.version == 4 else 48
    return str(ipaddress.ip_network(f"{address}/{plen}", strict=False))


class TokenBucket:
    """Packets/s limiter with a burst of one tenth of a second's worth (at least 1)."""

    __slots__ = ("rate", "burst", "tokens", "stamp")

    def __init__(self, rate: float, now: float) -> None:
        self.rate = rate
        self.burst = max(1.0, rate / 10.0)
        self.tokens = self.burst
        self.stamp = now

    def refill(self, now: float) -> None:
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_time(self) -> float:
        return 0.0 if self.tokens >= 1.0 else (1.0 - self.tokens) / self.rate


class Admission:
    """Concurrent and hourly accounting per address and per prefix."""

    def __init__(self, policy: Policy, clock=time.monotonic) -> None:  # noqa: ANN001
        self.policy = policy
        self.clock = clock
        self.active_by_address: dict[str, int] = defaultdict(int)
        self.active_by_prefix: dict[str, int] = defaultdict(int)
        self.active_total = 0
        # (time, bytes) of each admitted session, for the hourly windows.
        self.history_by_address: dict[str, deque[tuple[float, int]]] = defaultdict(deque)
        self.history_by_prefix: dict[str, deque[tuple[float, int]]] = defaultdict(deque)

    def _trim(self, q: deque[tuple[float, int]], now: float) -> deque[tuple[float, int]]:
        while q and q[0][0] < now - 3600.0:
            q.popleft()
        return q

    def check(self, address: str, nbytes: int) -> str | None:
        """None when admitted; otherwise the human reason for a 429."""
        p = self.policy
        now = self.clock()
        prefix = prefix_of(address)
        ha = self._trim(self.history_by_address[address], now)
        hp = self._trim(self.history_by_prefix[prefix], now)
        if self.active_total >= p.max_sessions:
            return "the server is running its maximum number of sessions; try again later"
        if self.active_by_address[address] >= p.sessions_per_address:
            return f"at most {p.sessions_per_address} concurrent sessions per address"
        if self.active_by_prefix[prefix] >= p.sessions_per_prefix:
            return f"at most {p.sessions_per_prefix} concurrent sessions per {prefix}"
        if len(ha) >= p.sessions_per_address_hour:
            return f"at most {p.sessions_per_address_hour} sessions per address per hour"
        if len(hp) >= p.sessions_per_prefix_hour:
            return f"at most {p.sessions_per_prefix_hour} sessions per {prefix} per hour"
        if sum(b for _, b in ha) + nbytes > p.bytes_per_address_hour:
            return f"at most {p.bytes_per_address_hour} probe bytes per address per hour"
        if sum(b for _, b in hp) + nbytes > p.bytes_per_prefix_hour:
            return f"at most {p.bytes_per_prefix_hour} probe bytes per {prefix} per hour"
        return None

    def admit(self, address: str, nbytes: int) -> None:
        now = self.clock()
        prefix = prefix_of(address)
        self.active_by_address[address] += 1
        self.active_by_prefix[prefix] += 1
        self.active_total += 1
        self.history_by_address[address].append((now, nbytes))
        self.history_by_prefix[prefix].append((now, nbytes))

    def release(self, address: str) -> None:
        prefix = prefix_of(address)
        self.active_by_address[address] = max(0, self.active_by_address[address] - 1)
        self.active_by_prefix[prefix] = max(0, self.active_by_prefix[prefix] - 1)
        self.active_total = max(0, self.active_total - 1)
