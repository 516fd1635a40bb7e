"""Window and credit control of one run: how many probes may be out, and the client's split credit.

The window is the plan's (``--window N``, stop-and-wait at 1: at most N
probes unresolved), or, for an adaptive plan, what the run's
``WindowController`` (window.py, started here by ``open_window``) allows up
to it; ``ProbeRun.window``/``in_window`` say how full it is. A client that
announced flow control (``split_credit`` at admission: ``grant``) also bounds
the split phase: its REPORTs (about 20 per second) carry ``split_limit``, and
no split probe beyond it is sent (``ProbeRun.credit_blocked``), so the study's
own unfinished datagrams never fill the client's reassembly memory
(kickass_probe.reassembly explains the budget). REPORTs also name ranges of
seqs measured while the client's kernel refused fragments: a probe there that
was not acknowledged is *invalid* (``reassembly_invalid``), not lost, and
stays out of the verdict's counts (``take_report``). Such a run finishes
``REPORT_GRACE_S`` after its last probe resolved, so the client's last REPORT
can still arrive.

Pure functions of a run and the client's words (no clock, no socket): the
core (core.py) counts, records and schedules what they answer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kickass_core import wire
from kickass_core.states import PROBING

from ..window import WindowController
from . import plan_iter
from .plan_iter import _LOST
from .run import IN_FLIGHT, ProbeRun, ReassemblyLog

if TYPE_CHECKING:
    from ..policy import Policy

__all__ = ["IN_FLIGHT", "MAX_INVALID_RANGES", "REPORT_GRACE_S", "ReassemblyLog"]

# A run with flow control finishes this long after its last probe resolved:
# the client reports every 50 ms, so its last word on refused fragments is in.
REPORT_GRACE_S = 0.5
# Invalid ranges a run keeps (each REPORT names up to 4; merged when adjacent).
MAX_INVALID_RANGES = 4096


def grant(run: ProbeRun, split_credit: int | None, credit_mode: str | None) -> None:
    """The credit the client announced at admission: this many splits may go
    before its first REPORT arrives (None: no flow control until a REPORT).
    ``credit_mode`` ``IN_FLIGHT``: the credit bounds splits in flight (see
    ProbeRun)."""
    if split_credit is not None:
        plan = run.plan
        credit = max(0, split_credit)
        run.split_limit = min(plan.total_probes, plan.split_from + credit)
        run.reasm = ReassemblyLog(initial_credit=credit)
        run.credit_mode = IN_FLIGHT if credit_mode == IN_FLIGHT else None


def open_window(run: ProbeRun, policy: Policy, now: float, rtt: float) -> None:
    """An adaptive plan's window, when probing starts (else the plan's, fixed)."""
    if run.plan.adaptive:
        run.ctl = WindowController(
            run.plan.window,
            now,
            rate_bps=policy.adaptive_rate_bps,
            initial_window=policy.adaptive_initial_window,
            rtt_seed=rtt,
        )


def take_report(run: ProbeRun, msg: wire.Report) -> tuple[list[int], bool]:
    """A REPORT from the run's proven peer: its refused-fragment ranges, then,
    unless an earlier REPORT overtook it, its memory and new credit. Returns
    the lost probes that became invalid (in seq order: the caller records
    them again) and whether the REPORT was new."""
    if run.reasm is None:
        # A client that did not announce flow control at admission: it
        # starts with its first REPORT.
        run.reasm = ReassemblyLog(initial_credit=None)
    log = run.reasm
    invalid: list[int] = []
    for first, end in msg.invalid:
        invalid += _mark_invalid(run, first, end)
    if msg.report_seq <= log.last_report_seq:
        return invalid, False
    log.last_report_seq = msg.report_seq
    log.reports += 1
    if msg.frag_memory != wire.UNKNOWN_U32:
        log.max_memory = max(log.max_memory, msg.frag_memory)
    if msg.frag_high_thresh != wire.UNKNOWN_U32:
        log.high_thresh = msg.frag_high_thresh
    log.refused = max(log.refused, msg.refused)
    if run.state == PROBING:
        # In IN_FLIGHT mode the limit is split_from + credit (never capped: the
        # credit is what counts); else an absolute bound on the next seq.
        run.split_limit = (
            msg.split_limit
            if run.credit_mode == IN_FLIGHT
            else min(msg.split_limit, run.plan.total_probes)
        )
    return invalid, True


def credit_wait(now: float, run: ProbeRun) -> bool:
    """Account the time a run waits for credit (the client's memory full);
    True when a wait begins."""
    log = run.reasm
    if log is None:
        return False
    waiting = run.credit_blocked() and run.next_seq < run.plan.total_probes
    if waiting and log.waiting_since is None:
        log.waiting_since = now
        log.credit_waits += 1
        return True
    if not waiting and log.waiting_since is not None:
        log.credit_wait_s += now - log.waiting_since
        log.waiting_since = None
    return False


def final_log(now: float, run: ProbeRun) -> dict[str, object] | None:
    """The run's reassembly log as it finishes (a wait still open ends now)."""
    if run.reasm is None:
        return None
    if run.reasm.waiting_since is not None:
        run.reasm.credit_wait_s += now - run.reasm.waiting_since
        run.reasm.waiting_since = None
    return run.reasm.to_json(run.phase_invalid)


def _mark_invalid(run: ProbeRun, first: int, end: int) -> list[int]:
    """Probes in [first, end) were measured while the client's kernel
    refused fragments: those not acknowledged are invalid, not lost. Returns
    those already lost.

    Every REPORT repeats its ranges (20 a second): only the part of a
    range not covered before is walked, so a repeated range costs nothing.
    """
    log = run.reasm
    assert log is not None
    first, end = max(0, first), min(end, len(run.codes))
    if first >= end:
        return []
    lost = []
    for a, b in _uncovered(log.ranges, first, end):
        for seq in range(a, b):
            if run.invalid[seq] or not _refusable(run, seq):
                continue
            run.invalid[seq] = 1
            if run.codes[seq] == _LOST:
                run.phase_invalid[plan_iter.phase(run.plan, seq)] += 1
                lost.append(seq)
    _cover(log.ranges, first, end)
    return lost


def _refusable(run: ProbeRun, seq: int) -> bool:
    """Could a full reassembly memory have refused this probe? Splits
    always; whole packets only from a size the path fragments."""
    return seq >= run.plan.split_from or plan_iter.ip_len(run.plan, seq) >= run.min_fragmented_whole


def _uncovered(ranges: list[tuple[int, int]], first: int, end: int) -> list[tuple[int, int]]:
    """The parts of [first, end) outside the sorted, disjoint ``ranges``."""
    out, at = [], first
    for a, b in ranges:
        if b <= at:
            continue
        if a >= end:
            break
        if a > at:
            out.append((at, a))
        at = max(at, b)
        if at >= end:
            break
    if at < end:
        out.append((at, end))
    return out


def _cover(ranges: list[tuple[int, int]], first: int, end: int) -> None:
    """Add [first, end) to the sorted, disjoint ``ranges`` (merging), bounded
    by MAX_INVALID_RANGES: beyond it the last two merge, and the gap between
    them counts as walked (the client's end-of-session report, which the store
    applies, still marks anything there)."""
    merged = []
    placed = False
    for a, b in ranges:
        if b < first:
            merged.append((a, b))
        elif a > end:
            if not placed:
                merged.append((first, end))
                placed = True
            merged.append((a, b))
        else:
            first, end = min(first, a), max(end, b)
    if not placed:
        merged.append((first, end))
        merged.sort()
    while len(merged) > MAX_INVALID_RANGES:
        (a, _), (_, d) = merged[-2], merged.pop()
        merged[-1] = (a, d)
    ranges[:] = merged
