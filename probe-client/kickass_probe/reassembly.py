"""The client's own IPv4 reassembly memory: read it, budget the split phase by
it, and notice when the kernel refuses fragments.

Why (issue 11): when one piece of a split datagram is lost, filtered or
duplicated, the other piece waits in the receiving kernel's reassembly queue
for ``ipfrag_time`` (30 s). Linux limits that queue to ``ipfrag_high_thresh``
(4 MB per network namespace); once it is full the kernel refuses *every* new
fragment (``IpReasmFails`` in /proc/net/snmp) and a naive study counts them as
lost on the path: 68% reported against 48.8% true at 20% loss each way.

What this module does, without root (Linux; elsewhere, macOS and Windows,
everything is unknown and a conservative estimate takes over: the summary
then says "cannot tell", never 0):

* ``read_limits`` / ``read_sample`` read the limits
  (/proc/sys/net/ipv4/ipfrag_high_thresh, ipfrag_low_thresh, ipfrag_time),
  the counters (/proc/net/snmp ``Ip: ReasmReqds ReasmOKs ReasmFails
  ReasmTimeout``, /proc/net/netstat ``IpExt: ReasmOverlaps``) and the memory
  in use right now (/proc/net/sockstat ``FRAG: inuse N memory BYTES``). All
  are per network namespace and world-readable.
* ``ReassemblyBudget`` (sans-IO: samples and time in, numbers out) is the
  flow control of the split phase. The client tells the server, in every
  REPORT (~20 per second), how many splits it may have in flight:
  ``credits = (BUDGET_FRACTION * high_thresh - memory in use) / cost``
  (``IN_FLIGHT`` mode, which a server confirms at admission: the REPORT's
  limit is ``first split seq + credits`` and the server keeps at most
  ``credits`` splits sent and unresolved; a split frees its credit when it
  is acknowledged *or times out*, so a path that drops every fragment runs
  the split phase at the pace of its window; a leftover it did leave is in
  the memory in use, hence in the next credits). With an older server the
  limit is absolute: ``highest seq received + 1 + credits``, which stalls on
  a path where no split ever arrives.
  ``cost`` being the memory one unfinished datagram takes (learnt from
  sockstat as memory / queues, never below ``MIN_COST``; ``DEFAULT_COST``
  until learnt). Every split the server may still send is counted as if it
  became a leftover, so the study's own leftovers can at most fill
  ``BUDGET_FRACTION`` (half) of the memory, whatever the path does (loss,
  filters, duplication) — the other half stays free for the rest of the
  system. On a clean path credits are in the thousands and never bind; on a
  path that leaves many leftovers the split phase slows to what the memory
  drains (at worst budget / cost leftovers per ``ipfrag_time``).
  Why the client and not the server: only the client sees its memory, and
  it also sees leftovers the server cannot infer (a duplicated split is
  acknowledged, yet leaves its duplicate piece behind).
* Refusals: ``ReasmFails`` counts timeouts (our own leftovers expiring) and
  overlaps too, so refused = ΔReasmFails - ΔReasmTimeout - ΔReasmOverlaps.
  A refused fragment belongs to a probe sent after the highest one received
  before the refusals began and before the first one received after they
  ended (the server sends in sequence order; a window of slack on either side
  for reordering). That span becomes an *invalid* range once it is closed
  (or at the end of the session): a probe in it that never arrived is
  reported invalid, not lost, and the server leaves it out of every drop
  rate. The range is not closed by time but by the next probe that arrives:
  while the memory is full the server sends nothing (no credit), so the
  refused probes can be far behind the clock.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

SNMP_PATH = "/proc/net/snmp"
NETSTAT_PATH = "/proc/net/netstat"
SOCKSTAT_PATH = "/proc/net/sockstat"
SYSCTL_DIR = "/proc/sys/net/ipv4"

# Linux's defaults, assumed where the system does not tell.
DEFAULT_HIGH_THRESH = 4 * 1024 * 1024
DEFAULT_TIME_S = 30
# The share of the reassembly memory the study's own leftovers may fill.
BUDGET_FRACTION = 0.5
# Bytes one unfinished datagram holds: assumed until learnt, and the least
# ever assumed. Measured on veth (Linux 6.x): 1,032 bytes for a 44-byte
# fragment, 2,504 for 916 or 1,480 bytes; drivers that give each packet a
# whole page hold more, and sockstat tells us so.
DEFAULT_COST = 4096
MIN_COST = 2048
# Queues needed before memory / queues is trusted as the cost.
LEARN_MIN_QUEUES = 16
# How often the client samples its counters and sends a REPORT.
REPORT_INTERVAL_S = 0.05
# Memory full for longer than this many ipfrag_time, at most TRICKLE_MAX_S
# (something else holds it): grant one split per report, so the session ends
# instead of waiting forever; those probes are marked invalid if the kernel
# refuses them. The cap stays below the runner's "no progress" limit (120 s).
TRICKLE_AFTER_TIMES = 2
TRICKLE_MAX_S = 60.0
# A REPORT names at most this many invalid ranges (the newest); all of them
# go in the end-of-session report.
MAX_RANGES_KEPT = 4096
# The flow-control mode in which credits bound the splits in flight (the
# session request's reassembly.credit_mode; the server's flow_control).
IN_FLIGHT = "in-flight"


@dataclass(frozen=True)
class Limits:
    """The kernel's reassembly limits (None: not known on this system)."""

    high_thresh: int | None = None
    low_thresh: int | None = None
    time_s: int | None = None

    def to_json(self) -> dict[str, int | None]:
        return asdict(self)


