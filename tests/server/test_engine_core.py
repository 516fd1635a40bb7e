"""The probe engine's sans-IO core on a simulated clock: no sockets, no sleeps.

Every rule of the probe protocol as the server applies it: the handshake
(wrong cookie, challenge smaller than hello, echo from the wrong address),
per-probe timeouts and their RTT estimate, late and duplicate ACKs (also after
the run ended), the window, pacing per address, per /24 and globally,
admission, expiry (handshake, silence, maximum session time) and ending.
Fuzz tests feed the UDP parsers arbitrary datagrams.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kickass_core import wire
from kickass_core.pacing import Pacer, TokenBucket
from kickass_core.plan import ProbePlan, plan_bytes
from kickass_core.verdict import decide
from kickass_server.policy import AdmissionDenied, Policy
from kickass_server.probe_core import (
    FINISHED_GRACE_S,
    FLUSH_INTERVAL_S,
    Action,
    Heartbeat,
    OutcomeBatch,
    OutcomeEntry,
    ProbeCore,
    RunFinished,
    RunProbing,
    SendDatagram,
    SendProbe,
)
from kickass_server.rtt_estimator import RttEstimator

T0 = 1000.0
SERVER_IP = "192.0.2.1"


class Sim:
    """The shell's loop on a simulated clock: inputs at ``now``, timers fired
    exactly at the core's deadlines, every action kept for inspection."""

    def __init__(self, policy: Policy | None = None, seed: int = 1) -> None:
        rng = random.Random(seed)
        self.policy = policy or Policy()
        self.core = ProbeCore(self.policy, T0, probe_port=9000, random_bytes=rng.randbytes)
        self.now = T0
        self.actions: list[Action] = []
        # e.g. a client acking
        self.on_probe: Callable[[SendProbe], object] | None = None

    def take(self, out: list[Action]) -> list[Action]:
        self.actions.extend(out)
        for a in out:
            if isinstance(a, SendProbe) and self.on_probe is not None:
                self.on_probe(a)
        return out

    def timers(self) -> list[Action]:
        """Fire what is due at ``now``."""
        out = self.core.on_timer(self.now)
        nxt = self.core.next_deadline()
        # The core never asks to be woken again for the same instant: a shell
        # loop on it cannot spin.
        assert nxt is None or nxt > self.now, (nxt, self.now)
        return self.take(out)

    def advance(self, dt: float) -> list[Action]:
        """Run the clock forward by ``dt``, firing every deadline on the way."""
        end = self.now + dt
        got: list[Action] = []
        while True:
            d = self.core.next_deadline()
            if d is None or d > end:
                break
            self.now = max(self.now, d)
            got += self.timers()
        self.now = end
        return got

    def deliver(self, addr: tuple[str, int], data: bytes) -> list[Action]:
        out = self.take(self.core.on_datagram(self.now, addr, data, SERVER_IP))
        # What a shell does next: timers due now (a window that opened).
        d = self.core.next_deadline()
        if d is not None and d <= self.now:
            out += self.timers()
        return out

    def of(self, kind: type, since: int = 0) -> list:
        return [a for a in self.actions[since:] if isinstance(a, kind)]


