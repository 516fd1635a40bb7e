"""The report's readers: every view it shows, read in one snapshot.

``ReportStore.read`` runs ``READERS`` (one per section, in the page's order:
bench/dashboards_bench.py times each) in one REPEATABLE READ transaction
into a ``ReportData``; what each reads and why (the rollups, the live half
no refresh has seen yet, the filters) is said beside its SQL, and in the
package's docstring.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import kickass_db as db
from kickass_core.errors import KickassError
from kickass_db.experiment_store import (
    ExperimentRun,
    read_rates,
    read_router_modes,
    read_runs,
)
from kickass_db.tx import StoreBase
from sqlalchemy import Connection, text

from .. import experiments_section, figures, rollups, stats
from ..networks import NetworkTable

MAX_ROUTER_RUNS = 6
MAX_FAILURES = 50


@dataclass(frozen=True)
class Filters:
    campaign: str | None = None
    since: datetime | None = None

    def params(self) -> dict[str, Any]:
        return {"campaign": self.campaign, "since": self.since}


# -- reading the views ---------------------------------------------------------------------

_SINCE = "(CAST(:since AS timestamptz) IS NULL OR {col} >= CAST(:since AS timestamptz))"
_CAMPAIGN = "(CAST(:campaign AS text) IS NULL OR {col} = CAST(:campaign AS text))"

# Per source, phase and size, pooled: the day rollup (v_drop_rollup, migration
# 0012; sessions finished since the last refresh are counted live). A
# ``since`` keeps whole UTC days: volunteer sessions created, Atlas probes
# last heard from, on since's day or later.
_DROP = f"""
SELECT source, phase, ip_len AS size, sum(sessions)::bigint AS sessions,
       sum(sent)::bigint AS sent, sum(acked)::bigint AS acked
FROM v_drop_rollup
WHERE phase IN ('whole', 'split')
  AND (CAST(:since AS timestamptz) IS NULL
       OR day >= date_trunc('day', CAST(:since AS timestamptz), 'UTC'))
  AND (source <> 'atlas' OR {_CAMPAIGN.format(col="campaign")})
GROUP BY source, phase, ip_len
ORDER BY source, phase, ip_len
"""
# Atlas's part of v_drop_rollup has no live half: while results were stored
# after its last refresh (or none ran yet), the same counts from the outcomes.
_ATLAS_ROLLUP_CURRENT = """
SELECT r.refreshed_at IS NOT NULL
       AND r.refreshed_at >= coalesce((SELECT max(fetched_at) FROM atlas_results),
                                      '-infinity'::timestamptz)
FROM (VALUES ('mv_atlas_probe_drop')) v(name)
LEFT JOIN rollup_refreshes r ON r.name = v.name
"""
_ATLAS_DROP = f"""
SELECT 'atlas' AS source, a.phase, a.ip_len AS size, count(*) AS sessions,
       sum(a.sent)::bigint AS sent, sum(a.acked)::bigint AS acked
FROM (
    SELECT campaign_id, prb_id, phase, ip_len::integer AS ip_len,
           count(*) FILTER (WHERE outcome IN ('acked', 'lost', 'late')) AS sent,
           count(*) FILTER (WHERE outcome = 'acked') AS acked,
           max(result_at) AS last_result_at
    FROM atlas_outcomes WHERE ip_len IS NOT NULL
    GROUP BY campaign_id, prb_id, phase, ip_len
) a
JOIN atlas_campaigns c ON c.id = a.campaign_id
WHERE a.sent > 0 AND {_CAMPAIGN.format(col="c.name")}
  AND (CAST(:since AS timestamptz) IS NULL
       OR a.last_result_at >= date_trunc('day', CAST(:since AS timestamptz), 'UTC'))
