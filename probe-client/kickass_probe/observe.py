"""The opt-in privileged observation: every probe's fragments before reassembly.

Why (issue 11): ``IP_RECVFRAGSIZE``, all an unprivileged client has, reports
only the *largest* fragment of a datagram. A middlebox that reassembles and
re-cuts a split with the largest piece first (Linux connection tracking
forwarding onto a VXLAN overlay does exactly that) turns a 604 + 916 split
into 916 + 604: the largest piece is unchanged, so the client can only say
"largest fragment as sent". Kick-Ass encodes the rate in the *leading*
fragment, so such a swap changes the rate a receiver decodes; to see it the
client must read the fragments themselves.

``--observe-fragments`` (root or CAP_NET_RAW) opens an AF_PACKET socket with a
classic BPF filter in the kernel that passes only this session's probes —
IPv4 UDP from the server's address and probe port to this client's port, and
every non-first fragment from the server's address (they carry no ports;
the IP id ties them to their first piece). ``FragmentObserver`` (sans-IO: IP
packets in) records, per probe sequence number, the IP length of the piece
at offset 0 (``leading_len``) and how many distinct pieces arrived
(``fragments``). They travel in the end-of-session report (two compressed
arrays of the plan's length), so the server stores them per probe
(``probe_outcomes.observed_leading_len``, ``observed_fragments``).

Can the server choose split shapes whose re-cut shows in the largest
fragment, so that even unprivileged clients would see it? Linux re-cuts at
the largest fragment's size, so the largest piece survives a re-cut
unchanged, except when it is the *last* piece and its payload is not a
multiple of 8 (then every new piece is rounded down to 8 bytes and the
largest shrinks). A 1500-byte datagram has 1480 bytes of payload, so every
piece of every split of it is a multiple of 8: no full-size shape shows the
re-cut. A datagram of 1497 bytes would, but the study measures full-size
packets (the only ones a Kick-Ass router marks, paper section II), so the
study keeps them and offers this observation instead. For splits whose
leading piece is the larger one (leading IP length >= 760) the Linux re-cut
reproduces the split exactly, so a swap can only occur below 760.
"""

from __future__ import annotations

import base64
import contextlib
import socket
import struct
import sys
import zlib
from array import array
from dataclasses import dataclass
from typing import Any

from kickass_core import wire
from kickass_core.plan import ProbePlan
from kickass_core.rate import FULL_PACKET_LEN, IPV4_HEADER_LEN

from .reassembly import on_linux

ETH_P_IP = 0x0800
SOL_PACKET = 263
PACKET_STATISTICS = 6
SO_ATTACH_FILTER = 26
SO_RCVBUFFORCE = 33
# Room for a burst of probes while the thread is busy elsewhere.
OBSERVER_RCVBUF = 8 << 20
# IP ids whose first piece has not arrived yet, kept at most.
MAX_PENDING = 8192
ENCODING = "zlib-base64-v1"
# The report must fit the server's body limit (256 KiB) with room to spare.
MAX_ENCODED_BYTES = 200_000
# The split whose two pieces are equal: a swap cannot be told (nor matters).
SYMMETRIC_SPLIT = (FULL_PACKET_LEN + IPV4_HEADER_LEN) // 2


class ObserverUnavailable(Exception):
    """The packet socket cannot be opened (no privilege, not Linux)."""


# -- the kernel filter -------------------------------------------------------------------


