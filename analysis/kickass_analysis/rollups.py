"""Rollups the scheduled ``refresh`` computes and stores for every reader.

``refresh_speedups``: the trials' speedup on matched flows
(``stats.speedup``) and beside it the share of matched flows finished
sooner under the arm, failures kept (``stats.sooner``), per size bucket and
over all sizes, per trial and pooled over trials of the same destination,
access capacity, workload and arms, written to ``trial_speedups`` (read
through ``v_trial_speedups`` by the dashboards, notebooks, report,
benchmarks and demo) in one transaction: readers see the old rows or the
new ones, never half.

``sooner`` compares every matched flow but those never given their time:
a flow of a period that was skipped (no flow tokens) or of a trial that was
stopped (Ctrl-C, a scheduled round's timeout) did not fail on its own, so
its pair is left out (``given_its_time``); every other flow that did not
complete counts as slower than its twin.

Which arms are compared: in a trial with Kick-Ass and TCP arms, each
Kick-Ass arm against each TCP arm (speedup = FCT(TCP) / FCT(Kick-Ass)); in
one with a single protocol (an A/A calibration, or TCP against TCP), each
arm against the first of the trial's arms (speedup = FCT(first) / FCT(arm)).

``refresh`` brings every rollup of migration 0012 up to date too (the
dashboards read them; db/README.md, "Rollups"):

* the study's, incrementally (migration 0020): the changes of the sessions'
  durable counts written since the last refresh are folded into the day and
  all-time rollups and the distinct clients per size
  (``fold_unit_count_changes``, one transaction: readers, which add the
  changes not yet folded, see the counts before or after, never half);
* the materialised views, with ``REFRESH MATERIALIZED VIEW CONCURRENTLY``
  (readers keep the old rows meanwhile): Atlas's and the trials';
* the router telemetry per second and per minute, incrementally: per run,
  from the last second (minute) already rolled up, which is recomputed (it
  may have been partial); a run whose raw samples end before that (pruned)
  is left as it is.

Each refresh is recorded in ``rollup_refreshes`` (``v_rollup_status``).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Any

from kickass_db.tx import StoreBase
from sqlalchemy import Connection, text

from . import stats

ALL_SIZES = "all"

_FLOWS = text("""
SELECT f.trial_id, f.destination, f.access_capacity_bps, f.pair, f.flow_index, f.arm,
       f.protocol, f.size_packets, f.completed, f.fct_ms, f.error, t.parameters
FROM v_flow_results f JOIN trials t ON t.trial_id = f.trial_id
WHERE f.pair IS NOT NULL AND f.arm IS NOT NULL
""")
# Each period pair's span in time, from what happened (actual starts).
PAIR_SPANS = """
SELECT trial_id, pair,
       extract(epoch FROM min(period_started_at))::float8 AS started,
       extract(epoch FROM max(period_started_at + make_interval(secs => duration_s)))::float8
           AS ended
FROM v_trial_periods
WHERE pair IS NOT NULL {where}
GROUP BY trial_id, pair
"""

PairKey = tuple[str, int]
Span = tuple[float, float]

# How the trial runner (kickass_wan.trials.runner) begins the error of a flow it
# never gave its time: "not run: ..." (its period skipped for want of flow
# tokens, or the trial stopped before it was due) and "interrupted: ..."
# (the trial stopped while it ran). tests/analysis/test_rollups.py holds the
# runner's words to these.
NOT_GIVEN_ITS_TIME = ("not run", "interrupted")


def given_its_time(flow: Mapping[str, Any]) -> bool:
    """Whether a flow ran until it completed, failed or reached its limit."""
    if flow["completed"]:
        return True
    return not str(flow.get("error") or "").startswith(NOT_GIVEN_ITS_TIME)


def pair_spans(conn: Connection, trial_ids: Sequence[str] | None = None) -> dict[PairKey, Span]:
    """(trial_id, pair) -> (started, ended) in epoch seconds."""
    where, params = "", {}
    if trial_ids is not None:
        where, params = "AND trial_id = ANY(:ids)", {"ids": list(trial_ids)}
    rows = conn.execute(text(PAIR_SPANS.format(where=where)), params).mappings()
    return {(r["trial_id"], r["pair"]): (r["started"], r["ended"]) for r in rows}


def pair_clusters(spans: Mapping[PairKey, Span]) -> dict[PairKey, int]:
    """Period pairs that ran at overlapping times (several senders' trials
    through one bottleneck, say) saw the same conditions: one cluster. Pairs
    one after the other (a trial's own) are clusters of their own."""
    labels: dict[PairKey, int] = {}
    cluster, end = -1, -math.inf
    for key, (started, ended) in sorted(spans.items(), key=lambda kv: (kv[1][0], kv[0])):
        if started >= end:
            cluster, end = cluster + 1, ended
        else:
            end = max(end, ended)
        labels[key] = cluster
    return labels


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
    sooner: stats.Sooner

    def to_row(self) -> dict[str, Any]:
        s, q = self.speedup, self.sooner
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
            "clusters": s.clusters,
            "completion_arm": s.completion_kickass,
            "completion_baseline": s.completion_baseline,
            "workload": None if self.workload is None else json.dumps(self.workload),
            "sooner": q.estimate,
            "sooner_low": q.low,
            "sooner_high": q.high,
            "sooner_pairs": q.pairs,
            "sooner_clusters": q.clusters,
        }


