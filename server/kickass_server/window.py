"""The adaptive probe window (issue 11 part 4): how many probes one run has in
flight, from the RTT it measures and the losses it sees. Sans-IO: time and
events in, a window and a send time out; ``ProbeCore`` owns one per adaptive
run, and tests drive it on a simulated clock.

Why: a fixed window is either slow (W=8 takes about 8 minutes for the paper's
36,600 probes over a 100 ms path) or too much for some volunteers' links. The
controller starts small and grows while the path shows no sign that the study
itself is the cause of anything, so the default plan takes about a minute on
a 100 ms path and its estimates are the ones stop-and-wait (W=1) gives.

The trap: loss is what the study *measures*. A path that drops 2% of all
packets, or every fragment, or every size above its MTU, must not shrink the
window (the estimate does not depend on it, and a fragment-dropping client at
W=1 would wait an hour). Only loss the window *causes* counts, told apart
like this:

* **Delay** (the main signal, LEDBAT-like). A queue the study builds on the
  volunteer's access link shows as a longer round trip before it overflows.
  Each epoch (about one window of probes) takes the minimum RTT of its first
  ``DELAY_SAMPLES`` ACKs (the minimum: jitter does not move it, a standing
  queue does) and compares it with the base RTT (the smallest epoch minimum
  of the last ``BASE_RTT_WINDOW_S``). More than the target above it —
  ``DELAY_TARGET_FRACTION`` of the base, within ``DELAY_TARGET_MIN_S`` ..
  ``DELAY_TARGET_MAX_S`` — ends slow start, or shrinks the window by
  ``DELAY_BETA``. The per-probe timeout (2 SRTT + 4 RTTVAR) is far above
  that, so a queue kept this short never turns a delivered probe into a lost
  one.
* **Excess loss** (for policers and shallow buffers, which drop without
  delay). Only probes of *live* sizes count: sizes acknowledged at least once
  before in this phase. A size the path drops every time (a fragment filter,
  an MTU black hole) is dead after its first try and says nothing about the
  window; a size not tried yet (the first round of a phase) is not judged.
  Each epoch's losses among live sizes are compared with the phase's loss
  rate among live sizes, a baseline of epochs not flagged (trusted after
  ``BASELINE_MIN`` probes; until then the window stays within
  ``BASELINE_WINDOW``, so the baseline is the path's loss at a rate too low
  to cause any; the split phase starts from the whole phase's baseline).
  More than n·p + ``LOSS_Z`` binomial standard deviations + 1 (on a path
  losing 1% each way an epoch of 64 is flagged by chance with probability
  0.03% (whole) to 0.06% (split): one false alarm in about three full
  plans, each costing about a second): the window
  shrinks by ``BETA``, and to no more than the probes of that epoch that
  got through (what the path carried in about one round trip). An epoch
  flagged while the window is already at ``FLOOR_WINDOW`` or below joins the
  baseline instead: loss that persists at the smallest window is the path's,
  not ours.

Losses are seen early: a probe still unacknowledged when ``REORDER_THRESHOLD``
probes sent after it were acknowledged counts as lost *for the window* at
once (TCP's three duplicate ACKs), not at its timeout, so a policer is
noticed within about one round trip. (The study's own outcome of the probe
still waits for its timeout: a late ACK makes it ``late``, as always.)

One reaction per episode: epochs that began before the last decrease cannot
cause another (they were sent at the old window).

Growth: slow start (+1 per ACK, doubling per round trip) from
``INITIAL_WINDOW`` up to the first congestion sign, then +1 per window of
ACKs (a quarter of that within ``NEAR_CEILING`` of the window at the last
excess loss, so a policer's edge is probed rarely, as CUBIC's plateau
does); only while the window is what limits sending (not pacing, not the
client's reassembly credit), so it never inflates unused.

Caps, whatever the signals say:

* ``max_window``: the plan's window (the server's ``max_window``, 64);
* the access-link rate: sends are paced to ``rate_bps`` IP bits per second
  (default ``ACCESS_RATE_BPS``, 8 Mbit/s = 1 MB/s, a virtual clock with at
  most ``PACING_SLACK_S`` of burst);
* the client's reassembly credit and the server's per-address, per-/24 and
  global pacing stay where they were: ``ProbeCore`` checks them before this.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

INITIAL_WINDOW = 4
MIN_WINDOW = 1
# At or below this window a flagged epoch is the path's loss, not ours.
FLOOR_WINDOW = 2
# The study's sending rate, in IP bits per second: 8 Mbit/s (1 MB/s). Why this
# number: the paper's plan is 42 MB of IP packets, so about a minute needs
# 5.6 Mbit/s on average; 8 leaves room for the slow start and the tail. It is
# a few percent of a typical fixed line (median fixed broadband is well over
# 50 Mbit/s) and one HD video stream; on a slower line the delay signal,
# not this cap, keeps the study out of the way.
ACCESS_RATE_BPS = 8_000_000.0
# Burst the pacing's virtual clock may run behind the real one (quinn paces in
# bursts of about 2 ms): a late timer does not lower the rate.
PACING_SLACK_S = 0.002
# An epoch: at least this many probes, or the window at its start.
MIN_EPOCH = 16
REORDER_THRESHOLD = 3
NEAR_CEILING = 0.9
BETA = 0.7  # multiplicative decrease on excess loss (CUBIC's)
DELAY_BETA = 0.85  # on a standing queue in congestion avoidance
DELAY_SAMPLES = 8
DELAY_TARGET_FRACTION = 0.25
DELAY_TARGET_MIN_S = 0.010
DELAY_TARGET_MAX_S = 0.050
BASE_RTT_WINDOW_S = 30.0
LOSS_Z = 3.5
BASELINE_MIN = 32
# Until the loss baseline is trusted the window stays at most this: the
# baseline is the path's loss at a rate too low to cause any.
BASELINE_WINDOW = 16
# Epoch minimum RTTs kept for the run's record (the queue the study built).
MAX_RECORDED_EPOCHS = 20_000


@dataclass
class _Epoch:
    start: int  # first seq
    end: int  # one past the last seq sent in it so far
    phase: str
    closed: bool = False
    resolved: int = 0
    lost: int = 0
    acks: int = 0
    live: int = 0  # resolved probes of sizes acknowledged before in this phase
    live_lost: int = 0
    min_rtt: float = math.inf
    delay_checked: bool = False


@dataclass
class _Baseline:
    """A phase's loss among live sizes, from epochs the window did not affect."""

    probes: float = 0.0
    lost: float = 0.0

    def rate(self) -> float:
        return (self.lost + 0.5) / (self.probes + 1.0)

    def add(self, probes: int, lost: int) -> None:
        self.probes += probes
        self.lost += lost


