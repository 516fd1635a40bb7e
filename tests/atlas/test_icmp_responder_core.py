"""The ICMP responder's sans-IO core on simulated time: what it answers, how
(byte-exact echoes, splits as Linux cuts them), and what it refuses — forged,
malformed or over the per-address, per-/24 and global caps."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kickass_atlas import responder_core as rc
from kickass_atlas.responder_core import (
    ResponderConfig,
    ResponderCore,
    echo_reply_checksum,
    internet_checksum,
)
from kickass_core.plan import split_leading_ip_lens
from scapy.layers.inet import ICMP, IP, defragment
from scapy.packet import Raw

WHOLE, SPLIT = "198.18.80.10", "198.18.80.11"
PROBE = "198.18.81.7"
SPLITS = tuple(split_leading_ip_lens(64))  # 44, 108, ..., 1452: 23 splits


def core(**kw: object) -> ResponderCore:
    cfg = {
        "whole_addresses": frozenset({WHOLE}),
        "split_addresses": frozenset({SPLIT}),
        "splits": SPLITS,
        "pps_per_address": 1000.0,
        "pps_per_prefix": 10000.0,
        "pps_global": 100000.0,
        "secret": b"fixed-for-tests!",
    }
    cfg.update(kw)
    return ResponderCore(ResponderConfig(**cfg), now=0.0, first_ip_id=100)  # type: ignore[arg-type]


def request(
    dst: str = WHOLE,
    ip_len: int = 84,
    icmp_id: int = 0x1234,
    seq: int = 1,
    src: str = PROBE,
    sent_ns: int = 1_000_000_000,
) -> bytes:
    """An echo request as a 64-bit Atlas probe sends it (struct evdata in
    ping.c): its monotonic send time (timespec, host order), the
    measurement's index, an 8-byte cookie, padding; zeros after."""
    record = struct.pack("<qqI8s4x", sent_ns // 10**9, sent_ns % 10**9, 3, b"cookie!!")
    data = (record + bytes(max(0, ip_len - 28 - len(record))))[: ip_len - 28]
    return bytes(IP(src=src, dst=dst, id=7, ttl=55) / ICMP(type=8, id=icmp_id, seq=seq) / Raw(data))


def test_whole_reply_echoes_everything_exactly() -> None:
    c = core()
    req = request(ip_len=1500)
    reply = c.on_request(5.0, req)
    assert reply is not None and len(reply.packets) == 1
    pkt = IP(reply.packets[0])
    asked = IP(req)
    assert (pkt.src, pkt.dst, pkt.len, pkt.flags, pkt.frag) == (WHOLE, PROBE, 1500, 0, 0)
    assert pkt[ICMP].type == 0 and pkt[ICMP].code == 0
    assert (pkt[ICMP].id, pkt[ICMP].seq) == (asked[ICMP].id, asked[ICMP].seq)
    assert bytes(pkt[ICMP].payload) == bytes(asked[ICMP].payload)
    # Both checksums are right (scapy recomputes them when the field is deleted).
    for layer in (IP, ICMP):
        given_sum = pkt[layer].chksum
        fresh = IP(reply.packets[0])
        del fresh[layer].chksum
        assert IP(bytes(fresh))[layer].chksum == given_sum
    r = reply.record
    assert (r.reply_no, r.responder_address, r.dst_address, r.icmp_id, r.icmp_seq) == (
        0, WHOLE, PROBE, 0x1234, 1,
    )  # fmt: skip
    assert (r.request_len, r.phase, r.ip_len, r.sent_at) == (1500, "whole", 1500, 5.0)


def test_split_reply_is_the_request_cut_at_a_leading_fragment_length() -> None:
    c = core()
    req = request(dst=SPLIT, ip_len=1500)
    reply = c.on_request(1.0, req)
    assert reply is not None and len(reply.packets) == 2
    lead, rest = (IP(p) for p in reply.packets)
    leading_len = reply.record.ip_len
    assert leading_len in SPLITS and reply.record.phase == "split"
    # As Linux ip_do_fragment cuts: same id, MF on the first, offset in 8-byte units.
    assert lead.len == leading_len and lead.flags == "MF" and lead.frag == 0
    assert rest.flags == 0 and rest.frag * 8 == leading_len - 20 and lead.id == rest.id
    assert lead.len + rest.len - 20 == 1500
    whole = IP(bytes(defragment([lead, rest])[0]))
    assert whole[ICMP].type == 0 and bytes(whole[ICMP].payload) == bytes(IP(req)[ICMP].payload)
    icmp = bytes(whole)[20:]
    assert internet_checksum(icmp) == 0  # the reassembled reply's ICMP checksum holds


def test_one_ping_covers_the_split_sweep_and_probes_start_apart() -> None:
    c = core()
    seen = [
        c.on_request(i, request(dst=SPLIT, ip_len=1500, seq=i)).record.ip_len for i in range(23)
    ]
    assert sorted(seen) == sorted(SPLITS)  # every split exactly once per sweep
    other = [
        c.on_request(30 + i, request(dst=SPLIT, ip_len=1500, seq=i, icmp_id=0x9999)).record.ip_len
        for i in range(3)
    ]
    assert other[0] != seen[0] or other[1] != seen[1]  # another probe, another start
    # A duplicated request (a byte-identical copy) is answered with the same split.
    a = c.on_request(60, request(dst=SPLIT, ip_len=1500, seq=40))
    b = c.on_request(60.001, request(dst=SPLIT, ip_len=1500, seq=40))
    assert a is not None and b is not None and a.record.ip_len == b.record.ip_len
    assert (a.record.duplicate, b.record.duplicate) == (False, True)
    assert a.record.attempt == b.record.attempt == 0


def test_a_reused_sequence_number_is_a_new_request_with_the_next_split() -> None:
    """After a first reply the firmware re-sends a sequence number until a
    reply comes (ping.c): each re-send has new data (its send time) and gets
    the next split, so a split the path drops never stalls the sweep."""
    c = core()
    first = c.on_request(0, request(dst=SPLIT, ip_len=1500, seq=1, sent_ns=0))
    assert first is not None and first.record.attempt == 0
    splits, attempts = [], []
    for k in range(len(SPLITS)):  # seq 2, its reply lost every time
        reply = c.on_request(1 + k, request(dst=SPLIT, ip_len=1500, seq=2, sent_ns=(1 + k) * 10**9))
        assert reply is not None and not reply.record.duplicate
        splits.append(reply.record.ip_len)
        attempts.append(reply.record.attempt)
    assert attempts == list(range(len(SPLITS)))
    assert len(set(splits)) == len(SPLITS)  # every split once: the sweep moved on
    # A copy of the last re-send is a duplicate of it, not attempt 23.
    copy = c.on_request(24, request(dst=SPLIT, ip_len=1500, seq=2, sent_ns=len(SPLITS) * 10**9))
    assert copy is not None and copy.record.duplicate
    assert (copy.record.attempt, copy.record.ip_len) == (attempts[-1], splits[-1])
    # The next sequence number starts again at attempt 0.
    nxt = c.on_request(25, request(dst=SPLIT, ip_len=1500, seq=3, sent_ns=25 * 10**9))
    assert nxt is not None and nxt.record.attempt == 0 and not nxt.record.duplicate


def test_a_probes_measurements_are_separate_streams() -> None:
    """One probe's concurrent pings share its ICMP id (one pid in eperd) and
    often their sequence numbers: another target or size is another stream,
    never a re-send."""
    c = core()
    records = [
        c.on_request(t, request(dst=dst, ip_len=ip_len, seq=1, sent_ns=t * 10**9))
        for t, (dst, ip_len) in enumerate(
            [(SPLIT, 1500), (WHOLE, 100), (WHOLE, 1000), (WHOLE, 1500)]
        )
    ]
    assert all(r is not None and r.record.attempt == 0 for r in records)
    assert not any(r.record.duplicate for r in records if r is not None)


def test_shared_address_answers_1500_split_and_other_sizes_whole() -> None:
    c = core(whole_addresses=frozenset({WHOLE}), split_addresses=frozenset({WHOLE}))
    assert c.on_request(0, request(ip_len=1500)).record.phase == "split"
    assert c.on_request(0, request(ip_len=1000)).record.phase == "whole"


@pytest.mark.parametrize(
    ("packet", "reason"),
    [
        (request(dst="198.18.80.99"), rc.NOT_OUR_ADDRESS),
        (request(dst=SPLIT, ip_len=1000), rc.SIZE_NOT_PLANNED),
        (request(src="127.0.0.1"), rc.BAD_SOURCE),
        (request(src="224.0.0.5"), rc.BAD_SOURCE),
        (request(src="0.0.0.0"), rc.BAD_SOURCE),
        (request(src=WHOLE), rc.BAD_SOURCE),
        (bytes(IP(src=PROBE, dst=WHOLE) / ICMP(type=0) / Raw(b"x" * 20)), rc.NOT_ECHO),
        (bytes(IP(src=PROBE, dst=WHOLE) / ICMP(type=13)), rc.NOT_ECHO),
        (bytes(IP(src=PROBE, dst=WHOLE, flags="MF") / ICMP() / Raw(b"y" * 32)), rc.FRAGMENT),
        (request()[:-1], rc.MALFORMED),  # the IP length no longer matches
        (b"\x45" + bytes(10), rc.MALFORMED),
        (b"\x60" + bytes(60), rc.NOT_IPV4),
    ],
    ids=[
        "other-address",
        "size-not-planned",
        "loopback",
        "multicast",
        "unspecified",
        "ourselves",
        "echo-reply",
        "timestamp",
        "fragment",
        "truncated",
        "short",
        "ipv6",
    ],
)
def test_refusals(packet: bytes, reason: str) -> None:
    c = core()
    assert c.on_request(0.0, packet) is None
    assert c.stats[reason] == 1 and c.replies == 0


def test_bad_icmp_checksum_is_refused() -> None:
    req = bytearray(request())
    req[-1] ^= 0xFF  # data changed, IP header still valid
    c = core()
    assert c.on_request(0.0, bytes(req)) is None and c.stats[rc.BAD_CHECKSUM] == 1


@settings(max_examples=500, deadline=None)
@given(st.integers(0, 0xFFFF))
def test_incremental_checksum_equals_a_full_one(checksum: int) -> None:
    # Any request checksum: flipping type 8 -> 0 in the sum is what RFC 1624 says.
    body = struct.pack("!BBHHH", 8, 0, 0, 0x1234, 7) + b"payload!"
    body = body[:2] + struct.pack("!H", internet_checksum(body)) + body[4:]
    reply = b"\0\0" + struct.pack("!H", echo_reply_checksum(struct.unpack("!H", body[2:4])[0]))
    assert internet_checksum(reply + body[4:]) == 0
    del checksum


@settings(max_examples=400, deadline=None)
@given(
    raw=st.binary(min_size=0, max_size=1600),
    ip_len=st.integers(28, 1500),
    dst=st.sampled_from([WHOLE, SPLIT]),
    options=st.booleans(),
    mutate=st.integers(0, 1600),
)
def test_no_reply_is_ever_larger_than_its_request(
    raw: bytes, ip_len: int, dst: str, options: bool, mutate: int
) -> None:
    """Forged or garbled requests, real or random bytes: any reply datagram is
    at most the request's size and carries the request's ICMP bytes exactly."""
    c = core()
    if options:
        pkt = IP(src=PROBE, dst=dst, options=[b"\x01\x01\x01\x00"]) / ICMP(id=1, seq=2)
        req = bytes(pkt / Raw(bytes(max(0, ip_len - 32))))
    else:
        req = request(dst=dst, ip_len=ip_len)
    for candidate in (req, raw, req[:mutate] + raw[: max(0, len(req) - mutate)]):
        reply = c.on_request(0.0, candidate)
        if reply is None:
            continue
        frags = [IP(p) for p in reply.packets]
        datagram = sum(f.len - 20 for f in frags) + 20
        assert datagram <= len(candidate)
        ihl = (candidate[0] & 0x0F) * 4
        icmp = b"".join(p[20:] for p in reply.packets)
        assert icmp[4:] == candidate[ihl + 4 :]
        assert all(len(p) <= 1500 for p in reply.packets)


def flood(c: ResponderCore, sources: list[str], rate: float, seconds: float) -> int:
    """Requests from ``sources`` in turn at ``rate`` per second; replies given."""
    packets = [request(src=src) for src in sources]  # built once: scapy is slow
    answered = 0
    for i in range(int(rate * seconds)):
        if c.on_request(i / rate, packets[i % len(packets)]) is not None:
            answered += 1
    return answered


def test_one_address_is_capped_at_its_rate() -> None:
    c = core(pps_per_address=50.0)
    answered = flood(c, [PROBE], rate=2000, seconds=4)
    # 50/s for 4 s plus the bucket's burst (a tenth of a second's worth, at least 1).
    assert 200 <= answered <= 200 + 5 + 1
    assert c.stats[rc.RATE_LIMITED_ADDRESS] == 8000 - answered


def test_a_slash_24_is_capped_at_its_rate() -> None:
    c = core(pps_per_address=50.0, pps_per_prefix=400.0)
    sources = [f"198.18.99.{i}" for i in range(1, 255)]
    answered = flood(c, sources, rate=5000, seconds=3)
    assert 1200 <= answered <= 1200 + 40 + 1
    assert c.stats[rc.RATE_LIMITED_PREFIX] > 0


def test_the_global_cap_holds_across_prefixes() -> None:
    c = core(pps_per_address=50.0, pps_per_prefix=400.0, pps_global=1000.0)
    sources = [f"198.18.{p}.{h}" for p in range(100, 140) for h in (1, 2, 3, 4)]
    answered = flood(c, sources, rate=8000, seconds=2)
    assert 2000 <= answered <= 2000 + 100 + 1
    assert c.stats[rc.RATE_LIMITED_GLOBAL] > 0


def test_requester_state_is_forgotten_when_quiet_and_bounded_under_spoofing() -> None:
    c = core(max_tracked=100)
    for i in range(300):
        c.on_request(0.001 * i, request(src=f"198.18.{100 + i // 250}.{1 + i % 250}"))
    assert c.stats[rc.TOO_MANY_REQUESTERS] == 200 and c.replies == 100
    c.on_request(rc.SWEEP_INTERVAL_S + 5, request())  # the sweep forgets the refilled buckets
    assert c.tracked() == 2  # only the last requester's address and /24


def test_the_shell_refuses_an_address_the_host_does_not_have() -> None:
    from kickass_atlas.responder import check_addresses, nft_ruleset
    from kickass_core.errors import KickassError

    with pytest.raises(KickassError, match="192.0.2.99 is not an address of this host"):
        check_addresses(["127.0.0.1", "192.0.2.99"])
    # The kernel switch names exactly the responder's addresses and spares our mark.
    rules = nft_ruleset([SPLIT, WHOLE, WHOLE])
    assert f"ip saddr {{ {WHOLE}, {SPLIT} }} icmp type echo-reply meta mark != 0x4b41" in rules
    assert rules.startswith("table inet kickass_icmp_responder {}\ndelete table")
