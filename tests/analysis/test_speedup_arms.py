"""Which arms the trials' speedups compare, on rows as v_flow_results gives
them (``rollups.compute``, no database): a Kick-Ass arm that gives a share
of its flows to TCP (``kickass@tcp50``) is compared as two arms, its
Kick-Ass flows and its TCP flows (experiment (c), issue 24), each against
the same flows in the TCP arm."""

from __future__ import annotations

from typing import Any

from kickass_analysis import rollups

ARMS = [
    {"name": "kickass@tcp50", "protocol": "kickass", "tcp_share": 0.5},
    {"name": "tcp:cubic", "protocol": "tcp", "tcp_share": 0.0},
]


def _rows(tcp_beside_kickass_ms: float) -> list[dict[str, Any]]:
    """Two pairs of ten flows; in the mixed arm the even flows are TCP (the
    first flow of the arm among them). FCTs: TCP alone 100 ms, Kick-Ass 50,
    TCP beside Kick-Ass ``tcp_beside_kickass_ms``."""
    out = []
    for pair in range(2):
        for i in range(10):
            for arm in ARMS:
                if arm["name"] == "tcp:cubic":
                    protocol, fct = "tcp", 100.0
                elif i % 2 == 0:
                    protocol, fct = "tcp", tcp_beside_kickass_ms
                else:
                    protocol, fct = "kickass", 50.0
                out.append({
                    "trial_id": "t1", "destination": "far", "access_capacity_bps": 10e6,
                    "pair": pair, "flow_index": i, "arm": arm["name"], "protocol": protocol,
                    "size_packets": 50, "completed": True, "fct_ms": fct + pair, "error": None,
                    "parameters": {"arms": ARMS, "workload": {"seed": 1}},
                })  # fmt: skip
    return out


def _all_sizes(rows: list[rollups.SpeedupRow]) -> dict[tuple[str, str], rollups.SpeedupRow]:
    return {
        (r.arm, r.baseline_arm): r
        for r in rows
        if r.scope == "trial" and r.size_bucket == rollups.ALL_SIZES
    }


def test_a_mixed_arm_is_compared_as_its_kickass_flows_and_its_tcp_flows() -> None:
    got = _all_sizes(rollups.compute(_rows(tcp_beside_kickass_ms=125.0)))
    assert set(got) == {("kickass@tcp50", "tcp:cubic"), ("kickass@tcp50[tcp]", "tcp:cubic")}
    ka, share = got[("kickass@tcp50", "tcp:cubic")], got[("kickass@tcp50[tcp]", "tcp:cubic")]
    # Kick-Ass flows only: 5 per pair, twice as fast as the same flows in TCP.
    assert ka.speedup.matched == 10
    assert 1.9 < ka.speedup.estimate < 2.1
    # The TCP share: the same TCP flows alone over beside Kick-Ass.
    assert share.speedup.matched == 10
    assert 0.79 < share.speedup.estimate < 0.81


def test_pooled_rows_split_the_mixed_arm_too() -> None:
    pooled = {
        (r.arm, r.baseline_arm)
        for r in rollups.compute(_rows(100.0))
        if r.scope == "pooled" and r.size_bucket == rollups.ALL_SIZES
    }
    assert pooled == {("kickass@tcp50", "tcp:cubic"), ("kickass@tcp50[tcp]", "tcp:cubic")}


def test_without_scheduled_arms_the_first_flow_names_the_protocol_as_before() -> None:
    rows = [r for r in _rows(100.0) if r["protocol"] == "kickass" or r["arm"] == "tcp:cubic"]
    for r in rows:
        r["parameters"] = {}
    got = _all_sizes(rollups.compute(rows))
    assert set(got) == {("kickass@tcp50", "tcp:cubic")}