# A Kick-Ass arm that gives a share of its flows to TCP (``kickass@tcpNN``,
# the paper's §IV-A light load with half the flows TCP) is compared as two:
# its Kick-Ass flows under the arm's name, and its TCP flows under the arm's
# name and this suffix, against the same flows in each TCP arm. The second is
# experiment (c): TCP flows' FCT without Kick-Ass beside them over their FCT
# with it (1 = Kick-Ass costs TCP nothing).
TCP_SHARE = "[tcp]"


def comparisons(arms: list[str], protocols: Mapping[str, str]) -> list[tuple[str, str]]:
    """(arm, baseline) pairs of a trial with these arms (in schedule order;
    a mixed arm's TCP flows as ``arm + TCP_SHARE``)."""
    shares = [a for a in arms if a.endswith(TCP_SHARE)]
    plain = [a for a in arms if a not in shares]
    kickass = [a for a in plain if protocols.get(a) == "kickass"]
    others = [a for a in plain if protocols.get(a) != "kickass"]
    if kickass and others:
        pairs = [(k, b) for k in kickass for b in others]
    else:
        pairs = [(a, plain[0]) for a in plain[1:]]
    return pairs + [(s, b) for s in shares for b in others]


def _speedups(
    flows: Iterable[Mapping[str, Any]],
    clusters: Mapping[PairKey, int],
    arm_protocols: Mapping[str, str] | None = None,
) -> dict[tuple[str, str, str], tuple[stats.Speedup, stats.Sooner]]:
    """Per (arm, baseline, size bucket or "all"), from one group of trials'
    flows; ``clusters`` from ``pair_clusters`` (a pair missing from it is a
    cluster of its own); ``arm_protocols`` each arm's protocol as the trial
    scheduled it (without it, that of the arm's first flow)."""
    by_flow: dict[tuple[str, int, int], dict[str, Mapping[str, Any]]] = defaultdict(dict)
    arm_order: list[str] = []
    protocols: dict[str, str] = {}
    for f in flows:
        arm, protocol = f["arm"], f["protocol"]
        scheduled = (arm_protocols or {}).get(arm)
        if scheduled == "kickass" and protocol != scheduled:
            arm += TCP_SHARE
        elif scheduled is not None:
            protocol = scheduled
        by_flow[(f["trial_id"], f["pair"], f["flow_index"])][arm] = f
        if arm not in protocols:
            protocols[arm] = protocol
            arm_order.append(arm)
    # The schedule's order where the trial stored it (parameters.arms).
    out: dict[tuple[str, str, str], tuple[stats.Speedup, stats.Sooner]] = {}
    for arm, base in comparisons(arm_order, protocols):
        buckets: dict[str, list[tuple[float | None, float | None]]] = defaultdict(list)
        labels: dict[str, list[Hashable]] = defaultdict(list)
        given: dict[str, list[bool]] = defaultdict(list)
        for (trial_id, pair_index, _), twins in by_flow.items():
            a, b = twins.get(arm), twins.get(base)
            if a is None or b is None:
                continue  # the flow of a period that did not run (skipped)
            fcts = (
                a["fct_ms"] if a["completed"] else None,
                b["fct_ms"] if b["completed"] else None,
            )
            label = clusters.get((trial_id, pair_index), (trial_id, pair_index))
            both_given = given_its_time(a) and given_its_time(b)
            for bucket in (stats.size_bucket(int(a["size_packets"])), ALL_SIZES):
                buckets[bucket].append(fcts)
                labels[bucket].append(label)
                given[bucket].append(both_given)
        for bucket, fcts_of in buckets.items():
            keep = given[bucket]
            out[(arm, base, bucket)] = (
                stats.speedup(fcts_of, labels[bucket]),
                stats.sooner(
                    [f for f, k in zip(fcts_of, keep, strict=True) if k],
                    [m for m, k in zip(labels[bucket], keep, strict=True) if k],
                ),
            )
    return out