GROUP BY a.phase, a.ip_len
"""
_VOLUNTEER_CLIENTS = f"""
SELECT client_id, host(last_address) AS address, latest_verdict AS verdict
FROM v_client_verdicts
WHERE latest_verdict IS NOT NULL AND {_SINCE.format(col="latest_finished_at")}
"""
_ATLAS_VERDICTS = f"""
SELECT campaign, prb_id, verdict, asn, country_code
FROM v_verdicts_by_source
WHERE source = 'atlas' AND {_CAMPAIGN.format(col="campaign")}
  AND {_SINCE.format(col="finished_at")}
"""
# The trials' figures and tables, computed by PostgreSQL (migration 0014):
# from the rollup while it holds every flow and nothing is filtered,
# else from the flows (report_fct_bins, report_ka_mode: the same SQL).
# Current: it holds every flow (both views are refreshed in one snapshot;
# flows are stored with their own start times, often long after them, so a
# count is the test, not a time).
_TRIALS_ROLLUP_CURRENT = """
SELECT (SELECT flows FROM v_flow_count)
       = (SELECT coalesce(sum(flows), 0) FROM v_report_fct_bins WHERE size_bin IS NOT NULL)
"""
_FCT_BINS = {
    "rollup": "SELECT * FROM v_report_fct_bins",
    "live": "SELECT * FROM report_fct_bins(CAST(:since AS timestamptz))",
}
_KA_MODE = {
    "rollup": "SELECT * FROM v_report_ka_mode",
    "live": f"SELECT * FROM report_ka_mode(CAST(:since AS timestamptz), {figures.MAX_POINTS})",
}
# The flows the speedup pairs, for a report the rollup cannot answer.
_PAIRED_FLOWS = f"""
SELECT trial_id, destination, access_capacity_bps, protocol,
       coalesce(arm, protocol || coalesce(':' || congestion_control, '')) AS arm,
       size_packets, completed, fct_ms, error, pair, flow_index
FROM v_flow_results
WHERE pair IS NOT NULL AND {_SINCE.format(col="started_at")}
"""
_SPEEDUPS = """
SELECT * FROM v_trial_speedups WHERE scope = 'pooled'
ORDER BY destination, access_capacity_bps, arm, baseline_arm, size_bucket
"""
# Kick-Ass flows that fell back to TCP from the start (negotiated_protocol):
# from the hourly rollup while it holds every flow, else from the flows.
_FLOW_HOURLY_CURRENT = """
SELECT (SELECT flows FROM v_flow_count) = (SELECT coalesce(sum(flows), 0) FROM v_flow_hourly)
"""
_FALLBACKS_ROLLUP = """
SELECT access_capacity_bps, arm, sum(flows)::bigint AS flows,
       sum(fell_back_to_tcp)::bigint AS fell_back
FROM v_flow_hourly WHERE protocol = 'kickass'
GROUP BY access_capacity_bps, arm
"""
_FALLBACKS_LIVE = f"""
SELECT access_capacity_bps, coalesce(arm, protocol) AS arm, count(*) AS flows,
       count(*) FILTER (WHERE negotiated_protocol = 'tcp') AS fell_back
FROM v_flow_results WHERE protocol = 'kickass' AND {_SINCE.format(col="started_at")}
GROUP BY access_capacity_bps, coalesce(arm, protocol)
"""
# The router from its rollups (migration 0012): a run's minutes up to its
# last rolled-up minute, then its seconds up to its last rolled-up second,
# then the raw samples after that (what no refresh has seen yet). Each row:
# a span's time, samples and sums.
_ROUTER_RUNS = """
SELECT r.run_id, r.run_name, r.router_kind, r.capacity_bps,
       date_trunc('second', r.started_at) AS base,
       -- ORDER BY ... LIMIT 1, not max(): through the view's join only this
       -- walks the (run_id, at) index instead of every second of the run.
       (SELECT at FROM v_router_telemetry_1m WHERE run_id = r.run_id
        ORDER BY at DESC LIMIT 1) AS last_minute,
       (SELECT at FROM v_router_telemetry_1s WHERE run_id = r.run_id
        ORDER BY at DESC LIMIT 1) AS last_second