class Volunteer:
    """A scripted client of one session."""

    def __init__(
        self,
        sim: Sim,
        plan: ProbePlan,
        addr: tuple[str, int] = ("198.51.100.7", 40000),
        source: str | None = None,
    ) -> None:
        self.sim = sim
        self.addr = addr
        new = sim.core.admit(sim.now, plan, source or addr[0])
        sim.core.register(sim.now, new.session_id)
        self.sid = new.session_id
        self.tag = bytes.fromhex(new.session_id)
        self.cookie = new.cookie
        self.plan = plan
        self.measured = 0

    def send(self, msg: bytes, addr: tuple[str, int] | None = None) -> list[Action]:
        return self.sim.deliver(addr or self.addr, msg)

    def hello(self, cookie: bytes | None = None, addr: tuple[str, int] | None = None) -> list:
        return self.send(wire.Hello(self.tag, cookie or self.cookie).encode(), addr)

    def handshake(self, rtt: float = 0.02) -> wire.Challenge:
        (reply,) = self.hello()
        challenge = wire.decode(reply.data)
        assert isinstance(challenge, wire.Challenge)
        self.sim.advance(rtt)
        self.send(wire.Echo(self.tag, challenge.token).encode())
        return challenge

    def ack(
        self, seq: int, addr: tuple[str, int] | None = None, frag_size: int = 0
    ) -> list[Action]:
        return self.send(wire.Ack(self.tag, seq, 16, frag_size).encode(), addr)

    def probes(self, since: int = 0) -> list[int]:
        return [a.seq for a in self.sim.of(SendProbe, since) if a.session_id == self.sid]

    def snap(self):  # noqa: ANN201
        return self.sim.core.snapshot(self.sid)

    def finished(self) -> RunFinished | None:
        done = [e for e in self.sim.of(RunFinished) if e.session_id == self.sid]
        return done[0] if done else None

    def rows(self) -> dict[int, OutcomeEntry]:
        """The last word on every seq, as the store's upsert keeps it."""
        last: dict[int, OutcomeEntry] = {}
        for b in self.sim.of(OutcomeBatch):
            if b.session_id == self.sid:
                for e in b.entries:
                    last[e.seq] = e
        return last


def small_plan(window: int = 1, repetitions: int = 1) -> ProbePlan:
    plan = ProbePlan.build(repetitions=repetitions, step=512, window=window, phases=["whole"])
    assert plan.total_probes == 5 * repetitions  # 44, 556, 1068, 1480, 1500
    return plan


# -- handshake -------------------------------------------------------------------------


def test_challenge_goes_to_the_hello_source_smaller_than_the_hello() -> None:
    sim = Sim()
    v = Volunteer(sim, small_plan())
    hello = wire.Hello(v.tag, v.cookie).encode()
    (reply,) = v.send(hello)
    assert isinstance(reply, SendDatagram) and reply.addr == v.addr and reply.src == SERVER_IP
    assert isinstance(wire.decode(reply.data), wire.Challenge)
    assert len(reply.data) < len(hello)
    # A larger (padded) HELLO changes nothing; the answer stays small.
    v2 = Volunteer(sim, small_plan(), addr=("198.51.100.8", 1))
    (reply2,) = v2.send(wire.Hello(v2.tag, v2.cookie).encode(pad_to=1200))
    assert len(reply2.data) == len(reply.data)


def test_no_probe_before_the_echo_then_exactly_the_window() -> None:
    sim = Sim()
    v = Volunteer(sim, ProbePlan.build(repetitions=2, step=256, window=4))
    (reply,) = v.hello()
    sim.advance(5.0)
    assert v.probes() == [] and v.snap().state == "created"
    v.send(wire.Echo(v.tag, wire.decode(reply.data).token).encode())
    (probing,) = sim.of(RunProbing)
    assert (probing.probe_address, probing.probe_port) == v.addr
    assert probing.rtt_ms == pytest.approx(5000.0)
    assert v.probes() == [0, 1, 2, 3]  # W, then nothing until an ACK or a timeout
    sim.advance(0.01)
    assert v.probes() == [0, 1, 2, 3]


def test_wrong_cookie_short_hello_and_unknown_tag_are_silent() -> None:
    sim = Sim()
    v = Volunteer(sim, small_plan())
    assert v.hello(cookie=b"\x00" * 16) == []
    short = wire.Hello(v.tag, v.cookie).encode()[: wire.HELLO_MIN_LEN - 1]
    assert v.send(short) == []
    assert v.send(wire.Hello(b"\x01" * 8, v.cookie).encode()) == []
    c = sim.core.counters
    assert c["bad_cookie"] == 1 and c["malformed"] == 1 and c["unknown_session"] == 1
    sim.advance(1.0)
    assert sim.actions == []


def test_retransmitted_hello_gets_the_same_token_and_challenges_are_capped() -> None:
    sim = Sim(Policy(max_challenges_per_session=3))
    v = Volunteer(sim, small_plan())
    (a,) = v.hello()
    (b,) = v.hello()
    assert a.data == b.data
    (c,) = v.hello(addr=("198.51.100.7", 40001))  # another port: another token
    assert c.data != a.data
    assert v.hello() == []  # the cap counts every challenge sent
    assert sim.core.counters["hello_ignored"] == 1


