"""Regenerate core/vectors/fragment_kickass.json (run from the repo root):

    .venv/bin/python core/vectors/make_fragment_vectors.py

Input packets and the expected router output are built with scapy, which
has its own header and checksum code, independent of the Rust fragmenter:
the expected pieces follow Linux ip_do_fragment (header copied, same id,
offset in 8-byte units, MF on all but the last, DF/reserved cleared,
non-copied options NOP'ed in the second piece, checksum recomputed).
The Rust test core/ka-core/tests/fragment_vectors.rs must reproduce every byte.
"""

from __future__ import annotations

import json
from pathlib import Path

from scapy.all import IP, TCP, UDP, Raw
from scapy.layers.inet import IPOption

OUT = Path(__file__).resolve().parent / "fragment_kickass.json"
SRC, DST = "198.18.1.2", "198.18.2.2"


def body(n: int, seed: int) -> bytes:
    return bytes((i * 31 + seed) & 0xFF for i in range(n))


def nop_uncopied(opts: bytes) -> bytes:
    out = bytearray(opts)
    i = 0
    while i < len(out):
        t = out[i]
        if t == 0:
            break
        if t == 1:
            i += 1
            continue
        ln = out[i + 1]
        if not t & 0x80:
            out[i : i + ln] = b"\x01" * ln
        i += ln
    return bytes(out)


def piece(ip: IP, options: bytes, data: bytes, offset: int, mf: bool) -> bytes:
    """One fragment as scapy builds it: ihl, len and checksum are scapy's."""
    h = IP(
        src=ip.src,
        dst=ip.dst,
        id=ip.id,
        ttl=ip.ttl,
        tos=ip.tos,
        proto=ip.proto,
        flags="MF" if mf else 0,
        frag=offset // 8,
        options=[IPOption(options)] if options else [],
    )
    return bytes(h / Raw(data))


def cut(pkt: bytes, lead: int) -> list[bytes]:
    ip = IP(pkt)
    hl = ip.ihl * 4
    opts = pkt[20:hl]
    payload = pkt[hl : ip.len]
    off = ip.frag * 8
    return [
        piece(ip, opts, payload[:lead], off, True),
        piece(ip, nop_uncopied(opts), payload[lead:], off + lead, bool(ip.flags.MF)),
    ]


def cases() -> list[dict]:
    out = []

    def add(name: str, pkt: bytes, lead: int | None, expect: list[bytes]) -> None:
        assert IP(pkt).len == len(pkt)
        out.append(
            {
                "name": name,
                "leading_fragment_len": lead,
                "input": pkt.hex(),
                "output": [e.hex() for e in expect],
            }
        )

    udp = bytes(
        IP(src=SRC, dst=DST, id=0x1234, ttl=63) / UDP(sport=5001, dport=9000) / Raw(body(1472, 1))
    )
    add("udp_1500_cut_584", udp, 584, cut(udp, 584))
    add("udp_1500_cut_24", udp, 24, cut(udp, 24))
    add("udp_1500_at_1480_passes", udp, 1480, [udp])
    tcp = bytes(
        IP(src=SRC, dst=DST, id=0xBEEF, ttl=64)
        / TCP(sport=443, dport=50000, flags="A", seq=1, ack=2)
        / Raw(body(1460, 2))
    )
    add("tcp_1500_cut_1472", tcp, 1472, cut(tcp, 1472))
    opts = bytes([0x94, 0x04, 0, 0, 0x44, 0x08, 0x05, 0x00, 0, 0, 0, 0])
    with_opts = bytes(
        IP(src=SRC, dst=DST, id=7, ttl=60, options=[IPOption(opts)])
        / UDP(sport=1, dport=2)
        / Raw(body(1500 - 32 - 8, 3))
    )
    add("udp_options_cut_880", with_opts, 880, cut(with_opts, 880))
    df = bytes(IP(src=SRC, dst=DST, id=9, flags="DF") / UDP(sport=1, dport=2) / Raw(body(1472, 4)))
    add("df_passes", df, 584, [df])
    short = bytes(IP(src=SRC, dst=DST, id=10) / UDP(sport=1, dport=2) / Raw(body(1471, 5)))
    add("1499_passes", short, 584, [short])
    lead = bytes(IP(src=SRC, dst=DST, id=11, flags="MF") / Raw(body(1480, 6)))
    add("leading_fragment_recut_880", lead, 880, cut(lead, 880))
    small_lead = bytes(IP(src=SRC, dst=DST, id=12, flags="MF") / Raw(body(584, 7)))
    add("short_leading_fragment_passes", small_lead, 880, [small_lead])
    tail = bytes(IP(src=SRC, dst=DST, id=13, frag=73) / Raw(body(1480, 8)))
    add("tail_fragment_passes", tail, 24, [tail])
    add("not_marking_passes", udp, None, [udp])
    return out


def main() -> None:
    doc = {
        "version": 1,
        "generator": "core/vectors/make_fragment_vectors.py (scapy)",
        "rule": "paper section II-A; headers as Linux ip_do_fragment",
        "cases": cases(),
    }
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {OUT} ({len(doc['cases'])} cases)")


if __name__ == "__main__":
    main()
