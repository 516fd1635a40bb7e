"""The client side of the UDP probe protocol (kickass_core.wire).

Two layers, the quinn-proto / boringtun way:

* ``ProbeSession`` is a sans-IO state machine: it is fed datagrams and the
  current time and returns the datagrams to send. It owns every protocol
  decision (HELLO retries, ECHO, ACK, what counts as a duplicate) and the
  local counts, and is tested on simulated time without sockets.
* ``UdpShell`` is the thin socket shell: one IPv4 UDP socket, a receive
  thread, IP_RECVFRAGSIZE read from ancillary data.

The shell runs in its own thread on purpose: probes must be acknowledged at
once (the server's per-probe timeout turns a late ACK into a loss), so HTTP
polling and the progress display must never sit between a PROBE and its ACK.
"""

from __future__ import annotations

import contextlib
import enum
import math
import select
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kickass_core import wire
from kickass_core.plan import ProbePlan, expected_max_fragment

from .observe import FragmentObserver, attach_filter, bpf_filter, packet_drops
from .reassembly import REPORT_INTERVAL_S, ReassemblyBudget, Sample, on_linux, read_sample

# How often HELLO is repeated until the server's CHALLENGE arrives.
HELLO_INTERVAL_S = 0.5
# After our ECHO, how long to wait for the first PROBE before saying HELLO
# again: the ECHO itself may have been lost, and a fresh HELLO makes the
# server challenge us again.
REHELLO_AFTER_ECHO_S = 1.0

# Linux IP_RECVFRAGSIZE (include/uapi/linux/in.h); Python's socket module does
# not export it. Unprivileged, Linux >= 4.10; elsewhere setsockopt fails and
# the client reports fragment sizes as 0 ("cannot tell").
IP_RECVFRAGSIZE = 25
# Large enough for any probe (at most 1472 bytes of UDP payload) with room
# to notice an oversized datagram.
RECV_BUFSIZE = 4096
# Bytes of each observed packet read (IP header, UDP header, probe header).
OBSERVE_SNAPLEN = 256
# Probes arrive in windows; a larger receive buffer keeps a busy moment on a
# small machine from turning into losses the path did not cause.
SOCKET_RCVBUF = 1 << 20
_ACK_U16_MAX = 0xFFFF  # received_len and observed_frag_size are 16 bits on the wire
# The largest plan this client follows. The paper's plan is 36,600 probes and
# the reference server allows at most 200 repetitions (73,200 probes); the
# client keeps one byte per probe, so this bounds what a misconfigured or
# hostile server can make it allocate to about a megabyte.
MAX_PLAN_PROBES = 1_000_000


class Phase(enum.Enum):
    HELLO = "hello"  # HELLO sent, waiting for CHALLENGE
    ECHOED = "echoed"  # ECHO sent, waiting for the first PROBE
    PROBING = "probing"
    DONE = "done"  # the server's DONE arrived (HTTP is the truth)
    FAILED = "failed"


class Failure(enum.Enum):
    NO_CHALLENGE = "no-challenge"
    NO_PROBES = "no-probes"


@dataclass
class SizeCounts:
    """What this client saw of one probe size (ip_len or leading_ip_len)."""

    received: int = 0
    # split phase: the largest fragment had the size the server cut
    as_sent: int = 0
    # split phase: arrived in one piece (reassembled on the way: NAT/conntrack)
    reassembled: int = 0
    # split phase: fragmented, but not as sent; whole phase: arrived fragmented
    refragmented: int = 0