def test_echo_from_another_address_or_with_a_wrong_token_proves_nothing() -> None:
    sim = Sim()
    v = Volunteer(sim, small_plan())
    (reply,) = v.hello()
    token = wire.decode(reply.data).token
    assert v.send(wire.Echo(v.tag, token).encode(), addr=("198.51.100.7", 40001)) == []
    assert v.send(wire.Echo(v.tag, token).encode(), addr=("203.0.113.9", 40000)) == []
    assert v.send(wire.Echo(v.tag, bytes(16)).encode()) == []
    sim.advance(1.0)
    assert v.probes() == [] and sim.core.counters["bad_echo"] == 3
    v.send(wire.Echo(v.tag, token).encode())
    assert v.probes() == [0]


def test_a_proven_peer_hello_is_ignored_and_a_new_address_must_prove_itself() -> None:
    sim = Sim()
    v = Volunteer(sim, small_plan(window=1, repetitions=4))
    v.handshake()
    assert v.hello() == []  # a late retransmission from the proven address
    moved = ("198.51.100.99", 50000)  # a NAT rebinding: the owner proves a new address
    (reply,) = v.hello(addr=moved)
    assert reply.addr == moved
    assert all(a.dst == v.addr[0] for a in sim.of(SendProbe))
    v.send(wire.Echo(v.tag, wire.decode(reply.data).token).encode(), addr=moved)
    v.ack(0, addr=moved)
    assert sim.of(SendProbe)[-1].dst == moved[0]
    assert sim.core.counters["peer_migrations"] == 1


def test_probe_packets_carry_session_and_seq_from_the_proven_address() -> None:
    sim = Sim()
    v = Volunteer(sim, ProbePlan.build(repetitions=1, step=8, window=2))
    v.handshake()
    whole = sim.of(SendProbe)[0]
    (pkt,) = whole.packets
    assert len(pkt) == 44 and pkt[12:16] == bytes([192, 0, 2, 1])
    sport, dport = struct.unpack("!HH", pkt[20:24])
    assert (sport, dport) == (9000, v.addr[1])
    probe = wire.decode(pkt[28:])
    assert probe == wire.ProbeHeader(v.tag, 0)
    # Skip to the split phase: every probe of it is two fragments.
    split_from = v.plan.split_from
    for seq in range(split_from):
        v.ack(seq)
    split = [a for a in sim.of(SendProbe) if a.seq == split_from][0]
    first, second = split.packets
    assert len(first) == 44 and struct.unpack("!H", first[6:8])[0] & 0x2000  # MF
    assert len(first) + len(second) - 20 == 1500


# -- timeouts and the RTT estimate ---------------------------------------------------------


def test_rtt_estimator_seed_sample_and_clamp() -> None:
    e = RttEstimator(0.05, 3.0)
    e.seed(0.1)
    assert (e.srtt, e.rttvar) == (0.1, 0.05)
    assert e.timeout == pytest.approx(0.4)  # 2*SRTT + 4*RTTVAR
    assert e.window_timeout == pytest.approx(0.3)  # SRTT + 4*RTTVAR
    e.sample(0.3)
    assert e.rttvar == pytest.approx(0.75 * 0.05 + 0.25 * 0.2)
    assert e.srtt == pytest.approx(0.875 * 0.1 + 0.125 * 0.3)
    e.seed(0.0001)
    assert e.timeout == 0.05
    e.seed(5.0)
    assert e.timeout == 3.0


@pytest.mark.parametrize(("handshake_rtt", "timeout"), [(0.1, 0.4), (0.001, 0.05), (2.0, 3.0)])
def test_probe_timeout_comes_from_the_handshake_rtt(handshake_rtt: float, timeout: float) -> None:
    sim = Sim()
    v = Volunteer(sim, small_plan())
    v.handshake(rtt=handshake_rtt)
    sent_at = sim.now
    sim.advance(timeout - 1e-6)
    assert v.probes() == [0] and v.snap().outstanding == 1  # not lost yet
    sim.advance(2e-6)
    assert v.probes() == [0, 1]  # lost: the window is free again
    sim.take(sim.core.flush())
    row = v.rows()[0]
    assert row.outcome == "lost" and row.sent_at == pytest.approx(sent_at)
    assert row.acked_at is None and row.received_len is None


