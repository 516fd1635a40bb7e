"""The ICMP responder's shell: raw sockets, the kernel's echo replies switched
off, the reply log written in batches. Every decision is in ``responder_core``.

Run by ``kickass atlas responder CAMPAIGN.yaml`` (needs root, or
CAP_NET_RAW + CAP_NET_ADMIN).

Switching the kernel's own replies off, for our addresses only. Linux
answers every echo request itself; a second, kernel-made reply would make
Atlas count a duplicate and, for the split sweep, put an unfragmented reply
beside ours. ``icmp_echo_ignore_all`` would silence the whole host, so
instead one nftables table drops outgoing echo replies *from the responder's
addresses* that do not carry our socket mark::

    table inet kickass_icmp_responder {
      chain output {
        type filter hook output priority 0; policy accept;
        ip saddr { 192.0.2.10, 192.0.2.11 } icmp type echo-reply meta mark != 0x4b41 drop
      }
    }

Our replies leave a raw socket with ``SO_MARK`` 0x4b41 and pass; the
kernel's carry no mark and are dropped (its replies from every other address
are untouched). The table is created when the responder starts (replacing
one a crashed run left behind) and deleted when it stops — on SIGINT,
SIGTERM or an error alike. ``kickass atlas responder --undo`` deletes it by
hand (e.g. after a SIGKILL).

Receiving: one raw ICMP socket (the kernel hands it reassembled datagrams)
with an ICMP_FILTER that lets only echo requests through. Sending: one
long-lived IPPROTO_RAW socket writing every header byte itself, fragments
included, with IP_NODEFRAG so conntrack never reassembles and re-cuts them.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import selectors
import socket
import struct
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence

from kickass_core.errors import KickassError

from .responder_core import Reply, ReplyRecord, ResponderCore

log = logging.getLogger("kickass.responder")

NFT_TABLE = "kickass_icmp_responder"
REPLY_MARK = 0x4B41  # "KA"
IP_NODEFRAG = 22  # Linux; not exported by Python's socket module
SOL_RAW = 255
ICMP_FILTER = 1
ICMP_ECHO_REQUEST = 8
RECV_BATCH = 512
FLUSH_INTERVAL_S = 0.5
FLUSH_ROWS = 2000
STATS_INTERVAL_S = 30.0


def nft_ruleset(addresses: Iterable[str]) -> str:
    """The table that drops the kernel's own echo replies from ``addresses``
    (and, in the same transaction, any table a crashed run left)."""
    addrs = ", ".join(sorted(set(addresses)))
    return (
        f"table inet {NFT_TABLE} {{}}\n"
        f"delete table inet {NFT_TABLE}\n"
        f"table inet {NFT_TABLE} {{\n"
        "  chain output {\n"
        "    type filter hook output priority 0; policy accept;\n"
        f"    ip saddr {{ {addrs} }} icmp type echo-reply meta mark != {REPLY_MARK:#x} "
        "counter drop\n"
        "  }\n"
        "}\n"
    )


def _nft(args: Sequence[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            ["nft", *args], input=stdin, capture_output=True, text=True, timeout=30, check=False
        )
    except FileNotFoundError:
        raise KickassError(
            "nftables (`nft`) is missing: the responder needs it to silence the kernel's "
            "own echo replies on its addresses",
            hint="apt-get install nftables (tools/setup-system.sh installs it)",
        ) from None


@contextlib.contextmanager
def kernel_echo_replies_off(addresses: Iterable[str]) -> Iterator[None]:
    """While inside, the kernel sends no echo reply from ``addresses``; undone on exit."""
    proc = _nft(["-f", "-"], nft_ruleset(addresses))
    if proc.returncode != 0:
        raise KickassError(
            f"cannot switch off the kernel's echo replies (nft): {proc.stderr.strip()}",
            hint="the responder needs root (or CAP_NET_ADMIN) and nftables",
        )
    log.info("kernel echo replies off for %s (nft table inet %s)", ", ".join(addresses), NFT_TABLE)
    try:
        yield
    finally:
        undo_kernel_switch()


def undo_kernel_switch() -> bool:
    """Give the kernel its echo replies back; False if there was nothing to undo."""
    proc = _nft(["delete", "table", "inet", NFT_TABLE])
    if proc.returncode == 0:
        log.info("kernel echo replies restored (nft table inet %s deleted)", NFT_TABLE)
        return True
    return False


def check_addresses(addresses: Iterable[str]) -> None:
    """Every address must be this host's own: the kernel delivers nothing else to us."""
    for address in addresses:
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            probe.bind((address, 0))
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                raise KickassError(
                    f"{address} is not an address of this host: the responder cannot answer "
                    "echo requests sent to it",
                    hint=f"add it (ip addr add {address}/32 dev IFACE) or fix the campaign's "
                    "target",
                ) from None
            raise
        finally:
            probe.close()