def bpf_filter(server_ip: str, server_port: int, client_port: int) -> bytes:
    """A classic BPF program (struct sock_filter[]) for an AF_PACKET SOCK_DGRAM
    socket, whose packets start at the IP header: IPv4 UDP from ``server_ip``;
    a non-first fragment passes on the address alone, anything else also needs
    UDP source ``server_port`` and destination ``client_port``."""
    src = struct.unpack("!I", socket.inet_aton(server_ip))[0]
    # (code, jt, jf, k)
    ld_b, ld_h, ld_w, ldx_msh = 0x30, 0x28, 0x20, 0xB1
    ld_h_ind = 0x48
    jeq, jset, ret = 0x15, 0x45, 0x06
    # Jumps count instructions after the next one.
    prog = [
        (ld_b, 0, 0, 9),  # 0: A = protocol
        (jeq, 0, 9, 17),  # 1: UDP? else -> 11 drop
        (ld_w, 0, 0, 12),  # 2: A = source address
        (jeq, 0, 7, src),  # 3: the server? else -> 11 drop
        (ld_h, 0, 0, 6),  # 4: A = flags and fragment offset
        (jset, 7, 0, 0x1FFF),  # 5: a non-first fragment -> 13 accept
        (ldx_msh, 0, 0, 0),  # 6: X = IP header length
        (ld_h_ind, 0, 0, 0),  # 7: A = UDP source port
        (jeq, 0, 2, server_port),  # 8: the probe port? else -> 11 drop
        (ld_h_ind, 0, 0, 2),  # 9: A = UDP destination port
        (jeq, 1, 0, client_port),  # 10: ours? -> 12 accept, else 11 drop
        (ret, 0, 0, 0),  # 11 drop
        (ret, 0, 0, 0xFFFF),  # 12 accept
        (ret, 0, 0, 0xFFFF),  # 13 accept
    ]
    return b"".join(struct.pack("HBBI", *ins) for ins in prog)


def open_packet_socket(rcvbuf: int = OBSERVER_RCVBUF) -> socket.socket:
    """An AF_PACKET socket for IPv4, nothing attached yet. ObserverUnavailable
    without the privilege (root or CAP_NET_RAW) or on another system."""
    if not on_linux() or not hasattr(socket, "AF_PACKET"):
        raise ObserverUnavailable("needs Linux (AF_PACKET)")
    try:
        s = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(ETH_P_IP))
    except PermissionError:
        raise ObserverUnavailable("needs root or CAP_NET_RAW") from None
    except OSError as exc:
        raise ObserverUnavailable(f"cannot open a packet socket: {exc.strerror or exc}") from None
    try:
        s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, rcvbuf)
    except OSError:
        with contextlib.suppress(OSError):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    return s


def attach_filter(sock: socket.socket, program: bytes) -> None:
    """Attach ``program`` (bpf_filter) and drop what arrived before it."""
    n = len(program) // 8
    buf = array("B", program)
    addr, _ = buf.buffer_info()
    fprog = struct.pack("HL", n, addr)
    # The kernel copies the program: ``buf`` only has to live through this call.
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
    del buf
    sock.setblocking(False)
    for _ in range(100_000):  # whatever came in unfiltered
        try:
            sock.recv(65535)
        except (BlockingIOError, InterruptedError):
            break


def packet_drops(sock: socket.socket) -> int | None:
    """Packets the kernel dropped for this socket since the last call."""
    try:
        raw = sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8)
    except OSError:
        return None
    _packets, drops = struct.unpack("II", raw)
    return int(drops)


# -- the observer (sans-IO) ----------------------------------------------------------------


@dataclass
class _Pending:
    seq: int | None
    offsets: set[int]
    leading_len: int = 0