def test_timeout_follows_acked_round_trips() -> None:
    sim = Sim()
    v = Volunteer(sim, small_plan(window=1, repetitions=4))
    v.handshake(rtt=0.2)  # timeout 0.8
    for seq in range(6):  # the path got faster: 10 ms round trips
        sim.advance(0.01)
        v.ack(seq)
    t = v.snap().timeout_ms
    assert 50 <= t < 800
    sent = sim.now
    sim.advance(t / 1000.0 + 1e-6)
    sim.take(sim.core.flush())
    assert v.rows()[6].outcome == "lost" and v.rows()[6].sent_at == pytest.approx(sent)


# -- ACK accounting ------------------------------------------------------------------------


def test_late_duplicate_reordered_stray_and_foreign_acks() -> None:
    sim = Sim(Policy(min_timeout_ms=200))
    v = Volunteer(sim, small_plan(window=3))
    v.handshake(rtt=0.01)  # timeout 200 ms (the floor)
    assert v.probes() == [0, 1, 2]
    v.ack(2)  # reordered
    v.ack(0)
    v.ack(0)  # duplicate
    v.ack(99)  # never sent
    v.ack(1, addr=("203.0.113.5", 40000))  # not the proven peer
    assert sorted(v.probes()) == [0, 1, 2, 3, 4]
    sim.advance(0.3)  # probe 1 times out (3 and 4 too: never acked)
    v.ack(1)  # late
    v.ack(1)  # a late duplicate
    sim.take(sim.core.flush())
    rows = v.rows()
    assert [rows[s].outcome for s in range(5)] == ["acked", "late", "acked", "lost", "lost"]
    assert rows[0].ack_count == 2 and rows[1].ack_count == 2
    assert rows[0].acked_at is not None and rows[1].acked_at == pytest.approx(sim.now)
    c = sim.core.counters
    assert (c["dup_acks"], c["late_acks"], c["stray_acks"], c["wrong_peer"]) == (2, 1, 1, 1)
    snap = v.snap()
    assert (snap.sent, snap.acked) == (5, 2)  # late is lost for drop rates


def test_a_fragment_size_the_client_cannot_observe_is_stored_as_unknown() -> None:
    """Linux says 0 for a datagram that arrived whole; a system without
    IP_RECVFRAGSIZE says FRAG_SIZE_UNKNOWN, stored as NULL (not "whole")."""
    sim = Sim(Policy(min_timeout_ms=200))
    v = Volunteer(sim, small_plan(window=3))
    v.handshake(rtt=0.01)
    assert v.probes() == [0, 1, 2]
    v.ack(0, frag_size=0)
    v.ack(1, frag_size=wire.FRAG_SIZE_UNKNOWN)
    v.ack(2, frag_size=1196)
    sim.take(sim.core.flush())
    rows = v.rows()
    assert [rows[s].observed_frag_size for s in range(3)] == [0, None, 1196]


def test_acks_after_the_run_ended_are_still_recorded_until_forgotten() -> None:
    sim = Sim(Policy(min_timeout_ms=100))
    v = Volunteer(sim, small_plan(window=5))
    v.handshake(rtt=0.01)
    for seq in (0, 2, 3, 4):
        v.ack(seq)
    sim.advance(0.2)  # seq 1 lost: the plan is done
    done = v.finished()
    assert done is not None and done.state == "complete"
    assert isinstance(wire.decode(sim.of(SendDatagram)[-1].data), wire.Done)
    n = len(sim.actions)
    v.ack(1)  # late, after the end
    v.ack(0)  # duplicate, after the end
    sim.advance(FLUSH_INTERVAL_S)
    after = [e for b in sim.of(OutcomeBatch, n) for e in b.entries]
    assert [(e.seq, e.outcome) for e in after] == [(1, "late"), (0, "acked")]
    # After the grace period the run is forgotten: its ACKs are unknown.
    sim.advance(FINISHED_GRACE_S)
    assert v.snap() is None
    v.ack(1)
    assert sim.core.counters["unknown_session"] == 1
    # Nothing but ACKs reaches a finished run.
    assert sim.core.stats()["sessions_remembered"] == 0


# -- window and completion -------------------------------------------------------------------