@dataclass
class LocalCounts:
    """Everything the client counted itself, independent of the server."""

    received: int = 0  # distinct probes
    duplicates: int = 0  # extra copies of a probe already received
    reordered: int = 0  # first copy arrived after a higher seq
    corrupted: int = 0  # fill pattern differs from kickass_core.wire.probe_payload
    wrong_length: int = 0  # UDP payload length differs from the plan's
    unexpected_seq: int = 0  # seq outside the plan (acknowledged anyway)
    foreign: int = 0  # not our session, or not the probe protocol
    highest_seq: int = -1
    challenges: int = 0
    hellos_sent: int = 0
    done_received: bool = False
    frag_size_supported: bool = True
    first_probe_at: float | None = None
    last_probe_at: float | None = None
    split_received: int = 0  # distinct split probes
    reports_sent: int = 0
    whole: dict[int, SizeCounts] = field(default_factory=dict)
    split: dict[int, SizeCounts] = field(default_factory=dict)

    def phase_counts(self, phase: str) -> dict[int, SizeCounts]:
        return self.whole if phase == "whole" else self.split

    def copy(self) -> LocalCounts:
        c = LocalCounts(**{k: v for k, v in vars(self).items() if k not in ("whole", "split")})
        c.whole = {k: SizeCounts(**vars(v)) for k, v in self.whole.items()}
        c.split = {k: SizeCounts(**vars(v)) for k, v in self.split.items()}
        return c


