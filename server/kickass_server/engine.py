"""The probe engine: return-routability handshake, windowed probing, timeouts.

One thread owns every socket and every session (single-threaded like a
sans-IO core; the HTTP threads talk to it under ``self.lock``). Database
writes go through a separate writer thread so a slow or restarting database
never stalls the probe clock, and nothing measured is lost while it is away.

Handshake (DESIGN.md section 4): HELLO must carry the session's secret
cookie; the answer is a CHALLENGE smaller than the HELLO; probes start only
after the ECHO of that challenge arrives from the same address:port. A
spoofed HELLO therefore costs its victim one small packet.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import hmac
import logging
import secrets
import selectors
import socket
import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from kickass_core import verdict as verdicts
from kickass_core import wire
from kickass_core.plan import ProbePlan, plan_bytes
from kickass_core.states import FINAL_STATES
from kickass_db.store import ProbeOutcome
from kickass_db.writer import OrderedWriter

from .packets import SessionPackets, open_raw_socket
from .policy import Admission, Policy, TokenBucket, prefix_of

log = logging.getLogger("kickass.engine")

IP_PKTINFO = 8  # Linux; not exported by Python's socket module
_RECV_BUF = 4096
FLUSH_INTERVAL_S = 0.5

# Outcome codes per seq (bytearray, one byte per probe of the plan).
_UNSENT, _OUT, _ACKED, _LOST, _LATE = 0, 1, 2, 3, 4


@dataclass
class Session:
    session_id: str
    tag: bytes
    cookie_hash: bytes
    plan: ProbePlan
    source_address: str
    created: float
    expires: float
    state: str = "created"
    peer: tuple[str, int] | None = None
    local_ip: str | None = None
    challenges: dict[tuple[str, int], tuple[bytes, float, str]] = field(default_factory=dict)
    challenges_sent: int = 0
    rtt_ms: float | None = None
    srtt: float = 0.0
    rttvar: float = 0.0
    rto: float = 1.0
    next_seq: int = 0
    outstanding: dict[int, float] = field(default_factory=dict)  # seq -> monotonic send time
    codes: bytearray = field(default_factory=bytearray)
    ack_counts: bytearray = field(default_factory=bytearray)
    sent_mono: array = field(default_factory=lambda: array("d"))
    ack_mono: array = field(default_factory=lambda: array("d"))
    wall0: datetime = field(default_factory=lambda: datetime.now(UTC))
    mono0: float = 0.0
    sent: int = 0
    acked: int = 0
    phase_sent: dict[str, int] = field(default_factory=lambda: {"whole": 0, "split": 0})
    phase_acked: dict[str, int] = field(default_factory=lambda: {"whole": 0, "split": 0})
    last_seen: float = 0.0  # last ACK, or last HTTP poll: the client is still there
    ip_id: int = 0
    packets: SessionPackets | None = None
    addr_bucket: TokenBucket | None = None
    prefix_bucket: TokenBucket | None = None
    pending: list = field(default_factory=list)  # (seq, outcome, len, frag) not yet written
    end_requested: str | None = None
    finished_at: float | None = None  # monotonic; finished sessions linger for late ACKs
    finished: threading.Event = field(default_factory=threading.Event)

    def ok_cookie(self, cookie: bytes) -> bool:
        return hmac.compare_digest(hashlib.sha256(cookie).digest(), self.cookie_hash)


@dataclass
class NewSession:
    session_id: str
    cookie: str
    plan: ProbePlan
    expires_in_s: int


class AdmissionDenied(Exception):
    """The policy refuses a new session (HTTP 429)."""


class ProbeEngine:
    def __init__(
        self,
        store,  # noqa: ANN001 - kickass_db.store.Store (duck-typed for tests)
        policy: Policy | None = None,
        *,
        bind_host: str = "0.0.0.0",
        probe_port: int = 9000,
        server_version: str = "0",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.policy = policy or Policy()
        self.bind_host = bind_host
        self.probe_port = probe_port
        self.server_version = server_version
        self.clock = clock
        self.lock = threading.RLock()
        self.sessions: dict[str, Session] = {}
        self.by_tag: dict[bytes, Session] = {}
        self.admission = Admission(self.policy, clock)
        now = clock()
        self.global_bucket = TokenBucket(self.policy.pps_global, now)
        self.addr_buckets: dict[str, TokenBucket] = {}
        self.prefix_buckets: dict[str, TokenBucket] = {}
        self.timeouts: list[tuple[float, str, int]] = []
        self.counters: dict[str, int] = {
            k: 0
            for k in (
                "datagrams",
                "malformed",
                "unknown_session",
                "bad_cookie",
                "hello_ignored",
                "challenges_sent",
                "bad_echo",
                "wrong_peer",
                "acks",
                "late_acks",
                "dup_acks",
                "stray_acks",
                "probes_sent",
                "packets_sent",
                "bytes_sent",
                "send_errors",
                "paced",
            )
        }
        self.writer = OrderedWriter()
        self.udp: socket.socket | None = None
        self.raw: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._running = False
        self._thread: threading.Thread | None = None
        self._last_flush = now

    # -- lifecycle -----------------------------------------------------------
    def open_sockets(self) -> None:
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        udp.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
        udp.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
        udp.bind((self.bind_host, self.probe_port))
        udp.setblocking(False)
        self.udp = udp
        self.probe_port = udp.getsockname()[1]
        self.raw = open_raw_socket()

    def start(self) -> None:
        if self.udp is None:
            self.open_sockets()
        self._running = True
        self._thread = threading.Thread(target=self.run, name="kickass-probe-engine", daemon=True)
        self._thread.start()

    def stop(self, reason: str = "server-shutdown") -> None:
        """Finish every live session as incomplete, flush, close sockets."""
        self._running = False
        self._wake()
        if self._thread:
            self._thread.join(10)
        with self.lock:
            for s in list(self.sessions.values()):
                if s.state not in FINAL_STATES:
                    self._finish(s, "incomplete", reason)
        self.writer.close()
        for sock in (self.udp, self.raw, self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    # -- API side (HTTP threads) ---------------------------------------------
    def create_session(
        self,
        plan: ProbePlan,
        source_address: str,
        *,
        client_version: str | None = None,
        platform: str | None = None,
        install_id: str | None = None,
    ) -> NewSession:
        nbytes = plan_bytes(plan)
        with self.lock:
            reason = self.admission.check(source_address, nbytes)
            if reason:
                raise AdmissionDenied(reason)
            self.admission.admit(source_address, nbytes)
            while True:
                tag = secrets.token_bytes(wire.SESSION_TAG_LEN)
                if tag not in self.by_tag:
                    break
        cookie = secrets.token_bytes(wire.COOKIE_LEN)
        now = self.clock()
        s = Session(
            session_id=tag.hex(),
            tag=tag,
            cookie_hash=hashlib.sha256(cookie).digest(),
            plan=plan,
            source_address=source_address,
            created=now,
            expires=now + self.policy.handshake_timeout_s,
            codes=bytearray(plan.total_probes),
            sent_mono=array("d", bytes(8 * plan.total_probes)),
            ack_mono=array("d", bytes(8 * plan.total_probes)),
            mono0=now,
            ack_counts=bytearray(plan.total_probes),
            ip_id=secrets.randbelow(0xFFFF) + 1,
        )
        try:
            self.store.create_session(
                session_id=s.session_id,
                cookie_hash=s.cookie_hash,
                plan=plan.to_json(),
                source_address=source_address,
                expires_at=datetime.now(UTC) + timedelta(seconds=self.policy.handshake_timeout_s),
                server_version=self.server_version,
                client_version=client_version,
                platform=platform,
                install_id=install_id,
            )
        except Exception:
            with self.lock:
                self.admission.release(source_address)
            raise
        with self.lock:
            self.sessions[s.session_id] = s
            self.by_tag[tag] = s
        return NewSession(s.session_id, cookie.hex(), plan, int(self.policy.handshake_timeout_s))

    def end_session(self, session_id: str, cookie_hex: str, wait_s: float = 5.0) -> str:
        """Client asked to stop: no new probes; outstanding ones get their
        timeout, then the session is recorded as ``ended``. Returns the
        outcome: 'ended', 'not-found', 'forbidden' or 'already-final'."""
        try:
            cookie = bytes.fromhex(cookie_hex)
        except ValueError:
            return "forbidden"
        with self.lock:
            s = self.sessions.get(session_id)
            if s is None:
                return "not-found"
            if not s.ok_cookie(cookie):
                return "forbidden"
            if s.state in FINAL_STATES:
                return "already-final"
            s.end_requested = "client-ended"
        self._wake()
        s.finished.wait(wait_s)
        return "ended"

    def writer_sync(self, timeout: float = 10.0) -> bool:
        return self.writer.sync(timeout)

    def touch(self, session_id: str) -> None:
        """The client polled over HTTP: it is alive even if no probe gets
        through (a fragment-dropping path acks nothing for a whole phase)."""
        with self.lock:
            s = self.sessions.get(session_id)
            if s is not None:
                s.last_seen = self.clock()

    def live(self, session_id: str) -> Session | None:
        with self.lock:
            return self.sessions.get(session_id)

    def stats(self) -> dict:
        with self.lock:
            live = [s for s in self.sessions.values() if s.state not in FINAL_STATES]
            return {
                "counters": dict(self.counters),
                "sessions_live": len(live),
                "sessions_probing": sum(1 for s in live if s.state == "probing"),
                "db_write_backlog": self.writer.q.qsize(),
                "db_write_failures": self.writer.failures,
                "db_writes_dropped": self.writer.dropped,
            }

    # -- the loop --------------------------------------------------------------
    def run(self) -> None:
        assert self.udp is not None
        sel = selectors.DefaultSelector()
        sel.register(self.udp, selectors.EVENT_READ, "udp")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._wake_r.setblocking(False)
        while self._running:
            timeout = self._next_wakeup()
            for key, _ in sel.select(timeout):
                if key.data == "wake":
                    with contextlib.suppress(BlockingIOError):
                        self._wake_r.recv(4096)
                else:
                    self._drain_udp()
            with self.lock:
                self.tick(self.clock())
        sel.close()

    def _next_wakeup(self) -> float:
        now = self.clock()
        t = 0.05
        with self.lock:
            if self.timeouts:
                t = min(t, max(0.0, self.timeouts[0][0] - now))
            if any(
                s.state == "probing"
                and s.next_seq < s.plan.total_probes
                and len(s.outstanding) < s.plan.window
                for s in self.sessions.values()
            ):
                t = min(t, self._pacing_wait())
        return t

    def _drain_udp(self) -> None:
        assert self.udp is not None
        for _ in range(512):
            try:
                data, anc, _flags, addr = self.udp.recvmsg(_RECV_BUF, 64)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. ICMP port unreachable reported on the socket
                log.debug("udp recv error: %s", exc)
                continue
            local_ip = None
            for level, ctype, cdata in anc:
                if level == socket.IPPROTO_IP and ctype == IP_PKTINFO and len(cdata) >= 12:
                    local_ip = socket.inet_ntoa(cdata[8:12])
            with self.lock:
                self.handle_datagram(data, addr, local_ip, self.clock())

    # -- datagram handling -------------------------------------------------------
    def handle_datagram(
        self, data: bytes, addr: tuple[str, int], local_ip: str | None, now: float
    ) -> None:
        self.counters["datagrams"] += 1
        try:
            msg = wire.decode(data)
        except wire.WireError:
            self.counters["malformed"] += 1
            return
        s = self.by_tag.get(msg.session_tag)
        # A finished session stays in memory for a grace period so that late
        # and duplicate ACKs are still accounted; nothing else is accepted.
        if s is None or (s.state in FINAL_STATES and not isinstance(msg, wire.Ack)):
            self.counters["unknown_session"] += 1
            return
        if isinstance(msg, wire.Hello):
            self._on_hello(s, msg, len(data), addr, local_ip, now)
        elif isinstance(msg, wire.Echo):
            self._on_echo(s, msg, addr, now)
        elif isinstance(msg, wire.Ack):
            self._on_ack(s, msg, addr, now)
        else:
            self.counters["malformed"] += 1  # server-to-client kinds never come in

    def _on_hello(
        self,
        s: Session,
        msg: wire.Hello,
        size: int,
        addr: tuple[str, int],
        local_ip: str | None,
        now: float,
    ) -> None:
        if not s.ok_cookie(msg.cookie):
            self.counters["bad_cookie"] += 1
            return
        if s.peer == addr:
            self.counters["hello_ignored"] += 1  # already proven; a late retransmission
            return
        if s.challenges_sent >= self.policy.max_challenges_per_session:
            self.counters["hello_ignored"] += 1
            return
        token, _, _ = s.challenges.get(addr, (secrets.token_bytes(wire.CHALLENGE_LEN), 0.0, ""))
        reply = wire.Challenge(s.tag, token).encode()
        if len(reply) > size:  # never amplify (decode() already enforces HELLO_MIN_LEN)
            self.counters["hello_ignored"] += 1
            return
        s.challenges[addr] = (token, now, local_ip or self.bind_host)
        s.challenges_sent += 1
        self.counters["challenges_sent"] += 1
        self._send_udp(reply, addr)

    def _on_echo(self, s: Session, msg: wire.Echo, addr: tuple[str, int], now: float) -> None:
        pending = s.challenges.get(addr)
        if pending is None or not hmac.compare_digest(pending[0], msg.token):
            self.counters["bad_echo"] += 1
            return
        token, sent_at, local_ip = pending
        del s.challenges[addr]
        if s.peer == addr:
            return
        rtt = max(now - sent_at, 1e-4)
        s.peer = addr
        s.local_ip = local_ip if local_ip and local_ip != "0.0.0.0" else None
        s.packets = None
        s.addr_bucket = s.prefix_bucket = None
        if s.state == "created":
            s.state = "probing"
            s.rtt_ms = rtt * 1000.0
            s.srtt, s.rttvar = rtt, rtt / 2
            s.rto = self._clamp_rto(2 * s.srtt + 4 * s.rttvar)
            s.last_seen = now
            s.expires = now + self.policy.max_session_s
            sid, peer_ip, peer_port, rtt_ms = s.session_id, addr[0], addr[1], s.rtt_ms
            self.writer.submit(lambda: self.store.mark_probing(sid, peer_ip, peer_port, rtt_ms))

    def _clamp_rto(self, rto: float) -> float:
        p = self.policy
        return min(max(rto, p.min_timeout_ms / 1000.0), p.max_timeout_ms / 1000.0)

    def _on_ack(self, s: Session, msg: wire.Ack, addr: tuple[str, int], now: float) -> None:
        if addr != s.peer:
            self.counters["wrong_peer"] += 1
            return
        seq = msg.seq
        if seq >= len(s.codes) or s.codes[seq] == _UNSENT:
            self.counters["stray_acks"] += 1
            return
        self.counters["acks"] += 1
        s.last_seen = now
        code = s.codes[seq]
        s.ack_counts[seq] = min(255, s.ack_counts[seq] + 1)
        phase = "split" if seq >= s.plan.split_from else "whole"
        if code == _OUT:
            sent_at = s.outstanding.pop(seq)
            rtt = max(now - sent_at, 0.0)
            # Jacobson/Karels; no retransmissions, so every sample is clean.
            s.rttvar = 0.75 * s.rttvar + 0.25 * abs(s.srtt - rtt)
            s.srtt = 0.875 * s.srtt + 0.125 * rtt
            s.rto = self._clamp_rto(2 * s.srtt + 4 * s.rttvar)
            s.codes[seq] = _ACKED
            s.ack_mono[seq] = now
            s.acked += 1
            s.phase_acked[phase] += 1
            self._record(s, seq, "acked", msg)
        elif code == _LOST:
            s.codes[seq] = _LATE
            s.ack_mono[seq] = now
            self.counters["late_acks"] += 1
            self._record(s, seq, "late", msg)
        else:
            self.counters["dup_acks"] += 1
            self._record(s, seq, "acked" if code == _ACKED else "late", msg)

    def _record(self, s: Session, seq: int, outcome: str, ack: wire.Ack | None) -> None:
        """Queue one probe's outcome. Rows are built later, in the writer
        thread, from the session's arrays: a re-recorded seq (late or
        duplicate ACK) rewrites the whole row, so nothing recorded earlier is
        lost by the store's last-word-wins upsert."""
        if ack is None:
            s.pending.append((seq, outcome, None, None))
        else:
            s.pending.append((seq, outcome, ack.received_len, ack.observed_frag_size))

    @staticmethod
    def _rows(s: Session, batch: list) -> list:
        lens, split_from = s.plan.seq_ip_len, s.plan.split_from
        rows = []
        for seq, outcome, received_len, frag in batch:
            sent, acked = s.sent_mono[seq], s.ack_mono[seq]
            rows.append(
                ProbeOutcome(
                    seq=seq,
                    phase="split" if seq >= split_from else "whole",
                    ip_len=lens[seq],
                    sent_at=s.wall0 + timedelta(seconds=sent - s.mono0),
                    outcome=outcome,
                    acked_at=s.wall0 + timedelta(seconds=acked - s.mono0) if acked else None,
                    rtt_ms=(acked - sent) * 1000.0 if acked else None,
                    ack_count=s.ack_counts[seq],
                    received_len=received_len,
                    observed_frag_size=frag,
                )
            )
        return rows

    # -- time-driven work -----------------------------------------------------
    def tick(self, now: float) -> None:
        self._expire_timeouts(now)
        self._send_probes(now)
        for s in list(self.sessions.values()):
            if s.state in FINAL_STATES:
                continue
            if s.end_requested and not s.outstanding:
                self._finish(s, "ended", s.end_requested)
            elif s.state == "created" and now > s.expires:
                self._finish(s, "expired", "no return-routability proof in time")
            elif s.state == "probing":
                if s.next_seq >= s.plan.total_probes and not s.outstanding:
                    self._finish(s, "complete", None)
                elif now - s.last_seen > self.policy.silence_timeout_s:
                    self._finish(s, "incomplete", "client-silent")
                elif now > s.expires:
                    self._finish(s, "incomplete", "max-session-time")
        if now - self._last_flush >= FLUSH_INTERVAL_S:
            self._last_flush = now
            self._flush_all()
            self._forget_finished(now)

    def _expire_timeouts(self, now: float) -> None:
        while self.timeouts and self.timeouts[0][0] <= now:
            _, sid, seq = heapq.heappop(self.timeouts)
            s = self.sessions.get(sid)
            if s is None or s.codes[seq] != _OUT:
                continue
            sent_at = s.outstanding.get(seq)
            if sent_at is None:
                continue
            # The RTO may have grown since scheduling; honour the current one.
            if now < sent_at + s.rto:
                heapq.heappush(self.timeouts, (sent_at + s.rto, sid, seq))
                continue
            del s.outstanding[seq]
            s.codes[seq] = _LOST
            self._record(s, seq, "lost", None)

    def _bucket(self, table: dict[str, TokenBucket], key: str, rate: float, now: float):  # noqa: ANN202
        b = table.get(key)
        if b is None:
            b = table[key] = TokenBucket(rate, now)
        return b

    def _pacing_wait(self) -> float:
        return max(self.global_bucket.wait_time(), 0.0005)

    def _send_probes(self, now: float) -> None:
        self.global_bucket.refill(now)
        active = [
            s
            for s in self.sessions.values()
            if s.state == "probing" and not s.end_requested and s.next_seq < s.plan.total_probes
        ]
        for s in active:
            if s.addr_bucket is None or s.prefix_bucket is None:
                assert s.peer is not None
                pps = self.policy
                s.addr_bucket = self._bucket(self.addr_buckets, s.peer[0], pps.pps_per_address, now)
                s.prefix_bucket = self._bucket(
                    self.prefix_buckets, prefix_of(s.peer[0]), pps.pps_per_prefix, now
                )
            s.addr_bucket.refill(now)
            s.prefix_bucket.refill(now)
        # Small bursts per session in turn, so no session starves another and
        # the pacing buckets stay the only limit on the aggregate.
        while active:
            still = []
            for s in active:
                ab, pb = s.addr_bucket, s.prefix_bucket
                assert ab is not None and pb is not None
                sent = 0
                while (
                    sent < 8
                    and len(s.outstanding) < s.plan.window
                    and s.next_seq < s.plan.total_probes
                ):
                    if min(ab.tokens, pb.tokens, self.global_bucket.tokens) < 1.0:
                        self.counters["paced"] += 1
                        break
                    if not self._send_one(s, now):
                        break
                    ab.tokens -= 1
                    pb.tokens -= 1
                    self.global_bucket.tokens -= 1
                    sent += 1
                if sent == 8:
                    still.append(s)
            active = still

    def _send_one(self, s: Session, now: float) -> bool:
        assert s.peer is not None and self.raw is not None
        seq = s.next_seq
        phase = "split" if seq >= s.plan.split_from else "whole"
        if s.packets is None:
            s.packets = SessionPackets(
                s.local_ip or self._source_for(s.peer[0]),
                s.peer[0],
                self.probe_port,
                s.peer[1],
                s.tag,
            )
        s.ip_id = s.ip_id % 0xFFFF + 1
        dst = (s.peer[0], 0)
        try:
            for pkt in s.packets.render(phase, s.plan.seq_ip_len[seq], seq, s.ip_id):
                self.raw.sendto(pkt, dst)
                self.counters["packets_sent"] += 1
                self.counters["bytes_sent"] += len(pkt)
        except (BlockingIOError, InterruptedError):
            return False  # socket buffer full: try again next pass, nothing consumed
        except OSError as exc:
            self.counters["send_errors"] += 1
            log.warning("session %s: probe send failed: %s", s.session_id, exc)
            return False
        s.next_seq += 1
        s.codes[seq] = _OUT
        s.outstanding[seq] = now
        s.sent_mono[seq] = now
        s.sent += 1
        s.phase_sent[phase] += 1
        self.counters["probes_sent"] += 1
        heapq.heappush(self.timeouts, (now + s.rto, s.session_id, seq))
        return True

    def _source_for(self, dst: str) -> str:
        """Local address the kernel would use towards dst (for raw-socket headers)."""
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((dst, 9))  # no packet leaves: connect() on UDP only routes
            return probe.getsockname()[0]

    def _send_udp(self, data: bytes, addr: tuple[str, int]) -> None:
        assert self.udp is not None
        try:
            self.udp.sendto(data, addr)
        except OSError as exc:
            self.counters["send_errors"] += 1
            log.debug("udp send to %s failed: %s", addr, exc)

    # -- finishing -------------------------------------------------------------
    def _flush(self, s: Session) -> None:
        sid = s.session_id
        if s.pending:
            batch, s.pending = s.pending, []
            self.writer.submit(lambda: self.store.record_outcomes(sid, self._rows(s, batch)))
        if s.state == "probing":
            sent, acked = s.sent, s.acked
            self.writer.submit(lambda: self.store.heartbeat(sid, sent, acked))

    def _flush_all(self) -> None:
        # Finished sessions too: late and duplicate ACKs arrive after the end.
        for s in self.sessions.values():
            self._flush(s)

    def _finish(self, s: Session, state: str, end_reason: str | None) -> None:
        # Probes still in flight when a session ends early were sent but never
        # resolved: record them lost so what was sent is what was stored.
        for seq in list(s.outstanding):
            s.codes[seq] = _LOST
            self._record(s, seq, "lost", None)
        s.outstanding.clear()
        v = verdicts.decide(
            s.phase_sent["whole"],
            s.phase_acked["whole"],
            s.phase_sent["split"],
            s.phase_acked["split"],
        )
        if state == "expired":
            v = verdicts.Verdict(verdicts.INCONCLUSIVE, "no probes were sent")
        self._flush(s)
        s.state = state
        sid = s.session_id
        self.writer.submit(
            lambda: self.store.finish_session(sid, state, v.verdict, v.reason, end_reason)
        )
        self.admission.release(s.source_address)
        s.finished_at = self.clock()
        if s.peer is not None:
            self._send_udp(wire.Done(s.tag).encode(), s.peer)
        s.finished.set()

    def _forget_finished(self, now: float) -> None:
        """Drop finished sessions from memory after a grace period (late acks)."""
        for sid, s in list(self.sessions.items()):
            if s.finished_at is not None and now - s.finished_at > 60.0:
                del self.sessions[sid]
                self.by_tag.pop(s.tag, None)
