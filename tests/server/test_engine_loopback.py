"""The probe engine's shell on loopback: real UDP and raw sockets, a scripted
client socket and the real store.

Every protocol rule is tested on simulated time in test_engine_core.py; these
tests check what only the shell does: the exclusive probe port, CHALLENGE and
probes really leaving from the right sockets, ACKs read back, rows reaching
PostgreSQL in order (also across a database restart), and ``end_session``
waiting for the loop.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from kickass_core import wire
from kickass_core.errors import KickassError
from kickass_core.plan import ProbePlan
from kickass_db.study_store import StudyStore
from kickass_server.engine import ProbeEngine
from kickass_server.policy import Policy

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="raw sockets need root")


@pytest.fixture
def engine(database_url: str) -> Iterator[ProbeEngine]:
    e = ProbeEngine(
        StudyStore(database_url),
        Policy(min_timeout_ms=200),
        bind_host="127.0.0.1",
        probe_port=0,
        server_version="test",
    )
    e.start()
    try:
        yield e
    finally:
        e.stop()


def _wait_state(engine: ProbeEngine, session_id: str, state: str, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = engine.snapshot(session_id)
        if snap is not None and snap.state == state:
            return True
        time.sleep(0.02)
    return False


class Peer:
    def __init__(self, engine: ProbeEngine, plan: ProbePlan) -> None:
        self.engine = engine
        self.new = engine.create_session(plan, "127.0.0.1", client_version="test")
        self.tag = bytes.fromhex(self.new.session_id)
        self.cookie = bytes.fromhex(self.new.cookie)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(1.0)
        self.server = ("127.0.0.1", engine.probe_port)

    def send(self, msg: bytes) -> None:
        self.sock.sendto(msg, self.server)

    def recv(self, timeout: float = 1.0) -> wire.Message | None:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(4096)
        except TimeoutError:
            return None
        return wire.decode(data)

    def handshake(self) -> None:
        self.send(wire.Hello(self.tag, self.cookie).encode())
        ch = self.recv()
        assert isinstance(ch, wire.Challenge)
        self.send(wire.Echo(self.tag, ch.token).encode())

    def probes(self, n: int, timeout: float = 2.0) -> list[int]:
        seqs: list[int] = []
        deadline = time.monotonic() + timeout
        while len(seqs) < n and time.monotonic() < deadline:
            m = self.recv(max(0.01, deadline - time.monotonic()))
            if isinstance(m, wire.ProbeHeader):
                seqs.append(m.seq)
        return seqs

    def ack(self, seq: int) -> None:
        self.send(wire.Ack(self.tag, seq, 16).encode())

    def close(self) -> None:
        self.sock.close()


def test_no_probe_before_echo_and_window_is_respected(engine: ProbeEngine) -> None:
    plan = ProbePlan.build(repetitions=2, step=256, window=4)
    peer = Peer(engine, plan)
    try:
        peer.send(wire.Hello(peer.tag, peer.cookie).encode())
        ch = peer.recv()
        assert isinstance(ch, wire.Challenge)
        assert peer.recv(0.3) is None  # nothing until the echo
        peer.send(wire.Echo(peer.tag, ch.token).encode())
        # Without acks exactly W probes come, then silence until timeouts.
        first = peer.probes(10, timeout=0.15)
        assert first == [0, 1, 2, 3]
    finally:
        peer.close()


def test_ack_accounting_late_duplicate_reordered(engine: ProbeEngine, database_url: str) -> None:
    plan = ProbePlan.build(repetitions=1, step=512, window=3, phases=["whole"])
    assert plan.total_probes == 5  # 44, 556, 1068, 1480, 1500
    peer = Peer(engine, plan)
    try:
        peer.handshake()
        assert peer.probes(3) == [0, 1, 2]
        peer.ack(2)  # reordered
        peer.ack(0)
        peer.ack(0)  # duplicate
        # Let probe 1 time out (timeout floor 200 ms), then ack it: late.
        seqs = peer.probes(2, timeout=1.5)
        assert sorted(seqs) == [3, 4]
        for s in seqs:
            peer.ack(s)
        time.sleep(0.5)
        peer.ack(1)  # after the session completed: still counted, as late
        peer.ack(99)  # stray: never sent
        assert _wait_state(engine, peer.new.session_id, "complete")
        time.sleep(0.2)  # let the loop read the late and the stray ACK
        # writer_sync hands the engine's pending rows over first: no race
        # with the periodic flush.
        engine.writer_sync()
        res = StudyStore(database_url).session_results(peer.new.session_id)
        by_len = {r["ip_len"]: r for r in res["whole"]}
        assert by_len[556]["acked"] == 0 and by_len[556]["late"] == 1
        assert by_len[44]["acked"] == 1 and by_len[1068]["acked"] == 1
        assert by_len[44]["rtt_ms_median"] is not None  # the duplicate kept the first RTT
        assert res["acked"] == 4 and res["sent"] == 5
        c = engine.stats()["counters"]
        assert c["dup_acks"] == 1 and c["late_acks"] == 1 and c["stray_acks"] == 1
    finally:
        peer.close()


def test_end_session_records_outstanding_as_lost(engine: ProbeEngine, database_url: str) -> None:
    plan = ProbePlan.build(repetitions=5, step=64, window=8)
    peer = Peer(engine, plan)
    try:
        peer.handshake()
        seqs = peer.probes(8)
        for s in seqs[:5]:
            peer.ack(s)
        time.sleep(0.05)
        assert engine.end_session(peer.new.session_id, "00" * 16) == "forbidden"
        assert engine.end_session(peer.new.session_id, peer.new.cookie) == "ended"
        engine.writer_sync()
        res = StudyStore(database_url).session_results(peer.new.session_id)
        assert res["state"] == "ended" and res["end_reason"] == "client-ended"
        assert res["sent"] == sum(r["sent"] for r in res["whole"] + res["split"])
        assert res["acked"] >= 5
    finally:
        peer.close()


@pytest.mark.parametrize("option", ["SO_REUSEADDR", "SO_REUSEPORT"])
@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_probe_port_is_exclusive(engine: ProbeEngine, option: str, host: str) -> None:
    """Nobody shares the probe port, not even a socket that asks to: the
    kernel would hand it part of the clients' ACKs."""
    other = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        other.setsockopt(socket.SOL_SOCKET, getattr(socket, option), 1)
        with pytest.raises(OSError) as exc:
            other.bind((host, engine.probe_port))
        assert exc.value.errno == errno.EADDRINUSE
    finally:
        other.close()


