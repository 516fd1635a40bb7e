"""The probe engine's sans-IO core: every protocol decision, and no IO at all.

``ProbeCore`` is fed the current time with everything that happens —
datagrams ``on_datagram(now, addr, data, local_ip)``, timers ``on_timer(now)``
whenever ``next_deadline()`` has passed, and the HTTP side's calls (``admit``,
``register``, ``cancel``, ``end``, ``touch``) — and answers with a list of
actions, in the order they must happen:

* what to send: ``SendDatagram`` (CHALLENGE and DONE on the probe UDP socket)
  and ``SendProbe`` (a probe's raw IP packets: one, or two fragments);
* what to persist: ``RunProbing``, ``OutcomeBatch``, ``Heartbeat``,
  ``RunFinished`` (``kickass_core.study_events``: the one definition the
  database's writer, journal and store read).

No sockets, threads, clock reads or database in here: the shell
(``engine.ProbeEngine``) owns those, and tests drive this class on a
simulated clock (quinn-proto / boringtun style; the volunteer client's
``ProbeSession`` is the same shape).

The engine's live state of one study session is a ``ProbeRun`` (the
database's row of it is ``kickass_db.models.SessionRow``). The HTTP API only
ever sees a ``RunSnapshot``: a frozen copy.

Handshake (ARCHITECTURE.md, "The probe protocol"): HELLO must carry the session's secret
cookie; the answer is a CHALLENGE smaller than the HELLO, to the HELLO's
source; probes start only after the ECHO of that challenge arrives from the
same address:port. A spoofed HELLO therefore costs its victim one small
packet, and nothing larger than what arrived is ever sent to an unproven
address.

Probing: W probes in flight, each with its own timeout (``RttEstimator``),
paced by ``Pacer``. In an adaptive run a probe older than the estimator's
``window_timeout`` (RFC 6298's RTO, a little over half the study's timeout) no
longer counts against W: it is presumed lost for the window, not for the
study, whose outcome waits for the timeout, nor for the split credit, which
protects the client's memory. A fixed window (``--window N``, stop-and-wait at
1) keeps its meaning: at most N probes unresolved. W is the plan's window, or,
for an adaptive plan, what the run's ``WindowController`` (window.py) allows
up to it: it grows from the measured RTT and shrinks on a standing queue or on
loss the window causes, and paces the run to the access-link rate. A client
that announced flow control (``split_credit`` at admission) also bounds the
split phase: its REPORTs (about 20 per second) carry ``split_limit``, and no
split probe with a higher seq is sent, so the study's own unfinished datagrams
never fill the client's reassembly memory (kickass_probe.reassembly explains
the budget). REPORTs also name ranges of
seqs measured while the client's kernel refused fragments: a probe there that
was not acknowledged is *invalid* (``reassembly_invalid``), not lost, and
stays out of the verdict's counts. Such a run finishes ``REPORT_GRACE_S``
after its last probe resolved, so the client's last REPORT can still arrive.
No ACK before the timeout: ``lost`` (the paper's rule); an ACK after it
turns the probe ``late``; duplicates are counted. A probe the shell could not
put on the wire is handed back (``probes_not_sent``) and
never counted as sent, so a full socket buffer is not mistaken for path loss.

The package, by subject: ``core.py`` (``ProbeCore``, the actions, the
handshake, the timers, the life cycle and what is persisted: the core that
composes the rest), ``plan_iter.py`` (the plan's iteration in one run: each
seq's phase, size and state, the counts per phase), ``credit.py`` (window and
credit control: the adaptive window's start, the client's split credit, its
REPORTs and the invalid ranges), ``run.py`` (``ProbeRun`` and the
``RunSnapshot`` the HTTP side reads). Every name callers import is here.
"""

from __future__ import annotations

from kickass_core.study_events import (
    Heartbeat,
    OutcomeBatch,
    OutcomeEntry,
    RunFinished,
    RunProbing,
    StudyEvent,
)

from .core import (
    COUNTERS,
    FINISHED_GRACE_S,
    FLUSH_INTERVAL_S,
    PROBE_BURST,
    SEND_ERROR_HOLD_S,
    SEND_RETRY_S,
    SWEEP_INTERVAL_S,
    Action,
    Admitted,
    ProbeCore,
    SendDatagram,
    SendProbe,
    Transmit,
)
from .credit import MAX_INVALID_RANGES, REPORT_GRACE_S, _cover, _uncovered
from .run import IN_FLIGHT, ProbeRun, ReassemblyLog, RunSnapshot

__all__ = [
    "COUNTERS",
    "FINISHED_GRACE_S",
    "FLUSH_INTERVAL_S",
    "IN_FLIGHT",
    "MAX_INVALID_RANGES",
    "PROBE_BURST",
    "REPORT_GRACE_S",
    "SEND_ERROR_HOLD_S",
    "SEND_RETRY_S",
    "SWEEP_INTERVAL_S",
    "Action",
    "Admitted",
    "Heartbeat",
    "OutcomeBatch",
    "OutcomeEntry",
    "ProbeCore",
    "ProbeRun",
    "ReassemblyLog",
    "RunFinished",
    "RunProbing",
    "RunSnapshot",
    "SendDatagram",
    "SendProbe",
    "StudyEvent",
    "Transmit",
    "_cover",
    "_uncovered",
]
