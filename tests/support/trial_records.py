"""Trial and flow records as a runner uploads them (tests of db, server and wan)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from kickass_analysis import rollups
from kickass_core.flow_record import flow_id

T0 = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)


def trial(tid: str, dest: str = "agent-a") -> dict:
    return {
        "trial_id": tid,
        "destination": dest,
        "access_capacity_bps": 10e6,
        "parameters": {"workload": {"seed": 1}},
        "versions": {"ka-transport": "0.1.0"},
        "started_at": T0.isoformat(),
        "periods": [
            {"index": 0, "pair": 0, "protocol": "tcp", "start_s": 0, "duration_s": 120,
             "congestion_control": "cubic"},
            {"index": 1, "pair": 0, "protocol": "kickass", "start_s": 120, "duration_s": 120},
        ],
    }  # fmt: skip


def flow(tid: str, i: int, proto: str, size: int, fct: float | None, frac: float | None) -> dict:
    return {
        "flow_id": flow_id(tid, 0, i),
        "period_index": 0 if proto == "tcp" else 1,
        "protocol": proto,
        "size_bytes": size * 1500,
        "size_packets": size,
        "started_at": (T0 + timedelta(seconds=i)).isoformat(),
        "completed": fct is not None,
        "fct_ms": fct,
        "ka_mode_fraction": frac,
    }


def overall_speedup(speedups: list[dict[str, Any]], arm: str, base: str) -> dict[str, Any]:
    """The one speedup row of ``arm`` against ``base`` over all flow sizes
    (``kickass_analysis.rollups``' rows as a trial's outcome carries them)."""
    rows = [
        r
        for r in speedups
        if (r["arm"], r["baseline_arm"], r["size_bucket"]) == (arm, base, rollups.ALL_SIZES)
    ]
    assert len(rows) == 1, speedups
    return rows[0]
