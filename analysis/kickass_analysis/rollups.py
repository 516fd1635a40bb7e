"""Rollups the scheduled ``refresh`` computes and stores for every reader.

``refresh_speedups``: the trials' speedup on matched flows
(``stats.speedup``), per size bucket and over all sizes, per trial and
pooled over trials of the same destination, access capacity, workload and
arms, written to ``trial_speedups`` (read through ``v_trial_speedups`` by
the dashboards, notebooks, report, benchmarks and demo) in one transaction:
readers see the old rows or the new ones, never half.

Which arms are compared: in a trial with Kick-Ass and TCP arms, each
Kick-Ass arm against each TCP arm (speedup = FCT(TCP) / FCT(Kick-Ass)); in
one with a single protocol (an A/A calibration, or TCP against TCP), each
arm against the first of the trial's arms (speedup = FCT(first) / FCT(arm)).
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kickass_db.tx import StoreBase
from sqlalchemy import Connection, text

from . import stats

ALL_SIZES = "all"

_FLOWS = text("""
SELECT f.trial_id, f.destination, f.access_capacity_bps, f.pair, f.flow_index, f.arm,
       f.protocol, f.size_packets, f.completed, f.fct_ms, t.parameters
FROM v_flow_results f JOIN trials t ON t.trial_id = f.trial_id
WHERE f.pair IS NOT NULL AND f.arm IS NOT NULL
""")


@dataclass(frozen=True)
class SpeedupRow:
    scope: str
    key: str
    destination: str
    access_capacity_bps: float | None
    arm: str
    baseline_arm: str
    size_bucket: str
    speedup: stats.Speedup
    workload: dict[str, Any] | None

    def to_row(self) -> dict[str, Any]:
        s = self.speedup
        return {
            "scope": self.scope,
            "key": self.key,
            "destination": self.destination,
            "access_capacity_bps": self.access_capacity_bps,
            "arm": self.arm,
            "baseline_arm": self.baseline_arm,
            "size_bucket": self.size_bucket,
            "pairs": s.pairs,
            "matched": s.matched,
            "speedup": s.estimate,
            "speedup_low": s.low,
            "speedup_high": s.high,
            "completion_arm": s.completion_kickass,
            "completion_baseline": s.completion_baseline,
            "workload": None if self.workload is None else json.dumps(self.workload),
        }


def comparisons(arms: list[str], protocols: Mapping[str, str]) -> list[tuple[str, str]]:
    """(arm, baseline) pairs of a trial with these arms (in schedule order)."""
    kickass = [a for a in arms if protocols.get(a) == "kickass"]
    others = [a for a in arms if protocols.get(a) != "kickass"]
    if kickass and others:
        return [(k, b) for k in kickass for b in others]
    return [(a, arms[0]) for a in arms[1:]]


def _speedups(
    flows: Iterable[Mapping[str, Any]],
) -> dict[tuple[str, str, str], stats.Speedup]:
    """Per (arm, baseline, size bucket or "all"), from one group of trials' flows."""
    by_flow: dict[tuple[str, int, int], dict[str, Mapping[str, Any]]] = defaultdict(dict)
    arm_order: list[str] = []
    protocols: dict[str, str] = {}
    for f in flows:
        by_flow[(f["trial_id"], f["pair"], f["flow_index"])][f["arm"]] = f
        if f["arm"] not in protocols:
            protocols[f["arm"]] = f["protocol"]
            arm_order.append(f["arm"])
    # The schedule's order where the trial stored it (parameters.arms).
    out: dict[tuple[str, str, str], stats.Speedup] = {}
    for arm, base in comparisons(arm_order, protocols):
        buckets: dict[str, list[tuple[float | None, float | None]]] = defaultdict(list)
        for twins in by_flow.values():
            a, b = twins.get(arm), twins.get(base)
            if a is None or b is None:
                continue  # the flow of a period that did not run (skipped)
            pair = (
                a["fct_ms"] if a["completed"] else None,
                b["fct_ms"] if b["completed"] else None,
            )
            buckets[stats.size_bucket(int(a["size_packets"]))].append(pair)
            buckets[ALL_SIZES].append(pair)
        for bucket, pairs in buckets.items():
            out[(arm, base, bucket)] = stats.speedup(pairs)
    return out


