"""UDP wire format of the fragment-viability probe protocol.

Every message starts with the same 12 bytes: magic ``b"KA"``, a kind byte, a
version byte and the 8-byte session tag. A probe adds its 4-byte sequence
number right after, so a probe's identity fits in the first 16 bytes of UDP
payload: the smallest probe (IP length 44) and the smallest leading fragment
(24 bytes of IP payload = 8 UDP + 16) both carry it whole.

Flow (DESIGN.md section 4, the QUIC way):
  client -> server  HELLO      tag + secret cookie from the HTTP API, padded
  server -> client  CHALLENGE  tag + fresh random token, never larger than HELLO
  client -> server  ECHO       tag + token, from the same address:port
  server -> client  PROBE ...  only after ECHO proved return routability
  client -> server  ACK        tag + seq + what the client saw
  server -> client  DONE       the plan is finished (a hint; HTTP is the truth)
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

MAGIC = b"KA"
WIRE_VERSION = 1
SESSION_TAG_LEN = 8
COOKIE_LEN = 16
CHALLENGE_LEN = 16
# HELLO is padded so that the server's CHALLENGE (28 bytes) is always smaller:
# a spoofed HELLO can never be amplified.
HELLO_MIN_LEN = 64
PROBE_HEADER_LEN = 16

_PREFIX = struct.Struct("!2sBB8s")  # magic, kind, version, session tag
_SEQ = struct.Struct("!I")
_ACK_TAIL = struct.Struct("!IHHI")  # seq, received_len, observed_frag_size, echo_ts


class WireError(ValueError):
    """A datagram that is not a valid probe-protocol message."""


class Kind(enum.IntEnum):
    HELLO = 1
    CHALLENGE = 2
    ECHO = 3
    PROBE = 4
    ACK = 5
    DONE = 6


@dataclass(frozen=True)
class Hello:
    session_tag: bytes
    cookie: bytes

    def encode(self, pad_to: int = HELLO_MIN_LEN) -> bytes:
        body = _PREFIX.pack(MAGIC, Kind.HELLO, WIRE_VERSION, self.session_tag) + self.cookie
        return body + b"\0" * max(0, max(pad_to, HELLO_MIN_LEN) - len(body))


@dataclass(frozen=True)
class Challenge:
    session_tag: bytes
    token: bytes

    def encode(self) -> bytes:
        return _PREFIX.pack(MAGIC, Kind.CHALLENGE, WIRE_VERSION, self.session_tag) + self.token


@dataclass(frozen=True)
class Echo:
    session_tag: bytes
    token: bytes

    def encode(self) -> bytes:
        return _PREFIX.pack(MAGIC, Kind.ECHO, WIRE_VERSION, self.session_tag) + self.token


@dataclass(frozen=True)
class ProbeHeader:
    session_tag: bytes
    seq: int

    def encode(self) -> bytes:
        return _PREFIX.pack(MAGIC, Kind.PROBE, WIRE_VERSION, self.session_tag) + _SEQ.pack(self.seq)


@dataclass(frozen=True)
class Ack:
    """The client's acknowledgement of one probe.

    ``received_len`` is the UDP payload length the client got (a truncated or
    padded datagram shows here); ``observed_frag_size`` is Linux's
    IP_RECVFRAGSIZE (largest fragment's IP length, 0 if it arrived whole or
    the platform cannot tell); ``echo_ts`` is opaque and unused by v1 servers.
    """

    session_tag: bytes
    seq: int
    received_len: int
    observed_frag_size: int = 0
    echo_ts: int = 0

    def encode(self) -> bytes:
        return _PREFIX.pack(MAGIC, Kind.ACK, WIRE_VERSION, self.session_tag) + _ACK_TAIL.pack(
            self.seq, self.received_len, self.observed_frag_size, self.echo_ts
        )


@dataclass(frozen=True)
class Done:
    session_tag: bytes

    def encode(self) -> bytes:
        return _PREFIX.pack(MAGIC, Kind.DONE, WIRE_VERSION, self.session_tag)


Message = Hello | Challenge | Echo | ProbeHeader | Ack | Done


def decode(data: bytes) -> Message:
    """Parse one datagram; raise WireError on anything malformed."""
    if len(data) < _PREFIX.size:
        raise WireError(f"datagram of {len(data)} bytes is shorter than the 12-byte header")
    magic, kind, version, tag = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise WireError("bad magic")
    if version != WIRE_VERSION:
        raise WireError(f"unsupported wire version {version}")
    rest = data[_PREFIX.size :]
    try:
        k = Kind(kind)
    except ValueError:
        raise WireError(f"unknown message kind {kind}") from None
    if k is Kind.HELLO:
        if len(data) < HELLO_MIN_LEN:
            raise WireError(f"HELLO of {len(data)} bytes is below the {HELLO_MIN_LEN}-byte minimum")
        return Hello(tag, rest[:COOKIE_LEN])
    if k in (Kind.CHALLENGE, Kind.ECHO):
        if len(rest) != CHALLENGE_LEN:
            raise WireError(f"{k.name} must carry exactly {CHALLENGE_LEN} token bytes")
        return (Challenge if k is Kind.CHALLENGE else Echo)(tag, rest)
    if k is Kind.PROBE:
        if len(rest) < _SEQ.size:
            raise WireError("PROBE without a sequence number")
        return ProbeHeader(tag, _SEQ.unpack_from(rest)[0])
    if k is Kind.ACK:
        if len(rest) != _ACK_TAIL.size:
            raise WireError(f"ACK must be {_PREFIX.size + _ACK_TAIL.size} bytes")
        seq, received_len, frag, echo_ts = _ACK_TAIL.unpack(rest)
        return Ack(tag, seq, received_len, frag, echo_ts)
    if len(rest):
        raise WireError("DONE carries no body")
    return Done(tag)


def probe_payload(session_tag: bytes, seq: int, udp_payload_len: int) -> bytes:
    """UDP payload of one probe: header, then a fixed fill pattern.

    The fill is deterministic so a client (or a test) can tell a corrupted or
    truncated datagram from an intact one.
    """
    if udp_payload_len < PROBE_HEADER_LEN:
        raise ValueError(f"a probe needs at least {PROBE_HEADER_LEN} bytes of UDP payload")
    head = ProbeHeader(session_tag, seq).encode()
    return head + fill_pattern(udp_payload_len - PROBE_HEADER_LEN)


_FILL = bytes((i * 7 + 3) & 0xFF for i in range(2048))


def fill_pattern(n: int) -> bytes:
    return _FILL[:n]
