"""Probe packets: built once with scapy, then patched per probe.

scapy builds the IP/UDP template of each (session, size) once; every probe
copies it and patches the few fields that change — IP id, sequence number and
the UDP checksum (updated incrementally, RFC 1624) — and one long-lived raw
socket sends it. ``scapy.send()`` per probe would open a socket per call and
run at a few thousand packets/s.
"""

from __future__ import annotations

import socket
import struct

from kickass_core.plan import UDP_HEADER_LEN
from kickass_core.rate import FULL_PACKET_LEN, IPV4_HEADER_LEN
from kickass_core.wire import probe_payload
from scapy.layers.inet import IP, UDP
from scapy.packet import Raw

# Offsets inside a probe's IP datagram (20-byte header, no options).
_ID_OFF = 4
_UDP_CSUM_OFF = IPV4_HEADER_LEN + 6
_SEQ_OFF = IPV4_HEADER_LEN + UDP_HEADER_LEN + 12  # after magic, kind, version, tag
_FLAGS_MF = 0x2000


def _fold(s: int) -> int:
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return s


class ProbeTemplate:
    """The bytes of one probe shape (whole packet or two-fragment split) for
    one session; ``render(seq, ip_id)`` gives the packets to send."""

    __slots__ = ("whole", "lead", "rest", "base_sum", "csum_pos", "seq_pos_lead")

    def __init__(
        self,
        src: str,
        dst: str,
        sport: int,
        dport: int,
        session_tag: bytes,
        ip_len: int,
        split: bool,
    ) -> None:
        datagram_len = FULL_PACKET_LEN if split else ip_len
        udp_payload_len = datagram_len - IPV4_HEADER_LEN - UDP_HEADER_LEN
        pkt = (
            IP(src=src, dst=dst, id=0, flags=0, ttl=64)
            / UDP(sport=sport, dport=dport)
            / Raw(probe_payload(session_tag, 0, udp_payload_len))
        )
        datagram = bytearray(bytes(pkt))
        assert len(datagram) == datagram_len
        csum = struct.unpack_from("!H", datagram, _UDP_CSUM_OFF)[0]
        # Unfolded sum with seq = 0; a zero checksum was sent as 0xffff.
        self.base_sum = (~csum) & 0xFFFF
        if not split:
            self.whole = datagram
            self.lead = self.rest = None
            return
        self.whole = None
        lead_payload = ip_len - IPV4_HEADER_LEN
        ip_payload = bytes(datagram[IPV4_HEADER_LEN:])
        # Fragment headers as Linux ip_do_fragment writes them: header copied,
        # same id, offset in 8-byte units, MF on all but the last.
        lead_hdr = bytes(
            IP(src=src, dst=dst, id=0, flags="MF", frag=0, ttl=64, proto=17, len=ip_len)
        )[:IPV4_HEADER_LEN]
        rest_len = IPV4_HEADER_LEN + len(ip_payload) - lead_payload
        rest_hdr = bytes(
            IP(
                src=src,
                dst=dst,
                id=0,
                flags=0,
                frag=lead_payload // 8,
                ttl=64,
                proto=17,
                len=rest_len,
            )
        )[:IPV4_HEADER_LEN]
        self.lead = bytearray(lead_hdr + ip_payload[:lead_payload])
        self.rest = bytearray(rest_hdr + ip_payload[lead_payload:])

    def render(self, seq: int, ip_id: int) -> list[bytes]:
        s = _fold(self.base_sum + (seq >> 16) + (seq & 0xFFFF))
        csum = (~s) & 0xFFFF or 0xFFFF
        if self.whole is not None:
            buf = self.whole
            struct.pack_into("!H", buf, _ID_OFF, ip_id)
            struct.pack_into("!I", buf, _SEQ_OFF, seq)
            struct.pack_into("!H", buf, _UDP_CSUM_OFF, csum)
            return [bytes(buf)]
        lead, rest = self.lead, self.rest
        assert lead is not None and rest is not None
        struct.pack_into("!H", lead, _ID_OFF, ip_id)
        struct.pack_into("!H", rest, _ID_OFF, ip_id)
        struct.pack_into("!I", lead, _SEQ_OFF, seq)
        struct.pack_into("!H", lead, _UDP_CSUM_OFF, csum)
        # The kernel fills the IP header checksum of raw IP_HDRINCL sends, but
        # we fill it too so the bytes are right on any path (and in tests).
        _ip_checksum(lead)
        _ip_checksum(rest)
        return [bytes(lead), bytes(rest)]


def _ip_checksum(buf: bytearray) -> None:
    buf[10:12] = b"\0\0"
    s = sum(struct.unpack_from("!10H", buf, 0))
    struct.pack_into("!H", buf, 10, (~_fold(s)) & 0xFFFF)


def open_raw_socket() -> socket.socket:
    """One long-lived IPPROTO_RAW socket (IP_HDRINCL implied): we write every
    header byte ourselves, fragments included."""
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * 1024 * 1024)
    s.setblocking(False)
    return s
