"""Regenerate the checked-in encoding vectors: ``python core/vectors/make_vectors.py``.

The vectors pin the Python core and the Rust router to the same bytes. Only
regenerate on a deliberate change of an encoding, and say so in the commit.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from kickass_core import flow_record, rate, rtt, wire

HERE = Path(__file__).resolve().parent


def rate_vectors() -> dict:
    lens = list(range(rate.MIN_LEADING_FRAGMENT_LEN, rate.MAX_LEADING_FRAGMENT_LEN + 1, 8))
    rates: list[float] = [0.0, 1.0, 12.4392, 15.0, 15.004, 245928.0 / 8, 1.25e6, 1e9]
    for L in lens:
        r = rate.advertised_rate(L)
        rates += [r, r * (1 - 1e-6), r * (1 + 1e-6)]
    return {
        "version": 1,
        "formula": (
            "L = 128 * ln(R / 12.4392), R in bytes/ms, L = leading fragment IP payload bytes"
        ),
        "rounding": "down to a multiple of 8 (after 1e-9 slack); null below 24; capped at 1480",
        "len_to_rate": [
            {"leading_fragment_len": L, "rate_bytes_per_ms": rate.advertised_rate(L)} for L in lens
        ],
        "rate_to_len": [
            {"rate_bytes_per_ms": r, "leading_fragment_len": rate.leading_fragment_len(r)}
            for r in rates
        ],
    }


def rtt_vectors() -> dict:
    samples = [
        0.0,
        0.5,
        1.0,
        1.99,
        2.0,
        3.0,
        3.99,
        4.0,
        7.5,
        8.0,
        100.0,
        1023.9,
        1024.0,
        2047.9,
        2048.0,
        5000.0,
        1e9,
    ]
    return {
        "version": 1,
        "rtt_to_indicator": [{"rtt_ms": s, "ip_len": rtt.rtt_indicator(s)} for s in samples],
        "indicator_to_rtt": [
            {"ip_len": n, "midpoint_ms": rtt.rtt_indicator_midpoint_ms(n)}
            for n in range(rtt.RTT_INDICATOR_MIN_LEN, rtt.RTT_INDICATOR_MAX_LEN + 1)
        ],
    }


def wire_vectors() -> dict:
    tag = bytes.fromhex("0123456789abcdef")
    cookie = bytes(range(16))
    token = bytes(range(0xA0, 0xB0))
    msgs = {
        "hello": wire.Hello(tag, cookie).encode(),
        "challenge": wire.Challenge(tag, token).encode(),
        "echo": wire.Echo(tag, token).encode(),
        "probe_header": wire.ProbeHeader(tag, 0x01020304).encode(),
        "ack": wire.Ack(tag, 7, 1472, 1476, 0).encode(),
        "done": wire.Done(tag).encode(),
        "report": wire.Report(tag, 3, 0x01020304, 123456, 4 << 20, 7, ((10, 20),)).encode(),
        "probe_payload_44": wire.probe_payload(tag, 1, 16),
    }
    return {"version": 1, "messages": {k: v.hex() for k, v in msgs.items()}}


def _transport(**changes: object) -> dict:
    """A ka-transport FlowRecord as ka-send prints it (every field, serde's names)."""
    base: dict = {
        "flow_id": 7,
        "protocol": "kickass",
        "handshake_mode": "padded",
        "size_bytes": 144000,
        "size_packets": 100,
        "fct_ns": 312_500_000,
        "completed": True,
        "error": None,
        "ka_mode_ns": 312_500_000,
        "ka_mode_fraction": 1.0,
        "mode_switch_count": 0,
        "mode_switches": [],
        "retransmissions": 0,
        "retransmitted_bytes": 0,
        "rto_count": 0,
        "fast_retransmits": 0,
        "srtt_ns": 101_200_000,
        "min_rtt_ns": 100_100_000,
        "advertised_rates": {
            "count": 31,
            "min_bytes_per_ms": 1220.7,
            "max_bytes_per_ms": 1250.0,
            "last_bytes_per_ms": 1248.5,
        },
        "datagrams_sent": 104,
        "rtt_indicators_sent": 3,
    }
    base.update(changes)
    return base


def flow_record_vectors() -> dict:
    cases = [
        ("kickass, completed in Kick-Ass mode", _transport(), None),
        (
            "fell back to TCP: the receiver did not echo rates",
            _transport(
                protocol="tcp",
                ka_mode_ns=0,
                ka_mode_fraction=0.0,
                mode_switch_count=1,
                mode_switches=[
                    {
                        "at_ns": 100_000_000,
                        "from": "kickass",
                        "to": "tcp",
                        "reason": "not_negotiated",
                    }
                ],
                advertised_rates={
                    "count": 0,
                    "min_bytes_per_ms": None,
                    "max_bytes_per_ms": None,
                    "last_bytes_per_ms": None,
                },
            ),
            None,
        ),  # fmt: skip
        (
            "lost the receiver half-way",
            _transport(
                completed=False,
                fct_ns=None,
                error="no answer from the receiver for 3 s",
                retransmissions=12,
                retransmitted_bytes=17280,
                rto_count=3,
                mode_switch_count=2,
                ka_mode_fraction=0.41,
                ka_mode_ns=1_230_000_000,
            ),
            "no answer from the receiver for 3 s",
        ),
    ]
    examples = [
        {"case": name, "transport": t, "error": err, "measured": flow_record.from_transport(t, err)}
        for name, t, err in cases
    ]
    return flow_record.vectors_document(examples)


def documents() -> dict[str, str]:
    """Each vector file's name and its text as this generator writes it today
    (tests/core/test_flow_record.py compares it with the checked-in file)."""
    return {
        name: json.dumps(data, indent=1, allow_nan=False) + "\n"
        for name, data in (
            ("rate_encoding.json", rate_vectors()),
            ("rtt_indicator.json", rtt_vectors()),
            ("probe_wire.json", wire_vectors()),
            ("flow_record.json", flow_record_vectors()),
        )
    }


def main() -> None:
    for name, text in documents().items():
        (HERE / name).write_text(text)
        print(f"wrote {name}")


if __name__ == "__main__":
    assert not math.isnan(rate.advertised_rate(24))
    main()