def test_window_limits_probes_in_flight() -> None:
    sim = Sim()
    v = Volunteer(sim, small_plan(window=2, repetitions=4))
    in_flight = []

    def on_probe(p: SendProbe) -> None:
        in_flight.append(p.seq)
        assert v.snap().outstanding <= 2

    sim.on_probe = on_probe
    v.handshake()
    assert in_flight == [0, 1]
    v.ack(1)
    assert in_flight == [0, 1, 2]
    v.ack(0)
    v.ack(2)
    assert in_flight == [0, 1, 2, 3, 4]


def test_a_completed_plan_finishes_with_a_verdict_and_done() -> None:
    sim = Sim()
    v = Volunteer(sim, ProbePlan.build(repetitions=1, step=64, window=8))
    sim.on_probe = lambda p: None
    v.handshake()
    while v.finished() is None:
        for seq in v.probes():
            if v.snap() and seq not in v.rows():
                v.ack(seq)
        sim.take(sim.core.flush())
    done = v.finished()
    assert done.state == "complete" and done.verdict == "fragments-ok"
    assert v.snap().sent == v.plan.total_probes == v.snap().acked
    beats = [h for h in sim.of(Heartbeat) if h.session_id == v.sid]
    assert beats[-1].sent == v.plan.total_probes
    # The final batch and heartbeat come before RunFinished, DONE after.
    kinds = [type(a).__name__ for a in sim.actions[-4:]]
    assert kinds[-2:] == ["RunFinished", "SendDatagram"]


def test_a_client_that_stalls_past_the_timeout_is_late_not_a_fragment_loss() -> None:
    """A client descheduled for longer than the probe timeout (a loaded
    machine: seen in the demo, where a clean path then read 'inconclusive')
    acknowledges a whole window of splits after their timeout. Those probes
    are recorded late, lost by the paper's rule for the drop rates, but they
    arrived: the verdict counts them as delivered and says so."""
    sim = Sim()
    plan = ProbePlan.build(repetitions=2, step=32, window=16)  # 47 sizes, 46 splits, twice
    v = Volunteer(sim, plan)
    sim.on_probe = lambda p: None
    v.handshake()
    stalled: list[int] = []
    while v.finished() is None:
        pending = [seq for seq in v.probes() if seq not in v.rows()]
        if not stalled and pending and pending[0] >= plan.split_from:
            stalled = pending
            # Past the probes' timeout (sent together): recorded lost.
            sim.advance(v.snap().timeout_ms / 1000.0 + 1e-3)
            for seq in stalled:
                v.ack(seq)  # ...then acknowledged, late
            continue
        for seq in pending:
            if v.snap() and seq not in v.rows():
                v.ack(seq)
        sim.take(sim.core.flush())
    rows = v.rows()
    assert len(stalled) == 16 and {rows[s].outcome for s in stalled} == {"late"}
    splits = plan.total_probes - plan.split_from
    assert v.snap().acked == plan.total_probes - 16  # the drop rates: late is lost
    done = v.finished()
    assert done.state == "complete" and done.verdict == "fragments-ok", done.verdict_reason
    assert "16 probes acknowledged after their timeout" in done.verdict_reason
    # By the paper's rule alone the same counts read as a fragment problem.
    whole = plan.split_from
    assert decide(whole, whole, splits, splits - 16).verdict == "inconclusive"


# -- pacing -----------------------------------------------------------------------------------


def _paced_rate(sim: Sim, volunteers: list[Volunteer], seconds: float) -> float:
    """Probes/s sent to ``volunteers`` (each ACKs every probe at once), after
    a second to get past the initial bursts; ``v.measured`` is each one's share."""
    by_sid = {v.sid: v for v in volunteers}
    sim.on_probe = lambda p: by_sid[p.session_id].ack(p.seq) if p.session_id in by_sid else None
    for v in volunteers:
        v.handshake(rtt=0.001)
    start_n = len(sim.of(SendProbe))
    sim.advance(1.0)  # past the initial burst
    mid = len(sim.of(SendProbe))
    before = [v.snap().sent for v in volunteers]
    sim.advance(seconds)
    assert start_n > 0
    for v, n in zip(volunteers, before, strict=True):
        v.measured = v.snap().sent - n
    return (len(sim.of(SendProbe)) - mid) / seconds


