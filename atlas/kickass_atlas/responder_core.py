"""The ICMP responder's sans-IO core: echo requests in, echo replies and log rows out.

RIPE Atlas probes ping the server (kickass_atlas). ``ResponderCore``
is fed every IPv4 datagram the raw socket received, with the time
(``on_request(now, datagram)``), and answers with at most one ``Reply``: the
raw IP packets to send and the ``ReplyRecord`` to log. No sockets, clocks or
database in here: ``responder.IcmpResponder`` owns those, and the tests
drive this class on simulated time (as ``probe_core.ProbeCore``).

What it answers (the fragment viability study, paper §IV-C):

* on a ``whole`` address, an echo request of up to 1500 bytes gets an
  ordinary, unfragmented reply of the same size;
* on a ``split`` address, a 1500-byte echo request gets a 1500-byte reply
  cut in two at a leading-fragment length of the campaign's split sweep (the
  leading fragment's IP length, as the paper counts it). The split is chosen
  per request, cycling through the sweep per probe's stream (below) from a
  starting point that differs between probes, so one Atlas measurement
  covers the whole sweep;
* the reply echoes identifier, sequence number and data exactly: Atlas
  probes discard a reply whose payload is not the one they sent.

Re-used sequence numbers. The probe firmware (``eperd/ping.c``) moves to the
next sequence number only when a reply arrives, or on a timeout before the
run's first reply; after a first reply, a lost reply makes the next echo
request *re-use* the sequence number. Such a re-send is a new request (its
data differ: they start with the probe's send time) and is answered as one:
with the next split of the sweep, so a split the path drops never holds the
probe's sweep on itself, and logged with ``attempt`` 1, 2, ... (0 for the
first request with that sequence number). A byte-identical copy of a request
already answered (the network duplicated it) is not a new request: it gets
the same split again and is logged with ``duplicate`` set. The state is kept
per *stream* (requester address, target address, ICMP id, request length):
one probe's concurrent measurements share its ICMP id but never a target and
size.

The server must never become a flood cannon, whatever arrives (ARCHITECTURE.md,
"The server is not a flood cannon"):

* a reply datagram is never larger than its request (the echo data is the
  request's, byte for byte; a split reply carries exactly the request's
  1500 bytes, plus the one IP header its second fragment needs);
* replies per second are capped per requester address, per /24 and in total
  (token buckets, as the probe engine's pacer); a request over a cap is not
  answered, so it reads as a lost *request* in the results, never as a lost
  reply;
* only the configured addresses are answered, and never a request from a
  source that cannot be a real requester (unspecified, loopback, multicast,
  broadcast, ourselves).
"""

from __future__ import annotations

import hashlib
import secrets
import socket
import struct
import sys
from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from kickass_core.pacing import TokenBucket
from kickass_core.plan import SPLIT, WHOLE
from kickass_core.rate import FULL_PACKET_LEN, IPV4_HEADER_LEN

ICMP_ECHO_REPLY = 0
ICMP_ECHO_REQUEST = 8
ICMP_HEADER_LEN = 8
IPPROTO_ICMP = 1
_MF = 0x2000
_OFFSET_MASK = 0x1FFF
_IP_HDR = struct.Struct("!BBHHHBBH4s4s")
REPLY_TTL = 64
# Buckets of requesters that went quiet are forgotten this often (a full
# bucket is the same as a new one), so memory follows current traffic only.
SWEEP_INTERVAL_S = 10.0
# More requesters than this at once (a spoofed-source flood): new ones are
# refused until the sweep frees buckets; the global cap holds regardless.
MAX_TRACKED = 200_000
# Requests remembered per stream to recognise a duplicated one: the network
# delivers a copy within milliseconds, before the probe's next request.
RECENT_REQUESTS = 3

# Reasons a request got no reply, named once (the stats and the tests use them).
NOT_IPV4 = "not_ipv4"
MALFORMED = "malformed"
FRAGMENT = "fragment"
NOT_OUR_ADDRESS = "not_our_address"
BAD_SOURCE = "bad_source"
NOT_ECHO = "not_echo"
BAD_CHECKSUM = "bad_checksum"
SIZE_NOT_PLANNED = "size_not_planned"
RATE_LIMITED_ADDRESS = "rate_limited_address"
RATE_LIMITED_PREFIX = "rate_limited_prefix"
RATE_LIMITED_GLOBAL = "rate_limited_global"
TOO_MANY_REQUESTERS = "too_many_requesters"
_ANSWERED = {WHOLE: "answered_whole", SPLIT: "answered_split"}