def open_sockets() -> tuple[socket.socket, socket.socket]:
    """(receive, send): a raw ICMP socket that sees echo requests only, and
    an IPPROTO_RAW socket whose packets carry our mark."""
    try:
        rx = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
        tx = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    except PermissionError:
        raise KickassError(
            "the ICMP responder needs raw sockets",
            hint="run it as root (or with CAP_NET_RAW and CAP_NET_ADMIN)",
        ) from None
    # ICMP_FILTER is a mask of types to *block*: everything but echo requests.
    rx.setsockopt(SOL_RAW, ICMP_FILTER, struct.pack("I", ~(1 << ICMP_ECHO_REQUEST) & 0xFFFFFFFF))
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 * 1024 * 1024)
    rx.setblocking(False)
    tx.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 * 1024 * 1024)
    tx.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, REPLY_MARK)
    tx.setsockopt(socket.IPPROTO_IP, IP_NODEFRAG, 1)
    tx.setblocking(False)
    return rx, tx


class IcmpResponder:
    """Feeds the core from the raw socket, sends what it returns, hands the
    log rows to ``sink`` in batches (from this thread; the sink may queue).

    ``sink(records)`` is called at most every FLUSH_INTERVAL_S or FLUSH_ROWS
    replies, and once more at the end.
    """

    def __init__(
        self,
        core: ResponderCore,
        sink: Callable[[list[ReplyRecord]], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.core = core
        self.sink = sink
        self.clock = clock
        self.pending: list[ReplyRecord] = []
        self._stop = threading.Event()
        self.rx: socket.socket | None = None
        self.tx: socket.socket | None = None

    def stop(self) -> None:
        self._stop.set()

    def serve(
        self,
        sockets: tuple[socket.socket, socket.socket] | None = None,
        ready: Callable[[], None] | None = None,
    ) -> None:
        self.rx, self.tx = sockets or open_sockets()
        sel = selectors.DefaultSelector()
        sel.register(self.rx, selectors.EVENT_READ)
        next_flush = self.clock() + FLUSH_INTERVAL_S
        next_stats = self.clock() + STATS_INTERVAL_S
        if ready is not None:
            ready()
        try:
            while not self._stop.is_set():
                if sel.select(timeout=0.2):
                    self._drain()
                now = self.clock()
                if self.pending and (now >= next_flush or len(self.pending) >= FLUSH_ROWS):
                    self._flush()
                    next_flush = now + FLUSH_INTERVAL_S
                if now >= next_stats:
                    log.info("responder: %s", self.summary())
                    next_stats = now + STATS_INTERVAL_S
        finally:
            sel.close()
            self._flush()

    def _drain(self) -> None:
        assert self.rx is not None
        for _ in range(RECV_BATCH):
            try:
                datagram = self.rx.recv(65535)
            except BlockingIOError:
                return
            except OSError as exc:
                log.warning("receive failed: %s", exc)
                return
            reply = self.core.on_request(self.clock(), datagram)
            if reply is not None:
                self._send(reply)

    def _send(self, reply: Reply) -> None:
        assert self.tx is not None
        try:
            for packet in reply.packets:
                self.tx.sendto(packet, (reply.dst, 0))
        except OSError as exc:
            if exc.errno not in (
                errno.EAGAIN,
                errno.ENOBUFS,
                errno.EPERM,
                errno.EHOSTUNREACH,
                errno.ENETUNREACH,
            ):
                log.warning("send to %s failed: %s", reply.dst, exc)
            self.core.not_sent(reply)
            return
        self.pending.append(reply.record)
        if len(self.pending) >= FLUSH_ROWS:
            self._flush()

    def _flush(self) -> None:
        batch, self.pending = self.pending, []
        if batch and self.sink is not None:
            self.sink(batch)

    def summary(self) -> str:
        stats = self.core.stats
        answered = ", ".join(
            f"{k.removeprefix('answered_')} {v}"
            for k, v in sorted(stats.items())
            if k.startswith("answered_")
        )
        ignored = ", ".join(
            f"{k} {v}" for k, v in sorted(stats.items()) if not k.startswith("answered_") and v
        )
        return f"answered {answered or 'none'}; not answered: {ignored or 'none'}"


def new_run_id() -> uuid.UUID:
    return uuid.uuid4()