def test_pacing_per_address() -> None:
    sim = Sim(Policy(pps_per_address=500, pps_per_prefix=1e6, pps_global=1e6))
    v = Volunteer(sim, ProbePlan.build(repetitions=20, step=8, window=64))
    assert _paced_rate(sim, [v], 4.0) == pytest.approx(500, rel=0.01)


def test_pacing_per_prefix_shared_by_a_24() -> None:
    sim = Sim(Policy(pps_per_address=1e6, pps_per_prefix=600, pps_global=1e6))
    plan = ProbePlan.build(repetitions=20, step=8, window=64)
    a = Volunteer(sim, plan, addr=("198.51.100.7", 40000))
    b = Volunteer(sim, plan, addr=("198.51.100.8", 40000))
    rate = _paced_rate(sim, [a, b], 4.0)
    assert rate == pytest.approx(600, rel=0.01)
    # Round robin: neither starves the other.
    assert abs(a.measured - b.measured) <= 2


def test_pacing_global() -> None:
    sim = Sim(Policy(pps_per_address=1e6, pps_per_prefix=1e6, pps_global=800))
    plan = ProbePlan.build(repetitions=20, step=8, window=64)
    a = Volunteer(sim, plan, addr=("198.51.100.7", 40000))
    b = Volunteer(sim, plan, addr=("203.0.113.8", 40000))
    assert _paced_rate(sim, [a, b], 4.0) == pytest.approx(800, rel=0.01)
    assert abs(a.measured - b.measured) <= 2


def test_pacer_buckets_are_released_with_their_runs() -> None:
    pacer = Pacer(100, 100, 100, now=0.0)
    one, two = pacer.lane("198.51.100.1", 0.0), pacer.lane("198.51.100.1", 0.0)
    assert one.by_address is two.by_address and pacer.buckets() == 2
    pacer.release(one)
    assert pacer.buckets() == 2
    pacer.release(two)
    assert pacer.buckets() == 0
    b = TokenBucket(1000.0, 0.0)
    b.tokens = 0.0
    assert b.ready_at() == pytest.approx(0.001)
    b.refill(b.ready_at())
    assert b.has_token()


def test_probes_the_shell_could_not_send_are_sent_again_not_lost() -> None:
    sim = Sim()
    v = Volunteer(sim, small_plan(window=3))
    v.handshake()
    first = sim.of(SendProbe)
    assert [p.seq for p in first] == [0, 1, 2]
    sim.core.probes_not_sent(sim.now, first[1:], buffer_full=True)  # 1 and 2 never left
    assert v.snap().sent == 1 and v.snap().outstanding == 1
    assert sim.core.next_deadline() > sim.now  # a short pause, not a spin
    sim.advance(0.002)
    assert v.probes() == [0, 1, 2, 1, 2]
    for seq in (0, 1, 2):
        v.ack(seq)
    sim.take(sim.core.flush())
    assert {s: r.outcome for s, r in v.rows().items()} == {0: "acked", 1: "acked", 2: "acked"}
    assert sim.core.counters["probes_not_sent"] == 2 and sim.core.counters["probes_sent"] == 5


# -- admission ----------------------------------------------------------------------------------


def test_admission_limits_and_refunds() -> None:
    plan = ProbePlan.quick()
    sim = Sim(Policy(sessions_per_address=2, sessions_per_address_hour=3))
    core = sim.core
    a = core.admit(sim.now, plan, "192.0.2.7")
    core.register(sim.now, a.session_id)
    core.register(sim.now, core.admit(sim.now, plan, "192.0.2.7").session_id)
    with pytest.raises(AdmissionDenied, match="concurrent sessions per address"):
        core.admit(sim.now, plan, "192.0.2.7")
    # A run that finishes frees its concurrent slot, not its hourly one.
    assert core.end(sim.now, a.session_id, b"\x00" * 16) == "forbidden"
    assert core.end(sim.now, a.session_id, a.cookie) == "ended"
    sim.advance(0.001)
    third = core.admit(sim.now, plan, "192.0.2.7")
    # The database did not store the third: it counts against nothing.
    core.cancel(third.session_id)
    core.register(sim.now, core.admit(sim.now, plan, "192.0.2.7").session_id)
    with pytest.raises(AdmissionDenied):
        core.admit(sim.now, plan, "192.0.2.7")
    assert core.counters["admission_denied"] == 2


