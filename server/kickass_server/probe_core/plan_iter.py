"""The plan's iteration in one run: each seq's phase, size and state, and the counts per phase.

A run walks its plan once, in order (``ProbeRun.next_seq``): the whole
packets, then the splits (``kickass_core.plan.ProbePlan``). Every seq has one
byte of state, ``_UNSENT`` -> ``_OUT`` -> ``_ACKED``, or ``_LOST`` and, when its
ACK comes after the timeout, ``_LATE``; a probe the shell could not send goes
back to ``_UNSENT`` and is sent again. The functions here are those
transitions, each keeping the run's counts per phase (sent, acknowledged,
late, invalid) in step, so the verdict's inputs cannot drift from the seqs'
states. The per-seq arrays are allocated when probing starts (``start``): an
unproven session costs no memory proportional to its plan.

Pure functions of a run (no clock, no socket): the core (core.py) decides
when a probe goes or times out, and counts, records and schedules.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

from kickass_core import wire
from kickass_core.plan import SPLIT, WHOLE, ProbePlan
from kickass_core.states import LOST
from kickass_core.study_events import OutcomeEntry

if TYPE_CHECKING:
    from .run import ProbeRun

# Per-seq probe state (one byte per probe of the plan).
_UNSENT, _OUT, _ACKED, _LOST, _LATE = 0, 1, 2, 3, 4


def phase(plan: ProbePlan, seq: int) -> str:
    return SPLIT if seq >= plan.split_from else WHOLE


def ip_len(plan: ProbePlan, seq: int) -> int:
    """``plan.probe(seq).ip_len`` in O(1) and without the per-plan table
    (``ProbePlan.seq_ip_len``), whose first use costs tens of
    milliseconds of the probe clock for every new session."""
    first_split = plan.split_from
    if seq < first_split:
        return plan.whole[seq % len(plan.whole)]
    return plan.split[(seq - first_split) % len(plan.split)]


def start(run: ProbeRun) -> None:
    """The per-seq arrays, when the run starts probing."""
    n = run.plan.total_probes
    run.codes = bytearray(n)
    run.ack_counts = bytearray(n)
    run.invalid = bytearray(n)
    run.sent_at = array("d", bytes(8 * n))
    run.acked_at = array("d", bytes(8 * n))


def sent(run: ProbeRun, seq: int, now: float) -> None:
    """``seq`` (the run's next) went out at ``now``: outstanding until resolved."""
    run.next_seq += 1
    run.codes[seq] = _OUT
    run.outstanding[seq] = now
    run.sent_at[seq] = now
    run.sent += 1
    run.phase_sent[phase(run.plan, seq)] += 1


def unsent(run: ProbeRun, seq: int) -> None:
    """``seq`` (the run's newest) never left: as if it was never sent, and next again."""
    del run.outstanding[seq]
    run.presumed_lost.discard(seq)
    run.codes[seq] = _UNSENT
    run.next_seq = seq
    run.sent -= 1
    run.phase_sent[phase(run.plan, seq)] -= 1


def acked(run: ProbeRun, seq: int, now: float) -> float:
    """An outstanding ``seq`` acknowledged in time; returns when it was sent."""
    sent_at = run.outstanding.pop(seq)
    run.presumed_lost.discard(seq)
    run.codes[seq] = _ACKED
    run.acked_at[seq] = now
    run.acked += 1
    run.phase_acked[phase(run.plan, seq)] += 1
    return sent_at


def late(run: ProbeRun, seq: int, now: float) -> None:
    """A lost ``seq`` acknowledged after its timeout: delivered for the verdict."""
    if run.invalid and run.invalid[seq]:
        run.phase_invalid[phase(run.plan, seq)] -= 1
    run.codes[seq] = _LATE
    run.acked_at[seq] = now
    run.phase_late[phase(run.plan, seq)] += 1


def lost(run: ProbeRun, seq: int) -> None:
    """``seq`` timed out (or was in flight when its run ended); the caller takes
    it out of ``outstanding``."""
    run.codes[seq] = _LOST
    if run.invalid and run.invalid[seq]:
        run.phase_invalid[phase(run.plan, seq)] += 1


def outcome(run: ProbeRun, seq: int, result: str, ack: wire.Ack | None) -> OutcomeEntry:
    """One probe's whole row, as it stands."""
    return OutcomeEntry(
        seq,
        phase(run.plan, seq),
        ip_len(run.plan, seq),
        result,
        run.sent_at[seq],
        None if result == LOST else run.acked_at[seq],
        run.ack_counts[seq],
        None if ack is None else ack.received_len,
        # Unknown (the client's system cannot observe it) is NULL.
        None
        if ack is None or ack.observed_frag_size == wire.FRAG_SIZE_UNKNOWN
        else ack.observed_frag_size,
        # Only a probe that never arrived can be invalid: a late one
        # got through, whatever the kernel refused meanwhile.
        result == LOST and bool(run.invalid) and bool(run.invalid[seq]),
    )