@dataclass(frozen=True)
class Sample:
    """The reassembly counters and memory at one moment (None: unknown)."""

    at: float
    reqds: int | None = None
    oks: int | None = None
    fails: int | None = None
    timeouts: int | None = None
    overlaps: int | None = None
    memory: int | None = None
    queues: int | None = None

    def to_json(self) -> dict[str, int | None]:
        d = asdict(self)
        del d["at"]
        return d


# -- reading the system (the only IO here) --------------------------------------------


def on_linux() -> bool:
    """Whether this system has Linux's /proc and IP_RECVFRAGSIZE. Read at each
    call (not at import), so a test can play another system by setting
    ``sys.platform`` before the client starts."""
    return sys.platform.startswith("linux")


def _read(path: str) -> str | None:
    """A /proc file's text; None when unreadable or not on Linux (where a file
    of that name would not be the kernel's)."""
    if not on_linux():
        return None
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read(65536)
    except OSError:
        return None


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        value = int(text.split()[0])
    except (ValueError, IndexError):
        return None
    return value if value >= 0 else None


def parse_proc_table(text: str | None, prefix: str) -> dict[str, int]:
    """The ``prefix`` rows of /proc/net/snmp or netstat: a header line of names
    followed by a line of values."""
    if not text:
        return {}
    lines = [ln.split() for ln in text.splitlines() if ln.startswith(prefix + ":")]
    out: dict[str, int] = {}
    for names, values in zip(lines[0::2], lines[1::2]):
        for k, v in zip(names[1:], values[1:]):
            try:
                out[k] = int(v)
            except ValueError:
                continue
    return out


def parse_sockstat_frag(text: str | None) -> tuple[int | None, int | None]:
    """(queues, memory) from the ``FRAG: inuse N memory M`` line."""
    for line in (text or "").splitlines():
        parts = line.split()
        if parts[:1] == ["FRAG:"] and len(parts) >= 5:
            kv = dict(zip(parts[1::2], parts[2::2]))
            return _int(kv.get("inuse")), _int(kv.get("memory"))
    return None, None


def read_limits(read: Callable[[str], str | None] = _read) -> Limits:
    return Limits(
        high_thresh=_int(read(f"{SYSCTL_DIR}/ipfrag_high_thresh")),
        low_thresh=_int(read(f"{SYSCTL_DIR}/ipfrag_low_thresh")),
        time_s=_int(read(f"{SYSCTL_DIR}/ipfrag_time")),
    )


def read_sample(now: float, read: Callable[[str], str | None] = _read) -> Sample:
    ip = parse_proc_table(read(SNMP_PATH), "Ip")
    ipext = parse_proc_table(read(NETSTAT_PATH), "IpExt")
    queues, memory = parse_sockstat_frag(read(SOCKSTAT_PATH))
    return Sample(
        at=now,
        reqds=ip.get("ReasmReqds"),
        oks=ip.get("ReasmOKs"),
        fails=ip.get("ReasmFails"),
        timeouts=ip.get("ReasmTimeout"),
        overlaps=ipext.get("ReasmOverlaps"),
        memory=memory,
        queues=queues,
    )


def refused_between(a: Sample, b: Sample) -> int:
    """Fragments the kernel refused between two samples (not timeouts or overlaps)."""
    if a.fails is None or b.fails is None:
        return 0
    d = b.fails - a.fails
    if a.timeouts is not None and b.timeouts is not None:
        d -= b.timeouts - a.timeouts
    if a.overlaps is not None and b.overlaps is not None:
        d -= b.overlaps - a.overlaps
    return max(0, d)


# -- the budget (sans-IO) -----------------------------------------------------------------