@dataclass(frozen=True)
class ResponderConfig:
    whole_addresses: frozenset[str]
    split_addresses: frozenset[str]
    splits: tuple[int, ...]  # leading fragment IP lengths of the split sweep
    pps_per_address: float = 50.0
    pps_per_prefix: float = 500.0
    pps_global: float = 5000.0
    max_tracked: int = MAX_TRACKED
    # Keys the starting split per probe; random unless a test fixes it.
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(16))

    def __post_init__(self) -> None:
        if not (self.whole_addresses or self.split_addresses):
            raise ValueError("the responder needs at least one address to answer on")
        if self.split_addresses and not self.splits:
            raise ValueError("a split address needs a split sweep")
        for lead in self.splits:
            if (
                not IPV4_HEADER_LEN + 8 <= lead <= FULL_PACKET_LEN - 8
                or (lead - IPV4_HEADER_LEN) % 8
            ):
                raise ValueError(f"leading fragment IP length {lead} cannot cut a 1500-byte reply")


@dataclass(frozen=True, slots=True)
class ReplyRecord:
    """One reply sent: a row of the reply log the Atlas results are joined to."""

    reply_no: int  # per responder run, from 0: the log's idempotency key
    responder_address: str
    dst_address: str  # the requester (a NAT's public address for a probe behind one)
    icmp_id: int
    icmp_seq: int
    request_len: int  # IP length of the echo request
    phase: str  # whole | split
    ip_len: int  # whole: the reply's IP length; split: the leading fragment's
    sent_at: float  # the `now` it was answered at (unix seconds)
    attempt: int = 0  # re-sends of this sequence number before it (that reached us)
    duplicate: bool = False  # a byte-identical copy of a request already answered


@dataclass(frozen=True, slots=True)
class Reply:
    dst: str
    packets: tuple[bytes, ...]  # IP packets, in sending order (leading fragment first)
    record: ReplyRecord


def _be_sum(data: bytes) -> int:
    words = array("H", data)
    if sys.byteorder == "little":
        words.byteswap()
    return sum(words)


def _fold(s: int) -> int:
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return s


def internet_checksum(data: bytes) -> int:
    """RFC 1071 over ``data`` (odd lengths padded with a zero byte)."""
    if len(data) % 2:
        data += b"\0"
    return (~_fold(_be_sum(data))) & 0xFFFF


def echo_reply_checksum(request_checksum: int) -> int:
    """The reply's ICMP checksum from the request's (RFC 1624 eqn. 3): only the
    type/code word changes, 0x0800 -> 0x0000, so nothing else is summed again."""
    s = ((~request_checksum) & 0xFFFF) + ((~0x0800) & 0xFFFF)
    return (~_fold(s)) & 0xFFFF


def _bad_source(src: bytes, dst: bytes) -> bool:
    first = src[0]
    return (
        first == 0  # "this network"
        or first == 127  # loopback
        or first >= 224  # multicast, reserved, broadcast
        or src == dst
    )


