"""The speedup rollup on a real database: matched flows, per bucket and pooled."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime, timedelta

import pytest
from kickass_analysis.rollups import RollupStore
from kickass_core.flow_record import flow_id
from kickass_db.trial_store import TrialStore

T0 = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)


def _trial(tid: str, arms: list[tuple[str, str]], pairs: int) -> dict:
    periods = []
    for pair in range(pairs):
        for arm, proto in arms:
            periods.append({"index": len(periods), "pair": pair, "protocol": proto, "arm": arm,
                            "start_s": 130.0 * len(periods), "duration_s": 120.0})  # fmt: skip
    return {
        "trial_id": tid,
        "destination": "far-1",
        "access_capacity_bps": 10e6,
        "parameters": {
            "workload": {"mean_packets": 100.0, "seed": 1},
            "arms": [{"name": a, "protocol": p} for a, p in arms],
            "period_s": 120.0,
        },
        "started_at": T0.isoformat(),
        "periods": periods,
    }


def _flows(tid: str, trial: dict, fct: dict[str, float], fail: set[tuple[int, str]]) -> list:
    """Per period, the same 6 flows (sizes 5, 50, 500 packets, twice): the
    paired design; FCT = size x fct[arm]; (index, arm) in ``fail`` did not complete."""
    out = []
    for p in trial["periods"]:
        for i, size in enumerate((5, 50, 500, 5, 50, 500)):
            done = (i, p["arm"]) not in fail
            out.append({
                "flow_id": flow_id(tid, p["index"], i), "period_index": p["index"],
                "pair": p["pair"], "arm": p["arm"], "protocol": p["protocol"],
                "size_bytes": size * 1440, "size_packets": size,
                "started_at": (T0 + timedelta(seconds=p["start_s"] + i)).isoformat(),
                "completed": done, "fct_ms": size * fct[p["arm"]] if done else None,
                "negotiated_protocol": p["protocol"],
            })  # fmt: skip
    return out


@pytest.fixture
def store(database_url: str):  # noqa: ANN201
    trials = TrialStore(database_url)
    runner = trials.authenticate(trials.add_runner("roll"))
    yield trials, runner, RollupStore(database_url)
    trials.close()


def test_speedup_per_bucket_on_matched_flows(store) -> None:  # noqa: ANN001
    trials, runner, rollups = store
    tid = secrets.token_hex(16)
    trial = _trial(tid, [("kickass", "kickass"), ("tcp:cubic", "tcp")], pairs=2)
    trials.put_trial(runner, trial)
    # TCP takes 3x as long; flow 1 (50 packets) failed under TCP in both pairs.
    flows = _flows(tid, trial, {"kickass": 2.0, "tcp:cubic": 6.0}, {(1, "tcp:cubic")})
    assert not trials.put_flows(runner, tid, flows).conflicts
    assert rollups.refresh_speedups() > 0
    rows = {(r["scope"], r["size_bucket"]): r for r in rollups.speedups()}
    every = rows[("trial", "all")]
    assert (every["arm"], every["baseline_arm"]) == ("kickass", "tcp:cubic")
    assert every["pairs"] == 12 and every["matched"] == 10
    assert every["speedup"] == pytest.approx(3.0)
    assert every["completion_arm"] == 1.0 and every["completion_baseline"] == pytest.approx(10 / 12)
    mid = rows[("trial", "11-100")]
    assert (mid["pairs"], mid["matched"]) == (4, 2)  # the failed twins leave the ratio
    assert rows[("pooled", "all")]["speedup"] == pytest.approx(3.0)
    # Refreshed again: the same rows, not twice as many.
    before = len(rollups.speedups())
    rollups.refresh_speedups()
    assert len(rollups.speedups()) == before


def test_an_a_a_trial_compares_its_arms_with_the_first(store) -> None:  # noqa: ANN001
    trials, runner, rollups = store
    tid = secrets.token_hex(16)
    trial = _trial(tid, [("tcp:cubic", "tcp"), ("tcp:cubic#2", "tcp")], pairs=3)
    trials.put_trial(runner, trial)
    trials.put_flows(runner, tid, _flows(tid, trial, {"tcp:cubic": 5.0, "tcp:cubic#2": 5.0}, set()))
    rollups.refresh_speedups()
    (row,) = [r for r in rollups.speedups([tid]) if r["size_bucket"] == "all"]
    assert (row["arm"], row["baseline_arm"]) == ("tcp:cubic#2", "tcp:cubic")
    assert row["speedup"] == pytest.approx(1.0) and row["speedup_low"] == pytest.approx(1.0)
