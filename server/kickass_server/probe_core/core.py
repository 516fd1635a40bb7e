"""``ProbeCore``: every session of one server, composed from the parts of the
package (the overview is ``kickass_server.probe_core``'s docstring).

The core owns what spans runs: the handshake, admission, the pacer, the
round-robin of runs that may send, the timers of every probe, each run's
life cycle and the batching of what is persisted. It composes per run the
plan's iteration (plan_iter.py: which seq, its phase and size, its state)
and the window and credit control (credit.py, and the adaptive
``WindowController`` of window.py), and turns what they answer into actions:
sends and study events. No sockets, threads, clock reads or database.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from kickass_core import verdict as verdicts
from kickass_core import wire
from kickass_core.pacing import Pacer
from kickass_core.plan import SPLIT, WHOLE, ProbePlan, plan_bytes
from kickass_core.states import (
    ACKED,
    COMPLETE,
    CREATED,
    ENDED,
    EXPIRED,
    FINAL_STATES,
    INCOMPLETE,
    LATE,
    LOST,
    PROBING,
)
from kickass_core.study_events import (
    Heartbeat,
    OutcomeBatch,
    RunFinished,
    RunProbing,
    StudyEvent,
)

from ..packets import SessionPackets
from ..policy import Admission, AdmissionDenied, Policy
from ..rtt_estimator import RttEstimator
from . import credit, plan_iter
from .credit import REPORT_GRACE_S
from .plan_iter import _ACKED, _LOST, _OUT, _UNSENT
from .run import ProbeRun, RunSnapshot, _PendingChallenge

# Outcome batches and progress counters go to the database at most this often
# per run: one statement per batch instead of one per ACK.
FLUSH_INTERVAL_S = 0.5
# A finished run stays in memory this long so late and duplicate ACKs are
# still recorded; then it is forgotten (the database has everything).
FINISHED_GRACE_S = 60.0
# Probes per run per round: small bursts in turn, so no run starves another
# and the pacer stays the only limit on the aggregate.
PROBE_BURST = 8
# After the raw socket's buffer filled up: wait this long before sending again.
SEND_RETRY_S = 0.001
# After a hard send error for one peer (no route, firewall): hold that run.
SEND_ERROR_HOLD_S = 0.1
# How often the admission's hourly windows are swept for forgotten addresses.
SWEEP_INTERVAL_S = 60.0

COUNTERS = (
    "datagrams",
    "malformed",
    "unknown_session",
    "bad_cookie",
    "hello_ignored",
    "challenges_sent",
    "bad_echo",
    "wrong_peer",
    "peer_migrations",
    "acks",
    "late_acks",
    "dup_acks",
    "stray_acks",
    "probes_sent",
    "probes_not_sent",
    "paced",
    "admission_denied",
    "polls_without_cookie",
    "reports",
    "stale_reports",
    "credit_waits",
    "window_paced",
)


# -- outputs ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SendDatagram:
    """A UDP datagram on the probe socket, from ``src`` (the address the peer
    wrote to) to ``addr``."""

    addr: tuple[str, int]
    data: bytes
    src: str | None = None


@dataclass(frozen=True, slots=True)
class SendProbe:
    """One probe's IP packets (a whole packet, or a split's two fragments) for
    the raw socket. If they cannot be sent, hand the action back through
    ``ProbeCore.probes_not_sent``."""

    session_id: str
    seq: int
    dst: str
    packets: tuple[bytes, ...]


Transmit = SendDatagram | SendProbe
Action = Transmit | StudyEvent


@dataclass(frozen=True)
class Admitted:
    """A session the admission accepted and the database has yet to store."""

    session_id: str
    cookie: bytes
    cookie_hash: bytes
    plan: ProbePlan
    source_address: str


# -- the core -------------------------------------------------------------------------


class ProbeCore:
    """All sessions of one server: handshake, probing, timeouts, pacing, expiry."""

    def __init__(
        self,
        policy: Policy,
        now: float,
        *,
        probe_port: int = 0,
        random_bytes: Callable[[int], bytes] = secrets.token_bytes,
    ) -> None:
        self.policy = policy
        # The probes' UDP source port: the shell sets it once the socket is bound.
        self.probe_port = probe_port
        self._random = random_bytes
        self.admission = Admission(policy)
        self.pacer = Pacer(policy.pps_per_address, policy.pps_per_prefix, policy.pps_global, now)
        self.runs: dict[str, ProbeRun] = {}
        self._by_tag: dict[bytes, ProbeRun] = {}
        self._admitted: dict[str, ProbeRun] = {}  # admitted, not yet stored
        # Runs that may send now but for pacing (a full window or the end of
        # the plan takes a run out, an ACK or a timeout brings it back):
        # timers and deadlines look only at these. Insertion order is the
        # round-robin order.
        self._ready: dict[str, ProbeRun] = {}
        self._timers: list[tuple[float, str, int]] = []  # (deadline, session_id, seq)
        # (window timeout, session_id, seq): when a probe stops holding its window place.
        self._window_timers: list[tuple[float, str, int]] = []
        self._lifecycle_due = math.inf
        self._next_flush = math.inf
        self._next_sweep = now + SWEEP_INTERVAL_S
        self._send_hold_until = -math.inf
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)

    # -- the HTTP side ----------------------------------------------------------------

    def admit(
        self,
        now: float,
        plan: ProbePlan,
        source_address: str,
        *,
        split_credit: int | None = None,
        credit_mode: str | None = None,
    ) -> Admitted:
        """Admission for a new session (AdmissionDenied if refused). The run
        exists only once ``register``ed, after the database stored it; if
        that fails, ``cancel`` gives the admission back. ``split_credit``:
        the client does flow control of the split phase (REPORTs), and this
        many splits may go before its first REPORT arrives. ``credit_mode``
        ``credit.IN_FLIGHT``: the credit bounds splits in flight (see ProbeRun)."""
        nbytes = plan_bytes(plan)
        reason = self.admission.check(source_address, nbytes, now)
        if reason:
            self.counters["admission_denied"] += 1
            raise AdmissionDenied(reason)
        ticket = self.admission.admit(source_address, nbytes, now)
        while True:
            tag = self._random(wire.SESSION_TAG_LEN)
            if tag not in self._by_tag and tag.hex() not in self._admitted:
                break
        cookie = self._random(wire.COOKIE_LEN)
        p = self.policy
        run = ProbeRun(
            session_id=tag.hex(),
            tag=tag,
            cookie_hash=hashlib.sha256(cookie).digest(),
            plan=plan,
            source_address=source_address,
            ticket=ticket,
            rtt=RttEstimator(p.min_timeout_ms / 1000.0, p.max_timeout_ms / 1000.0),
            ip_id=int.from_bytes(self._random(2), "big") % 0xFFFF + 1,
        )
        credit.grant(run, split_credit, credit_mode)
        self._admitted[run.session_id] = run
        return Admitted(run.session_id, cookie, run.cookie_hash, plan, source_address)

    def register(self, now: float, session_id: str) -> None:
        """The database holds the session: from now on its HELLO is answered."""
        run = self._admitted.pop(session_id)
        run.created = now
        run.expires = now + self.policy.handshake_timeout_s
        self.runs[session_id] = run
        self._by_tag[run.tag] = run
        self._lifecycle_due = min(self._lifecycle_due, run.expires)

    def cancel(self, session_id: str) -> None:
        """The database did not store the session: as if it was never asked for."""
        run = self._admitted.pop(session_id, None)
        if run is not None:
            self.admission.refund(run.ticket)

    def end(self, now: float, session_id: str, cookie: bytes) -> str:
        """The owner asks to stop: no new probes; outstanding ones get their
        timeout, then the run finishes ``ended``. Returns 'ended',
        'not-found', 'forbidden' or 'already-final'."""
        run = self.runs.get(session_id)
        if run is None:
            return "not-found"
        if not run.ok_cookie(cookie):
            return "forbidden"
        if run.state in FINAL_STATES:
            return "already-final"
        if run.end_requested is None:
            run.end_requested = "client-ended"
            self._ready.pop(session_id, None)
        self._lifecycle_due = min(self._lifecycle_due, now)
        return "ended"

    def touch(self, now: float, session_id: str, cookie: bytes | None) -> bool:
        """The owner polled over HTTP: alive even if no probe gets through (a
        fragment-dropping path acknowledges nothing for a whole phase). Only
        the cookie proves ownership: anyone may read a session's results, and
        a stranger's polls must not keep an abandoned session alive."""
        run = self.runs.get(session_id)
        if run is None or run.state in FINAL_STATES:
            return False
        if cookie is None or not run.ok_cookie(cookie):
            self.counters["polls_without_cookie"] += 1
            return False
        run.last_seen = max(run.last_seen, now)
        return True

    def snapshot(self, session_id: str) -> RunSnapshot | None:
        run = self.runs.get(session_id)
        return None if run is None else run.snapshot()

    def stats(self) -> dict[str, object]:
        live = [r for r in self.runs.values() if r.state not in FINAL_STATES]
        return {
            "counters": dict(self.counters),
            "sessions_live": len(live),
            "sessions_probing": sum(1 for r in live if r.state == PROBING),
            "sessions_remembered": len(self.runs),
            "pacing_buckets": self.pacer.buckets(),
        }

    # -- datagrams ------------------------------------------------------------------------

    def on_datagram(
        self, now: float, addr: tuple[str, int], data: bytes, local_ip: str
    ) -> list[Action]:
        """One datagram from ``addr`` to our ``local_ip``. Anything malformed,
        unknown or unauthorised is dropped silently (and counted)."""
        out: list[Action] = []
        self.counters["datagrams"] += 1
        try:
            msg = wire.decode(data)
        except wire.WireError:
            self.counters["malformed"] += 1
            return out
        run = self._by_tag.get(msg.session_tag)
        # A finished run lingers so late and duplicate ACKs are still
        # accounted; nothing else reaches it.
        if run is None or (
            run.state in FINAL_STATES and not isinstance(msg, wire.Ack | wire.Report)
        ):
            self.counters["unknown_session"] += 1
            return out
        if isinstance(msg, wire.Hello):
            self._on_hello(now, run, msg, len(data), addr, local_ip, out)
        elif isinstance(msg, wire.Echo):
            self._on_echo(now, run, msg, addr, out)
        elif isinstance(msg, wire.Ack):
            self._on_ack(now, run, msg, addr, out)
        elif isinstance(msg, wire.Report):
            self._on_report(now, run, msg, addr)
        else:
            self.counters["malformed"] += 1  # server-to-client kinds never come in
        return out

    def _on_hello(
        self,
        now: float,
        run: ProbeRun,
        msg: wire.Hello,
        size: int,
        addr: tuple[str, int],
        local_ip: str,
        out: list[Action],
    ) -> None:
        if not run.ok_cookie(msg.cookie):
            self.counters["bad_cookie"] += 1
            return
        if run.peer == addr:
            self.counters["hello_ignored"] += 1  # already proven: a late retransmission
            return
        if run.challenges_sent >= self.policy.max_challenges_per_session:
            self.counters["hello_ignored"] += 1
            return
        pending = run.challenges.get(addr)
        # A retransmitted HELLO gets the same token: the client may echo
        # whichever challenge reaches it.
        token = pending.token if pending else self._random(wire.CHALLENGE_LEN)
        reply = wire.Challenge(run.tag, token).encode()
        if len(reply) > size:  # never amplify (decode() already enforces HELLO_MIN_LEN)
            self.counters["hello_ignored"] += 1
            return
        # The RTT seed is measured from the latest challenge to its echo.
        run.challenges[addr] = _PendingChallenge(token, now, local_ip)
        run.challenges_sent += 1
        self.counters["challenges_sent"] += 1
        out.append(SendDatagram(addr, reply, local_ip))

    def _on_echo(
        self, now: float, run: ProbeRun, msg: wire.Echo, addr: tuple[str, int], out: list[Action]
    ) -> None:
        pending = run.challenges.get(addr)
        if pending is None or not hmac.compare_digest(pending.token, msg.token):
            self.counters["bad_echo"] += 1
            return
        del run.challenges[addr]
        if run.peer == addr:
            return
        if run.lane is not None:
            self.pacer.release(run.lane)
        if run.peer is not None:
            # A NAT rebinding: the owner (cookie) proved a new address.
            self.counters["peer_migrations"] += 1
        run.peer = addr
        run.local_ip = pending.local_ip
        run.packets = None  # built again for the new peer
        run.lane = self.pacer.lane(addr[0], now)
        if run.state != CREATED:
            return
        rtt = max(now - pending.sent_at, 1e-4)
        plan_iter.start(run)
        run.state = PROBING
        run.handshake_rtt_ms = rtt * 1000.0
        run.rtt.seed(rtt)
        credit.open_window(run, self.policy, now, rtt)
        run.last_seen = now
        run.expires = now + self.policy.max_session_s
        self._make_ready(run)
        self._lifecycle_due = min(
            self._lifecycle_due, run.expires, now + self.policy.silence_timeout_s
        )
        self._arm_flush(now)
        out.append(RunProbing(run.session_id, addr[0], addr[1], rtt * 1000.0))

    def _on_ack(
        self, now: float, run: ProbeRun, msg: wire.Ack, addr: tuple[str, int], out: list[Action]
    ) -> None:
        if addr != run.peer:
            self.counters["wrong_peer"] += 1
            return
        seq = msg.seq
        if seq >= len(run.codes) or run.codes[seq] == _UNSENT:
            self.counters["stray_acks"] += 1
            return
        self.counters["acks"] += 1
        run.last_seen = max(run.last_seen, now)
        code = run.codes[seq]
        run.ack_counts[seq] = min(255, run.ack_counts[seq] + 1)
        if msg.observed_frag_size not in (0, wire.FRAG_SIZE_UNKNOWN) and seq < run.plan.split_from:
            run.min_fragmented_whole = min(
                run.min_fragmented_whole, plan_iter.ip_len(run.plan, seq)
            )
        if code == _OUT:
            sent_at = plan_iter.acked(run, seq, now)
            run.rtt.sample(max(now - sent_at, 0.0))
            if run.ctl is not None:
                run.ctl.on_ack(now, seq, max(now - sent_at, 0.0))
            self._record(now, run, seq, ACKED, msg)
            self._settle(now, run, out)
            self._make_ready(run)
        elif code == _LOST:
            plan_iter.late(run, seq, now)
            self.counters["late_acks"] += 1
            self._record(now, run, seq, LATE, msg)
        else:
            self.counters["dup_acks"] += 1
            self._record(now, run, seq, ACKED if code == _ACKED else LATE, msg)

    def _on_report(
        self, now: float, run: ProbeRun, msg: wire.Report, addr: tuple[str, int]
    ) -> None:
        """The client's reassembly memory: new credit, refused-fragment ranges."""
        if addr != run.peer or run.state == CREATED:
            self.counters["wrong_peer"] += 1
            return
        self.counters["reports"] += 1
        run.last_seen = max(run.last_seen, now)
        invalid, fresh = credit.take_report(run, msg)
        for seq in invalid:
            self._record(now, run, seq, LOST, None)
        if not fresh:
            self.counters["stale_reports"] += 1
            return
        if run.state != PROBING:
            return
        self._credit_wait(now, run)
        self._make_ready(run)

    def _credit_wait(self, now: float, run: ProbeRun) -> None:
        if credit.credit_wait(now, run):
            self.counters["credit_waits"] += 1

    def _record(
        self, now: float, run: ProbeRun, seq: int, outcome: str, ack: wire.Ack | None
    ) -> None:
        """Queue one probe's whole row. A seq recorded again (late or duplicate
        ACK) rewrites the row, so the store's last-word-wins upsert loses
        nothing recorded earlier."""
        run.pending.append(plan_iter.outcome(run, seq, outcome, ack))
        self._arm_flush(now)

    def _arm_flush(self, now: float) -> None:
        if self._next_flush == math.inf:
            self._next_flush = now + FLUSH_INTERVAL_S

    def _settle(self, now: float, run: ProbeRun, out: list[Action]) -> None:
        """Finish a probing run at once when nothing is left in flight and
        either the plan is done or its owner asked to end."""
        if run.state != PROBING or run.outstanding:
            return
        if run.end_requested is not None:
            self._finish(now, run, ENDED, run.end_requested, out)
        elif run.next_seq >= run.plan.total_probes:
            if run.reasm is None:
                self._finish(now, run, COMPLETE, None, out)
            elif run.complete_at is None:
                # The client's last REPORT (refused fragments) may be on its way.
                run.complete_at = now + REPORT_GRACE_S
                self._lifecycle_due = min(self._lifecycle_due, run.complete_at)

    # -- time -------------------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """When ``on_timer`` must run next (None: only an input can change anything)."""
        d = min(self._lifecycle_due, self._next_flush, self._next_sweep)
        if self._timers:
            d = min(d, self._timers[0][0])
        if self._window_timers:
            d = min(d, self._window_timers[0][0])
        for run in self._ready.values():
            if run.may_send() and run.lane is not None:
                ready = max(
                    self.pacer.ready_at(run.lane), run.send_hold_until, self._send_hold_until
                )
                if run.ctl is not None:
                    ready = max(ready, run.ctl.send_at)
                d = min(d, ready)
        return None if d == math.inf else d

    def on_timer(self, now: float) -> list[Action]:
        out: list[Action] = []
        self._expire_probes(now, out)
        self._send_probes(now, out)
        if now >= self._lifecycle_due:
            self._lifecycle(now, out)
        if now >= self._next_flush:
            self.flush_into(out)
        if now >= self._next_sweep:
            self.admission.sweep(now)
            self._next_sweep = now + SWEEP_INTERVAL_S
        return out

    def _expire_probes(self, now: float, out: list[Action]) -> None:
        window_timers = self._window_timers
        while window_timers and window_timers[0][0] <= now:
            _, sid, seq = heapq.heappop(window_timers)
            run = self.runs.get(sid)
            if run is None or run.codes[seq] != _OUT:
                continue
            due = run.outstanding[seq] + run.rtt.window_timeout
            if now < due:
                heapq.heappush(window_timers, (due, sid, seq))
                continue
            run.presumed_lost.add(seq)
            self._make_ready(run)
        timers = self._timers
        while timers and timers[0][0] <= now:
            _, sid, seq = heapq.heappop(timers)
            run = self.runs.get(sid)
            if run is None or run.codes[seq] != _OUT:
                continue  # acknowledged, or never really sent
            sent_at = run.outstanding[seq]
            due = sent_at + run.rtt.timeout
            if now < due:
                # The timeout grew since this probe left; honour the current one.
                heapq.heappush(timers, (due, sid, seq))
                continue
            del run.outstanding[seq]
            run.presumed_lost.discard(seq)
            plan_iter.lost(run, seq)
            if run.ctl is not None:
                run.ctl.on_loss(now, seq)
            self._record(now, run, seq, LOST, None)
            self._settle(now, run, out)
            self._make_ready(run)

    def _send_probes(self, now: float, out: list[Action]) -> None:
        if now < self._send_hold_until:
            return
        active = []
        for sid, run in list(self._ready.items()):
            if not run.may_send():
                del self._ready[sid]
            elif now >= run.send_hold_until:
                active.append(run)
        while active:
            still = []
            for run in active:
                lane = run.lane
                assert lane is not None
                n = 0
                while n < PROBE_BURST and run.may_send():
                    if run.ctl is not None and now < run.ctl.send_at:
                        self.counters["window_paced"] += 1
                        break
                    if not self.pacer.try_take(lane, now):
                        self.counters["paced"] += 1
                        break
                    self._send_one(now, run, out)
                    n += 1
                if n:
                    # To the back of the line: when tokens trickle in one at a
                    # time (a shared /24 or global bucket), the next one goes
                    # to a run that did not send now, instead of always to
                    # the oldest run.
                    del self._ready[run.session_id]
                    if run.may_send():
                        self._ready[run.session_id] = run
                if n == PROBE_BURST:
                    still.append(run)
            active = still

    def _make_ready(self, run: ProbeRun) -> None:
        if run.may_send() and run.session_id not in self._ready:
            self._ready[run.session_id] = run

    def _send_one(self, now: float, run: ProbeRun, out: list[Action]) -> None:
        peer, local_ip = run.peer, run.local_ip
        assert peer is not None and local_ip is not None
        seq = run.next_seq
        phase = plan_iter.phase(run.plan, seq)
        ip_len = plan_iter.ip_len(run.plan, seq)
        if run.packets is None:
            run.packets = SessionPackets(local_ip, peer[0], self.probe_port, peer[1], run.tag)
        run.ip_id = run.ip_id % 0xFFFF + 1
        packets = run.packets.render(phase, ip_len, seq, run.ip_id)
        plan_iter.sent(run, seq, now)
        self.counters["probes_sent"] += 1
        heapq.heappush(self._timers, (now + run.rtt.timeout, run.session_id, seq))
        self._arm_flush(now)
        out.append(SendProbe(run.session_id, seq, peer[0], tuple(packets)))
        if run.ctl is not None:
            heapq.heappush(self._window_timers, (now + run.rtt.window_timeout, run.session_id, seq))
            nbytes = sum(len(p) for p in packets)
            run.ctl.on_send(now, seq, phase, ip_len, nbytes, run.in_window())
        if run.reasm is not None:
            self._credit_wait(now, run)

    def probes_not_sent(
        self, now: float, probes: list[SendProbe], *, buffer_full: bool = False
    ) -> None:
        """The shell could not put these probes on the wire: undo them, so a
        probe that never left is never counted as lost. ``buffer_full`` (the
        raw socket would block) pauses all sending briefly; otherwise (a hard
        error for those peers) their runs pause a little longer.

        Probes are undone newest first; the shell reports, for each run, every
        probe from the first failed one on (a suffix of what it was given).
        """
        for p in reversed(probes):
            run = self.runs.get(p.session_id)
            if run is None or run.state != PROBING:
                continue
            seq = p.seq
            if seq != run.next_seq - 1 or run.codes[seq] != _OUT:
                continue  # not the newest probe: leave it to its timeout
            plan_iter.unsent(run, seq)
            if run.ctl is not None:
                run.ctl.on_unsent(seq, sum(len(pkt) for pkt in p.packets))
            self.counters["probes_sent"] -= 1
            self.counters["probes_not_sent"] += 1
            if run.lane is not None:
                self.pacer.give_back(run.lane)
            if not buffer_full:
                run.send_hold_until = now + SEND_ERROR_HOLD_S
            self._make_ready(run)
        if buffer_full:
            self._send_hold_until = now + SEND_RETRY_S

    # -- life cycle ------------------------------------------------------------------------

    def _lifecycle(self, now: float, out: list[Action]) -> None:
        p = self.policy
        due = math.inf
        for sid, run in list(self.runs.items()):
            if run.state == CREATED:
                if run.end_requested is not None:
                    self._finish(now, run, ENDED, run.end_requested, out)
                elif now >= run.expires:
                    self._finish(now, run, EXPIRED, "no return-routability proof in time", out)
                else:
                    due = min(due, run.expires)
            elif run.state == PROBING:
                silent_at = run.last_seen + p.silence_timeout_s
                if run.end_requested is not None and not run.outstanding:
                    self._finish(now, run, ENDED, run.end_requested, out)
                elif run.next_seq >= run.plan.total_probes and not run.outstanding:
                    if run.complete_at is None or now >= run.complete_at:
                        self._finish(now, run, COMPLETE, None, out)
                    else:
                        due = min(due, run.complete_at)
                elif now >= silent_at:
                    self._finish(now, run, INCOMPLETE, "client-silent", out)
                elif now >= run.expires:
                    self._finish(now, run, INCOMPLETE, "max-session-time", out)
                else:
                    due = min(due, silent_at, run.expires)
            if run.finished_at is not None:
                if now >= run.finished_at + FINISHED_GRACE_S:
                    self._forget(sid, run, out)
                else:
                    due = min(due, run.finished_at + FINISHED_GRACE_S)
        self._lifecycle_due = due

    def _finish(
        self, now: float, run: ProbeRun, state: str, end_reason: str | None, out: list[Action]
    ) -> None:
        # Probes still in flight when a run ends early were sent but never
        # resolved: record them lost, so what was sent is what was stored.
        for seq in sorted(run.outstanding):
            plan_iter.lost(run, seq)
            self._record(now, run, seq, LOST, None)
        run.outstanding.clear()
        run.presumed_lost.clear()
        if state == EXPIRED:
            v = verdicts.Verdict(verdicts.INCONCLUSIVE, "no probes were sent")
        else:
            inv = run.phase_invalid
            late = run.phase_late
            v = verdicts.decide(
                run.phase_sent[WHOLE] - inv[WHOLE],
                run.phase_acked[WHOLE] + late[WHOLE],
                run.phase_sent[SPLIT] - inv[SPLIT],
                run.phase_acked[SPLIT] + late[SPLIT],
                whole_invalid=inv[WHOLE],
                split_invalid=inv[SPLIT],
                late=late[WHOLE] + late[SPLIT],
            )
        reasm = credit.final_log(now, run)
        window = None if run.ctl is None else run.ctl.summary(now)
        self._flush_run(run, out)
        run.state = state
        run.end_reason = end_reason
        run.finished_at = now
        out.append(
            RunFinished(run.session_id, state, v.verdict, v.reason, end_reason, reasm, window)
        )
        self.admission.release(run.ticket)
        if run.lane is not None:
            self.pacer.release(run.lane)
            run.lane = None
        run.packets = None
        run.challenges.clear()
        self._ready.pop(run.session_id, None)
        if run.peer is not None:
            out.append(SendDatagram(run.peer, wire.Done(run.tag).encode(), run.local_ip))
        self._lifecycle_due = min(self._lifecycle_due, now + FINISHED_GRACE_S)

    def _forget(self, sid: str, run: ProbeRun, out: list[Action]) -> None:
        self._flush_run(run, out)  # a late ACK of the last moment
        del self.runs[sid]
        self._by_tag.pop(run.tag, None)

    def shutdown(self, now: float, reason: str = "server-shutdown") -> list[Action]:
        """Finish every live run ``incomplete`` and flush everything."""
        out: list[Action] = []
        for run in list(self.runs.values()):
            if run.state not in FINAL_STATES:
                self._finish(now, run, INCOMPLETE, reason, out)
        for sid in list(self._admitted):
            self.cancel(sid)
        self.flush_into(out)
        return out

    # -- persistence -----------------------------------------------------------------------

    def flush(self) -> list[Action]:
        """Every pending outcome and progress counter, now (before a reader
        must see them, e.g. the HTTP API waiting for a final state)."""
        out: list[Action] = []
        self.flush_into(out)
        return out

    def flush_into(self, out: list[Action]) -> None:
        for run in self.runs.values():
            self._flush_run(run, out)
        self._next_flush = math.inf

    def _flush_run(self, run: ProbeRun, out: list[Action]) -> None:
        if run.pending:
            out.append(OutcomeBatch(run.session_id, tuple(run.pending)))
            run.pending = []
        if run.state == PROBING and run.reported != (run.sent, run.acked):
            run.reported = (run.sent, run.acked)
            out.append(Heartbeat(run.session_id, run.sent, run.acked))
