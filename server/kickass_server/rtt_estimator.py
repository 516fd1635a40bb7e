"""Round-trip estimate and per-probe timeout of one probe run.

Jacobson/Karels smoothing (RFC 6298 gains), seeded from the handshake's
CHALLENGE -> ECHO round trip. The study never retransmits, so every sample is
clean (no Karn ambiguity). The timeout is ``2*SRTT + 4*RTTVAR`` — twice the
smoothed RTT rather than RFC 6298's once, because a probe that comes back
after its timeout is recorded lost, and the paper's rule must not turn a
slow-but-delivered probe into a loss — clamped to the policy's bounds.

``window_timeout`` is RFC 6298's own ``SRTT + 4*RTTVAR`` (at least
``1.25*SRTT``, within the same bounds, never above ``timeout``): after it a
probe no longer holds a place in the run's window (it is presumed lost, as
TCP's RTO presumes a segment left the network), while its outcome still waits
for ``timeout``. On a path that drops every fragment each split would
otherwise hold its window place for ``timeout``, about 2.2 RTT, and the split
phase would run at less than half the pace of a clean path; with it, at about
1/1.25 of that pace.
"""

from __future__ import annotations


class RttEstimator:
    __slots__ = ("srtt", "rttvar", "timeout", "window_timeout", "min_timeout", "max_timeout")

    def __init__(self, min_timeout: float, max_timeout: float) -> None:
        if not 0 < min_timeout <= max_timeout:
            raise ValueError(f"bad timeout bounds {min_timeout!r}..{max_timeout!r}")
        self.min_timeout = min_timeout
        self.max_timeout = max_timeout
        self.srtt = 0.0
        self.rttvar = 0.0
        # Until a sample arrives nothing is in flight; the upper bound is the
        # safe value should anyone ask.
        self.timeout = max_timeout
        self.window_timeout = max_timeout

    def seed(self, rtt: float) -> None:
        """First sample (the handshake): RFC 6298 section 2.2."""
        self.srtt, self.rttvar = rtt, rtt / 2.0
        self._update()

    def sample(self, rtt: float) -> None:
        """A later sample: RFC 6298 section 2.3 (beta 1/4, alpha 1/8)."""
        self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
        self.srtt = 0.875 * self.srtt + 0.125 * rtt
        self._update()

    def _update(self) -> None:
        raw = 2.0 * self.srtt + 4.0 * self.rttvar
        self.timeout = min(max(raw, self.min_timeout), self.max_timeout)
        # At least SRTT/4 above SRTT: jitter-free samples drive RTTVAR to zero,
        # and a probe a microsecond slower than the mean must keep its place.
        rto = self.srtt + max(4.0 * self.rttvar, self.srtt / 4.0)
        self.window_timeout = min(max(rto, self.min_timeout), self.timeout)