class ProbeSession:
    """Sans-IO client state machine for one measurement session.

    Call ``start(now)`` once, then ``on_datagram(...)`` for every datagram
    and ``on_timer(now)`` whenever ``next_deadline()`` has passed; send every
    returned datagram to the server's probe address, in order.
    """

    def __init__(
        self,
        session_tag: bytes,
        cookie: bytes,
        plan: ProbePlan,
        *,
        challenge_timeout: float = 10.0,
        frag_size_supported: bool = True,
        budget: ReassemblyBudget | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        if len(session_tag) != wire.SESSION_TAG_LEN:
            raise ValueError(f"session tag must be {wire.SESSION_TAG_LEN} bytes")
        if len(cookie) != wire.COOKIE_LEN:
            raise ValueError(f"cookie must be {wire.COOKIE_LEN} bytes")
        if plan.total_probes > MAX_PLAN_PROBES:
            # api.parse_plan refuses such plans with a clear error; this is the
            # guard for any other caller, before the allocation below.
            raise ValueError(f"plan of {plan.total_probes} probes exceeds {MAX_PLAN_PROBES}")
        self.session_tag = session_tag
        self.cookie = cookie
        self.plan = plan
        self.total_probes = plan.total_probes
        self.challenge_timeout = challenge_timeout
        self.phase = Phase.HELLO
        self.failure: Failure | None = None
        self.counts = LocalCounts(frag_size_supported=frag_size_supported)
        for phase in plan.phases:
            for size in plan.sizes(phase):
                self.counts.phase_counts(phase)[size] = SizeCounts()
        self._seen = bytearray(self.total_probes)
        self._log = log
        self._started_at = 0.0
        self._echoed_at: float | None = None
        self._next_hello_at = 0.0
        # Flow control of the split phase (reassembly.py); None: no REPORTs.
        self.budget = budget
        self._next_report_at = 0.0
        self._report_seq = 0
        self._lowest_since: int | None = None  # lowest new seq since the last sample

    # -- inputs ---------------------------------------------------------------

    def start(self, now: float) -> list[bytes]:
        self._started_at = now
        return self._hello(now, HELLO_INTERVAL_S)

    def next_deadline(self) -> float | None:
        report = self._next_report_at if self._reporting() else math.inf
        if self.phase in (Phase.HELLO, Phase.ECHOED):
            return min(self._next_hello_at, self._give_up_at(), report)
        return None if report == math.inf else report

    def _reporting(self) -> bool:
        # REPORTs go to the proven address only: from the first challenge
        # until the server's DONE.
        return self.budget is not None and self.phase in (Phase.ECHOED, Phase.PROBING)

    def sample_due(self, now: float) -> bool:
        """A reassembly sample is wanted now (the shell reads one and calls
        ``on_sample``)."""
        return self._reporting() and now >= self._next_report_at

    def on_sample(self, now: float, sample: Sample) -> list[bytes]:
        """One reading of the reassembly counters: a REPORT to send."""
        if self.budget is None or not self._reporting():
            return []
        c = self.counts
        span = max(0, c.highest_seq + 1 - self.plan.split_from)
        missing = max(0, span - c.split_received)
        b = self.budget
        b.on_sample(sample, c.highest_seq, missing, self._lowest_since)
        self._lowest_since = None
        self._next_report_at = now + REPORT_INTERVAL_S
        self._report_seq += 1
        c.reports_sent += 1
        return [
            wire.Report(
                self.session_tag,
                self._report_seq & 0xFFFFFFFF,
                split_limit=b.split_limit,
                frag_memory=_u32(sample.memory),
                frag_high_thresh=_u32(b.limits.high_thresh),
                refused=min(b.counters.refused, 0xFFFFFFFE),
                invalid=b.report_ranges()[-wire.MAX_REPORT_RANGES :],
            ).encode()
        ]

    def on_timer(self, now: float) -> list[bytes]:
        if self.phase not in (Phase.HELLO, Phase.ECHOED):
            return []
        if now >= self._give_up_at():
            self.phase = Phase.FAILED
            self.failure = Failure.NO_CHALLENGE if self._echoed_at is None else Failure.NO_PROBES
            self._note(f"giving up: {self.failure.value}")
            return []
        if now >= self._next_hello_at:
            interval = HELLO_INTERVAL_S if self.phase is Phase.HELLO else REHELLO_AFTER_ECHO_S
            return self._hello(now, interval)
        return []

    def on_datagram(self, data: bytes, frag_size: int, now: float) -> list[bytes]:
        """Handle one received datagram; ``frag_size`` is IP_RECVFRAGSIZE or 0."""
        if self.phase is Phase.FAILED:
            return []
        try:
            msg = wire.decode(data)
        except wire.WireError:
            self.counts.foreign += 1
            return []
        if msg.session_tag != self.session_tag:
            # Another session's traffic (a stale NAT mapping, a second client
            # on the same port): never acknowledge it, it would pollute that
            # session's counts.
            self.counts.foreign += 1
            return []
        if isinstance(msg, wire.ProbeHeader):
            return [self._on_probe(msg.seq, data, frag_size, now)]
        if isinstance(msg, wire.Challenge):
            self.counts.challenges += 1
            if self.phase is Phase.HELLO:
                self.phase = Phase.ECHOED
                self._note("challenge received, echoing")
            if self._echoed_at is None:
                self._echoed_at = now
                self._next_report_at = now  # the first REPORT right after the ECHO
            self._next_hello_at = now + REHELLO_AFTER_ECHO_S
            # Echo every challenge, also a repeated one: the server may have
            # re-challenged because our previous ECHO was lost.
            return [wire.Echo(self.session_tag, msg.token).encode()]
        if isinstance(msg, wire.Done):
            if not self.counts.done_received:
                self._note("server says the plan is done")
            self.counts.done_received = True
            self.phase = Phase.DONE
            return []
        # HELLO/ECHO/ACK only ever travel client -> server.
        self.counts.foreign += 1
        return []

    # -- outputs --------------------------------------------------------------

    @property
    def progress(self) -> int:
        """Probes the server has at least sent, as far as this client knows."""
        return self.counts.highest_seq + 1

    # -- internals ------------------------------------------------------------

    def _give_up_at(self) -> float:
        if self._echoed_at is None:
            return self._started_at + self.challenge_timeout
        return self._echoed_at + self.challenge_timeout

    def _hello(self, now: float, interval: float) -> list[bytes]:
        self._next_hello_at = now + interval
        self.counts.hellos_sent += 1
        return [wire.Hello(self.session_tag, self.cookie).encode()]

    def _on_probe(self, seq: int, data: bytes, frag_size: int, now: float) -> bytes:
        c = self.counts
        # Acknowledge every copy, duplicates included: the server counts them.
        # Both lengths are 16-bit fields; a larger value (only a malformed or
        # oversized datagram can have one) is reported as the maximum.
        ack = wire.Ack(
            self.session_tag,
            seq,
            min(len(data), _ACK_U16_MAX),
            # A system that cannot observe fragment sizes says so: a 0 would
            # read as "arrived whole" on the server.
            min(max(frag_size, 0), _ACK_U16_MAX - 1)
            if c.frag_size_supported
            else wire.FRAG_SIZE_UNKNOWN,
        ).encode()
        if self.phase in (Phase.HELLO, Phase.ECHOED):
            self.phase = Phase.PROBING
            self._note("first probe received")
        if c.first_probe_at is None:
            c.first_probe_at = now
        c.last_probe_at = now
        if not 0 <= seq < self.total_probes:
            c.unexpected_seq += 1
            return ack
        if self._seen[seq]:
            c.duplicates += 1
            return ack
        self._seen[seq] = 1
        c.received += 1
        if self._lowest_since is None or seq < self._lowest_since:
            self._lowest_since = seq
        if seq < c.highest_seq:
            c.reordered += 1
        c.highest_seq = max(c.highest_seq, seq)

        probe = self.plan.probe(seq)
        body = data[wire.PROBE_HEADER_LEN :]
        if body != wire.fill_pattern(len(body)):
            c.corrupted += 1
        if len(data) != probe.udp_payload_len:
            c.wrong_length += 1
        size = c.phase_counts(probe.phase).setdefault(probe.ip_len, SizeCounts())
        size.received += 1
        if probe.phase == "split":
            c.split_received += 1
        if probe.phase == "whole":
            if frag_size:
                size.refragmented += 1
        elif c.frag_size_supported:
            if frag_size == expected_max_fragment(probe.ip_len):
                size.as_sent += 1
            elif frag_size == 0:
                size.reassembled += 1
            else:
                size.refragmented += 1
        return ack

    def _note(self, text: str) -> None:
        if self._log:
            self._log(text)


def _u32(value: int | None) -> int:
    return wire.UNKNOWN_U32 if value is None else min(value, wire.UNKNOWN_U32 - 1)


def enable_recvfragsize(sock: socket.socket) -> bool:
    """Ask the kernel for the largest-fragment size of each datagram.

    Needs no root on Linux; returns False where unsupported (other systems,
    old kernels), in which case fragment sizes are reported as 0.
    """
    if not on_linux():
        return False
    try:
        sock.setsockopt(socket.IPPROTO_IP, IP_RECVFRAGSIZE, 1)
    except OSError:
        return False
    return True


def frag_size_from_ancdata(ancdata: list[tuple[int, int, bytes]]) -> int:
    for level, kind, cdata in ancdata:
        if level == socket.IPPROTO_IP and kind == IP_RECVFRAGSIZE and len(cdata) >= 4:
            return int.from_bytes(cdata[:4], sys.byteorder)
    return 0


def resolve_ipv4(host: str, port: int) -> tuple[str, int]:
    """The probe address; the protocol is IPv4-only (fragments are IPv4's)."""
    from .errors import ProbeError

    try:
        infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise ProbeError(
            f"cannot resolve the probe host {host!r} to an IPv4 address ({exc.strerror})",
            hint="this measurement needs IPv4; check your DNS and the server's probe_host",
        ) from None
    except (UnicodeError, ValueError):
        # e.g. a label longer than 63 characters fails in the IDNA codec.
        raise ProbeError(
            f"the server's probe_host {host[:80]!r} is not a usable host name",
            hint="the server is misconfigured; tell its operators",
        ) from None
    ip, p = infos[0][4][:2]
    return str(ip), int(p)


class UdpShell:
    """Runs a ProbeSession on one real UDP socket in a background thread."""

    def __init__(
        self,
        make_session: Callable[[bool], ProbeSession],
        server_addr: tuple[str, int],
        *,
        clock: Callable[[], float] = time.monotonic,
        read_sample: Callable[[float], Sample] = read_sample,
        observer: FragmentObserver | None = None,
        packet_socket: socket.socket | None = None,
    ) -> None:
        self.server_addr = server_addr
        self._clock = clock
        self._read_sample = read_sample
        # --observe-fragments: an AF_PACKET socket (opened by the caller, which
        # has the privilege) whose kernel filter passes only our probes.
        self.observer = observer
        self._pkt = packet_socket
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        # A smaller buffer only matters on a very busy machine: not fatal.
        with contextlib.suppress(OSError):
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_RCVBUF)
        self._sock.bind(("0.0.0.0", 0))
        self._sock.setblocking(False)
        self._has_recvmsg = hasattr(self._sock, "recvmsg")
        if self._pkt is not None:
            attach_filter(self._pkt, bpf_filter(server_addr[0], server_addr[1], self.local_port))
        frag_ok = self._has_recvmsg and enable_recvfragsize(self._sock)
        self.session = make_session(frag_ok)
        self.lock = threading.Lock()
        self.last_send_error: str | None = None
        # A bug in the receive loop must not end it silently: the probes
        # would go unacknowledged and look like losses. The runner checks this.
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run_guarded, name="kickass-probe-udp", daemon=True
        )

    @property
    def local_port(self) -> int:
        return int(self._sock.getsockname()[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and close the socket; safe to call twice."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2.0)
        self._sock.close()
        if self._pkt is not None:
            self._pkt.close()

    def snapshot(self) -> tuple[Phase, Failure | None, LocalCounts]:
        with self.lock:
            s = self.session
            return s.phase, s.failure, s.counts.copy()

    def reassembly_summary(self) -> dict[str, Any] | None:
        """The budget's summary with a sample taken now ("after")."""
        with self.lock:
            budget = self.session.budget
            if budget is None:
                return None
            now = self._clock()
            budget.finish(now)
            return budget.summary(after=self._read_sample(now))

    def observation(self) -> FragmentObserver | None:
        """The fragment observer, its kernel drop count brought up to date."""
        with self.lock:
            if self.observer is not None and self._pkt is not None:
                drops = packet_drops(self._pkt)
                if drops:
                    self.observer.kernel_drops += drops
            return self.observer

    def invalid_ranges(self) -> list[tuple[int, int]]:
        with self.lock:
            budget = self.session.budget
            return [] if budget is None else list(budget.invalid_ranges)

    def _send(self, datagrams: list[bytes]) -> None:
        for d in datagrams:
            try:
                self._sock.sendto(d, self.server_addr)
            except OSError as exc:
                # No route, no network...: HELLO retries and the challenge
                # timeout turn a persistent error into a clear failure.
                self.last_send_error = exc.strerror or str(exc)

    def _recv(self) -> tuple[bytes, int] | None:
        try:
            if self._has_recvmsg:
                data, anc, _flags, _addr = self._sock.recvmsg(RECV_BUFSIZE, socket.CMSG_SPACE(4))
                return data, frag_size_from_ancdata(anc)
            data, _addr = self._sock.recvfrom(RECV_BUFSIZE)
            return data, 0
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            # e.g. ECONNREFUSED surfaced from an ICMP error: not a datagram.
            return None

    def _run(self) -> None:
        try:
            with self.lock:
                out = self.session.start(self._clock())
            self._send(out)
            while not self._stop.is_set():
                with self.lock:
                    deadline = self.session.next_deadline()
                wait = 0.2 if deadline is None else deadline - self._clock()
                socks = [self._sock] if self._pkt is None else [self._sock, self._pkt]
                readable, _, _ = select.select(socks, [], [], max(0.0, min(wait, 0.2)))
                if self._sock in readable:
                    # Drain what is queued, ACKing each probe as it is read.
                    for _ in range(256):
                        got = self._recv()
                        if got is None:
                            break
                        with self.lock:
                            out = self.session.on_datagram(got[0], got[1], self._clock())
                        self._send(out)
                if self._pkt is not None and self._pkt in readable:
                    # After the ACKs: observing never delays one.
                    self._observe()
                with self.lock:
                    now = self._clock()
                    out = self.session.on_timer(now)
                    if self.session.sample_due(now):
                        out += self.session.on_sample(now, self._read_sample(now))
                self._send(out)
        except (OSError, ValueError):
            if not self._stop.is_set():
                raise
            # The socket was closed under us by stop(): nothing left to do.
            return

    def _observe(self) -> None:
        assert self._pkt is not None and self.observer is not None
        for _ in range(512):
            try:
                pkt = self._pkt.recv(OBSERVE_SNAPLEN)
            except (BlockingIOError, InterruptedError):
                return
            with self.lock:
                self.observer.on_packet(pkt)

    def _run_guarded(self) -> None:
        try:
            self._run()
        except Exception as exc:
            self.error = exc
