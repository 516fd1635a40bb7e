"""Ground truth for the study's namespace tests: what reached the client's
interface, read from tcpdump captures (before the client's kernel reassembles,
refuses or delivers anything).

``Capture`` runs tcpdump in a namespace; ``read_ipv4`` parses a pcap file (no
scapy: the format is 24 bytes of file header, then 16 bytes per record);
``probe_truth`` turns a client-side and a server-side capture into, per probe
sequence number, whether every piece of its datagram reached the client, how
it was cut (leading fragment length, number of pieces), and whether the
client's ACK of it was sent and reached the server.
"""

from __future__ import annotations

import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kickass_core import wire

_PCAP_HEADER = struct.Struct("<IHHiIII")
_RECORD = struct.Struct("<IIII")
LINKTYPE_ETHERNET = 1
LINKTYPE_LINUX_SLL = 113
LINKTYPE_RAW = 101


def wait_listening(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """Returns once tcpdump (``stderr=PIPE``) says "listening on": its filter
    is attached, so every packet from now on is captured."""
    deadline = time.monotonic() + timeout
    assert proc.stderr is not None
    line = b""
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if b"listening on" in line or not line:
            break
    assert b"listening on" in line, f"tcpdump did not start: {line!r}"


class Capture:
    """tcpdump on ``iface`` in ``ns`` into ``path``; ``stop()`` returns how
    many packets the filter matched and the file does not hold (the truth is
    only truth at 0).

    Why ``--immediate-mode`` and the quiet wait in ``stop()``: without it
    libpcap (TPACKET_V3) hands packets over a block at a time, up to a second
    late, and a tcpdump stopped inside that second never writes the last
    ones; its "dropped by kernel" stays 0 all the same. A CI run lost the
    last swapped split that way (the client counted 66, the capture 65)."""

    def __init__(self, ns, iface: str, path: Path, bpf: str, snaplen: int = 96) -> None:  # noqa: ANN001
        self.path = path
        self.proc = ns.popen(
            ["tcpdump", "-i", iface, "-w", str(path), "-s", str(snaplen), "-B", "32768", "-U",
             "--immediate-mode", "-nn", bpf],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        wait_listening(self.proc)

    def stop(self, quiet_s: float = 0.3, limit_s: float = 10.0) -> int:
        # The last packets are written once the file stops growing for quiet_s.
        deadline = time.monotonic() + limit_s
        size, since = -1, time.monotonic()
        while time.monotonic() < deadline:
            now_size = self.path.stat().st_size if self.path.exists() else 0
            if now_size != size:
                size, since = now_size, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                break
            time.sleep(0.05)
        self.proc.terminate()
        _, err = self.proc.communicate(timeout=20)
        text = err.decode(errors="replace")
        counts: dict[str, int] = {}
        for ln in text.splitlines():
            for what in ("captured", "received by filter", "dropped by kernel"):
                if ln.endswith(f"packets {what}") or ln.endswith(f"packet {what}"):
                    counts[what] = int(ln.split()[0])
        if len(counts) != 3:
            raise AssertionError(f"tcpdump printed no statistics: {text[-500:]}")
        # Matched by the filter yet not in the file: dropped by the kernel, or
        # still on their way to the file when tcpdump stopped.
        return counts["dropped by kernel"] + max(
            0, counts["received by filter"] - counts["captured"] - counts["dropped by kernel"]
        )


@dataclass(frozen=True)
class Ipv4:
    src: str
    dst: str
    ip_id: int
    offset: int  # bytes
    more: bool
    total_len: int
    proto: int
    payload: bytes  # as captured (may be cut by the snap length)


def read_ipv4(path: Path) -> Iterator[Ipv4]:
    data = path.read_bytes()
    magic, _, _, _, _, _snaplen, linktype = _PCAP_HEADER.unpack_from(data)
    assert magic == 0xA1B2C3D4, f"not a little-endian microsecond pcap: {magic:#x}"
    pos = _PCAP_HEADER.size
    while pos + _RECORD.size <= len(data):
        _, _, incl, _ = _RECORD.unpack_from(data, pos)
        pos += _RECORD.size
        frame = data[pos : pos + incl]
        pos += incl
        if linktype == LINKTYPE_ETHERNET:
            if frame[12:14] != b"\x08\x00":
                continue
            pkt = frame[14:]
        elif linktype == LINKTYPE_LINUX_SLL:
            if frame[14:16] != b"\x08\x00":
                continue
            pkt = frame[16:]
        elif linktype == LINKTYPE_RAW:
            pkt = frame
        else:
            raise AssertionError(f"unexpected link type {linktype}")
        if len(pkt) < 20 or pkt[0] >> 4 != 4:
            continue
        ihl = (pkt[0] & 0xF) * 4
        total_len, ip_id, frag = struct.unpack_from("!HHH", pkt, 2)
        yield Ipv4(
            src=socket.inet_ntoa(pkt[12:16]),
            dst=socket.inet_ntoa(pkt[16:20]),
            ip_id=ip_id,
            offset=(frag & 0x1FFF) * 8,
            more=bool(frag & 0x2000),
            total_len=total_len,
            proto=pkt[9],
            payload=pkt[ihl:],
        )


@dataclass
class _Datagram:
    seq: int | None = None
    pieces: set[tuple[int, int, bool]] = field(default_factory=set)  # offset, len, more
    leading_len: int | None = None  # IP length of the piece at offset 0

    def complete(self) -> bool:
        """Every byte from 0 to the end of the piece without "more fragments"."""
        at, end = 0, None
        for off, length, more in sorted(self.pieces):
            if off > at:
                return False
            at = max(at, off + length)
            if not more:
                end = off + length
        return end is not None and at >= end


@dataclass
class ProbeTruth:
    # seq -> (leading fragment IP length, distinct pieces) of datagrams that
    # reached the client's interface whole (every piece).
    delivered: dict[int, tuple[int, int]]
    acks_sent: set[int]  # ACKs the client sent (seqs)
    acks_at_server: set[int]  # ACKs that reached the server

    def acked_fraction(self, seqs: set[int]) -> float:
        """Of the ACKs the client sent for ``seqs``, the share the server got."""
        sent = self.acks_sent & seqs
        return len(self.acks_at_server & sent) / len(sent) if sent else 1.0


def _ack_seq(p: Ipv4, tag: bytes) -> int | None:
    body = p.payload[8:]
    if p.proto != 17 or p.offset or len(body) < 16:
        return None
    if body[:2] != wire.MAGIC or body[2] != wire.Kind.ACK or body[4:12] != tag:
        return None
    return int.from_bytes(body[12:16], "big")


def probe_truth(
    client_pcap: Path, server_pcap: Path, server_ip: str, client_ip: str, tag: bytes
) -> ProbeTruth:
    grams: dict[int, _Datagram] = {}
    acks_sent: set[int] = set()
    for p in read_ipv4(client_pcap):
        if p.src == server_ip and p.dst == client_ip and p.proto == 17:
            g = grams.setdefault(p.ip_id, _Datagram())
            g.pieces.add((p.offset, p.total_len - 20, p.more))
            if p.offset == 0:
                g.leading_len = p.total_len
                body = p.payload[8:]
                if (
                    len(body) >= 16
                    and body[:2] == wire.MAGIC
                    and body[2] == wire.Kind.PROBE
                    and body[4:12] == tag
                ):
                    g.seq = int.from_bytes(body[12:16], "big")
        elif p.src == client_ip and p.dst == server_ip:
            seq = _ack_seq(p, tag)
            if seq is not None:
                acks_sent.add(seq)
    acks_at_server: set[int] = set()
    for p in read_ipv4(server_pcap):
        if p.dst == server_ip:
            seq = _ack_seq(p, tag)
            if seq is not None:
                acks_at_server.add(seq)
    delivered = {
        g.seq: (g.leading_len or 0, len({(o, n) for o, n, _ in g.pieces}))
        for g in grams.values()
        if g.seq is not None and g.complete()
    }
    return ProbeTruth(delivered, acks_sent, acks_at_server)
