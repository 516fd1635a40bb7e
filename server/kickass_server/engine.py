"""The probe engine's shell: sockets, the selector loop, the lock, the database writer.

All protocol decisions live in the sans-IO ``probe_core.ProbeCore``; this
module only moves bytes and time in and out of it:

* one thread owns the probe UDP socket (HELLO/ECHO/ACK in, CHALLENGE/DONE
  out) and one raw ``IPPROTO_RAW`` socket (probes out), waits in a selector
  until the core's next deadline or a datagram, and feeds the core;
* HTTP threads call in under ``lock`` (create, end, touch, snapshot, stats);
* the core's persistence events go to an ``OrderedWriter`` thread, so a slow
  or restarting database never stalls the probe clock and nothing measured is
  lost while it is away.

The probe UDP port is exclusive: no SO_REUSEADDR/SO_REUSEPORT, so a second
server on the same port fails to start instead of silently sharing (and
stealing half of) the first one's ACKs.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from kickass_core import study_events
from kickass_core.errors import KickassError
from kickass_core.plan import ProbePlan
from kickass_core.states import FINAL_STATES
from kickass_core.study_events import ClockAnchor, OutcomeBatch, RunFinished, StudyEvent
from kickass_db.journal import Journal
from kickass_db.writer import OrderedWriter

from .packets import open_raw_socket
from .policy import AdmissionDenied, Policy
from .probe_core import (
    IN_FLIGHT,
    Action,
    ProbeCore,
    RunSnapshot,
    SendDatagram,
    SendProbe,
)

if TYPE_CHECKING:
    from kickass_db.study_store import StudyStore

__all__ = ["AdmissionDenied", "EngineUnavailable", "NewSession", "ProbeEngine"]

log = logging.getLogger("kickass.engine")

IP_PKTINFO = 8  # Linux; not exported by Python's socket module
_PKTINFO = struct.Struct("@I4s4s")  # struct in_pktinfo: ifindex, spec_dst, addr
_RECV_BUF = 4096
_RECV_BATCH = 64  # datagrams handled per lock acquisition
_DRAIN_MAX = 512  # datagrams per wake-up before timers get their turn
# Longest sleep of the loop with nothing due: a safety net only, every input
# that can bring a deadline closer wakes the loop itself.
_MAX_POLL_S = 0.5
_SEND_ERROR_LOG_EVERY_S = 10.0


@dataclass(frozen=True)
class NewSession:
    """What the HTTP API returns to a client that asked for a session."""

    session_id: str
    cookie: str  # hex; only its hash is kept
    plan: ProbePlan
    expires_in_s: int
    # The split phase's flow control this server applies for the client's
    # REPORTs ("in-flight"), if the client asked for it.
    flow_control: str | None = None


class EngineUnavailable(KickassError):
    """The engine is shutting down and takes no new session (HTTP 503)."""


class ProbeEngine:
    def __init__(
        self,
        store: StudyStore,  # duck-typed in tests
        policy: Policy | None = None,
        *,
        bind_host: str = "0.0.0.0",
        probe_port: int = 9000,
        server_version: str = "0",
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        journal_dir: str | Path | None = None,
    ) -> None:
        self.store = store
        self.policy = policy or Policy()
        self.bind_host = bind_host
        self.probe_port = probe_port
        self.server_version = server_version
        self.clock = clock
        self.wall_clock = wall_clock
        self.core = ProbeCore(self.policy, clock(), probe_port=probe_port)
        self.lock = threading.RLock()
        # Notified whenever a run finishes (end_session waits on it).
        self._finished = threading.Condition(self.lock)
        # Counted here because only the shell knows what reached the wire.
        self.io_counters: dict[str, int] = {
            "packets_sent": 0,
            "bytes_sent": 0,
            "send_errors": 0,
            "send_buffer_full": 0,
        }
        # Writes the database has not confirmed are journaled on disk first,
        # so a shutdown (database down, or the process killed) loses none.
        self.writer: OrderedWriter[StudyEvent] = OrderedWriter(
            store.apply,
            journal=Journal(journal_dir, study_events.to_json) if journal_dir else None,
        )
        self.udp: socket.socket | None = None
        self.raw: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._running = False
        self._accepting = True
        self._thread: threading.Thread | None = None
        self._source_cache: dict[str, str] = {}
        self._last_send_error_log = -_SEND_ERROR_LOG_EVERY_S

    # -- lifecycle -----------------------------------------------------------
    def open_sockets(self) -> None:
        """Bind the probe UDP port (exclusively) and open the raw socket.

        Raises KickassError with a hint when the port is taken or the raw
        socket is not allowed.
        """
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            # Deliberately no SO_REUSEADDR / SO_REUSEPORT: with either, a
            # second server (or any process setting the same option) could
            # bind this port too and the kernel would split the ACKs.
            udp.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
            udp.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
            udp.bind((self.bind_host, self.probe_port))
        except OSError as exc:
            udp.close()
            if exc.errno == errno.EADDRINUSE:
                raise KickassError(
                    f"UDP port {self.probe_port} on {self.bind_host} is already in use",
                    hint="another kickass server (or another program) owns it: stop it, "
                    "or give this one another --probe-port",
                ) from None
            if exc.errno in (errno.EACCES, errno.EPERM):
                raise KickassError(
                    f"not allowed to bind UDP port {self.probe_port}: {exc.strerror}",
                    hint="ports below 1024 need root or CAP_NET_BIND_SERVICE",
                ) from None
            raise KickassError(
                f"cannot open the probe socket on UDP {self.bind_host}:{self.probe_port}: "
                f"{exc.strerror or exc}",
                hint="check --probe-bind (an address of this host) and --probe-port",
            ) from None
        udp.setblocking(False)
        try:
            raw = open_raw_socket()
        except PermissionError:
            udp.close()
            raise KickassError(
                "the probe engine needs a raw socket",
                hint="run as root or give the interpreter CAP_NET_RAW",
            ) from None
        except OSError as exc:
            udp.close()
            raise KickassError(f"cannot open the raw probe socket: {exc}") from None
        self.udp, self.raw = udp, raw
        self.probe_port = udp.getsockname()[1]
        with self.lock:
            self.core.probe_port = self.probe_port

    def start(self) -> None:
        if self.udp is None:
            self.open_sockets()
        self._running = True
        self._thread = threading.Thread(target=self.run, name="kickass-probe-engine", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def loop_state(self) -> str:
        """'not-started', 'running', 'stopped' (stop() called) or 'died' (a bug)."""
        if self._thread is None:
            return "not-started"
        if self._thread.is_alive():
            return "running"
        return "died" if self._running else "stopped"

    def stop(self, reason: str = "server-shutdown") -> None:
        """Finish every live run as incomplete, flush, close sockets."""
        self._accepting = False
        self._running = False
        self._wake()
        if self._thread:
            self._thread.join(10)
        with self.lock:
            self._execute(self.core.shutdown(self.clock(), reason))
        # Bounded: with the database away, what is left stays in the journal
        # (stored at the next start) instead of holding up the shutdown.
        self.writer.close(timeout=5.0)
        for sock in (self.udp, self.raw, self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()
        self.udp = self.raw = None

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    # -- the HTTP side -------------------------------------------------------
    def create_session(
        self,
        plan: ProbePlan,
        source_address: str,
        *,
        client_version: str | None = None,
        platform: str | None = None,
        install_id: str | None = None,
        reassembly: dict[str, Any] | None = None,
    ) -> NewSession:
        """Admit, store, then register a new session.

        ``reassembly``: what the client announced about its reassembly memory
        (api.py checked it); with a ``split_credit`` the client does flow
        control of the split phase (probe_core).

        Raises AdmissionDenied (429) or whatever the store raises
        (DatabaseUnavailable: 503); a session the database did not store
        counts against no limit.
        """
        if not self._accepting:
            raise EngineUnavailable("the server is shutting down")
        with self.lock:
            admitted = self.core.admit(
                self.clock(),
                plan,
                source_address,
                split_credit=None if reassembly is None else reassembly.get("split_credit"),
                credit_mode=None if reassembly is None else reassembly.get("credit_mode"),
            )
        timeout = self.policy.handshake_timeout_s
        try:
            self.store.create_session(
                session_id=admitted.session_id,
                cookie_hash=admitted.cookie_hash,
                plan=plan.to_json(),
                source_address=source_address,
                expires_at=self.wall_clock() + timedelta(seconds=timeout),
                server_version=self.server_version,
                client_version=client_version,
                platform=platform,
                install_id=install_id,
                client_metadata=None
                if reassembly is None
                else {"reassembly": {"announced": reassembly}},
            )
        except BaseException:
            with self.lock:
                self.core.cancel(admitted.session_id)
            raise
        with self.lock:
            if not self._accepting:
                # Shut down while the database was storing it: the next start
                # of this server marks the row incomplete.
                self.core.cancel(admitted.session_id)
                raise EngineUnavailable("the server is shutting down")
            self.core.register(self.clock(), admitted.session_id)
        self._wake()  # its handshake deadline is new
        flow = None
        if reassembly is not None and reassembly.get("split_credit") is not None:
            flow = reassembly.get("credit_mode")
        return NewSession(
            admitted.session_id,
            admitted.cookie.hex(),
            plan,
            int(timeout),
            flow_control=flow if flow == IN_FLIGHT else None,
        )

    def end_session(self, session_id: str, cookie_hex: str, wait_s: float = 5.0) -> str:
        """The owner asks to stop. Returns 'ended', 'not-found', 'forbidden' or
        'already-final'; on 'ended', waits (up to ``wait_s``) for the run to
        finish, which takes at most the outstanding probes' timeout."""
        cookie = _cookie_bytes(cookie_hex)
        if cookie is None:
            with self.lock:
                return "not-found" if self.core.snapshot(session_id) is None else "forbidden"
        with self.lock:
            outcome = self.core.end(self.clock(), session_id, cookie)
        if outcome != "ended":
            return outcome
        self._wake()
        if not self.running:
            return outcome  # no loop to wait for (sockets never opened)
        deadline = time.monotonic() + wait_s
        with self._finished:
            while True:
                snap = self.core.snapshot(session_id)
                left = deadline - time.monotonic()
                if snap is None or snap.state in FINAL_STATES or left <= 0:
                    break
                self._finished.wait(left)
        return "ended"

    def writer_sync(self, timeout: float = 10.0) -> bool:
        """Hand every pending outcome to the writer, then wait until it is written."""
        with self.lock:
            self._execute(self.core.flush())
        return self.writer.sync(timeout)

    def touch(self, session_id: str, cookie_hex: str | None) -> bool:
        """The session's owner polled over HTTP (liveness); False without the
        right cookie, which proves nothing."""
        cookie = _cookie_bytes(cookie_hex) if cookie_hex else None
        with self.lock:
            return self.core.touch(self.clock(), session_id, cookie)

    def snapshot(self, session_id: str) -> RunSnapshot | None:
        with self.lock:
            return self.core.snapshot(session_id)

    def stats(self) -> dict[str, object]:
        with self.lock:
            out = self.core.stats()
            counters = dict(cast("dict[str, int]", out["counters"]))
            counters.update(self.io_counters)
        out["counters"] = counters
        out["db_write_backlog"] = self.writer.q.qsize()
        out["db_write_failures"] = self.writer.failures
        out["db_writes_dropped"] = self.writer.dropped
        return out

    # -- inputs without the loop (tools and tests on a chosen clock) -------------
    def handle_datagram(self, data: bytes, addr: tuple[str, int], local_ip: str) -> None:
        """Feed one datagram as if the socket had read it, at ``clock()``."""
        with self.lock:
            self._execute(self.core.on_datagram(self.clock(), addr, data, local_ip))

    def tick(self) -> None:
        """Run the core's timers at ``clock()`` (the loop does this itself)."""
        with self.lock:
            self._execute(self.core.on_timer(self.clock()))

    # -- the loop --------------------------------------------------------------
    def run(self) -> None:
        assert self.udp is not None
        sel = selectors.DefaultSelector()
        sel.register(self.udp, selectors.EVENT_READ, "udp")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        try:
            while self._running:
                with self.lock:
                    deadline = self.core.next_deadline()
                wait = _MAX_POLL_S if deadline is None else deadline - self.clock()
                for key, _ in sel.select(min(max(wait, 0.0), _MAX_POLL_S)):
                    if key.data == "wake":
                        with contextlib.suppress(BlockingIOError):
                            self._wake_r.recv(4096)
                    else:
                        self._drain_udp()
                with self.lock:
                    self._execute(self.core.on_timer(self.clock()))
        except Exception:
            log.exception("the probe engine loop died")
            raise
        finally:
            sel.close()

    def _drain_udp(self) -> None:
        udp = self.udp
        assert udp is not None
        for _ in range(_DRAIN_MAX // _RECV_BATCH):
            batch = []
            for _ in range(_RECV_BATCH):
                try:
                    data, anc, _flags, addr = udp.recvmsg(_RECV_BUF, 64)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:  # e.g. ICMP port unreachable reported on the socket
                    log.debug("udp recv error: %s", exc)
                    continue
                batch.append((data, addr, self._local_ip(anc, addr)))
            if not batch:
                return
            with self.lock:
                now = self.clock()
                for data, addr, local_ip in batch:
                    self._execute(self.core.on_datagram(now, addr, data, local_ip))
            if len(batch) < _RECV_BATCH:
                return

    def _local_ip(self, anc: list[tuple[int, int, bytes]], addr: tuple[str, int]) -> str:
        """Our address the datagram was sent to (replies and probes come from it)."""
        for level, ctype, cdata in anc:
            if level == socket.IPPROTO_IP and ctype == IP_PKTINFO and len(cdata) >= 12:
                # ipi_spec_dst: the local address the kernel would answer
                # from (equal to the header's destination for unicast; an
                # interface address for a broadcast, which is no source).
                return socket.inet_ntoa(cdata[4:8])
        if self.bind_host not in ("", "0.0.0.0"):
            return self.bind_host
        return self._source_for(addr[0])

    def _source_for(self, dst: str) -> str:
        """Local address the kernel would use towards dst (when IP_PKTINFO is missing)."""
        src = self._source_cache.get(dst)
        if src is None:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((dst, 9))  # no packet leaves: connect() on UDP only routes
                src = probe.getsockname()[0]
            if len(self._source_cache) > 4096:
                self._source_cache.clear()
            self._source_cache[dst] = src
        return src

    # -- carrying out the core's actions (under self.lock) ------------------------
    def _execute(self, actions: list[Action]) -> None:
        if not actions:
            return
        unsent: list[SendProbe] = []
        failed_runs: set[str] = set()
        buffer_full = False
        finished = False
        for a in actions:
            if isinstance(a, SendProbe):
                if buffer_full or a.session_id in failed_runs:
                    unsent.append(a)
                    continue
                err = self._send_probe(a)
                if err is None:
                    continue
                unsent.append(a)
                if err in (errno.EAGAIN, errno.ENOBUFS):
                    buffer_full = True  # every later probe waits too
                else:
                    failed_runs.add(a.session_id)
            elif isinstance(a, SendDatagram):
                self._send_udp(a)
            else:
                self._persist(a)
                finished = finished or isinstance(a, RunFinished)
        if unsent:
            self.core.probes_not_sent(self.clock(), unsent, buffer_full=buffer_full)
        if finished:
            self._finished.notify_all()

    def _send_probe(self, a: SendProbe) -> int | None:
        """Send a probe's packets; None when all left, else the errno."""
        if self.raw is None:
            return errno.EBADF
        dst = (a.dst, 0)
        for pkt in a.packets:
            try:
                self.raw.sendto(pkt, dst)
            except (BlockingIOError, InterruptedError):
                self.io_counters["send_buffer_full"] += 1
                return errno.EAGAIN
            except OSError as exc:
                self.io_counters["send_errors"] += 1
                now = self.clock()
                if now - self._last_send_error_log >= _SEND_ERROR_LOG_EVERY_S:
                    self._last_send_error_log = now
                    log.warning("session %s: probe send to %s failed: %s", a.session_id, a.dst, exc)
                return exc.errno or errno.EIO
            self.io_counters["packets_sent"] += 1
            self.io_counters["bytes_sent"] += len(pkt)
        return None

    def _send_udp(self, a: SendDatagram) -> None:
        if self.udp is None:
            return
        try:
            if a.src:
                # Reply from the address the peer wrote to, also on a
                # multi-homed host (else NATs drop the answer).
                info = _PKTINFO.pack(0, socket.inet_aton(a.src), b"\0\0\0\0")
                self.udp.sendmsg([a.data], [(socket.IPPROTO_IP, IP_PKTINFO, info)], 0, a.addr)
            else:
                self.udp.sendto(a.data, a.addr)
        except OSError as exc:
            self.io_counters["send_errors"] += 1
            log.debug("udp send to %s failed: %s", a.addr, exc)

    def _persist(self, event: Action) -> None:
        if isinstance(event, SendDatagram | SendProbe):
            return
        if isinstance(event, OutcomeBatch):
            # The core's times are monotonic; the anchor maps them to UTC in
            # the writer thread (no datetime arithmetic on the probe clock).
            event = event.stamped(ClockAnchor(self.wall_clock().timestamp(), self.clock()))
        elif isinstance(event, RunFinished) and event.window is not None:
            # The adaptive window's record (kickass_server.window), for the
            # operator and the benchmark: how far it grew and why it shrank.
            log.info("session %s window %s", event.session_id, json.dumps(dict(event.window)))
        self.writer.submit(event)


def _cookie_bytes(cookie_hex: str | None) -> bytes | None:
    if not cookie_hex:
        return None
    try:
        return bytes.fromhex(cookie_hex)
    except ValueError:
        return None