class ResponderCore:
    def __init__(self, config: ResponderConfig, now: float, first_ip_id: int | None = None) -> None:
        self.config = config
        self._whole = {socket.inet_aton(a) for a in config.whole_addresses}
        self._split = {socket.inet_aton(a) for a in config.split_addresses}
        self._ours = self._whole | self._split
        self._global = TokenBucket(config.pps_global, now)
        self._by_address: dict[bytes, TokenBucket] = {}
        self._by_prefix: dict[bytes, TokenBucket] = {}
        self._next_sweep = now + SWEEP_INTERVAL_S
        # Per stream (requester, target, ICMP id, request length), oldest
        # first for eviction: where it is in the split sweep, its last sequence
        # number and attempt, and its last few requests (duplicates).
        self._streams: OrderedDict[bytes, _Stream] = OrderedDict()
        self._ip_id = secrets.randbelow(1 << 16) if first_ip_id is None else first_ip_id
        self.replies = 0
        self.stats: Counter[str] = Counter()

    # -- the one entry point ---------------------------------------------------

    def on_request(self, now: float, datagram: bytes) -> Reply | None:
        """A received IPv4 datagram (header included, as a raw socket reads it)."""
        reason = self._check(datagram)
        if reason is not None:
            self.stats[reason] += 1
            return None
        ihl = (datagram[0] & 0x0F) * 4
        total = len(datagram)
        src, dst = datagram[12:16], datagram[16:20]
        if dst in self._split and total == FULL_PACKET_LEN and ihl == IPV4_HEADER_LEN:
            phase = SPLIT
        elif dst in self._whole and total <= FULL_PACKET_LEN:
            phase = WHOLE
        else:
            self.stats[SIZE_NOT_PLANNED] += 1
            return None
        if now >= self._next_sweep:
            self.sweep(now)
        refused = self._take_tokens(src, now)
        if refused is not None:
            self.stats[refused] += 1
            return None

        icmp = datagram[ihl:]
        (request_checksum,) = struct.unpack_from("!H", icmp, 2)
        reply_icmp = b"\0\0" + struct.pack("!H", echo_reply_checksum(request_checksum)) + icmp[4:]
        icmp_id, icmp_seq = struct.unpack_from("!HH", icmp, 4)
        tos = datagram[1]
        attempt, duplicate, split_index = self._track(src, dst, icmp_id, icmp_seq, total, icmp)
        packets: tuple[bytes, ...]
        if phase == SPLIT:
            lead = self.config.splits[split_index]
            packets = self._split_packets(tos, dst, src, reply_icmp, lead)
            ip_len = lead
        else:
            packets = (
                self._ip_header(tos, IPV4_HEADER_LEN + len(reply_icmp), 0, dst, src) + reply_icmp,
            )
            ip_len = IPV4_HEADER_LEN + len(reply_icmp)
        # The promise, checked on every reply: the reply datagram (the sum of
        # its fragments' payloads plus one header) is never larger than the request.
        datagram_len = IPV4_HEADER_LEN + len(reply_icmp)
        if datagram_len > total:  # pragma: no cover - a bug, never an input
            raise AssertionError(f"reply of {datagram_len} bytes to a {total}-byte request")
        record = ReplyRecord(
            reply_no=self.replies,
            responder_address=socket.inet_ntoa(dst),
            dst_address=socket.inet_ntoa(src),
            icmp_id=icmp_id,
            icmp_seq=icmp_seq,
            request_len=total,
            phase=phase,
            ip_len=ip_len,
            sent_at=now,
            attempt=attempt,
            duplicate=duplicate,
        )
        self.replies += 1
        self.stats[_ANSWERED[phase]] += 1
        return Reply(record.dst_address, packets, record)

    def not_sent(self, reply: Reply) -> None:
        """The shell could not put ``reply`` on the wire (socket buffer full):
        it is not logged, so it reads as an unanswered request."""
        self.stats[_ANSWERED[reply.record.phase]] -= 1
        self.stats["send_failed"] += 1

    # -- checks ------------------------------------------------------------------

    def _check(self, d: bytes) -> str | None:
        n = len(d)
        if n < IPV4_HEADER_LEN + ICMP_HEADER_LEN:
            return MALFORMED
        if d[0] >> 4 != 4:
            return NOT_IPV4
        ihl = (d[0] & 0x0F) * 4
        (total,) = struct.unpack_from("!H", d, 2)
        if ihl < IPV4_HEADER_LEN or total != n or n < ihl + ICMP_HEADER_LEN:
            return MALFORMED
        (frag,) = struct.unpack_from("!H", d, 6)
        if frag & (_MF | _OFFSET_MASK):
            # A raw socket reads datagrams after reassembly: a fragment here
            # was not meant for us.
            return FRAGMENT
        if d[9] != IPPROTO_ICMP:
            return NOT_ECHO
        if d[16:20] not in self._ours:
            return NOT_OUR_ADDRESS
        if _bad_source(d[12:16], d[16:20]):
            return BAD_SOURCE
        if d[ihl] != ICMP_ECHO_REQUEST or d[ihl + 1] != 0:
            return NOT_ECHO
        if _fold(_be_sum(d[ihl:] if (n - ihl) % 2 == 0 else d[ihl:] + b"\0")) != 0xFFFF:
            return BAD_CHECKSUM
        return None

    def _take_tokens(self, src: bytes, now: float) -> str | None:
        """One token from the requester's, its /24's and the global bucket, or
        none at all (the first empty one names the refusal)."""
        prefix = src[:3]
        a = self._by_address.get(src)
        p = self._by_prefix.get(prefix)
        if (a is None or p is None) and len(self._by_address) >= self.config.max_tracked:
            return TOO_MANY_REQUESTERS
        if a is None:
            a = self._by_address[src] = TokenBucket(self.config.pps_per_address, now)
        if p is None:
            p = self._by_prefix[prefix] = TokenBucket(self.config.pps_per_prefix, now)
        for bucket, refusal in (
            (a, RATE_LIMITED_ADDRESS),
            (p, RATE_LIMITED_PREFIX),
            (self._global, RATE_LIMITED_GLOBAL),
        ):
            bucket.refill(now)
            if not bucket.has_token():
                return refusal
        a.tokens -= 1.0
        p.tokens -= 1.0
        self._global.tokens -= 1.0
        return None

    def sweep(self, now: float) -> None:
        """Forget requesters' buckets that refilled (they behave like new ones)."""
        for table in (self._by_address, self._by_prefix):
            for key in [k for k, b in table.items() if _full(b, now)]:
                del table[key]
        self._next_sweep = now + SWEEP_INTERVAL_S

    def tracked(self) -> int:
        """Buckets held (for leak tests and stats)."""
        return len(self._by_address) + len(self._by_prefix)

    # -- building replies ----------------------------------------------------------

    def _track(
        self, src: bytes, dst: bytes, icmp_id: int, icmp_seq: int, total: int, icmp: bytes
    ) -> tuple[int, bool, int]:
        """(attempt, duplicate, split index) of this request in its stream."""
        key = src + dst + struct.pack("!HH", icmp_id, total)
        stream = self._streams.get(key)
        if stream is None:
            # Where in the sweep a probe starts: keyed, so probes start apart
            # and nobody outside can steer a probe onto a chosen split.
            digest = hashlib.blake2b(
                src + icmp_id.to_bytes(2, "big"), key=self.config.secret[:64], digest_size=4
            ).digest()
            n = max(1, len(self.config.splits))
            stream = self._streams[key] = _Stream(int.from_bytes(digest, "big") % n)
            if len(self._streams) > self.config.max_tracked:
                self._streams.popitem(last=False)
        else:
            self._streams.move_to_end(key)
        data = hash(icmp[8:])
        for seq, seen, attempt, split_index in stream.recent:
            if seq == icmp_seq and seen == data:
                return attempt, True, split_index
        attempt = stream.attempt + 1 if icmp_seq == stream.last_seq else 0
        split_index = stream.next_split
        if self.config.splits:
            stream.next_split = (split_index + 1) % len(self.config.splits)
        stream.last_seq, stream.attempt = icmp_seq, attempt
        stream.recent.append((icmp_seq, data, attempt, split_index))
        if len(stream.recent) > RECENT_REQUESTS:
            del stream.recent[0]
        return attempt, False, split_index

    def _next_ip_id(self) -> int:
        self._ip_id = (self._ip_id + 1) & 0xFFFF
        return self._ip_id

    def _ip_header(
        self, tos: int, total: int, frag: int, src: bytes, dst: bytes, ip_id: int | None = None
    ) -> bytes:
        ip_id = self._next_ip_id() if ip_id is None else ip_id
        # The header checksum from its 16-bit words directly: cheaper per
        # reply than packing twice and summing an array.
        a, b = int.from_bytes(src, "big"), int.from_bytes(dst, "big")
        s = (
            (0x4500 | tos) + total + ip_id + frag + (REPLY_TTL << 8 | IPPROTO_ICMP)
            + (a >> 16) + (a & 0xFFFF) + (b >> 16) + (b & 0xFFFF)
        )  # fmt: skip
        s = (s & 0xFFFF) + (s >> 16)
        s = (s & 0xFFFF) + (s >> 16)
        return _IP_HDR.pack(
            0x45, tos, total, ip_id, frag, REPLY_TTL, IPPROTO_ICMP, ~s & 0xFFFF, src, dst
        )

    def _split_packets(
        self, tos: int, src: bytes, dst: bytes, icmp: bytes, lead: int
    ) -> tuple[bytes, bytes]:
        """The reply cut as Linux ip_do_fragment cuts: header copied, one IP id,
        offset in 8-byte units, MF on the leading fragment only."""
        cut = lead - IPV4_HEADER_LEN
        ip_id = self._next_ip_id()
        first = self._ip_header(tos, lead, _MF, src, dst, ip_id) + icmp[:cut]
        rest = icmp[cut:]
        second = self._ip_header(tos, IPV4_HEADER_LEN + len(rest), cut // 8, src, dst, ip_id) + rest
        return first, second


class _Stream:
    """One probe's requests to one target and size (see the module doc)."""

    __slots__ = ("attempt", "last_seq", "next_split", "recent")

    def __init__(self, first_split: int) -> None:
        self.next_split = first_split
        self.last_seq = -1
        self.attempt = 0
        # (sequence, hash of the ICMP data, attempt, split index) of the last
        # few requests: a duplicate arrives right after its original.
        self.recent: list[tuple[int, int, int, int]] = []


def _full(bucket: TokenBucket, now: float) -> bool:
    bucket.refill(now)
    return bucket.tokens >= bucket.burst