FROM v_router_runs r
"""
# The views' means times their counts give back the rollups' sums.
_ROLLED = """
SELECT at, samples, advertised_rate_bps * samples AS ar,
       coalesce(leading_fragment_len * fragmenting_samples, 0) AS lf,
       fragmenting_samples AS lfn, queue_bytes * samples AS q, kickass_samples AS ka,
       tcp_samples AS tcp
FROM v_router_telemetry_{res}
"""
_ROUTER_SPANS = """
{minutes}
WHERE run_id = :run_id AND at < CAST(:last_minute AS timestamptz) AND {since_at}
UNION ALL
{seconds}
WHERE run_id = :run_id
  AND at >= coalesce(CAST(:last_minute AS timestamptz), '-infinity'::timestamptz)
  AND at < CAST(:last_second AS timestamptz) AND {since_at}
UNION ALL
SELECT CAST(:base AS timestamptz) + make_interval(secs => t), 1, advertised_rate_bps,
       coalesce(leading_fragment_len, 0), (leading_fragment_len IS NOT NULL)::int,
       queue_bytes, (marking_mode = 'kickass')::int, (marking_mode = 'tcp')::int
FROM v_router_telemetry
WHERE run_id = :run_id AND t >= :raw_from AND t >= :t_since
""".format(
    minutes=_ROLLED.format(res="1m"),
    seconds=_ROLLED.format(res="1s"),
    since_at=_SINCE.format(col="at"),
)
# Where a run's samples begin and end: its raw samples, found by walking the
# (run_id, t) index from either end, while their days are kept raw
# (v_router_telemetry is a window: kickass archive retires older days); an end
# whose raw samples are gone (its 1 s rollup starts before, or ends after,
# the raw samples' own second) is that rollup's first or last second.
_ROUTER_BOUNDS = """
SELECT CASE WHEN raw.first_at IS NULL OR rolled.first_at < date_trunc('second', raw.first_at)
            THEN rolled.first_at ELSE raw.first_at END AS first_at,
       CASE WHEN raw.last_at IS NULL OR rolled.last_at > date_trunc('second', raw.last_at)
            THEN rolled.last_at ELSE raw.last_at END AS last_at,
       raw.first_at IS NOT NULL
           AND coalesce(rolled.first_at >= date_trunc('second', raw.first_at), true) AS raw_whole,
       raw.last_at AS raw_last_at
FROM (
    SELECT CAST(:base AS timestamptz) + make_interval(secs => (
               SELECT t FROM v_router_telemetry WHERE run_id = :run_id AND t >= :t_since
               ORDER BY t LIMIT 1)) AS first_at,
           CAST(:base AS timestamptz) + make_interval(secs => (
               SELECT t FROM v_router_telemetry WHERE run_id = :run_id AND t >= :t_since
               ORDER BY t DESC LIMIT 1)) AS last_at
) raw, (
    SELECT (SELECT at FROM v_router_telemetry_1s WHERE run_id = :run_id AND {since_at}
            ORDER BY at LIMIT 1) AS first_at,
           (SELECT at FROM v_router_telemetry_1s WHERE run_id = :run_id AND {since_at}
            ORDER BY at DESC LIMIT 1) AS last_at
) rolled
""".format(since_at=_SINCE.format(col="at"))
_ROUTER_SUMS = """
       count(*) AS spans, sum(samples)::bigint AS samples, sum(ar) AS ar, sum(lf) AS lf,
       sum(lfn)::bigint AS lfn, sum(q) AS q, sum(ka)::bigint AS ka, sum(tcp)::bigint AS tcp
