"""The client's reassembly budget and fragment observer, without a network
(issue 11): /proc parsing, credits, refused-fragment ranges, the REPORT the
session sends, and the privileged observer's bookkeeping."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from kickass_core import wire
from kickass_core.plan import ProbePlan
from kickass_probe.observe import FragmentObserver, bpf_filter
from kickass_probe.reassembly import (
    BUDGET_FRACTION,
    DEFAULT_COST,
    MIN_COST,
    REPORT_INTERVAL_S,
    TRICKLE_AFTER_TIMES,
    Limits,
    ReassemblyBudget,
    Sample,
    credits_for,
    parse_proc_table,
    parse_sockstat_frag,
    read_limits,
    read_sample,
    refused_between,
)
from kickass_probe.session import ProbeSession
from kickass_server.client_report import parse_observations

SNMP = """Ip: Forwarding DefaultTTL InReceives ReasmTimeout ReasmReqds ReasmOKs ReasmFails FragOKs
Ip: 2 64 2788821 3 629240 314620 5 0
Icmp: InMsgs InErrors
Icmp: 1 0
"""
NETSTAT = """TcpExt: SyncookiesSent
TcpExt: 0
IpExt: InNoRoutes InTruncatedPkts ReasmOverlaps
IpExt: 0 0 2
"""
SOCKSTAT = """sockets: used 5
TCP: inuse 0 orphan 0 tw 0 alloc 0 mem 0
FRAG: inuse 100 memory 250400
"""
LIMITS = Limits(high_thresh=4 << 20, low_thresh=3 << 20, time_s=30)
MB = 1 << 20


def test_proc_parsers() -> None:
    ip = parse_proc_table(SNMP, "Ip")
    assert (ip["ReasmReqds"], ip["ReasmOKs"], ip["ReasmFails"], ip["ReasmTimeout"]) == (
        629240, 314620, 5, 3,
    )  # fmt: skip
    assert parse_proc_table(NETSTAT, "IpExt")["ReasmOverlaps"] == 2
    assert parse_sockstat_frag(SOCKSTAT) == (100, 250400)
    assert parse_sockstat_frag("nothing") == (None, None)
    files = {
        "/proc/net/snmp": SNMP,
        "/proc/net/netstat": NETSTAT,
        "/proc/net/sockstat": SOCKSTAT,
        "/proc/sys/net/ipv4/ipfrag_high_thresh": "4194304\n",
        "/proc/sys/net/ipv4/ipfrag_low_thresh": "3145728\n",
        "/proc/sys/net/ipv4/ipfrag_time": "30\n",
    }
    s = read_sample(1.0, files.get)
    assert (s.fails, s.timeouts, s.overlaps, s.memory, s.queues) == (5, 3, 2, 250400, 100)
    assert read_limits(files.get) == LIMITS
    # Elsewhere (no /proc): everything unknown, nothing raised.
    assert read_sample(1.0, lambda _p: None) == Sample(at=1.0)
    assert read_limits(lambda _p: None) == Limits()


def test_this_machine_has_the_counters() -> None:
    s = read_sample(0.0)
    assert s.fails is not None and s.memory is not None and s.timeouts is not None
    assert read_limits().high_thresh


def test_refused_leaves_out_timeouts_and_overlaps() -> None:
    a = Sample(0.0, fails=10, timeouts=4, overlaps=1)
    b = Sample(1.0, fails=30, timeouts=9, overlaps=3)  # +20 fails: 5 timeouts, 2 overlaps
    assert refused_between(a, b) == 13
    assert refused_between(a, Sample(1.0, fails=14, timeouts=8, overlaps=1)) == 0
    assert refused_between(Sample(0.0), b) == 0


def budget(**kw: object) -> ReassemblyBudget:
    defaults: dict = {
        "limits": LIMITS,
        "first_split_seq": 1000,
        "total_probes": 5000,
        "window": 8,
        "start": Sample(0.0, fails=0, timeouts=0, overlaps=0, memory=0, queues=0),
    }
    return ReassemblyBudget(**{**defaults, **kw})


def test_credits_are_the_free_half_of_the_memory() -> None:
    b = budget()
    half = BUDGET_FRACTION * 4 * MB
    assert b.initial_credit() == int(half // DEFAULT_COST) == credits_for(LIMITS, 0)
    assert b.split_limit == 1000 + b.initial_credit()
    # Memory in use: 1 MB over 400 queues (2.6 kB each): cost learnt.
    b.on_sample(Sample(1.0, fails=0, timeouts=0, memory=MB, queues=400), highest_seq=1200)
    assert b.learnt_cost and b.cost == pytest.approx(MB / 400)
    assert b.credits == int((half - MB) // (MB / 400))
    assert b.split_limit == 1201 + b.credits
    # The budget full: no credit; the limit stops at the next seq.
    b.on_sample(Sample(2.0, fails=0, timeouts=0, memory=int(half), queues=800), highest_seq=1300)
    assert b.credits == 0 and b.split_limit == 1301
    # Small leftovers never make the cost below MIN_COST.
    c = budget()
    c.on_sample(Sample(1.0, fails=0, timeouts=0, memory=16 * 500, queues=500), highest_seq=10)
    assert c.cost == MIN_COST


def test_memory_held_by_others_for_long_gets_a_trickle() -> None:
    b = budget()
    t = 1.0
    b.on_sample(Sample(t, fails=0, timeouts=0, memory=3 * MB, queues=1000), 1500)
    assert b.credits == 0
    while t < TRICKLE_AFTER_TIMES * 30 + 3:
        t += 1.0
        b.on_sample(Sample(t, fails=0, timeouts=0, memory=3 * MB, queues=1000), 1500)
    assert b.credits == 1 and b.counters.trickle_grants >= 1
    b.finish(t)
    assert b.counters.zero_credit_s >= TRICKLE_AFTER_TIMES * 30


def test_refusals_make_invalid_ranges_closed_by_the_next_arrival() -> None:
    b = budget(window=8)
    b.on_sample(Sample(1.0, fails=0, timeouts=0, overlaps=0), 1100, lowest_since=1090)
    # Refused 2 between the samples: from the highest seq received before
    # (less a window of reordering) on, the range is open.
    assert b.on_sample(Sample(2.0, fails=3, timeouts=1, overlaps=0), 1150, lowest_since=1101) == []
    assert b.counters.refused == 2 and b.invalid_ranges == []
    # Still refusing, then nothing arrives (no credit: the server waits).
    b.on_sample(Sample(3.0, fails=5, timeouts=1, overlaps=0), 1150, lowest_since=None)
    b.on_sample(Sample(4.0, fails=5, timeouts=1, overlaps=0), 1150, lowest_since=1151)
    b.on_sample(Sample(30.0, fails=5, timeouts=1, overlaps=0), 1150, lowest_since=None)
    assert b.invalid_ranges == []
    # The first probe after the refusals closes it, a window beyond it.
    assert b.on_sample(Sample(31.0, fails=5, timeouts=1, overlaps=0), 1400, lowest_since=1380) == [
        (1101 - 8, 1380 + 8)
    ]
    assert b.invalid_ranges == [(1093, 1388)]
    # Only timeouts: nothing.
    b.on_sample(Sample(32.0, fails=9, timeouts=5, overlaps=0), 1500, lowest_since=1401)
    assert len(b.invalid_ranges) == 1 and b.counters.refused == 4
    # Refusals at the very end are closed by finish(), to the end of the plan.
    b.on_sample(Sample(33.0, fails=12, timeouts=5, overlaps=0), 1600, lowest_since=1501)
    b.finish(34.0)
    assert b.invalid_ranges[-1] == (1500 + 1 - 8, 5000)
    s = b.summary(after=Sample(35.0, fails=12))
    assert s["during"]["refused"] == 7 and s["invalid_ranges"] == 2 and s["after"]["fails"] == 12


def test_without_the_memory_figure_missing_splits_count() -> None:
    b = budget(start=Sample(0.0))
    b.on_sample(Sample(1.0), highest_seq=1200, missing_splits=100)
    assert b.credits == credits_for(LIMITS, 100 * DEFAULT_COST)
    # ipfrag_time later those leftovers have expired.
    b.on_sample(Sample(40.0), highest_seq=1300, missing_splits=100)
    assert b.credits == credits_for(LIMITS, 0)


def test_in_flight_the_limit_is_the_first_split_plus_the_credits() -> None:
    """IN_FLIGHT (issue 16): the REPORT's limit counts splits the server may
    have in flight, wherever the splits received so far reached."""
    b = budget(in_flight=True)
    half = BUDGET_FRACTION * 4 * MB
    assert b.split_limit == 1000 + b.initial_credit()
    b.on_sample(Sample(1.0, fails=0, timeouts=0, memory=MB, queues=400), highest_seq=1200)
    assert b.credits == int((half - MB) // (MB / 400))
    assert b.split_limit == 1000 + b.credits  # not 1201 + credits (the absolute limit)
    # The budget full: no split in flight at all.
    b.on_sample(Sample(2.0, fails=0, timeouts=0, memory=int(half), queues=800), highest_seq=1300)
    assert b.credits == 0 and b.split_limit == 1000
    # Held for long by something else: the trickle is one split in flight.
    t = 2.0
    while b.counters.trickle_grants == 0:
        t += 1.0
        b.on_sample(Sample(t, fails=0, timeouts=0, memory=int(half), queues=800), 1300)
    assert b.credits == 1 and b.split_limit == 1001
    # The absolute limit, for comparison: a position past the highest seq.
    old = budget()
    old.on_sample(Sample(1.0, fails=0, timeouts=0, memory=MB, queues=400), highest_seq=1200)
    assert old.split_limit == 1201 + old.credits


def test_in_flight_lost_splits_free_their_credit() -> None:
    full = budget().initial_credit()
    # A path that drops every fragment: no split arrives, none waits in the
    # memory, and the credit stays whole, report after report (no trickle).
    b = budget(in_flight=True)
    t = 0.0
    while t < 3 * LIMITS.time_s:
        t += REPORT_INTERVAL_S
        b.on_sample(Sample(t, fails=0, timeouts=0, overlaps=0, memory=0, queues=0), 999)
        assert b.split_limit == 1000 + full, t
    assert b.counters.trickle_grants == 0 and b.counters.zero_credit_s == 0
    # Splits that lost a piece: their leftovers hold credit until the kernel
    # drops them (ipfrag_time), then the credit is back.
    c = budget(in_flight=True)
    leftovers = Sample(1.0, fails=0, timeouts=0, memory=100 * DEFAULT_COST, queues=100)
    c.on_sample(leftovers, highest_seq=1200, missing_splits=100)
    assert c.split_limit == 1000 + full - 100
    expired = Sample(32.0, fails=100, timeouts=100, memory=0, queues=0)
    assert c.on_sample(expired, highest_seq=1300, missing_splits=100) == []  # not refusals
    assert c.split_limit == 1000 + full
    # Where the memory in use is unknown, a missing split counts as a
    # leftover for ipfrag_time, then frees its credit.
    d = budget(in_flight=True, start=Sample(0.0))
    d.on_sample(Sample(1.0), highest_seq=1200, missing_splits=100)
    assert d.split_limit == 1000 + credits_for(LIMITS, 100 * DEFAULT_COST)
    d.on_sample(Sample(40.0), highest_seq=1300, missing_splits=100)
    assert d.split_limit == 1000 + full


# -- the session sends REPORTs --------------------------------------------------------------

TAG = bytes.fromhex("0123456789abcdef")
PLAN = ProbePlan.build(repetitions=2, step=256, window=4)


def test_session_reports_after_the_challenge_and_stops_after_done() -> None:
    b = budget(first_split_seq=PLAN.split_from, total_probes=PLAN.total_probes, window=4)
    s = ProbeSession(TAG, bytes(16), PLAN, budget=b)
    s.start(0.0)
    assert not s.sample_due(0.0)  # nothing before the address is proven
    s.on_datagram(wire.Challenge(TAG, bytes(16)).encode(), 0, 0.1)
    assert s.sample_due(0.1) and s.next_deadline() == pytest.approx(0.1)
    (raw,) = s.on_sample(0.1, Sample(0.1, fails=0, timeouts=0, memory=0, queues=0))
    msg = wire.decode(raw)
    assert isinstance(msg, wire.Report)
    assert msg.report_seq == 1 and msg.split_limit == b.split_limit
    assert msg.frag_memory == 0 and msg.frag_high_thresh == 4 << 20
    assert s.next_deadline() == pytest.approx(0.1 + REPORT_INTERVAL_S)
    s.on_datagram(wire.Done(TAG).encode(), 0, 0.2)
    assert not s.sample_due(10.0) and s.on_sample(10.0, Sample(10.0)) == []


def test_report_wire_format() -> None:
    vectors = json.loads(
        (Path(__file__).resolve().parents[2] / "core/vectors/probe_wire.json").read_text()
    )["messages"]
    assert wire.decode(bytes.fromhex(vectors["report"])) == wire.Report(
        TAG, 3, 0x01020304, 123456, 4 << 20, 7, ((10, 20),)
    )
    r = wire.Report(TAG, 7, 1234, 99, 4 << 20, 5, ((1, 4), (10, 20)))
    raw = r.encode()
    assert len(raw) == 12 + 21 + 16
    assert wire.decode(raw) == r
    many = wire.Report(TAG, 1, invalid=tuple((i, i + 1) for i in range(0, 20, 2)))
    assert wire.decode(many.encode()).invalid == many.invalid[-wire.MAX_REPORT_RANGES :]
    for bad in (raw[:-1], raw + b"\0", raw[:32] + b"\x05" + raw[33:]):
        with pytest.raises(wire.WireError):
            wire.decode(bad)
    reversed_range = wire.Report(TAG, 1, invalid=((5, 5),)).encode()
    with pytest.raises(wire.WireError):
        wire.decode(reversed_range)


# -- the fragment observer ------------------------------------------------------------------


def ip(ip_id: int, offset: int, more: bool, payload: bytes) -> bytes:
    frag = (0x2000 if more else 0) | (offset // 8)
    hdr = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(payload), ip_id, frag, 64, 17, 0,
                      bytes(4), bytes(4))  # fmt: skip
    return hdr + payload


def datagram(seq: int) -> bytes:
    body = wire.probe_payload(TAG, seq, PLAN.probe(seq).udp_payload_len)
    return struct.pack("!HHHH", 9000, 5000, 8 + len(body), 0) + body


def test_observer_tells_as_sent_swapped_and_whole() -> None:
    obs = FragmentObserver(TAG, PLAN)
    first = PLAN.split_from
    # A split as sent: leading piece first (IP length = the plan's).
    lead = PLAN.probe(first).ip_len - 20
    d = datagram(first)
    obs.on_packet(ip(1, 0, True, d[:lead]))
    obs.on_packet(ip(1, lead, False, d[lead:]))
    # Swapped: the larger piece at offset 0 (a re-cut), trailing piece first.
    seq = first + 1
    small = PLAN.probe(seq).ip_len - 20
    big = 1480 - small
    d = datagram(seq)
    obs.on_packet(ip(2, big, False, d[big:]))
    obs.on_packet(ip(2, 0, True, d[:big]))
    obs.on_packet(ip(2, 0, True, d[:big]))  # a duplicate piece counts once
    # Whole, and whole arriving in two pieces (a small-MTU hop).
    obs.on_packet(ip(3, 0, False, datagram(0)))
    d = datagram(7)  # 1500 bytes
    obs.on_packet(ip(4, 0, True, d[:1376]))
    obs.on_packet(ip(4, 1376, False, d[1376:]))
    # Another session's probe and garbage: ignored.
    other = wire.probe_payload(bytes(8), 3, 100)
    obs.on_packet(ip(5, 0, False, struct.pack("!HHHH", 9000, 5000, 108, 0) + other))
    obs.on_packet(b"\x60" + bytes(40))
    kinds = [obs.classify(s) for s in (first, first + 1, 0, 7, 3)]
    assert kinds == ["as-sent", "swapped", "whole", "fragmented", None]
    s = obs.summary()
    assert (s["split_observed"], s["split_leading_as_sent"], s["split_swapped"]) == (2, 1, 1)
    assert (s["whole_observed"], s["whole_fragmented"]) == (2, 1)
    assert s["swapped_leading_ip_lens"] == [PLAN.probe(seq).ip_len]
    # The report's arrays, read back by the server's parser.
    enc = obs.encoded()
    assert enc is not None
    _, parsed = parse_observations({"summary": s, **enc}, PLAN.total_probes)
    assert parsed is not None
    got = dict(zip(parsed.seqs, zip(parsed.leading, parsed.fragments, strict=True), strict=True))
    assert got == {
        first: (PLAN.probe(first).ip_len, 2),
        first + 1: (big + 20, 2),
        0: (PLAN.probe(0).ip_len, 1),
        7: (1396, 2),
    }


def test_bpf_filter_is_a_program_of_sock_filters() -> None:
    prog = bpf_filter("203.0.113.10", 9000, 40000)
    assert len(prog) % 8 == 0 and len(prog) // 8 == 14
    codes = [struct.unpack_from("HBBI", prog, i)[0] for i in range(0, len(prog), 8)]
    assert codes[-3:] == [0x06, 0x06, 0x06]  # every path ends in a return
