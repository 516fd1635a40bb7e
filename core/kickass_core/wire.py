"""UDP wire format of the fragment-viability probe protocol.

Every message starts with the same 12 bytes: magic ``b"KA"``, a kind byte, a
version byte and the 8-byte session tag. A probe adds its 4-byte sequence
number right after, so a probe's identity fits in the first 16 bytes of UDP
payload: the smallest probe (IP length 44) and the smallest leading fragment
(24 bytes of IP payload = 8 UDP + 16) both carry it whole.

Flow (ARCHITECTURE.md, "The probe protocol"; the QUIC way):
  client -> server  HELLO      tag + secret cookie from the HTTP API, padded
  server -> client  CHALLENGE  tag + fresh random token, never larger than HELLO
  client -> server  ECHO       tag + token, from the same address:port
  server -> client  PROBE ...  only after ECHO proved return routability
  client -> server  ACK        tag + seq + what the client saw
  client -> server  REPORT     the client's reassembly memory: how many more split
                               datagrams it can take (flow control), and which
                               sequence numbers were measured while its kernel
                               refused fragments (every ~50 ms while probing)
  server -> client  DONE       the plan is finished (a hint; HTTP is the truth)

REPORT is new in the same wire version: a server that does not know it
counts it as malformed and ignores it, and a client that does not send it
gets no flow control (the server's behaviour before REPORT existed).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Union

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
# report_seq, split_limit, frag_memory, frag_high_thresh, refused, number of ranges
_REPORT_HEAD = struct.Struct("!IIIIIB")
_RANGE = struct.Struct("!II")  # [first, end) of sequence numbers
# A REPORT carries at most this many invalid ranges (the most recent ones):
# 12 + 21 + 4 * 8 = 65 bytes at most.
MAX_REPORT_RANGES = 4
# split_limit meaning "no limit", and "unknown" for the 32-bit gauges.
NO_LIMIT = 0xFFFFFFFF
UNKNOWN_U32 = 0xFFFFFFFF


class WireError(ValueError):
    """A datagram that is not a valid probe-protocol message."""


class Kind(enum.IntEnum):
    HELLO = 1
    CHALLENGE = 2
    ECHO = 3
    PROBE = 4
    ACK = 5
    DONE = 6
    REPORT = 7


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


# An ACK's observed_frag_size when the client's system cannot observe it (no
# fragment of an IPv4 datagram is 65535 bytes: the value is free).
FRAG_SIZE_UNKNOWN = 0xFFFF


@dataclass(frozen=True)
class Ack:
    """The client's acknowledgement of one probe.

    ``received_len`` is the UDP payload length the client got (a truncated or
    padded datagram shows here); ``observed_frag_size`` is Linux's
    IP_RECVFRAGSIZE (largest fragment's IP length, 0 if it arrived whole), or
    ``FRAG_SIZE_UNKNOWN`` where the client cannot tell (not Linux, an old
    kernel): stored as unknown, never as "arrived whole"; ``echo_ts`` is
    opaque and unused by v1 servers.
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
class Report:
    """The client's reassembly memory, for flow control of the split phase.

    ``split_limit``: the server may send split probes only with ``seq <
    split_limit`` (``NO_LIMIT``: any). The client computes it from how much
    of its kernel's IPv4 reassembly memory is free, so that the study's own
    unfinished datagrams (a split whose other piece was lost, filtered or
    duplicated waits 30 s in that memory) can never fill it.
    ``frag_memory`` / ``frag_high_thresh``: bytes in use and the kernel's
    limit (``UNKNOWN_U32`` when the system does not tell). ``refused``:
    fragments the kernel refused since the session began (cumulative).
    ``invalid``: ranges ``[first, end)`` of sequence numbers measured while
    the kernel refused fragments; a probe in one that never arrived is not
    evidence of loss on the path. ``report_seq`` orders reports (a stale one
    is ignored).
    """

    session_tag: bytes
    report_seq: int
    split_limit: int = NO_LIMIT
    frag_memory: int = UNKNOWN_U32
    frag_high_thresh: int = UNKNOWN_U32
    refused: int = 0
    invalid: tuple[tuple[int, int], ...] = ()

    def encode(self) -> bytes:
        ranges = self.invalid[-MAX_REPORT_RANGES:]
        return (
            _PREFIX.pack(MAGIC, Kind.REPORT, WIRE_VERSION, self.session_tag)
            + _REPORT_HEAD.pack(
                self.report_seq,
                self.split_limit,
                self.frag_memory,
                self.frag_high_thresh,
                self.refused,
                len(ranges),
            )
            + b"".join(_RANGE.pack(a, b) for a, b in ranges)
        )


@dataclass(frozen=True)
class Done:
    session_tag: bytes

    def encode(self) -> bytes:
        return _PREFIX.pack(MAGIC, Kind.DONE, WIRE_VERSION, self.session_tag)


# typing.Union, not ``|``: a type alias is evaluated at run time, and ``|``
# between classes needs Python 3.10 (the volunteer client runs on 3.9).
Message = Union[Hello, Challenge, Echo, ProbeHeader, Ack, Report, Done]


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
    if k is Kind.REPORT:
        if len(rest) < _REPORT_HEAD.size:
            raise WireError("REPORT is too short")
        report_seq, split_limit, frag_memory, frag_high_thresh, refused, n = (
            _REPORT_HEAD.unpack_from(rest)
        )
        if n > MAX_REPORT_RANGES or len(rest) != _REPORT_HEAD.size + n * _RANGE.size:
            raise WireError(f"REPORT must carry 0..{MAX_REPORT_RANGES} ranges of 8 bytes")
        ranges = tuple(
            _RANGE.unpack_from(rest, _REPORT_HEAD.size + i * _RANGE.size) for i in range(n)
        )
        if any(a >= b for a, b in ranges):
            raise WireError("REPORT range is empty or reversed")
        return Report(
            tag, report_seq, split_limit, frag_memory, frag_high_thresh, refused, invalid=ranges
        )
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
