"""The TCP baseline: kernel TCP flows of the trial's sizes, FCT measured like Kick-Ass's.

Protocol (one connection per flow): the sender writes a 42-byte header —
magic ``KAT2``, a 30-byte flow token (``token.py``, kind tcp), the flow size as
u64 — then the payload. The receiving agent answers one byte (``ACCEPTED``) as
soon as the token checks out, and 8 more, the number of payload bytes it
received, once it has them all. FCT runs from the ``connect()`` call to that
confirmation (as HKUST's TrafficGenerator measures at the client: request to
last byte). A connection without a valid token gets nothing back and is
closed: the agent never sends to an unproven sender. The accept byte is what
lets the sender tell "token refused" from "the agent went away mid-flow"
(``KAT1`` had no such byte, and both read as a closed connection).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from kickass_core.flow_record import DEFAULT_CONGESTION_CONTROL

from .token import KIND_TCP, TOKEN_LEN, ReplayGuard

log = logging.getLogger("kickass.agent.tcp")

MAGIC = b"KAT2"
ACCEPTED = b"\x01"
_HEADER = struct.Struct(f"!4s{TOKEN_LEN}sQ")
_CONFIRM = struct.Struct("!Q")
MAX_FLOW_BYTES = 2000 * 1500 * 16
CHUNK = 256 * 1024
# struct tcp_info offsets (linux/tcp.h): stable since 2.6 for these fields
# (tcpi_bytes_acked since 4.1).
_TCPI_RTT, _TCPI_TOTAL_RETRANS, _TCPI_BYTES_ACKED, _TCPI_MIN_RTT = 68, 100, 120, 148
_TCPI_SND_MSS, _TCPI_UNACKED, _TCPI_SND_CWND = 16, 24, 80


@dataclass
class TcpFlowResult:
    protocol: str
    congestion_control: str
    size_bytes: int
    completed: bool
    fct_ms: float | None
    retransmissions: int | None
    srtt_ms: float | None
    min_rtt_ms: float | None
    error: str | None = None
    # The congestion control the socket really ran (TCP_CONGESTION after connect).
    cc_in_effect: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def available_congestion_controls() -> list[str]:
    try:
        with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
            return f.read().split()
    except OSError:
        return []


def _tcp_info(sock: socket.socket) -> tuple[float | None, int | None, float | None]:
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
    except OSError:
        return None, None, None
    rtt = struct.unpack_from("I", raw, _TCPI_RTT)[0] / 1000 if len(raw) >= 72 else None
    retrans = struct.unpack_from("I", raw, _TCPI_TOTAL_RETRANS)[0] if len(raw) >= 104 else None
    min_rtt = struct.unpack_from("I", raw, _TCPI_MIN_RTT)[0] / 1000 if len(raw) >= 152 else None
    return rtt, retrans, min_rtt


@dataclass
class TcpProgress:
    """A TCP flow at one instant (TCP_INFO)."""

    at: float  # monotonic seconds
    acked_bytes: int
    cwnd_bytes: int
    # Segments sent and not yet acknowledged (tcpi_unacked), in bytes.
    unacked_bytes: int


def _progress(sock: socket.socket) -> TcpProgress | None:
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
    except OSError:
        return None
    if len(raw) < 128:
        return None
    mss = struct.unpack_from("I", raw, _TCPI_SND_MSS)[0]
    unacked = struct.unpack_from("I", raw, _TCPI_UNACKED)[0]
    cwnd = struct.unpack_from("I", raw, _TCPI_SND_CWND)[0]
    acked = struct.unpack_from("Q", raw, _TCPI_BYTES_ACKED)[0]
    return TcpProgress(time.monotonic(), acked, cwnd * mss, unacked * mss)


class _Progress(threading.Thread):
    """Every ``interval_s``, the bytes the peer acknowledged so far and the
    window (TCP_INFO), handed to ``report``: a TCP flow's rate over time, as
    ka-send's --progress gives a Kick-Ass flow's."""

    def __init__(
        self, sock: socket.socket, interval_s: float, report: Callable[[TcpProgress], None]
    ) -> None:
        super().__init__(name="tcp-progress", daemon=True)
        self.sock, self.interval_s, self.report = sock, interval_s, report
        self.done = threading.Event()

    def run(self) -> None:
        next_at = time.monotonic()
        while not self.done.wait(max(0.0, next_at - time.monotonic())):
            sample = _progress(self.sock)
            if sample is not None:
                self.report(sample)
            next_at += self.interval_s


# A flow still running when its time limit passed (the caller's timeout_s).
TIMED_OUT = "not completed within its time limit"


def send_flow(
    addr: tuple[str, int],
    token: bytes,
    size_bytes: int,
    congestion_control: str = DEFAULT_CONGESTION_CONTROL,
    timeout_s: float = 60.0,
    source: str | None = None,
    progress: Callable[[TcpProgress], None] | None = None,
    progress_interval_s: float = 0.1,
) -> TcpFlowResult:
    """One TCP flow of ``size_bytes`` to an agent; never raises for network
    failures. ``progress(TcpProgress)`` is called every
    ``progress_interval_s`` while it runs."""
    result = TcpFlowResult("tcp", congestion_control, size_bytes, False, None, None, None, None)
    if not 0 < size_bytes <= MAX_FLOW_BYTES:
        result.error = f"flow size {size_bytes} out of range"
        return result
    payload = memoryview(bytes(min(size_bytes, CHUNK)))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion_control.encode())
            # No Nagle: the flow's last partial segment would otherwise wait a
            # round trip for the ACK of the data before it (measured: a 10-packet
            # flow took 3 RTT instead of 2), a handicap the baseline must not carry.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:
            result.error = f"congestion control {congestion_control!r} unavailable: {exc}"
            return result
        sock.settimeout(timeout_s)
        if source:
            sock.bind((source, 0))
        start = time.monotonic()
        deadline = start + timeout_s
        connected = False
        sampler: _Progress | None = None
        try:
            sock.connect(addr)
            connected = True
            if progress is not None:
                sampler = _Progress(sock, progress_interval_s, progress)
                sampler.start()
            with contextlib.suppress(OSError):
                raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
                result.cc_in_effect = raw.split(b"\0", 1)[0].decode("ascii", "replace")
            # The header rides with the first data (one write): on its own it
            # would take a segment of the initial window (no Nagle to merge it).
            first = min(size_bytes, len(payload))
            sock.sendall(_HEADER.pack(MAGIC, token, size_bytes) + bytes(payload[:first]))
            left = size_bytes - first
            while left:
                n = min(left, len(payload))
                sock.sendall(payload[:n])
                left -= n
                sock.settimeout(max(0.1, deadline - time.monotonic()))
            accepted = _recv_exact(sock, len(ACCEPTED))
            got = _recv_exact(sock, _CONFIRM.size) if accepted == ACCEPTED else None
            end = time.monotonic()
        except (OSError, TimeoutError) as exc:
            if sampler is not None:
                sampler.done.set()
                sampler.join()
            result.error = f"{type(exc).__name__}: {exc}"
            if connected and isinstance(exc, TimeoutError):
                # Our own limit (the flow timeout, or the end of the period
                # the runner gave it), not the agent's doing.
                result.error = f"{TIMED_OUT} ({timeout_s:g} s)"
            elif connected and _accepted_before(sock):
                result.error = (
                    "the agent accepted the flow, then broke the connection before confirming "
                    f"every byte (it stopped or restarted mid-flow): {result.error}"
                )
            elif isinstance(exc, ConnectionRefusedError):
                result.error = (
                    "nothing listens on the agent's TCP port (the agent is stopped or "
                    f"restarting): {result.error}"
                )
            elif not connected and isinstance(exc, TimeoutError):
                result.error = (
                    f"no answer to the connection in {timeout_s:g}s (the agent or its "
                    f"network is down, or a firewall drops it): {result.error}"
                )
            elif connected and isinstance(exc, ConnectionError):
                result.error = (
                    "the agent broke the connection without accepting the flow (token refused, "
                    f"or the agent stopped before checking it): {result.error}"
                )
            result.srtt_ms, result.retransmissions, result.min_rtt_ms = _tcp_info(sock)
            return result
        if sampler is not None:
            sampler.done.set()
            sampler.join()
        if accepted is None:
            result.error = (
                "the agent closed the connection without accepting the flow "
                "(token refused, or the agent stopped before checking it)"
            )
        elif accepted != ACCEPTED:
            result.error = f"the agent answered {accepted!r}, not a flow acceptance (not KAT2?)"
        elif got is None:
            result.error = (
                "the agent accepted the flow, then closed the connection before confirming "
                "every byte (it stopped or restarted mid-flow)"
            )
        elif _CONFIRM.unpack(got)[0] != size_bytes:
            result.error = f"the agent confirmed {_CONFIRM.unpack(got)[0]} of {size_bytes} bytes"
        else:
            result.completed = True
            result.fct_ms = (end - start) * 1000
        result.srtt_ms, result.retransmissions, result.min_rtt_ms = _tcp_info(sock)
        return result
    finally:
        if not result.completed:
            # A flow given up is aborted (RST), not closed: a close would let
            # the kernel go on sending the megabytes in its send buffer, into
            # the next period of the trial.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


def _accepted_before(sock: socket.socket) -> bool:
    """Did the accept byte arrive before the connection broke? (It waits,
    unread, in the receive queue while the sender is still writing.)"""
    try:
        return sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == ACCEPTED
    except OSError:
        return False


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


class TcpReceiver:
    """The agent's TCP side: a thread per accepted flow, bounded in number and time."""

    def __init__(
        self,
        guard: ReplayGuard,
        bind: tuple[str, int] = ("0.0.0.0", 0),
        max_flows: int = 64,
        header_timeout_s: float = 5.0,
        flow_timeout_s: float = 300.0,
    ) -> None:
        self.guard = guard
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(bind)
        self.sock.listen(128)
        self.address = self.sock.getsockname()
        self.slots = threading.BoundedSemaphore(max_flows)
        self.header_timeout_s = header_timeout_s
        self.flow_timeout_s = flow_timeout_s
        self.counts = {"accepted": 0, "completed": 0, "refused": 0, "busy": 0, "failed": 0}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="tcp-receiver", daemon=True)

    def start(self) -> TcpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(5)

    def _count(self, key: str) -> None:
        with self._lock:
            self.counts[key] += 1

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _peer = self.sock.accept()
            except OSError:
                return
            if not self.slots.acquire(blocking=False):
                self._count("busy")
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            # The accept byte and the confirmation go out at once (no Nagle).
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(self.header_timeout_s)
            head = _recv_exact(conn, _HEADER.size)
            if head is None:
                self._count("refused")
                return
            magic, token, size = _HEADER.unpack(head)
            if (
                magic != MAGIC
                or not 0 < size <= MAX_FLOW_BYTES
                or self.guard.accept(token, time.time(), KIND_TCP) is None
            ):
                self._count("refused")
                return  # nothing is ever sent to an unproven sender
            self._count("accepted")
            conn.sendall(ACCEPTED)
            conn.settimeout(self.flow_timeout_s)
            left = size
            while left:
                chunk = conn.recv(min(left, CHUNK))
                if not chunk:
                    break
                left -= len(chunk)
            # Counted before confirming: once the sender holds the
            # confirmation, the agent's books already show the flow.
            self._count("completed" if left == 0 else "failed")
            conn.sendall(_CONFIRM.pack(size - left))
        except (OSError, TimeoutError) as exc:
            log.info("tcp flow failed: %s", exc)
            self._count("failed")
        finally:
            conn.close()
            self.slots.release()