def _arm_order(parameters: Mapping[str, Any]) -> list[str]:
    arms = parameters.get("arms") or []
    return [a["name"] for a in arms if isinstance(a, dict) and "name" in a]


def _arm_protocols(parameters: Mapping[str, Any]) -> dict[str, str]:
    arms = parameters.get("arms") or []
    return {
        a["name"]: a["protocol"]
        for a in arms
        if isinstance(a, dict) and isinstance(a.get("name"), str) and a.get("protocol")
    }


def compute(
    rows: Sequence[Mapping[str, Any]],
    spans: Mapping[PairKey, Span] | None = None,
    *,
    trials: bool = True,
) -> list[SpeedupRow]:
    """Every trial's (unless not ``trials``) and every pooled group's speedups
    from v_flow_results rows; ``spans`` (``pair_spans``) decide which period
    pairs are independent clusters (without them, each pair is one)."""
    clusters = pair_clusters(spans or {})
    by_trial: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for r in rows:
        by_trial[r["trial_id"]].append(r)
    out: list[SpeedupRow] = []
    groups: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    group_meta: dict[str, tuple[str, float | None, dict[str, Any]]] = {}
    group_protocols: dict[str, dict[str, str]] = defaultdict(dict)
    for trial_id, flows in by_trial.items():
        first = flows[0]
        params = first["parameters"] or {}
        order = _arm_order(params)
        arm_protocols = _arm_protocols(params)
        flows = sorted(
            flows, key=lambda f: order.index(f["arm"]) if f["arm"] in order else len(order)
        )
        mine = _speedups(flows, clusters, arm_protocols) if trials else {}
        for (arm, base, bucket), (s, q) in mine.items():
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
                    q,
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
        group_protocols[key].update(arm_protocols)
    for key, flows in groups.items():
        dest, cap, identity = group_meta[key]
        for (arm, base, bucket), (s, q) in _speedups(flows, clusters, group_protocols[key]).items():
            out.append(
                SpeedupRow(
                    "pooled", key, dest, cap, arm, base, bucket, s, identity["workload"], q
                )  # fmt: skip
            )
    return out