"""
# Short runs: a point per span (a sample, a second, a minute).
_ROUTER_POINTS = f"""
SELECT extract(epoch FROM at - CAST(:t0 AS timestamptz))::float8 AS x, {_ROUTER_SUMS}
FROM ({_ROUTER_SPANS}) u GROUP BY at ORDER BY at
"""
# Longer ones: MAX_POINTS time buckets, each at its spans' mean time; one
# pass, the run's totals are the buckets' sums.
_ROUTER_BUCKETS = f"""
SELECT avg(extract(epoch FROM at - CAST(:t0 AS timestamptz)))::float8 AS x, {_ROUTER_SUMS}
FROM ({_ROUTER_SPANS}) u
GROUP BY floor(extract(epoch FROM at - CAST(:t0 AS timestamptz)) / :width)
ORDER BY 1
"""
_ITEM_OUTCOMES = f"""
SELECT item, kind, outcome, count(*) AS runs
FROM v_item_runs WHERE {_SINCE.format(col="due_at")}
GROUP BY item, kind, outcome ORDER BY item, outcome
"""
_ITEM_FAILURES = f"""
SELECT item, kind, due_at, host, attempt, outcome, reason, duration_s, dead_attempts
FROM v_item_runs
WHERE outcome IN ('failed', 'timeout') AND {_SINCE.format(col="due_at")}
ORDER BY due_at DESC, item LIMIT {MAX_FAILURES}
"""
_ATLAS_MEASUREMENTS = f"""
SELECT campaign, msm_id, phase, ip_len, status_name, results_fetched, credits_spent,
       last_fetch_at, last_error