def test_second_engine_on_a_busy_port_refuses_to_start(engine: ProbeEngine) -> None:
    second = ProbeEngine(
        engine.store, Policy(), bind_host="127.0.0.1", probe_port=engine.probe_port
    )
    try:
        with pytest.raises(KickassError, match=f"UDP port {engine.probe_port}.*in use") as exc:
            second.start()
        assert exc.value.hint and "--probe-port" in exc.value.hint
        assert second.udp is None and second.raw is None
    finally:
        second.stop()
    # The first one still answers.
    peer = Peer(engine, ProbePlan.build(repetitions=1, step=512, window=1))
    try:
        peer.send(wire.Hello(peer.tag, peer.cookie).encode())
        assert isinstance(peer.recv(), wire.Challenge)
    finally:
        peer.close()


def test_database_restart_mid_session_loses_nothing(tmp_path) -> None:  # noqa: ANN001
    """PostgreSQL goes away for a while during probing: the engine keeps
    measuring, keeps every row in order, and writes it all once it is back."""
    from kickass_db import upgrade
    from kickass_testbed.pg import EmbeddedPostgres

    pg = EmbeddedPostgres(tmp_path / "pg")
    url = pg.start()
    try:
        upgrade(url)
        e = ProbeEngine(
            StudyStore(url),
            # Paced so that the probing after the outage starts lasts
            # about 2.5 s: writes meet the outage, whatever the machine's speed.
            Policy(min_timeout_ms=200, pps_per_address=100),
            bind_host="127.0.0.1",
            probe_port=0,
            server_version="test",
        )
        e.start()
        try:
            plan = ProbePlan.build(repetitions=6, step=64, window=2)
            peer = Peer(e, plan)
            try:
                peer.handshake()
                acked = 0
                restarted = False
                deadline = time.monotonic() + 60
                while acked < plan.total_probes and time.monotonic() < deadline:
                    for seq in peer.probes(1, timeout=1.0):
                        peer.ack(seq)
                        acked += 1
                    if acked >= 40 and not restarted:
                        # The database vanishes mid-session and comes back at
                        # the same URL, while the peer goes on acknowledging.
                        outage = threading.Thread(
                            target=lambda: (pg.stop(), time.sleep(2.0), pg.start())  # type: ignore[func-returns-value]  # a tuple: three calls in one lambda
                        )
                        outage.start()
                        restarted = True
                outage.join(30)
                assert restarted and acked == plan.total_probes
                assert _wait_state(e, peer.new.session_id, "complete", deadline - time.monotonic())
                assert e.writer_sync(30)
                res = StudyStore(url).session_results(peer.new.session_id)
                assert res["state"] == "complete"
                assert res["sent"] == plan.total_probes and res["acked"] == plan.total_probes
                assert e.stats()["db_write_failures"] >= 1  # it really was away
                assert e.stats()["db_writes_dropped"] == 0
            finally:
                peer.close()
        finally:
            e.stop()
    finally:
        pg.stop()