def test_hourly_byte_budget_counts_the_plan() -> None:
    plan = ProbePlan.build()
    sim = Sim(Policy(bytes_per_address_hour=int(1.5 * plan_bytes(plan))))
    sim.core.admit(sim.now, plan, "192.0.2.7")
    with pytest.raises(AdmissionDenied, match="bytes per address"):
        sim.core.admit(sim.now, plan, "192.0.2.7")
    sim.advance(3600.0)
    sim.core.admit(sim.now, plan, "192.0.2.7")


# -- expiry and ending ---------------------------------------------------------------------------


def test_unproven_session_expires_at_the_handshake_timeout() -> None:
    sim = Sim(Policy(handshake_timeout_s=30))
    v = Volunteer(sim, small_plan())
    v.hello()  # a HELLO alone proves nothing
    sim.advance(30.0 - 1e-6)
    assert v.finished() is None
    sim.advance(2e-6)
    done = v.finished()
    assert done.state == "expired" and done.verdict == "inconclusive"
    assert not sim.of(SendDatagram, 1)  # no DONE to an unproven address


def test_silent_client_expires_and_only_the_owners_poll_keeps_it_alive() -> None:
    sim = Sim(Policy(silence_timeout_s=30, max_timeout_ms=1000))
    v = Volunteer(sim, small_plan(window=1, repetitions=200))  # nothing is ever acked
    v.handshake()
    proven = sim.now
    sim.advance(20.0)
    assert sim.core.touch(sim.now, v.sid, None) is False  # a stranger, no cookie
    assert sim.core.touch(sim.now, v.sid, b"\x11" * 16) is False  # a wrong cookie
    sim.advance(10.0 - 1e-6)
    assert v.finished() is None
    sim.advance(2e-6)
    done = v.finished()
    assert done.state == "incomplete" and done.end_reason == "client-silent"
    assert sim.now - proven == pytest.approx(30.0, abs=1e-5)
    # The same with the owner polling: alive 30 s after the poll, not after the proof.
    sim2 = Sim(Policy(silence_timeout_s=30, max_timeout_ms=1000))
    w = Volunteer(sim2, small_plan(window=1, repetitions=200))
    w.handshake()
    sim2.advance(20.0)
    assert sim2.core.touch(sim2.now, w.sid, w.cookie) is True
    sim2.advance(29.0)
    assert w.finished() is None
    sim2.advance(1.0 + 1e-6)
    assert w.finished().end_reason == "client-silent"


def test_maximum_session_time() -> None:
    sim = Sim(Policy(max_session_s=100, silence_timeout_s=30, max_timeout_ms=1000))
    v = Volunteer(sim, small_plan(window=1, repetitions=1000))
    v.handshake()
    while v.finished() is None:
        sim.advance(10.0)
        sim.core.touch(sim.now, v.sid, v.cookie)
    done = v.finished()
    assert done.state == "incomplete" and done.end_reason == "max-session-time"
    assert sim.now == pytest.approx(T0 + 0.02 + 100, abs=10)


def test_end_waits_for_outstanding_probes_then_finishes_ended() -> None:
    sim = Sim(Policy(min_timeout_ms=200))
    v = Volunteer(sim, small_plan(window=3, repetitions=10))
    v.handshake(rtt=0.01)
    v.ack(0)
    assert v.probes() == [0, 1, 2, 3]
    assert sim.core.end(sim.now, "0" * 16, v.cookie) == "not-found"
    assert sim.core.end(sim.now, v.sid, v.cookie) == "ended"
    sim.advance(0.001)
    assert v.finished() is None and v.probes() == [0, 1, 2, 3]  # nothing new
    sim.advance(0.25)  # the three outstanding probes time out
    done = v.finished()
    assert done.state == "ended" and done.end_reason == "client-ended"
    sim.take(sim.core.flush())
    assert {s: r.outcome for s, r in v.rows().items()} == {
        0: "acked",
        1: "lost",
        2: "lost",
        3: "lost",
    }
    assert sim.core.end(sim.now, v.sid, v.cookie) == "already-final"