class RollupStore(StoreBase):
    """Reads the views and writes the rollup tables (``kickass_analysis``)."""

    def refresh_speedups(self) -> int:
        """Recompute ``trial_speedups``; returns the rows written."""

        def work(conn: Connection) -> int:
            rows = [dict(r) for r in conn.execute(_FLOWS).mappings()]
            computed = compute(rows, pair_spans(conn))
            conn.execute(text("DELETE FROM trial_speedups"))
            if computed:
                conn.execute(
                    text(
                        "INSERT INTO trial_speedups (scope, key, destination, "
                        "access_capacity_bps, arm, baseline_arm, size_bucket, pairs, matched, "
                        "speedup, speedup_low, speedup_high, clusters, completion_arm, "
                        "completion_baseline, workload, sooner, sooner_low, sooner_high, "
                        "sooner_pairs, sooner_clusters) VALUES (:scope, :key, :destination, "
                        ":access_capacity_bps, :arm, :baseline_arm, :size_bucket, :pairs, "
                        ":matched, :speedup, :speedup_low, :speedup_high, :clusters, "
                        ":completion_arm, :completion_baseline, CAST(:workload AS jsonb), "
                        ":sooner, :sooner_low, :sooner_high, :sooner_pairs, :sooner_clusters)"
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


# -- the rollups of migration 0012 --------------------------------------------------

OTHER_MATVIEWS = ("mv_atlas_probe_drop", "mv_flow_summary", "mv_flow_hourly")
# The report's trial figures (migration 0014): one snapshot for both, so the
# report can tell from one count whether they hold every flow.
REPORT_MATVIEWS = ("mv_report_fct_bins", "mv_report_ka_mode")

# The study's rollups of the durable counts (migration 0020), in rollup_refreshes.
STUDY_ROLLUP = "unit_counts"
_FOLD = text("SELECT fold_unit_count_changes()")

# Before any sample (Python's datetime has no -infinity).
_BEFORE_ANY = datetime(1970, 1, 1, tzinfo=UTC)

_RECORD = text("""
INSERT INTO rollup_refreshes (name, refreshed_at, rows, seconds)
VALUES (:name, now(), :rows, :seconds)
ON CONFLICT (name) DO UPDATE SET
    refreshed_at = excluded.refreshed_at, rows = excluded.rows, seconds = excluded.seconds
""")

# Per run: its last second rolled up (and of how many samples), and where its
# raw samples end.
_ROUTER_RUNS = text("""
SELECT r.id AS run_id, date_trunc('second', r.started_at) AS base, x.at AS last_at,
       x.samples AS last_samples,
       (SELECT max(s.t) FROM router_telemetry s WHERE s.run_id = r.id) AS raw_max_t
FROM router_runs r
LEFT JOIN LATERAL (
    SELECT at, samples FROM router_telemetry_1s WHERE run_id = r.id ORDER BY at DESC LIMIT 1
) x ON true
ORDER BY r.id
""")
_RAW_SINCE = text("SELECT count(*) FROM router_telemetry WHERE run_id = :r AND t >= :t")

# Both rollups' columns (router_telemetry_1s and _1m) written once, so the
# two INSERTs cannot come to fill them in different orders.
_ROLLUP_COLUMNS = """
    run_id, at, samples, advertised_rate_sum, advertised_rate_min, advertised_rate_max,
    leading_fragment_sum, leading_fragment_n, leading_fragment_min, leading_fragment_max,
    input_rate_sum, output_rate_sum, output_rate_n, queue_bytes_sum, queue_bytes_max,
    kickass_samples, tcp_samples, rtt_ms_sum, rtt_ms_n, drops_max, fragmented_max,
    mode_switches_max"""

_ROLL_SECONDS = text(f"""
INSERT INTO router_telemetry_1s ({_ROLLUP_COLUMNS})
SELECT s.run_id, CAST(:base AS timestamptz) + make_interval(secs => floor(s.t)),
       count(*), sum(s.advertised_rate_bps), min(s.advertised_rate_bps),
       max(s.advertised_rate_bps),
       coalesce(sum(s.leading_fragment_len), 0), count(s.leading_fragment_len),
       min(s.leading_fragment_len), max(s.leading_fragment_len),
       sum(s.input_rate_bps), coalesce(sum(s.output_rate_bps), 0), count(s.output_rate_bps),
       sum(s.queue_bytes), max(s.queue_bytes),
       count(*) FILTER (WHERE s.marking_mode = 'kickass'),
       count(*) FILTER (WHERE s.marking_mode = 'tcp'),
       coalesce(sum(s.rtt_ms), 0), count(s.rtt_ms),
       max(s.drops), max(s.fragmented), max(s.mode_switches)
FROM router_telemetry s
WHERE s.run_id = :run_id AND s.t >= :t_from
GROUP BY s.run_id, floor(s.t)
""")

_MINUTE_RUNS = text("""
SELECT r.id AS run_id, m.at AS last_at, m.samples AS last_samples,
       (SELECT max(x.at) FROM router_telemetry_1s x WHERE x.run_id = r.id) AS src_max
FROM router_runs r
LEFT JOIN LATERAL (
    SELECT at, samples FROM router_telemetry_1m WHERE run_id = r.id ORDER BY at DESC LIMIT 1
) m ON true
ORDER BY r.id
""")
_SECONDS_SINCE = text(
    "SELECT coalesce(sum(samples), 0) FROM router_telemetry_1s WHERE run_id = :r AND at >= :a"
)

_ROLL_MINUTES = text(f"""
INSERT INTO router_telemetry_1m ({_ROLLUP_COLUMNS})
SELECT run_id, date_trunc('minute', at, 'UTC'), sum(samples), sum(advertised_rate_sum),
       min(advertised_rate_min), max(advertised_rate_max), sum(leading_fragment_sum),
       sum(leading_fragment_n), min(leading_fragment_min), max(leading_fragment_max),
       sum(input_rate_sum), sum(output_rate_sum), sum(output_rate_n), sum(queue_bytes_sum),
       max(queue_bytes_max), sum(kickass_samples), sum(tcp_samples), sum(rtt_ms_sum),
       sum(rtt_ms_n), max(drops_max), max(fragmented_max), max(mode_switches_max)
FROM router_telemetry_1s
WHERE run_id = :run_id AND at >= :at_from
GROUP BY run_id, date_trunc('minute', at, 'UTC')
""")


def _refresh_matviews(conn: Connection, names: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for name in names:
        started = time.monotonic()
        # Names from the constants above, never from input.
        conn.execute(text(f"REFRESH MATERIALIZED VIEW CONCURRENTLY {name}"))
        rows = int(conn.execute(text(f"SELECT count(*) FROM {name}")).scalar_one())
        _record(conn, name, rows, started)
        out[name] = rows
    return out


def _record(conn: Connection, name: str, rows: int, started: float) -> None:
    conn.execute(_RECORD, {"name": name, "rows": rows, "seconds": time.monotonic() - started})


def _roll_seconds(conn: Connection) -> int:
    written = 0
    for run in conn.execute(_ROUTER_RUNS).mappings().all():
        if run["raw_max_t"] is None:
            continue  # no raw samples (never had any, or pruned): keep what is rolled up
        t_from = -1.0
        if run["last_at"] is not None:
            t_from = (run["last_at"] - run["base"]).total_seconds()
            if run["raw_max_t"] < t_from:
                continue  # raw samples end before the last second: pruned, keep it
            since = conn.execute(_RAW_SINCE, {"r": run["run_id"], "t": t_from}).scalar_one()
            if since == run["last_samples"]:
                continue  # nothing new since the last second rolled up
            conn.execute(
                text("DELETE FROM router_telemetry_1s WHERE run_id = :r AND at >= :a"),
                {"r": run["run_id"], "a": run["last_at"]},
            )
        params = {"run_id": run["run_id"], "base": run["base"], "t_from": t_from}
        written += conn.execute(_ROLL_SECONDS, params).rowcount
    return written


def _roll_minutes(conn: Connection) -> int:
    written = 0
    for run in conn.execute(_MINUTE_RUNS).mappings().all():
        if run["src_max"] is None:
            continue
        at_from = run["last_at"]
        if at_from is not None:
            if run["src_max"] < at_from:
                continue
            since = conn.execute(_SECONDS_SINCE, {"r": run["run_id"], "a": at_from}).scalar_one()
            if since == run["last_samples"]:
                continue  # nothing new since the last minute rolled up
            conn.execute(
                text("DELETE FROM router_telemetry_1m WHERE run_id = :r AND at >= :a"),
                {"r": run["run_id"], "a": at_from},
            )
        params = {"run_id": run["run_id"], "at_from": at_from or _BEFORE_ANY}
        written += conn.execute(_ROLL_MINUTES, params).rowcount
    return written


class Rollups(RollupStore):
    """Every rollup of migrations 0010 and 0012, refreshed."""

    def refresh_study(self) -> dict[str, int]:
        """Fold the durable counts' changes in; how many were folded."""
        started = time.monotonic()

        def work(conn: Connection) -> dict[str, int]:
            folded = int(conn.execute(_FOLD).scalar_one())
            _record(conn, STUDY_ROLLUP, folded, started)
            return {STUDY_ROLLUP: folded}

        return self.run(work)

    def refresh_report(self) -> dict[str, int]:
        def work(conn: Connection) -> dict[str, int]:
            return _refresh_matviews(conn, REPORT_MATVIEWS)

        return self.run(work, isolation="REPEATABLE READ")

    def refresh_matviews(self, names: Iterable[str] = OTHER_MATVIEWS) -> dict[str, int]:
        out: dict[str, int] = {}
        for name in names:  # one transaction each: no lock held longer than needed
            out.update(self.run(partial(_refresh_matviews, names=(name,))))
        return out

    def refresh_router(self) -> dict[str, int]:
        return {
            "router_telemetry_1s": self._recorded("router_telemetry_1s", _roll_seconds),
            "router_telemetry_1m": self._recorded("router_telemetry_1m", _roll_minutes),
        }

    def refresh_trial_speedups(self) -> int:
        started = time.monotonic()
        rows = self.refresh_speedups()
        self.run(partial(_record, name="trial_speedups", rows=rows, started=started))
        return rows

    def _recorded(self, name: str, roll: Callable[[Connection], int]) -> int:
        started = time.monotonic()

        def work(conn: Connection) -> int:
            rows = roll(conn)
            _record(conn, name, rows, started)
            return rows

        return self.run(work)


def refresh(database_url: str | None = None) -> dict[str, int]:
    """Every rollup, brought up to date (the scheduled ``refresh`` item's work).

    Returns rows per rollup: what a materialised view or ``trial_speedups``
    holds now, what this refresh (re)wrote of the router's seconds and minutes,
    how many changes of the durable counts it folded in (``unit_counts``).
    """
    with Rollups(database_url) as store:
        out = {"trial_speedups": store.refresh_trial_speedups()}
        out.update(store.refresh_study())
        out.update(store.refresh_matviews())
        out.update(store.refresh_report())
        out.update(store.refresh_router())
        return out
