"""The probe pacer: token buckets per proven address, per /24 and for the whole server.

Every probe takes one token from each of three buckets; it may leave only when
all three hold one. Time is passed in (sans-IO), so the pacer is tested on a
simulated clock, and ``ready_at`` tells the caller exactly when to come back
instead of polling.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass


def prefix_of(address: str) -> str:
    """The /24 (IPv4) or /48 (IPv6) an address belongs to: one subscriber's reach."""
    ip = ipaddress.ip_address(address)
    plen = 24 if ip.version == 4 else 48
    return str(ipaddress.ip_network(f"{address}/{plen}", strict=False))


# A bucket that reached 1 token minus float noise is full enough: without this
# slack ``ready_at`` can name an instant at which ``refill`` computes
# 0.999999999 tokens, and a loop waking exactly then would spin.
_EPSILON = 1e-9


class TokenBucket:
    """Packets/s limiter with a burst of one tenth of a second's worth (at least 1)."""

    __slots__ = ("rate", "burst", "tokens", "stamp")

    def __init__(self, rate: float, now: float) -> None:
        if not rate > 0:
            raise ValueError(f"a pacing rate must be positive, got {rate!r}")
        self.rate = rate
        self.burst = max(1.0, rate / 10.0)
        self.tokens = self.burst
        self.stamp = now

    def refill(self, now: float) -> None:
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now

    def has_token(self) -> bool:
        return self.tokens >= 1.0 - _EPSILON

    def ready_at(self) -> float:
        """The earliest time at which this bucket holds one token."""
        if self.has_token():
            return self.stamp
        return self.stamp + (1.0 - self.tokens) / self.rate


@dataclass(eq=False)
class PacingLane:
    """The per-address and per-prefix buckets one proven peer draws from."""

    address: str
    prefix: str
    by_address: TokenBucket
    by_prefix: TokenBucket


class Pacer:
    """Three layers of token buckets; buckets live while a proven peer uses them."""

    def __init__(
        self, per_address_pps: float, per_prefix_pps: float, global_pps: float, now: float
    ) -> None:
        self.per_address_pps = per_address_pps
        self.per_prefix_pps = per_prefix_pps
        self.global_bucket = TokenBucket(global_pps, now)
        self._by_address: dict[str, TokenBucket] = {}
        self._by_prefix: dict[str, TokenBucket] = {}
        # How many lanes hold each bucket: two sessions from one address share
        # its bucket, and a bucket is forgotten only when nobody uses it.
        self._address_refs: dict[str, int] = {}
        self._prefix_refs: dict[str, int] = {}

    def lane(self, address: str, now: float) -> PacingLane:
        prefix = prefix_of(address)
        a = self._by_address.get(address)
        if a is None:
            a = self._by_address[address] = TokenBucket(self.per_address_pps, now)
        p = self._by_prefix.get(prefix)
        if p is None:
            p = self._by_prefix[prefix] = TokenBucket(self.per_prefix_pps, now)
        self._address_refs[address] = self._address_refs.get(address, 0) + 1
        self._prefix_refs[prefix] = self._prefix_refs.get(prefix, 0) + 1
        return PacingLane(address, prefix, a, p)

    def release(self, lane: PacingLane) -> None:
        for refs, buckets, key in (
            (self._address_refs, self._by_address, lane.address),
            (self._prefix_refs, self._by_prefix, lane.prefix),
        ):
            n = refs.get(key, 0) - 1
            if n <= 0:
                refs.pop(key, None)
                buckets.pop(key, None)
            else:
                refs[key] = n

    def try_take(self, lane: PacingLane, now: float) -> bool:
        """Take one token from each bucket if all three have one."""
        buckets = (lane.by_address, lane.by_prefix, self.global_bucket)
        for b in buckets:
            b.refill(now)
        if not all(b.has_token() for b in buckets):
            return False
        for b in buckets:
            b.tokens -= 1.0
        return True

    def give_back(self, lane: PacingLane) -> None:
        """Undo one ``try_take``: the probe never left (socket buffer full)."""
        for b in (lane.by_address, lane.by_prefix, self.global_bucket):
            b.tokens = min(b.burst, b.tokens + 1.0)

    def ready_at(self, lane: PacingLane) -> float:
        """When all three buckets of ``lane`` will hold a token (no one else taking)."""
        return max(
            lane.by_address.ready_at(), lane.by_prefix.ready_at(), self.global_bucket.ready_at()
        )

    def buckets(self) -> int:
        """Per-address and per-prefix buckets held (for stats and leak tests)."""
        return len(self._by_address) + len(self._by_prefix)
