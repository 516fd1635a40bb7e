"""Probe packets: built once per session with scapy, then patched per probe.

scapy builds each session's reference datagram (1500-byte IP/UDP probe to the
proven peer) once. Every probe is then derived from those bytes by patching
the few fields that change — IP total length, id, fragment field, the UDP
length, the sequence number and both checksums — and sent on one long-lived
raw socket. Checksums come from precomputed ones'-complement partial sums
(RFC 1071/1624), so a probe costs a few struct calls whatever its size.
``scapy.send()`` per probe would open a socket per call and run at a few
thousand packets/s; tests check every shape against packets scapy builds
whole.
"""

from __future__ import annotations

import socket
import struct
import sys
from array import array

from kickass_core.plan import UDP_HEADER_LEN
from kickass_core.rate import FULL_PACKET_LEN, IPV4_HEADER_LEN
from kickass_core.wire import PROBE_HEADER_LEN, fill_pattern, probe_payload
from scapy.layers.inet import IP, UDP
from scapy.packet import Raw

_MF = 0x2000
IP_NODEFRAG = 22  # Linux; not exported by Python's socket module
_IP_HDR = struct.Struct("!BBHHHBBH4s4s")
_UDP_HDR = struct.Struct("!HHHH")
_SEQ = struct.Struct("!I")
_MAX_UDP_PAYLOAD = FULL_PACKET_LEN - IPV4_HEADER_LEN - UDP_HEADER_LEN
_FILL = fill_pattern(_MAX_UDP_PAYLOAD - PROBE_HEADER_LEN)


def _fold(s: int) -> int:
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return s


def _be_sum(data: bytes) -> int:
    """Sum of big-endian 16-bit words (even length)."""
    words = array("H", data)
    if sys.byteorder == "little":
        words.byteswap()
    return sum(words)


def _fill_prefix_sums() -> list[int]:
    """sums[n] = ones'-complement partial sum of the first n fill bytes (odd n
    pads with a zero byte, as the checksum does)."""
    sums = [0] * (len(_FILL) + 1)
    acc = 0
    for n in range(1, len(_FILL) + 1):
        if n % 2 == 0:
            acc += (_FILL[n - 2] << 8) | _FILL[n - 1]
            sums[n] = acc
        else:
            sums[n] = acc + (_FILL[n - 1] << 8)
    return sums


_FILL_SUMS = _fill_prefix_sums()


class SessionPackets:
    """All probe shapes of one session (one source, destination, ports, tag)."""

    __slots__ = ("src", "dst", "udp_const", "ip_const", "head", "sport", "dport")

    def __init__(self, src: str, dst: str, sport: int, dport: int, session_tag: bytes) -> None:
        ref = bytes(
            IP(src=src, dst=dst, id=0, flags=0, ttl=64)
            / UDP(sport=sport, dport=dport)
            / Raw(probe_payload(session_tag, 0, _MAX_UDP_PAYLOAD))
        )
        self.src, self.dst = ref[12:16], ref[16:20]
        self.sport, self.dport = sport, dport
        # Probe header with seq 0 (magic, kind, version, tag, seq).
        self.head = ref[28 : 28 + PROBE_HEADER_LEN - 4]
        # UDP checksum parts that never change: pseudo-header addresses and
        # protocol, the ports, the probe header without seq.
        self.udp_const = _be_sum(ref[12:20]) + 17 + sport + dport + _be_sum(self.head)
        # IP header words that never change: version/IHL/TOS, TTL/proto, addresses.
        self.ip_const = 0x4500 + (64 << 8 | 17) + _be_sum(ref[12:20])

    def _udp_checksum(self, udp_len: int, seq: int) -> int:
        s = self.udp_const + 2 * udp_len + (seq >> 16) + (seq & 0xFFFF)
        s += _FILL_SUMS[udp_len - UDP_HEADER_LEN - PROBE_HEADER_LEN]
        return (~_fold(s)) & 0xFFFF or 0xFFFF

    def _ip_header(self, total_len: int, ip_id: int, frag: int) -> bytes:
        csum = (~_fold(self.ip_const + total_len + ip_id + frag)) & 0xFFFF
        return _IP_HDR.pack(0x45, 0, total_len, ip_id, frag, 64, 17, csum, self.src, self.dst)

    def _udp_datagram(self, udp_len: int, seq: int) -> bytes:
        return (
            _UDP_HDR.pack(self.sport, self.dport, udp_len, self._udp_checksum(udp_len, seq))
            + self.head
            + _SEQ.pack(seq)
            + _FILL[: udp_len - UDP_HEADER_LEN - PROBE_HEADER_LEN]
        )

    def whole(self, ip_len: int, seq: int, ip_id: int) -> list[bytes]:
        udp = self._udp_datagram(ip_len - IPV4_HEADER_LEN, seq)
        return [self._ip_header(ip_len, ip_id, 0) + udp]

    def split(self, leading_ip_len: int, seq: int, ip_id: int) -> list[bytes]:
        """A full-size datagram in two fragments, as Linux ip_do_fragment cuts
        it: header copied, same id, offset in 8-byte units, MF on the first."""
        udp = self._udp_datagram(FULL_PACKET_LEN - IPV4_HEADER_LEN, seq)
        cut = leading_ip_len - IPV4_HEADER_LEN
        rest_len = IPV4_HEADER_LEN + len(udp) - cut
        return [
            self._ip_header(leading_ip_len, ip_id, _MF) + udp[:cut],
            self._ip_header(rest_len, ip_id, cut // 8) + udp[cut:],
        ]

    def render(self, phase: str, ip_len: int, seq: int, ip_id: int) -> list[bytes]:
        if phase == "whole":
            return self.whole(ip_len, seq, ip_id)
        return self.split(ip_len, seq, ip_id)


def open_raw_socket() -> socket.socket:
    """One long-lived IPPROTO_RAW socket (IP_HDRINCL implied): we write every
    header byte ourselves, fragments included."""
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * 1024 * 1024)
    # Should conntrack ever be loaded on the server host, it must not
    # reassemble our hand-cut fragments on the way out (and re-cut them).
    s.setsockopt(socket.IPPROTO_IP, IP_NODEFRAG, 1)
    s.setblocking(False)
    return s
