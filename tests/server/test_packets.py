"""Probe packets patched from a scapy template equal packets scapy builds whole."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from kickass_core.plan import expected_max_fragment
from kickass_core.wire import probe_payload
from kickass_server.packets import SessionPackets
from scapy.layers.inet import IP, UDP, defragment

TAG = bytes.fromhex("0011223344556677")
SRC, DST = "203.0.113.10", "198.18.1.2"


def reference(seq: int, udp_len: int, ip_id: int) -> bytes:
    pkt = IP(src=SRC, dst=DST, id=ip_id) / UDP(sport=9000, dport=40000)
    return bytes(IP(bytes(pkt / probe_payload(TAG, seq, udp_len)))[UDP])


@settings(max_examples=300, deadline=None)
@given(
    seq=st.integers(0, 2**32 - 1),
    ip_id=st.integers(1, 0xFFFF),
    size=st.integers(0, 182),
    split=st.booleans(),
)
def test_template_matches_scapy(seq: int, ip_id: int, size: int, split: bool) -> None:
    ip_len = 44 + 8 * size
    t = SessionPackets(SRC, DST, 9000, 40000, TAG)
    pkts = t.render("split" if split else "whole", ip_len, seq, ip_id)
    if split:
        lead, rest = (IP(p) for p in pkts)
        assert len(pkts[0]) == ip_len and lead.flags == "MF" and lead.frag == 0
        assert rest.flags == 0 and rest.frag * 8 == ip_len - 20 and lead.id == rest.id == ip_id
        # Header checksums valid (scapy recomputes when the field is deleted).
        for f in (lead, rest):
            c = f.chksum
            del f.chksum
            assert IP(bytes(f)).chksum == c
        assert max(len(p) for p in pkts) == expected_max_fragment(ip_len)
        whole = IP(bytes(defragment([lead, rest])[0]))
        udp_len = 1472
    else:
        assert len(pkts) == 1 and len(pkts[0]) == ip_len
        whole = IP(pkts[0])
        c = whole.chksum
        del whole.chksum
        assert IP(bytes(whole)).chksum == c
        whole = IP(pkts[0])
        udp_len = ip_len - 28
    assert bytes(whole[UDP]) == reference(seq, udp_len, ip_id)
