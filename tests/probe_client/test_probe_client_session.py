"""The client's sans-IO protocol state machine, on simulated time.

No sockets: datagrams in, datagrams out, time passed in. The bytes are the
real wire format (kickass_core.wire) and are checked against the shared
vectors where one exists.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
from kickass_core import wire
from kickass_core.plan import ProbePlan, expected_max_fragment
from kickass_probe.session import (
    HELLO_INTERVAL_S,
    IP_RECVFRAGSIZE,
    REHELLO_AFTER_ECHO_S,
    Failure,
    Phase,
    ProbeSession,
    enable_recvfragsize,
    frag_size_from_ancdata,
)

VECTORS = json.loads(
    (Path(__file__).resolve().parents[2] / "core" / "vectors" / "probe_wire.json").read_text()
)["messages"]

TAG = bytes.fromhex("0123456789abcdef")
COOKIE = bytes(range(16))
TOKEN = bytes(range(0xA0, 0xB0))
PLAN = ProbePlan.build(repetitions=2, step=256, window=4)


def session(**kw: object) -> ProbeSession:
    return ProbeSession(TAG, COOKIE, PLAN, challenge_timeout=10.0, **kw)  # type: ignore[arg-type]


def probe(seq: int, tag: bytes = TAG) -> bytes:
    return wire.probe_payload(tag, seq, PLAN.probe(seq).udp_payload_len)


def started(now: float = 0.0) -> ProbeSession:
    s = session()
    s.start(now)
    s.on_datagram(wire.Challenge(TAG, TOKEN).encode(), 0, now + 0.01)
    return s


def first_split_seq() -> int:
    return PLAN.repetitions * len(PLAN.whole)


# -- handshake -------------------------------------------------------------------------


def test_start_sends_the_vector_hello() -> None:
    s = session()
    (hello,) = s.start(0.0)
    assert hello.hex() == VECTORS["hello"]
    assert s.phase is Phase.HELLO


def test_hello_repeats_every_half_second_then_gives_up() -> None:
    s = session()
    s.start(0.0)
    assert s.on_timer(0.2) == []
    assert s.next_deadline() == pytest.approx(HELLO_INTERVAL_S)
    sent = 0
    t = HELLO_INTERVAL_S
    while t < 10.0:
        sent += len(s.on_timer(t))
        t += HELLO_INTERVAL_S
    assert sent == 19  # 0.5 .. 9.5 s
    assert s.on_timer(10.0) == []
    assert s.phase is Phase.FAILED and s.failure is Failure.NO_CHALLENGE
    assert s.next_deadline() is None
    # A late challenge changes nothing once the client gave up.
    assert s.on_datagram(wire.Challenge(TAG, TOKEN).encode(), 0, 10.1) == []


def test_challenge_is_echoed_with_its_token() -> None:
    s = session()
    s.start(0.0)
    (echo,) = s.on_datagram(bytes.fromhex(VECTORS["challenge"]), 0, 0.1)
    assert echo.hex() == VECTORS["echo"]
    assert s.phase is Phase.ECHOED
    # A repeated challenge (our echo was lost) is echoed again.
    (again,) = s.on_datagram(wire.Challenge(TAG, b"\x55" * 16).encode(), 0, 0.2)
    assert wire.decode(again) == wire.Echo(TAG, b"\x55" * 16)


def test_no_probe_after_echo_says_hello_again_then_fails() -> None:
    s = started(0.0)
    assert s.on_timer(0.5) == []  # no HELLO while a probe may be on its way
    (hello,) = s.on_timer(0.01 + REHELLO_AFTER_ECHO_S)
    assert isinstance(wire.decode(hello), wire.Hello)
    s.on_timer(10.02)
    assert s.failure is Failure.NO_PROBES


def test_challenge_for_another_session_is_ignored() -> None:
    s = session()
    s.start(0.0)
    assert s.on_datagram(wire.Challenge(b"\x99" * 8, TOKEN).encode(), 0, 0.1) == []
    assert s.phase is Phase.HELLO and s.counts.foreign == 1


# -- probes and ACKs ---------------------------------------------------------------------


def test_probe_is_acked_with_what_arrived() -> None:
    s = started()
    (ack,) = s.on_datagram(probe(3), 0, 1.0)
    assert wire.decode(ack) == wire.Ack(TAG, 3, PLAN.probe(3).udp_payload_len, 0)
    assert s.phase is Phase.PROBING
    assert s.counts.received == 1 and s.progress == 4
    assert s.counts.whole[PLAN.probe(3).ip_len].received == 1
    assert s.next_deadline() is None  # no more HELLOs


def test_ack_matches_the_shared_vector() -> None:
    # Vector: seq 7, 1472 bytes received, largest fragment 1476.
    big = ProbePlan.build(repetitions=8, step=8)
    s = ProbeSession(TAG, COOKIE, big)
    s.start(0.0)
    data = wire.probe_payload(TAG, 7, 1472)
    (ack,) = s.on_datagram(data, 1476, 0.1)
    assert ack.hex() == VECTORS["ack"]


def test_probe_before_challenge_still_acked() -> None:
    # The ECHO got through but the CHALLENGE copy we saw was reordered away.
    s = session()
    s.start(0.0)
    assert len(s.on_datagram(probe(0), 0, 0.1)) == 1
    assert s.phase is Phase.PROBING


def test_duplicates_are_acked_every_time_but_counted_once() -> None:
    s = started()
    acks = [s.on_datagram(probe(5), 0, 1.0 + i) for i in range(3)]
    assert all(len(a) == 1 for a in acks)
    assert s.counts.received == 1 and s.counts.duplicates == 2


def test_reordering_is_counted() -> None:
    s = started()
    for seq in (0, 4, 2, 3, 1, 5):
        s.on_datagram(probe(seq), 0, 1.0)
    assert s.counts.reordered == 3  # 2, 3 and 1 arrived after 4
    assert s.counts.highest_seq == 5


def test_foreign_and_malformed_datagrams_are_not_acked() -> None:
    s = started()
    assert s.on_datagram(probe(1, tag=b"\xee" * 8), 0, 1.0) == []
    assert s.on_datagram(b"hello world, not ours", 0, 1.0) == []
    assert s.on_datagram(b"KA", 0, 1.0) == []
    assert s.on_datagram(wire.Ack(TAG, 1, 100).encode(), 0, 1.0) == []  # wrong direction
    assert s.counts.foreign == 4 and s.counts.received == 0


def test_corrupted_and_truncated_probes_are_acked_and_counted() -> None:
    s = started()
    bad = bytearray(probe(2))
    bad[-1] ^= 0xFF
    assert len(s.on_datagram(bytes(bad), 0, 1.0)) == 1
    short = probe(3)[:-8]
    (ack,) = s.on_datagram(short, 0, 1.0)
    assert wire.decode(ack).received_len == len(short)
    assert s.counts.corrupted == 1
    assert s.counts.wrong_length == 1
    assert s.counts.received == 2


def test_seq_outside_the_plan_is_acked_not_counted() -> None:
    s = started()
    data = wire.probe_payload(TAG, PLAN.total_probes + 5, 100)
    assert len(s.on_datagram(data, 0, 1.0)) == 1
    assert s.counts.unexpected_seq == 1 and s.counts.received == 0


def test_split_fragment_sizes_are_classified() -> None:
    s = started()
    base = first_split_seq()
    p0, p1, p2 = (PLAN.probe(base + i) for i in range(3))
    assert p0.phase == "split"
    s.on_datagram(probe(base), expected_max_fragment(p0.ip_len), 1.0)
    s.on_datagram(probe(base + 1), 0, 1.0)
    s.on_datagram(probe(base + 2), 576, 1.0)
    assert s.counts.split[p0.ip_len].as_sent == 1
    assert s.counts.split[p1.ip_len].reassembled == 1
    assert s.counts.split[p2.ip_len].refragmented == 1


def test_whole_probe_arriving_fragmented_is_counted() -> None:
    s = started()
    s.on_datagram(probe(PLAN.whole.index(1500)), 1280, 1.0)
    assert s.counts.whole[1500].refragmented == 1


def test_without_fragment_sizes_nothing_is_classified() -> None:
    s = ProbeSession(TAG, COOKIE, PLAN, frag_size_supported=False)
    s.start(0.0)
    base = first_split_seq()
    s.on_datagram(probe(base), 0, 1.0)
    sc = s.counts.split[PLAN.probe(base).ip_len]
    assert (sc.received, sc.as_sent, sc.reassembled, sc.refragmented) == (1, 0, 0, 0)


def test_frag_size_is_clamped_to_16_bits() -> None:
    s = started()
    (ack,) = s.on_datagram(probe(0), 70000, 1.0)
    # Clamped below 0xFFFF, which means "cannot tell" (wire.FRAG_SIZE_UNKNOWN).
    assert wire.decode(ack).observed_frag_size == 0xFFFE


def test_a_system_that_cannot_observe_fragment_sizes_says_so_in_every_ack() -> None:
    s = session(frag_size_supported=False)
    s.start(0.0)
    s.on_datagram(wire.Challenge(TAG, TOKEN).encode(), 0, 0.01)
    (ack,) = s.on_datagram(probe(0), 0, 1.0)
    assert wire.decode(ack).observed_frag_size == wire.FRAG_SIZE_UNKNOWN


def test_done_is_noted_and_late_probes_still_acked() -> None:
    s = started()
    s.on_datagram(probe(0), 0, 1.0)
    assert s.on_datagram(bytes.fromhex(VECTORS["done"]), 0, 2.0) == []
    assert s.phase is Phase.DONE and s.counts.done_received
    assert len(s.on_datagram(probe(1), 0, 2.1)) == 1


def test_snapshot_copy_is_independent() -> None:
    s = started()
    s.on_datagram(probe(0), 0, 1.0)
    snap = s.counts.copy()
    s.on_datagram(probe(1), 0, 1.0)
    assert snap.received == 1 and s.counts.received == 2
    assert snap.whole[PLAN.probe(0).ip_len].received == 1


def test_bad_tag_or_cookie_length_rejected() -> None:
    with pytest.raises(ValueError):
        ProbeSession(b"short", COOKIE, PLAN)
    with pytest.raises(ValueError):
        ProbeSession(TAG, b"short", PLAN)


# -- socket helpers ----------------------------------------------------------------------


def test_frag_size_from_ancdata() -> None:
    cdata = (1476).to_bytes(4, sys.byteorder)
    assert frag_size_from_ancdata([(socket.IPPROTO_IP, IP_RECVFRAGSIZE, cdata)]) == 1476
    assert frag_size_from_ancdata([(socket.IPPROTO_IP, 8, cdata)]) == 0
    assert frag_size_from_ancdata([]) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux-only socket option")
def test_recvfragsize_needs_no_privilege() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        assert enable_recvfragsize(s) is True
        assert s.getsockopt(socket.IPPROTO_IP, IP_RECVFRAGSIZE) == 1