def test_end_of_an_unproven_session_and_shutdown() -> None:
    sim = Sim()
    a = Volunteer(sim, small_plan())
    assert sim.core.end(sim.now, a.sid, a.cookie) == "ended"
    sim.advance(0.0)
    assert a.finished().state == "ended"
    b = Volunteer(sim, small_plan(window=2), addr=("198.51.100.9", 1))
    b.handshake()
    out = sim.take(sim.core.shutdown(sim.now))
    done = b.finished()
    assert done.state == "incomplete" and done.end_reason == "server-shutdown"
    assert {r.outcome for r in b.rows().values()} == {"lost"}
    assert any(isinstance(x, SendDatagram) and x.addr == b.addr for x in out)  # DONE


# -- fuzz ----------------------------------------------------------------------------------------

_PEER = ("198.51.100.7", 40000)
_ADDRS = st.sampled_from([_PEER, ("198.51.100.7", 40001), ("203.0.113.1", 53), ("10.0.0.1", 1)])


def _fuzz_sim() -> tuple[Sim, list[bytes], list[Volunteer]]:
    """A core with one proven run (peer _PEER), one unproven run and one
    finished run; returns it and their tags."""
    sim = Sim(Policy(min_timeout_ms=50, max_timeout_ms=200), seed=7)
    proven = Volunteer(sim, small_plan(window=4, repetitions=3), addr=_PEER)
    proven.handshake(rtt=0.01)
    waiting = Volunteer(sim, small_plan(), addr=("203.0.113.1", 53))
    done = Volunteer(sim, small_plan(), addr=("10.0.0.1", 1))
    sim.core.end(sim.now, done.sid, done.cookie)
    sim.advance(0.001)
    return sim, [proven.tag, waiting.tag, done.tag], [proven, waiting, done]


def _near_valid(tags: list[bytes]) -> st.SearchStrategy[bytes]:
    prefix = st.builds(
        lambda kind, version, tag: b"KA" + bytes([kind, version]) + tag,
        st.integers(0, 255) | st.sampled_from([1, 3, 5]),
        st.sampled_from([wire.WIRE_VERSION, wire.WIRE_VERSION, 0, 2]),
        st.sampled_from(tags) | st.binary(min_size=8, max_size=8),
    )
    return st.builds(lambda p, tail: p + tail, prefix, st.binary(max_size=80))


@settings(max_examples=400, deadline=None)
@given(data=st.binary(max_size=200))
def test_fuzz_wire_decode_raises_only_wire_error(data: bytes) -> None:
    try:
        msg = wire.decode(data)
    except wire.WireError:
        return
    assert msg.session_tag == data[4:12]
    if not isinstance(msg, wire.Hello):  # HELLO's padding is not kept
        assert msg.encode() == data


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.data())
def test_fuzz_core_datagram_handler(data: st.DataObject) -> None:
    """Any datagram from anywhere: silently dropped or a valid answer, never
    an exception, never more bytes to an unproven address than arrived."""
    sim, tags, (proven, _, _) = _fuzz_sim()
    valid = [
        wire.Hello(tags[0], proven.cookie).encode(),
        wire.Ack(tags[0], 1, 16).encode(),
        wire.Ack(tags[2], 0, 16).encode(),
    ]
    datagrams = data.draw(
        st.lists(
            st.tuples(
                _ADDRS,
                st.binary(max_size=120) | _near_valid(tags) | st.sampled_from(valid),
                st.floats(0, 0.3),
            ),
            max_size=30,
        )
    )
    for addr, payload, dt in datagrams:
        sim.advance(dt)
        out = sim.core.on_datagram(sim.now, addr, payload, SERVER_IP)
        sim.take(out)
        proven_peers = {r.peer for r in sim.core.runs.values() if r.peer is not None}
        to_unproven = sum(
            len(a.data) for a in out if isinstance(a, SendDatagram) and a.addr not in proven_peers
        )
        assert to_unproven <= len(payload)
        for a in out:
            if isinstance(a, SendDatagram):
                assert isinstance(wire.decode(a.data), wire.Challenge | wire.Done)
            elif isinstance(a, SendProbe):
                assert (a.dst, a.session_id) == (_PEER[0], proven.sid)
        d = sim.core.next_deadline()
        if d is not None and d <= sim.now:
            sim.timers()
    sim.advance(5.0)