def credits_for(limits: Limits, memory: float | None, cost: float = DEFAULT_COST) -> int:
    """Unfinished datagrams the budget still has room for."""
    budget = BUDGET_FRACTION * (limits.high_thresh or DEFAULT_HIGH_THRESH)
    return max(0, int((budget - (memory or 0)) // cost))


@dataclass
class _Counters:
    reports: int = 0
    refused: int = 0  # since the session began
    refused_in_split: int = 0
    max_memory: int = 0
    max_memory_in_split: int = 0
    min_credits: int | None = None
    zero_credit_s: float = 0.0
    trickle_grants: int = 0
    # Whether this system tells the memory in use (sockstat) and the counters
    # refusals are computed from (snmp); without them (not Linux) the summary
    # says null ("cannot tell"), never 0.
    memory_known: bool = False
    refusals_known: bool = False


@dataclass
class ReassemblyBudget:
    """Flow control of the split phase from the client's reassembly memory.

    Feed it ``on_sample(sample, highest_seq)`` (highest probe seq received so
    far, -1 before any); read ``split_limit`` (the REPORT's) and
    ``invalid_ranges``. ``window`` is the plan's probes in flight: the margin
    of an invalid range on either side. ``in_flight``: the server applies
    ``IN_FLIGHT`` flow control (the limit is ``first_split_seq + credits``).
    """

    limits: Limits
    first_split_seq: int
    total_probes: int
    window: int
    start: Sample | None = None
    in_flight: bool = False
    cost: float = DEFAULT_COST
    learnt_cost: bool = False
    split_limit: int = 0
    credits: int = 0
    invalid_ranges: list[tuple[int, int]] = field(default_factory=list)
    split_start: Sample | None = None
    last: Sample | None = None
    counters: _Counters = field(default_factory=_Counters)
    _zero_since: float | None = None
    _missing: deque[tuple[float, int]] = field(default_factory=deque)
    _last_highest: int = -1
    _initial_credit: int = 0
    # Start of a span of refusals not yet closed by a probe received after it.
    _open_lo: int | None = None
    _refusal_ended: bool = False

    def __post_init__(self) -> None:
        self.last = self.start
        if self.start is not None:
            self._learn_known(self.start)
        self._missing.append((self.start.at if self.start else 0.0, 0))
        self.credits = self._credits(self.start.memory if self.start else None, 0)
        self._initial_credit = self.credits
        self.split_limit = min(self.total_probes, self.first_split_seq + self.credits)

    # -- derived --------------------------------------------------------------------

    @property
    def high_thresh(self) -> int:
        return self.limits.high_thresh or DEFAULT_HIGH_THRESH

    @property
    def time_s(self) -> float:
        return float(self.limits.time_s or DEFAULT_TIME_S)

    @property
    def budget_bytes(self) -> float:
        return BUDGET_FRACTION * self.high_thresh

    def initial_credit(self) -> int:
        """Splits the server may send before the first REPORT arrives."""
        return self._initial_credit

    def _credits(self, memory: int | None, estimated_leftovers: int) -> int:
        used = memory if memory is not None else estimated_leftovers * self.cost
        return credits_for(self.limits, used, self.cost)

    # -- input ----------------------------------------------------------------------

    def on_sample(
        self,
        sample: Sample,
        highest_seq: int,
        missing_splits: int = 0,
        lowest_since: int | None = None,
    ) -> list[tuple[int, int]]:
        """Take one sample; returns the invalid ranges it closed (often none).

        ``missing_splits``: split probes below ``highest_seq`` that never
        arrived (cumulative). It estimates the leftovers where the memory in
        use is unknown (not Linux): each counts for ``ipfrag_time``.
        ``lowest_since``: the lowest seq received since the previous sample
        (None: none arrived); it closes a span of refusals.
        """
        c = self.counters
        c.reports += 1
        self._learn_known(sample)
        prev = self.last
        self.last = sample
        in_split = highest_seq >= self.first_split_seq
        if in_split and self.split_start is None:
            self.split_start = prev or sample
        if sample.memory is not None:
            c.max_memory = max(c.max_memory, sample.memory)
            if in_split:
                c.max_memory_in_split = max(c.max_memory_in_split, sample.memory)
            if sample.queues and sample.queues >= LEARN_MIN_QUEUES:
                avg = sample.memory / sample.queues
                base = self.cost if self.learnt_cost else MIN_COST
                self.cost = max(base, avg)
                self.learnt_cost = True
        # Leftovers estimate for systems that do not tell the memory in use.
        now = sample.at
        # Keep the last entry at or before now - ipfrag_time as the baseline:
        # what went missing since then may still sit in the queue.
        self._missing.append((now, missing_splits))
        while len(self._missing) > 1 and self._missing[1][0] <= now - self.time_s:
            self._missing.popleft()
        recent = missing_splits - self._missing[0][1]
        credits = self._credits(sample.memory, recent)
        # The budget of the split phase only: before it, this is what the
        # server may send once it starts.
        trickle = False
        if credits == 0:
            if self._zero_since is None:
                self._zero_since = now
            elif now - self._zero_since > min(TRICKLE_AFTER_TIMES * self.time_s, TRICKLE_MAX_S):
                credits, trickle = 1, True
                c.trickle_grants += 1
        else:
            if self._zero_since is not None:
                c.zero_credit_s += now - self._zero_since
            self._zero_since = None
        self.credits = credits
        if in_split:
            c.min_credits = credits if c.min_credits is None else min(c.min_credits, credits)
        if self.in_flight:
            # A count, not a position: the server resolves splits (acked or
            # timed out) and keeps at most ``credits`` in flight. A trickle is
            # one split at a time.
            self.split_limit = self.first_split_seq + credits
        else:
            base = max(highest_seq + 1, self.first_split_seq)
            if trickle:
                # One more split per report, whether the last one arrived or
                # not (a refused one would otherwise hold the limit where it is).
                base = max(base, self.split_limit)
            self.split_limit = min(self.total_probes, base + credits)
        added: list[tuple[int, int]] = []
        refused = refused_between(prev, sample) if prev is not None else 0
        if refused:
            c.refused += refused
            if in_split or highest_seq + 1 + 2 * self.window >= self.first_split_seq:
                c.refused_in_split += refused
            if self._open_lo is None:
                self._open_lo = max(0, self._last_highest + 1 - self.window)
            self._refusal_ended = False
        elif self._open_lo is not None:
            if self._refusal_ended and lowest_since is not None:
                # A probe that arrived after the refusals ended: every refused
                # one was sent before it.
                added.append(self._close(lowest_since + self.window))
            else:
                # Arrivals in the same interval as the last refusals may
                # predate them: wait for the next interval's.
                self._refusal_ended = True
        self._last_highest = highest_seq
        return added

    def _learn_known(self, sample: Sample) -> None:
        if sample.memory is not None:
            self.counters.memory_known = True
        if sample.fails is not None:
            self.counters.refusals_known = True

    def _close(self, end: int) -> tuple[int, int]:
        assert self._open_lo is not None
        lo, self._open_lo = self._open_lo, None
        self._refusal_ended = False
        return self._add_range(lo, max(lo + 1, min(self.total_probes, end)))

    def finish(self, now: float) -> None:
        """At the end of the session: close a credit wait and a span of
        refusals still open (to the end of the plan)."""
        if self._zero_since is not None:
            self.counters.zero_credit_s += now - self._zero_since
            self._zero_since = now
        if self._open_lo is not None:
            self._close(self.total_probes)

    def _add_range(self, lo: int, hi: int) -> tuple[int, int]:
        r = self.invalid_ranges
        if r and lo <= r[-1][1]:
            lo = min(lo, r[-1][0])
            hi = max(hi, r[-1][1])
            r[-1] = (lo, hi)
        else:
            r.append((lo, hi))
            if len(r) > MAX_RANGES_KEPT:
                # Merge the oldest two: wider, never narrower, so nothing
                # refused is ever reported as valid.
                a, b = r.pop(0), r.pop(0)
                r.insert(0, (a[0], b[1]))
        return r[-1]

    def report_ranges(self) -> tuple[tuple[int, int], ...]:
        return tuple(self.invalid_ranges)

    # -- output ---------------------------------------------------------------------

    def summary(self, after: Sample | None = None) -> dict[str, Any]:
        """What the session's metadata and the JSON output keep."""
        c = self.counters
        memory = c.memory_known
        refusals = c.refusals_known
        return {
            "limits": self.limits.to_json(),
            "budget": {
                "method": "client-credit",
                "fraction": BUDGET_FRACTION,
                "budget_bytes": int(self.budget_bytes),
                "cost_bytes": int(math.ceil(self.cost)),
                "cost_learnt": self.learnt_cost,
                "initial_credit": self._initial_credit,
                "min_credits_in_split": c.min_credits,
                "zero_credit_s": round(c.zero_credit_s, 3),
                "trickle_grants": c.trickle_grants,
                # "measured": credits from the memory in use (Linux sockstat);
                # "estimated": from the splits that did not arrive within
                # ipfrag_time (a system that does not tell its memory).
                "memory_in_use": "measured" if memory else "estimated",
            },
            "before": None if self.start is None else self.start.to_json(),
            "split_start": None if self.split_start is None else self.split_start.to_json(),
            "during": {
                "samples": c.reports,
                # null: this system does not tell (not Linux), not "none".
                "max_memory": c.max_memory if memory else None,
                "max_memory_in_split": c.max_memory_in_split if memory else None,
                "refused": c.refused if refusals else None,
                "refused_in_split": c.refused_in_split if refusals else None,
            },
            "after": None if after is None else after.to_json(),
            # The ranges themselves travel beside this summary (the report's
            # "invalid_ranges"): there may be thousands.
            "invalid_ranges": len(self.invalid_ranges),
        }
