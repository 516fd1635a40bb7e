"""The shared core against its checked-in vectors and the paper's anchor values."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kickass_core import rate, rtt, verdict, wire
from kickass_core.plan import PlanError, ProbePlan, expected_max_fragment

VECTORS = Path(__file__).resolve().parents[2] / "core" / "vectors"


def load(name: str) -> dict:
    return json.loads((VECTORS / name).read_text())


def test_rate_vectors() -> None:
    v = load("rate_encoding.json")
    for row in v["len_to_rate"]:
        assert rate.advertised_rate(row["leading_fragment_len"]) == pytest.approx(
            row["rate_bytes_per_ms"], rel=1e-12
        )
    for row in v["rate_to_len"]:
        assert rate.leading_fragment_len(row["rate_bytes_per_ms"]) == row["leading_fragment_len"]


def test_paper_anchor_values() -> None:
    # 10 Gbit/s = 1.25e6 B/ms -> F = 1474.3 -> 1472 after rounding down.
    assert rate.leading_fragment_len(1.25e6) == 1472
    # L = 1000 is "about 245 Mbit/s" (paper II-A).
    assert rate.bytes_per_ms_to_bps(rate.advertised_rate(1000)) / 1e6 == pytest.approx(245.9, 0.01)
    # 120 kbit/s sits 0.03% under R(24): not encodable when rounding down.
    assert rate.leading_fragment_len(15.0) is None
    assert rate.leading_fragment_len(15.01) == 24
    assert rate.leading_fragment_len(1e12) == rate.MAX_LEADING_FRAGMENT_LEN


@given(st.floats(min_value=15.01, max_value=1e7, allow_nan=False))
def test_rate_never_overstated(r: float) -> None:
    L = rate.leading_fragment_len(r)
    assert L is not None and L % 8 == 0 and 24 <= L <= 1480
    # Rounding down: the advertised rate never exceeds what was computed.
    assert rate.advertised_rate(L) <= r * (1 + 1e-9)
    if L < 1480:
        assert rate.advertised_rate(L + 8) > r


def test_rtt_vectors() -> None:
    v = load("rtt_indicator.json")
    for row in v["rtt_to_indicator"]:
        assert rtt.rtt_indicator(row["rtt_ms"]) == row["ip_len"]
    for row in v["indicator_to_rtt"]:
        assert rtt.rtt_indicator_midpoint_ms(row["ip_len"]) == row["midpoint_ms"]
    assert rtt.rtt_indicator_midpoint_ms(601) == 3.0  # [2, 4) ms
    assert rtt.is_rtt_indicator(605, True) and not rtt.is_rtt_indicator(605, False)


@given(st.floats(min_value=0, max_value=1e6, allow_nan=False))
def test_rtt_indicator_range_contains_rtt(x: float) -> None:
    low, high = rtt.rtt_indicator_range_ms(rtt.rtt_indicator(x))
    assert low <= x < high or (x < 2 and low == 0)


def test_wire_vectors_roundtrip() -> None:
    v = load("probe_wire.json")["messages"]
    tag = bytes.fromhex("0123456789abcdef")
    assert wire.decode(bytes.fromhex(v["hello"])) == wire.Hello(tag, bytes(range(16)))
    assert len(bytes.fromhex(v["challenge"])) < len(bytes.fromhex(v["hello"]))
    assert wire.decode(bytes.fromhex(v["ack"])) == wire.Ack(tag, 7, 1472, 1476, 0)
    assert wire.decode(bytes.fromhex(v["probe_payload_44"])) == wire.ProbeHeader(tag, 1)
    for name, hexed in v.items():
        if name != "probe_payload_44":
            assert wire.decode(bytes.fromhex(hexed)).encode() == bytes.fromhex(hexed), name


@given(st.binary(max_size=200))
def test_wire_decode_never_crashes(data: bytes) -> None:
    with contextlib.suppress(wire.WireError):
        wire.decode(data)


def test_wire_rejects() -> None:
    tag = b"\x01" * 8
    with pytest.raises(wire.WireError):
        wire.decode(wire.Hello(tag, b"c" * 16).encode()[:40])  # too short: amplification
    with pytest.raises(wire.WireError):
        wire.decode(b"XX" + wire.Done(tag).encode()[2:])
    with pytest.raises(wire.WireError):
        wire.decode(wire.Ack(tag, 1, 2).encode() + b"x")


def test_plan_shapes() -> None:
    p = ProbePlan.build()
    assert p.whole[0] == 44 and p.whole[-1] == 1500 and 1480 in p.whole
    assert len(p.whole) == 184 and len(p.split) == 182
    assert p.split[0] == 44 and p.split[-1] == 1492
    assert p.total_probes == 100 * (184 + 182)
    assert p.probe(0).phase == "whole" and p.probe(184 * 100).phase == "split"
    assert p.probe(1).ip_len == 52  # round-robin over sizes
    assert ProbePlan.from_json(p.to_json()) == p
    assert p.probe(0).udp_payload_len == 16 and p.probe(18400).udp_payload_len == 1472
    with pytest.raises(PlanError):
        ProbePlan.build(step=12)
    assert expected_max_fragment(44) == 1476 and expected_max_fragment(1492) == 1492


def test_verdict_rule() -> None:
    assert verdict.decide(1000, 1000, 1000, 1000).verdict == verdict.FRAGMENTS_OK
    assert verdict.decide(1000, 990, 1000, 0).verdict == verdict.FRAGMENT_INTOLERANT
    assert verdict.decide(1000, 300, 1000, 300).verdict == verdict.INCONCLUSIVE  # too lossy
    assert verdict.decide(5, 5, 0, 0).verdict == verdict.INCONCLUSIVE  # ended early
    # 5% each way: whole ~9.75%, split ~14.3% is within the two-fragment bound.
    assert verdict.decide(2000, 1805, 2000, 1715).verdict == verdict.FRAGMENTS_OK
    # Fragments lost far beyond plain loss but not blocked: inconclusive.
    assert verdict.decide(2000, 1990, 2000, 1000).verdict == verdict.INCONCLUSIVE
    assert math.isclose(verdict.drop_rate(10, 7) or 0, 0.3)


# -- plans read back from untrusted JSON -------------------------------------------


def test_plan_json_round_trips() -> None:
    from kickass_core.plan import ProbePlan

    for plan in (ProbePlan.build(), ProbePlan.quick(), ProbePlan.build(phases=("split",))):
        assert ProbePlan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize(
    "patch",
    [
        {"repetitions": True},
        {"repetitions": 2.0},
        {"repetitions": float("inf")},
        {"step": "8"},
        {"window": 0},
        {"phases": ["whole", "whole"]},
        {"phases": []},
        {"whole": [44, 44]},
        {"whole": [43]},
        {"split": [1500]},
        {"split": [True]},
        {"version": 99},
        {"phases": ["sideways"]},
    ],
)
def test_plan_from_json_refuses_bad_fields_with_plan_error(patch: dict) -> None:
    from kickass_core.plan import PlanError, ProbePlan

    with pytest.raises(PlanError):
        ProbePlan.from_json({**ProbePlan.quick().to_json(), **patch})


def test_plan_from_json_bounds_the_probe_count() -> None:
    from kickass_core.plan import PlanTooLarge, ProbePlan

    huge = {**ProbePlan.quick().to_json(), "repetitions": 10**30}
    with pytest.raises(PlanTooLarge):
        ProbePlan.from_json(huge, max_probes=1_000_000)


@pytest.mark.parametrize(
    "argv",
    [["db"], ["schedule"], ["trials"], ["trials", "runners"], ["trials", "agents"],
     ["archive"], ["telemetry"], ["experiment"], ["atlas"]],
)  # fmt: skip
def test_every_command_of_commands_opens_the_same_way(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """One opening (``kickass_core.cli.group``): run without its action, a command of
    commands prints its help, listing its actions as NAME_COMMAND, and exits 2."""
    from kickass_core import cli

    assert cli.main(argv) == 2
    out = capsys.readouterr().out
    assert out.startswith(f"usage: kickass {' '.join(argv)} ")
    assert f"{argv[-1].upper()}_COMMAND" in out