FROM v_atlas_measurements WHERE {_CAMPAIGN.format(col="campaign")}
ORDER BY campaign, phase, ip_len, msm_id
"""


def _rows(conn: Connection, sql: str, params: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [dict(r) for r in conn.execute(text(sql), dict(params)).mappings()]


@dataclass
class ReportData:
    """Everything the report shows, read in one snapshot."""

    filters: Filters
    generated_at: datetime
    database: str
    size: dict[str, list[stats.SizeRate]] = field(default_factory=dict)  # source -> rates
    split: dict[str, list[stats.SizeRate]] = field(default_factory=dict)
    verdicts: dict[str, list[tuple[str, str, str | None]]] = field(default_factory=dict)
    fct_bins: list[dict[str, Any]] = field(default_factory=list)  # report_fct_bins rows
    ka_mode: list[dict[str, Any]] = field(default_factory=list)  # report_ka_mode rows
    trials_source: str = "rollup"  # or "live": computed from the flows on this read
    speedups: list[dict[str, Any]] = field(default_factory=list)
    speedups_computed: bool = False
    fallbacks: list[dict[str, Any]] = field(default_factory=list)  # per capacity and arm
    router_runs: list[dict[str, Any]] = field(default_factory=list)
    router_series: list[figures.RunSeries] = field(default_factory=list)
    experiment_runs: list[ExperimentRun] = field(default_factory=list)
    experiments: list[experiments_section.Experiment] = field(default_factory=list)  # drawn
    item_outcomes: list[dict[str, Any]] = field(default_factory=list)
    item_failures: list[dict[str, Any]] = field(default_factory=list)
    atlas_measurements: list[dict[str, Any]] = field(default_factory=list)


class ReportStore(StoreBase):
    """Reads the views the report shows."""

    def read(self, filters: Filters, networks: NetworkTable | None = None) -> ReportData:
        def work(conn: Connection) -> ReportData:
            data = ReportData(filters, datetime.now(UTC), db.describe_url(self.database_url))
            for read in READERS.values():
                read(conn, data, networks)
            return data

        return self.run(work, isolation="REPEATABLE READ")


def read_study(conn: Connection, data: ReportData, networks: NetworkTable | None) -> None:
    p = data.filters.params()
    rows = _rows(conn, _DROP, p)
    if not conn.execute(text(_ATLAS_ROLLUP_CURRENT)).scalar_one():
        rows = [r for r in rows if r["source"] != "atlas"] + _rows(conn, _ATLAS_DROP, p)
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault((r["phase"], r["source"]), []).append(r)
    for phase, attr in (("whole", "size"), ("split", "split")):
        rates = {
            src: stats.drop_by_size(rs, "size")
            for (ph, src), rs in sorted(by.items())
            if ph == phase
        }
        setattr(data, attr, {src: r for src, r in rates.items() if r})
    # One verdict per client (volunteers: the latest session's; Atlas: per
    # probe and campaign), with the client's country and network.
    vol = []
    for r in _rows(conn, _VOLUNTEER_CLIENTS, p):
        net = networks.lookup(r["address"]) if networks is not None else None
        vol.append(
            (
                net.country or "unknown" if net else "unknown",
                f"AS{net.asn}" if net else "unknown",
                r["verdict"],
            )
        )
    atlas = [
        (
            r["country_code"] or "unknown",
            f"AS{r['asn']}" if r["asn"] is not None else "unknown",
            r["verdict"],
        )
        for r in _rows(conn, _ATLAS_VERDICTS, p)
    ]
    data.verdicts = {k: v for k, v in (("volunteer", vol), ("atlas", atlas)) if v}


def read_trials(conn: Connection, data: ReportData, networks: NetworkTable | None) -> None:
    p = data.filters.params()
    current = conn.execute(text(_TRIALS_ROLLUP_CURRENT)).scalar_one()
    data.trials_source = "rollup" if data.filters.since is None and current else "live"
    data.fct_bins = _rows(conn, _FCT_BINS[data.trials_source], p)
    data.ka_mode = _rows(conn, _KA_MODE[data.trials_source], p)
    hourly = data.filters.since is None and conn.execute(text(_FLOW_HOURLY_CURRENT)).scalar_one()
    data.fallbacks = _rows(conn, _FALLBACKS_ROLLUP if hourly else _FALLBACKS_LIVE, p)
    if data.filters.since is None:
        data.speedups = _rows(conn, _SPEEDUPS, p)
    if not data.speedups:
        # The rollup is empty (no refresh ran yet) or the flows are filtered:
        # the same computation on the flows shown here.
        paired = [
            {**f, "parameters": None}
            for f in _rows(conn, _PAIRED_FLOWS, p)
            if f["flow_index"] is not None
        ]
        if paired:
            spans = rollups.pair_spans(conn, sorted({f["trial_id"] for f in paired}))
            computed = [r.to_row() for r in rollups.compute(paired, spans, trials=False)]
            data.speedups = computed
            data.speedups_computed = bool(computed)


def _router_values(r: Mapping[str, Any]) -> dict[str, float | None]:
    n, ka_tcp = r["samples"], (r["ka"] or 0) + (r["tcp"] or 0)
    return {
        "advertised_rate": r["ar"] / n if n else None,
        "leading_fragment_len": r["lf"] / r["lfn"] if r["lfn"] else None,
        "queue": r["q"] / n if n else None,
        "kickass_mode": (r["ka"] or 0) / ka_tcp if ka_tcp else None,
    }


def read_router(conn: Connection, data: ReportData, networks: NetworkTable | None) -> None:
    p = data.filters.params()
    since = data.filters.since
    runs = []
    for run in _rows(conn, _ROUTER_RUNS, p):
        base, last_second = run["base"], run["last_second"]
        q = {
            **p,
            "run_id": run["run_id"],
            "base": base,
            "last_minute": run["last_minute"],
            "last_second": last_second,
            "raw_from": (last_second - base).total_seconds() if last_second else -math.inf,
            # The run's own clock (start + t), as its rollups count time.
            "t_since": (since - base).total_seconds() if since else -math.inf,
        }
        bounds = _rows(conn, _ROUTER_BOUNDS, q)[0]
        if bounds["first_at"] is None:
            continue
        raw_whole, raw_last = bounds.pop("raw_whole"), bounds.pop("raw_last_at")
        q["raw_whole"] = raw_whole
        if last_second is not None and (raw_last is None or raw_last < last_second):
            # The raw samples of its last rolled-up second are retired: that
            # second is read from the rollup too.
            q["last_second"] = last_second + timedelta(seconds=1)
            q["raw_from"] = (q["last_second"] - base).total_seconds()
        runs.append({**run, **bounds, "params": q})
    runs.sort(key=lambda r: (r["last_at"], r["run_id"]), reverse=True)
    for n, run in enumerate(runs):
        first, last = run["first_at"], run["last_at"]
        span_s = (last - first).total_seconds()
        width = span_s / (figures.MAX_POINTS - 1) if span_s > 0 else 1.0
        q = {**run.pop("params"), "t0": first, "width": width}
        # The coarsest rollup still finer than a figure's bucket (a short run
        # is drawn from its raw samples, however recently refreshed, while
        # they are all kept raw).
        if width < 60:
            q["last_minute"] = None
        if width < 1 and q.pop("raw_whole"):
            q["last_second"], q["raw_from"] = None, -math.inf
        q.pop("raw_whole", None)
        buckets = _rows(conn, _ROUTER_BUCKETS, q)
        totals = {
            k: sum(b[k] or 0 for b in buckets)
            for k in ("spans", "samples", "ar", "lf", "lfn", "q", "ka", "tcp")
        }
        mean = _router_values(totals)
        run.update(
            samples=totals["samples"],
            advertised_rate_mean=mean["advertised_rate"],
            queue_mean=mean["queue"],
            kickass_share=mean["kickass_mode"],
        )
        if n >= MAX_ROUTER_RUNS:
            continue
        pts = buckets
        if totals["samples"] <= figures.MAX_POINTS:
            pts = _rows(conn, _ROUTER_POINTS, q)  # few: one point each
        values = [_router_values(r) for r in pts]
        data.router_series.append(
            figures.RunSeries(
                _run_label(run),
                [float(r["x"]) for r in pts],
                {panel: [v[panel] for v in values] for panel, _, _ in figures.ROUTER_PANELS},
            )
        )
    data.router_runs = runs


def read_experiments(conn: Connection, data: ReportData, networks: NetworkTable | None) -> None:
    """The congestion experiments' runs (since the report's ``since``), the
    latest ``experiments_section.MAX_RUNS`` with their rates and router
    samples, for ``experiments_section.section``."""
    runs = read_runs(conn, data.filters.since)
    data.experiment_runs = runs
    data.experiments = [
        experiments_section.Experiment.from_stored(
            r, read_rates(conn, r.run_id), read_router_modes(conn, r)
        )
        for r in runs[-experiments_section.MAX_RUNS :]
    ]


def read_health(conn: Connection, data: ReportData, networks: NetworkTable | None) -> None:
    p = data.filters.params()
    data.item_outcomes = _rows(conn, _ITEM_OUTCOMES, p)
    data.item_failures = _rows(conn, _ITEM_FAILURES, p)
    data.atlas_measurements = _rows(conn, _ATLAS_MEASUREMENTS, p)


# Each section's reads, in the order the page shows them (bench/dashboards_bench
# times each with its section's rendering).
READERS = {
    "study": read_study,
    "trials": read_trials,
    "router": read_router,
    "experiments": read_experiments,
    "health": read_health,
}


def _run_label(run: Mapping[str, Any]) -> str:
    name = run["run_name"] or f"run {run['run_id']}"
    return f"{name} ({run['router_kind']})"


_RELATIVE = re.compile(r"^(\d+)\s*([smhdw])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_since(value: str, now: datetime | None = None) -> datetime:
    """``--since``: an ISO 8601 date or time (UTC when it names no zone), or
    a span back from now: ``90m``, ``24h``, ``7d``, ``2w``."""
    v = value.strip()
    m = _RELATIVE.match(v)
    if m:
        return (now or datetime.now(UTC)) - timedelta(seconds=int(m.group(1)) * _UNITS[m.group(2)])
    try:
        t = datetime.fromisoformat(v)
    except ValueError:
        raise KickassError(
            f"bad --since {value!r}",
            hint="an ISO date or time (2026-11-01, 2026-11-01T12:00+01:00) or a span: 24h, 7d",
        ) from None
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)