class WindowController:
    """The adaptive window of one run. Feed it every send, ACK and loss of its
    probes (in sequence order of sending); read ``window`` and ``send_at``."""

    def __init__(
        self,
        max_window: int,
        now: float,
        *,
        rate_bps: float = ACCESS_RATE_BPS,
        initial_window: int = INITIAL_WINDOW,
        rtt_seed: float | None = None,
    ) -> None:
        if max_window < 1:
            raise ValueError(f"max_window must be at least 1, got {max_window}")
        if not rate_bps > 0:
            raise ValueError(f"rate_bps must be positive, got {rate_bps!r}")
        self.max_window = max_window
        self.rate_bps = rate_bps
        self.cwnd = float(max(MIN_WINDOW, min(initial_window, max_window)))
        self.ssthresh = math.inf
        self.send_at = now
        self.srtt: float | None = rtt_seed
        self._base: deque[tuple[float, float]] = deque()  # (time, epoch min RTT)
        if rtt_seed is not None:
            self._base.append((now, rtt_seed))
        self._epochs: deque[_Epoch] = deque()
        self._where: dict[int, tuple[_Epoch, str, int]] = {}  # seq -> (epoch, phase, size)
        self._live: set[tuple[str, int]] = set()  # (phase, size) acknowledged before
        self._baselines: dict[str, _Baseline] = {}
        self._ceiling = math.inf  # the window at the last excess loss
        self._recovery_seq = -1  # epochs starting before this cannot react again
        self._next_seq = 0
        self._bytes = [0, 0]  # bytes and probes sent in the current phase
        self._last_full = -math.inf
        # For the run's summary.
        self.started = now
        self.max_reached = int(self.cwnd)
        self.loss_events = 0
        self.delay_events = 0
        self.floor_absorbed = 0
        self._epoch_min_rtts: list[float] = []
        self._window_time = 0.0  # integral of the window over time
        self._window_since = now

    # -- outputs ---------------------------------------------------------------------

    @property
    def window(self) -> int:
        return max(MIN_WINDOW, min(self.max_window, int(self.cwnd)))

    def base_rtt(self) -> float | None:
        return min(r for _, r in self._base) if self._base else None

    def delay_target(self, base: float) -> float:
        return min(max(DELAY_TARGET_FRACTION * base, DELAY_TARGET_MIN_S), DELAY_TARGET_MAX_S)

    def summary(self, now: float) -> dict[str, object]:
        self._account(now)
        span = max(now - self.started, 1e-9)
        base = self.base_rtt()
        return {
            "method": "adaptive",
            "max_window": self.max_window,
            "rate_bps": self.rate_bps,
            "window": self.window,
            "max_reached": self.max_reached,
            "mean_window": round(self._window_time / span, 2),
            "loss_events": self.loss_events,
            "delay_events": self.delay_events,
            "floor_absorbed": self.floor_absorbed,
            "base_rtt_ms": None if base is None else round(base * 1000.0, 3),
            # The standing queue the study built: each epoch's minimum RTT
            # above the smallest one of the run (median, 95th percentile).
            "queue_delay_ms": self._queue_delay(),
        }

    def _queue_delay(self) -> dict[str, float] | None:
        mins = sorted(self._epoch_min_rtts)
        if not mins:
            return None

        def at(q: float) -> float:
            return round((mins[min(len(mins) - 1, int(q * len(mins)))] - mins[0]) * 1000.0, 3)

        return {"p50": at(0.5), "p95": at(0.95), "max": at(1.0)}

    # -- inputs ----------------------------------------------------------------------

    def on_send(
        self, now: float, seq: int, phase: str, size: int, nbytes: int, in_flight: int
    ) -> None:
        """Probe ``seq`` (of ``phase`` and ``size``) left; ``in_flight`` counts it."""
        self.send_at = max(self.send_at, now - PACING_SLACK_S) + nbytes * 8.0 / self.rate_bps
        if in_flight >= self.window:
            self._last_full = now
        ep = self._epochs[-1] if self._epochs else None
        if ep is not None and ep.phase != phase:
            self._new_phase(now, phase, nbytes)
        if (
            ep is None
            or ep.closed
            or ep.phase != phase
            or ep.end - ep.start >= max(MIN_EPOCH, self.window)
            or ep.end != seq
        ):
            if ep is not None:
                ep.closed = True
                self._maybe_evaluate(now)
            ep = _Epoch(seq, seq, phase)
            self._epochs.append(ep)
        ep.end = seq + 1
        self._where[seq] = (ep, phase, size)
        self._bytes[0] += nbytes
        self._bytes[1] += 1
        self._next_seq = seq + 1

    def on_unsent(self, seq: int, nbytes: int) -> None:
        """The newest probe never left (the shell could not send it): undo it."""
        entry = self._where.pop(seq, None)
        if entry is None:
            return
        ep = entry[0]
        if ep.end == seq + 1:
            ep.end = seq
        self.send_at -= nbytes * 8.0 / self.rate_bps
        self._next_seq = seq
        if ep.end == ep.start and self._epochs and self._epochs[-1] is ep:
            self._epochs.pop()

    def on_ack(self, now: float, seq: int, rtt: float) -> None:
        """Probe ``seq`` was acknowledged in time, ``rtt`` after it left."""
        entry = self._where.pop(seq, None)
        if entry is None:
            return
        ep = entry[0]
        self.srtt = rtt if self.srtt is None else 0.875 * self.srtt + 0.125 * rtt
        ep.acks += 1
        ep.min_rtt = min(ep.min_rtt, rtt)
        self._resolve(entry, lost=False)
        # Older probes still out with REORDER_THRESHOLD later ones acknowledged.
        while self._where:
            oldest = next(iter(self._where))
            if oldest > seq - REORDER_THRESHOLD:
                break
            self._resolve(self._where.pop(oldest), lost=True)
        if not ep.delay_checked and ep.acks >= DELAY_SAMPLES:
            self._check_delay(now, ep)
        if now - self._last_full <= (self.srtt or 0.0) and ep.start >= self._recovery_seq:
            self._account(now)
            if self.cwnd < self.ssthresh:
                self.cwnd += 1.0
            else:
                slow = 4.0 if self.cwnd >= NEAR_CEILING * self._ceiling else 1.0
                self.cwnd += 1.0 / (slow * max(self.cwnd, 1.0))
            self.cwnd = min(self.cwnd, float(self.max_window), self._baseline_cap())
            self.max_reached = max(self.max_reached, self.window)
        self._maybe_evaluate(now)

    def on_loss(self, now: float, seq: int) -> None:
        """Probe ``seq`` timed out (lost, or late: the same to the window)."""
        entry = self._where.pop(seq, None)
        if entry is None:
            return
        self._resolve(entry, lost=True)
        self._maybe_evaluate(now)

    # -- internals ---------------------------------------------------------------------

    def _resolve(self, entry: tuple[_Epoch, str, int], *, lost: bool) -> None:
        ep, phase, size = entry
        key = (phase, size)
        if key in self._live:
            ep.live += 1
            ep.live_lost += lost
        elif not lost:
            self._live.add(key)
        ep.resolved += 1
        ep.lost += lost

    def _baseline_cap(self) -> float:
        """The window's bound while the current phase's loss baseline is not
        trusted yet (unbounded once it is)."""
        ep = self._epochs[-1] if self._epochs else None
        base = self._baselines.get(ep.phase) if ep is not None else None
        if base is not None and base.probes >= BASELINE_MIN:
            return math.inf
        return float(max(BASELINE_WINDOW, MIN_WINDOW))

    def _new_phase(self, now: float, phase: str, nbytes: int) -> None:
        """The split phase begins. Its probes are larger (1520 bytes against
        the whole phase's mean): after a congestion sign the window keeps the
        bytes in flight, not the count. Its loss baseline starts from the
        whole phase's, scaled to three packets instead of two, so its first
        epochs are judged too."""
        mean = self._bytes[0] / self._bytes[1] if self._bytes[1] else nbytes
        if self.ssthresh < math.inf and nbytes > mean:
            self._account(now)
            self.cwnd = max(float(MIN_WINDOW), self.cwnd * mean / nbytes)
            self.ssthresh = self.cwnd
        self._bytes = [0, 0]
        prev = next(iter(self._baselines.values()), None)
        if phase not in self._baselines and prev is not None and prev.probes >= BASELINE_MIN:
            p = 1.0 - (1.0 - prev.rate()) ** 1.5
            self._baselines[phase] = _Baseline(BASELINE_MIN, BASELINE_MIN * p)

    def _maybe_evaluate(self, now: float) -> None:
        """Judge the oldest epochs whose every probe is resolved, in order."""
        while self._epochs:
            ep = self._epochs[0]
            if not ep.closed or ep.resolved < ep.end - ep.start:
                return
            self._epochs.popleft()
            self._evaluate(now, ep)

    def _check_delay(self, now: float, ep: _Epoch) -> None:
        ep.delay_checked = True
        if ep.min_rtt == math.inf:
            return
        base = self.base_rtt()
        self._base.append((now, ep.min_rtt))
        if len(self._epoch_min_rtts) < MAX_RECORDED_EPOCHS:
            self._epoch_min_rtts.append(ep.min_rtt)
        while len(self._base) > 1 and self._base[0][0] < now - BASE_RTT_WINDOW_S:
            self._base.popleft()
        if base is None or ep.min_rtt <= base + self.delay_target(base):
            return
        if ep.start < self._recovery_seq:
            return
        self._account(now)
        self.delay_events += 1
        if self.cwnd < self.ssthresh:
            self.ssthresh = self.cwnd  # leave slow start where the queue began
        else:
            self.cwnd = max(float(MIN_WINDOW), self.cwnd * DELAY_BETA)
            self.ssthresh = self.cwnd
        self._recovery_seq = self._next_seq

    def _evaluate(self, now: float, ep: _Epoch) -> None:
        if not ep.delay_checked:
            self._check_delay(now, ep)
        n, lost = ep.live, ep.live_lost
        baseline = self._baselines.setdefault(ep.phase, _Baseline())
        p = baseline.rate()
        excess = (
            baseline.probes >= BASELINE_MIN
            and lost > n * p + LOSS_Z * math.sqrt(n * p * (1.0 - p)) + 1.0
        )
        if not excess:
            baseline.add(n, lost)
            return
        if self.cwnd <= FLOOR_WINDOW:
            self.floor_absorbed += 1
            baseline.add(n, lost)
            return
        if ep.start < self._recovery_seq:
            return  # the same episode: one decrease per round of the old window
        self._account(now)
        self.loss_events += 1
        carried = ep.resolved - ep.lost
        self._ceiling = self.cwnd
        self.cwnd = max(float(MIN_WINDOW), min(self.cwnd * BETA, float(carried)))
        self.ssthresh = self.cwnd
        self._recovery_seq = self._next_seq

    def _account(self, now: float) -> None:
        if now > self._window_since:
            self._window_time += self.window * (now - self._window_since)
            self._window_since = now