class FragmentObserver:
    """Per probe: IP length of the piece at offset 0 and the pieces seen."""

    def __init__(self, session_tag: bytes, plan: ProbePlan) -> None:
        self.tag = session_tag
        self.plan = plan
        n = plan.total_probes
        self.leading = array("H", bytes(2 * n))
        self.fragments = bytearray(n)
        self._by_id: dict[int, _Pending] = {}
        self.packets = 0
        self.foreign = 0
        self.kernel_drops = 0

    def on_packet(self, pkt: bytes) -> None:
        """One IPv4 packet as the packet socket read it (IP header first)."""
        if len(pkt) < 20 or pkt[0] >> 4 != 4:
            self.foreign += 1
            return
        ihl = (pkt[0] & 0xF) * 4
        total_len, ip_id, frag = struct.unpack_from("!HHH", pkt, 2)
        offset = (frag & 0x1FFF) * 8
        p = self._by_id.get(ip_id)
        if offset == 0:
            body = pkt[ihl + 8 : ihl + 8 + wire.PROBE_HEADER_LEN]
            if (
                len(body) < wire.PROBE_HEADER_LEN
                or body[:2] != wire.MAGIC
                or body[2] != wire.Kind.PROBE
                or body[4:12] != self.tag
            ):
                self.foreign += 1
                return
            seq = int.from_bytes(body[12:16], "big")
            if not 0 <= seq < self.plan.total_probes:
                self.foreign += 1
                return
            if p is None or (p.seq is not None and p.seq != seq):
                # New, or an IP id reused by a later probe (ids wrap at 65,535).
                p = _Pending(seq, set())
                self._remember(ip_id, p)
            p.seq = seq
            p.leading_len = total_len
        elif p is None:
            p = _Pending(None, set())
            self._remember(ip_id, p)
        self.packets += 1
        p.offsets.add(offset)
        if p.seq is not None:
            self.leading[p.seq] = p.leading_len
            self.fragments[p.seq] = min(255, len(p.offsets))

    def _remember(self, ip_id: int, p: _Pending) -> None:
        self._by_id.pop(ip_id, None)
        self._by_id[ip_id] = p
        while len(self._by_id) > MAX_PENDING:
            del self._by_id[next(iter(self._by_id))]

    # -- what it saw ---------------------------------------------------------------------

    def classify(self, seq: int) -> str | None:
        """'as-sent', 'swapped', 'recut' (split), 'whole'/'fragmented' (whole), None."""
        n = self.fragments[seq]
        if not n:
            return None
        probe = self.plan.probe(seq)
        lead = self.leading[seq]
        if probe.phase == "whole":
            return "whole" if n == 1 else "fragmented"
        if n == 2 and lead == probe.ip_len:
            return "as-sent"
        other = FULL_PACKET_LEN + IPV4_HEADER_LEN - probe.ip_len
        if n == 2 and lead == other and probe.ip_len != SYMMETRIC_SPLIT:
            return "swapped"
        return "recut"

    def per_split(self) -> dict[int, dict[str, int]]:
        out: dict[int, dict[str, int]] = {
            size: {"observed": 0, "leading_as_sent": 0, "swapped": 0, "recut": 0}
            for size in self.plan.split
        }
        for seq in range(self.plan.split_from, self.plan.total_probes):
            kind = self.classify(seq)
            if kind is None:
                continue
            row = out[self.plan.probe(seq).ip_len]
            row["observed"] += 1
            key = {"as-sent": "leading_as_sent"}.get(kind, kind)
            row[key] += 1
        return out

    def summary(self) -> dict[str, Any]:
        splits = self.per_split().values()
        whole = [
            self.classify(s) for s in range(self.plan.split_from) if self.fragments[s]
        ]  # fmt: skip
        swapped_sizes = sorted(
            size for size, r in self.per_split().items() if r["swapped"]
        )  # fmt: skip
        return {
            "method": "af-packet",
            "packets": self.packets,
            "kernel_drops": self.kernel_drops,
            "split_observed": sum(r["observed"] for r in splits),
            "split_leading_as_sent": sum(r["leading_as_sent"] for r in splits),
            "split_swapped": sum(r["swapped"] for r in splits),
            "split_recut": sum(r["recut"] for r in splits),
            "swapped_leading_ip_lens": swapped_sizes[:200],
            "whole_observed": len(whole),
            "whole_fragmented": sum(1 for k in whole if k == "fragmented"),
        }

    def encoded(self) -> dict[str, Any] | None:
        """The per-probe arrays for the end-of-session report (None if too large)."""
        lead = array("H", self.leading)
        if sys.byteorder == "little":
            lead.byteswap()  # big-endian on the wire
        leading = base64.b64encode(zlib.compress(lead.tobytes(), 9)).decode("ascii")
        fragments = base64.b64encode(zlib.compress(bytes(self.fragments), 9)).decode("ascii")
        if len(leading) + len(fragments) > MAX_ENCODED_BYTES:
            return None
        return {"encoding": ENCODING, "leading": leading, "fragments": fragments}