def _arm_order(parameters: Mapping[str, Any]) -> list[str]:
    arms = parameters.get("arms") or []
    return [a["name"] for a in arms if isinstance(a, dict) and "name" in a]


def compute(rows: Sequence[Mapping[str, Any]]) -> list[SpeedupRow]:
    """Every trial's and every pooled group's speedups from v_flow_results rows."""
    by_trial: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for r in rows:
        by_trial[r["trial_id"]].append(r)
    out: list[SpeedupRow] = []
    groups: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    group_meta: dict[str, tuple[str, float | None, dict[str, Any]]] = {}
    for trial_id, flows in by_trial.items():
        first = flows[0]
        params = first["parameters"] or {}
        order = _arm_order(params)
        flows = sorted(
            flows, key=lambda f: order.index(f["arm"]) if f["arm"] in order else len(order)
        )
        for (arm, base, bucket), s in _speedups(flows).items():
            out.append(
                SpeedupRow(
                    "trial",
                    trial_id,
                    first["destination"],
                    first["access_capacity_bps"],
                    arm,
                    base,
                    bucket,
                    s,
                    params.get("workload"),
                )  # fmt: skip
            )
        identity = {
            "destination": first["destination"],
            "capacity": first["access_capacity_bps"],
            "workload": {k: v for k, v in (params.get("workload") or {}).items() if k != "seed"},
            "arms": order,
            "period_s": params.get("period_s"),
        }
        key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
        groups[key].extend(flows)
        group_meta[key] = (first["destination"], first["access_capacity_bps"], identity)
    for key, flows in groups.items():
        dest, cap, identity = group_meta[key]
        for (arm, base, bucket), s in _speedups(flows).items():
            out.append(
                SpeedupRow(
                    "pooled", key, dest, cap, arm, base, bucket, s, identity["workload"]
                )  # fmt: skip
            )
    return out


class RollupStore(StoreBase):
    """Reads the views and writes the rollup tables (``kickass_analysis``)."""

    def refresh_speedups(self) -> int:
        """Recompute ``trial_speedups``; returns the rows written."""

        def work(conn: Connection) -> int:
            rows = [dict(r) for r in conn.execute(_FLOWS).mappings()]
            computed = compute(rows)
            conn.execute(text("DELETE FROM trial_speedups"))
            if computed:
                conn.execute(
                    text(
                        "INSERT INTO trial_speedups (scope, key, destination, "
                        "access_capacity_bps, arm, baseline_arm, size_bucket, pairs, matched, "
                        "speedup, speedup_low, speedup_high, completion_arm, "
                        "completion_baseline, workload) VALUES (:scope, :key, :destination, "
                        ":access_capacity_bps, :arm, :baseline_arm, :size_bucket, :pairs, "
                        ":matched, :speedup, :speedup_low, :speedup_high, :completion_arm, "
                        ":completion_baseline, CAST(:workload AS jsonb))"
                    ),
                    [c.to_row() for c in computed],
                )
            return len(computed)

        return self.run(work)

    def speedups(self, trial_ids: list[str] | None = None) -> list[dict[str, Any]]:
        """Rows of v_trial_speedups (per trial for ``trial_ids``, else all)."""
        sql = "SELECT * FROM v_trial_speedups"
        params: dict[str, Any] = {}
        if trial_ids is not None:
            sql += " WHERE scope = 'trial' AND key = ANY(:ids)"
            params["ids"] = trial_ids
        sql += " ORDER BY scope, key, arm, baseline_arm, size_bucket"
        return self.run(lambda c: [dict(r) for r in c.execute(text(sql), params).mappings()])


def refresh(database_url: str | None = None) -> dict[str, int]:
    """Every rollup, recomputed (the scheduled ``refresh`` item's work)."""
    with RollupStore(database_url) as store:
        return {"trial_speedups": store.refresh_speedups()}
