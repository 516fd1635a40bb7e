"""`kickass report`: one self-contained HTML file of everything measured.

    write_report(database_url, path, campaign=None, since=None) -> ReportResult

Five sections, each a few figures (inline SVG, ``figures``) and tables, every
number from ``kickass_analysis.stats`` (so it agrees with the notebooks, the
dashboards' rollups and the volunteer's page), the paper's numbers beside
ours:

- **the study**: drop rate against packet size and against the split's
  leading-fragment length, with Wilson intervals, by source (volunteers,
  RIPE Atlas); the share of fragment-intolerant clients overall, by country
  and by network (ASN), the paper's 8.3% of 405 beside it;
- **the trials**: FCT against flow size per access capacity and arm (the
  workload's floor stated: by default no flow is under 46 packets), the
  Kick-Ass flows that fell back to TCP per arm, the paired speedup with its
  interval over period pairs (``v_trial_speedups``, the ``refresh`` rollup)
  and beside it the share of matched flows finished sooner under Kick-Ass,
  failures kept, with completion per arm; the CDF of the time in Kick-Ass
  mode; the paper's 1.2-4x beside it;
- **the router**: advertised rate, leading-fragment length, queue and mode
  over time;
- **the congestion experiments** (paper §III-D, ``experiments_section``):
  per run every flow's rate over time, the router's TCP mode shaded, fairness,
  utilisation and switch times beside the paper's words;
- **schedule health**: scheduled item runs by outcome and the failures with
  their reasons (``v_item_runs``), the Atlas measurements' status.

Everything is read in one REPEATABLE READ transaction (one snapshot: the
sections agree with each other), from the rollups the scheduled ``refresh``
keeps (so a report stays under a second a section at ten million probes, a
million flows and a month of router telemetry: bench/dashboards_bench.py)
with what no refresh has seen yet added live: sessions finished since
(``v_drop_rollup``), a router's samples since its last rolled-up second,
and the trials' figures computed from the flows while some are not in
their rollup (``report_fct_bins``, ``report_ka_mode``, migration 0014). The
file needs nothing else: CSS inline, figures inline, no script, no fetch. A
section or figure with nothing to show says "no data yet".

Filters: ``campaign`` keeps the RIPE Atlas parts (results, verdicts,
measurements) to that Atlas campaign; volunteers, trials, the router and the
scheduled runs have no campaign and are shown whole. ``since`` keeps the
study's drop rates from since's UTC day on (the rollup counts by day:
volunteer sessions created, Atlas probes last heard from, that day or
later), clients whose latest verdict and Atlas probes whose verdict came
since then, flows started, router samples from then on (by the run's own
clock: its start plus the sample's t, as its rollups count) and item runs
due since then; the trials' speedup is then computed from those flows
(``rollups.compute``) instead of read from the rollup.

Volunteers' sessions store only an address: their country and network come
from an ip2asn table when one is given (``network_table``,
``kickass_analysis.networks``), else they are "unknown".
"""

from __future__ import annotations

import html
import math
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import kickass_db as db
from kickass_core.errors import KickassError
from kickass_core.states import FINAL_STATES
from kickass_db.experiment_store import ExperimentRun
from kickass_db.tx import StoreBase
from sqlalchemy import Connection, text

from . import __version__, experiments_section, figures, rollups, stats
from .figures import Figure
from .networks import NetworkTable

NO_DATA = "no data yet"
MAX_ROUTER_RUNS = 6
MAX_FAILURES = 50

_FINAL = "(" + ", ".join(f"'{s}'" for s in FINAL_STATES) + ")"


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
    "experiments": experiments_section.read,
    "health": read_health,
}


def _run_label(run: Mapping[str, Any]) -> str:
    name = run["run_name"] or f"run {run['run_id']}"
    return f"{name} ({run['router_kind']})"


# -- the numbers and figures of each section --------------------------------------------------


@dataclass
class Section:
    key: str
    title: str
    body: list[str] = field(default_factory=list)  # HTML fragments
    figures: list[Figure] = field(default_factory=list)
    empty: bool = True


def _f(x: float | None, fmt: str = "{:.1%}") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return fmt.format(x)


def _interval(r: stats.Rate) -> str:
    if math.isnan(r.rate):
        return "-"  # nothing to take a share of
    return f"{_f(r.rate)} ({_f(r.low)}-{_f(r.high)})"


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]], cls: str = "") -> str:
    e = html.escape
    out = [f'<table class="{e(cls)}"><thead><tr>']
    out += [f"<th>{e(h)}</th>" for h in head]
    out.append("</tr></thead><tbody>")
    for row in rows:
        out.append("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in row) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _figure(fig: Figure | None, what: str, caption: str) -> str:
    if fig is None:
        return f'<p class="nodata" data-figure="{html.escape(what)}">{what}: {NO_DATA}.</p>'
    return f"<figure>{fig.svg}<figcaption>{html.escape(caption)}</figcaption></figure>"


def study_section(data: ReportData) -> tuple[Section, dict[str, Any]]:
    sec = Section("study", "The fragment viability study")
    summary: dict[str, Any] = {}
    src_label = {"volunteer": "volunteers", "atlas": "RIPE Atlas probes"}
    for attr, name, what, xlabel in (
        ("size", "drop-by-size", "Drop rate against packet size (whole packets)", "IP length (B)"),
        (
            "split",
            "drop-by-split",
            "Drop rate against the split (1500-byte datagrams in two fragments)",
            "leading fragment IP length (B)",
        ),
    ):
        by: dict[str, list[stats.SizeRate]] = getattr(data, attr)
        series = [
            figures.rates(src_label.get(src, src), pts, colour=figures.COLOURS.get(src))
            for src, pts in by.items()
        ]
        fig = figures.drop_rate(name, what, xlabel, series)
        sec.body.append(
            _figure(
                fig,
                what,
                f"{what}: pooled over every session (volunteers) and probe (Atlas); "
                "bars are 95% Wilson intervals.",
            )
        )
        if fig is not None:
            sec.figures.append(fig)
            sec.empty = False
        rows = []
        for src, pts in by.items():
            sent = sum(p.rate.sent for p in pts)
            lost = sum(p.rate.lost for p in pts)
            pooled = stats.drop(sent, sent - lost)
            worst = max(pts, key=lambda p: p.rate.rate)
            rows.append(
                [
                    src_label.get(src, src),
                    len(pts),
                    max(p.sessions for p in pts),
                    f"{sent:,}",
                    _interval(pooled),
                    f"{worst.size} B: {_f(worst.rate.rate)}",
                ]
            )
            summary[f"{attr}_{src}"] = {"sizes": len(pts), "pooled": pooled.to_json()}
        if rows:
            sec.body.append(
                _table(
                    ["source", "sizes", "sessions", "probes sent", "drop (95% CI)", "worst size"],
                    rows,
                )
            )
    # Fragment-intolerant clients: overall, by country, by network.
    overall = []
    by_country: dict[str, list[stats.GroupShare]] = {}
    by_asn: dict[str, list[stats.GroupShare]] = {}
    for src, vs in data.verdicts.items():
        total = stats.intolerant_share([v for _, _, v in vs], src_label.get(src, src))
        overall.append(total)
        summary[f"intolerant_{src}"] = total.to_json()
        by_country[src] = stats.intolerant_by_group((c, v) for c, _, v in vs)
        by_asn[src] = stats.intolerant_by_group((a, v) for _, a, v in vs)
    paper = stats.PAPER
    paper_k = round(paper["intolerant_share"] * paper["clients"])
    paper_share = stats.share(paper_k, int(paper["clients"]))
    if overall:
        sec.empty = False
        rows = [
            [g.group, g.clients, g.intolerant, g.inconclusive, _interval(g.share)] for g in overall
        ]
        # The paper states 8.3% of 405 (34 clients); the interval is 34 of 405's.
        stated = f"{_f(paper['intolerant_share'])} ({_f(paper_share.low)}-{_f(paper_share.high)})"
        rows.append(["the paper (Kick-Ass, §IV-C)", paper["clients"], paper_k, "-", stated])
        sec.body.append("<h3>Fragment-intolerant clients</h3>")
        sec.body.append(
            _table(
                ["clients", "conclusive", "fragment-intolerant", "inconclusive", "share (95% CI)"],
                rows,
                "shares",
            )
        )
    for groups, name, what in (
        (by_country, "intolerant-by-country", "Fragment-intolerant clients by country"),
        (by_asn, "intolerant-by-asn", "Fragment-intolerant clients by network (ASN)"),
    ):
        fig = figures.shares(name, what, groups)
        sec.body.append(
            _figure(
                fig,
                what,
                f"{what}: share among clients with a conclusive verdict, 95% "
                f"Wilson interval; the dashed line is the paper's "
                f"{paper['intolerant_share']:.1%} of {paper['clients']} clients.",
            )
        )
        if fig is not None:
            sec.figures.append(fig)
    return sec, summary


def _capacity(bps: float | None) -> str:
    return f"{bps / 1e6:g} Mbit/s" if bps else "capacity unknown"


def _fct_summary(r: Mapping[str, Any]) -> stats.FctSummary:
    flows, completed = int(r["flows"]), int(r["completed"])
    return stats.FctSummary(
        flows,
        completed,
        completed / flows if flows else math.nan,
        r["fct_ms_mean"],
        r["fct_ms_p50"],
        r["fct_ms_p95"],
    )


def trials_section(data: ReportData) -> tuple[Section, dict[str, Any]]:
    sec = Section("trials", "The wide-area trials")
    summary: dict[str, Any] = {}
    binned: dict[str, dict[str, dict[int, stats.FctSummary]]] = {}
    buckets: dict[tuple[str, str], dict[str, stats.FctSummary]] = {}
    for r in data.fct_bins:
        cap = _capacity(r["access_capacity_bps"])
        s = _fct_summary(r)
        if r["size_bin"] is not None:
            binned.setdefault(cap, {}).setdefault(r["arm"], {})[int(r["size_bin"])] = s
        elif r["size_bucket"] is not None:
            buckets.setdefault((cap, r["arm"]), {})[r["size_bucket"]] = s
    binned = {
        cap: {arm: dict(sorted(bins.items())) for arm, bins in sorted(arms.items())}
        for cap, arms in sorted(binned.items())
    }
    how = (
        "the refresh rollup (v_report_fct_bins, v_report_ka_mode)"
        if data.trials_source == "rollup"
        else "the flows, on this read (report_fct_bins, report_ka_mode)"
    )
    smallest = min(
        (int(r["size_bin"]) for r in data.fct_bins if r["size_bin"] is not None and r["flows"]),
        default=None,
    )
    summary["smallest_size_bin"] = smallest
    if smallest is not None:
        label = "1" if smallest == 1 else f"{smallest}-{2 * smallest - 1}"
        sec.body.append(
            "<p>Flow sizes are the paper's workload (§IV-A) as <code>kickass trials run</code> "
            "draws it by default: bounded Pareto, shape 1.8, mean 100 packets of 1500 bytes, "
            "within 1..2000. With that mean and shape the Pareto's scale is 45.7 packets, so "
            "<strong>no flow is shorter than 46 packets</strong>: the 1-10 bucket stays empty "
            "and 11-100 holds 46-100 only (a reading of the paper, which gives the range, the "
            "mean and the shape). The paper's range taken literally is "
            "<code>--literal-range</code> (71% of the flows of one packet, mean 1.9). "
            f"The smallest flows shown here are in the {label} packet bin (below 46: trials "
            "of another workload).</p>"
        )
    what = "FCT against flow size"
    fig = figures.fct_by_size("fct-by-size", what, binned)
    sec.body.append(
        _figure(
            fig,
            what,
            f"{what}, per access capacity and arm: the marker is the median FCT of "
            "the completed flows in each power-of-two size bin, the bar reaches the 95th "
            "percentile; flows that did not complete count in the table's completion rate "
            f"(from {how}).",
        )
    )
    if fig is not None:
        sec.figures.append(fig)
        sec.empty = False
    rows = []
    for (cap, arm), by_bucket in sorted(buckets.items()):
        for bucket in stats.SIZE_BUCKETS:
            b = by_bucket.get(bucket)
            if b is not None and b.flows:
                rows.append(
                    [
                        cap,
                        arm,
                        bucket,
                        b.flows,
                        _f(b.completion_rate),
                        _f(b.p50_ms, "{:.0f}"),
                        _f(b.p95_ms, "{:.0f}"),
                    ]
                )
    if rows:
        sec.body.append(
            _table(
                [
                    "access",
                    "arm",
                    "size (packets)",
                    "flows",
                    "completed",
                    "FCT p50 (ms)",
                    "FCT p95 (ms)",
                ],
                rows,
            )
        )
    # Kick-Ass flows that ran as TCP from the start.
    frows = []
    summary["fallbacks"] = []
    for r in sorted(data.fallbacks, key=lambda r: (r["access_capacity_bps"] or 0.0, r["arm"])):
        flows, fell = int(r["flows"]), int(r["fell_back"])
        fell_share = stats.share(fell, flows)
        frows.append([_capacity(r["access_capacity_bps"]), r["arm"], flows, fell,
                      _interval(fell_share)])  # fmt: skip
        summary["fallbacks"].append(
            {"access_capacity_bps": r["access_capacity_bps"], "arm": r["arm"],
             "flows": flows, "fell_back": fell, "share": fell_share.to_json()}
        )  # fmt: skip
    if frows:
        sec.body.append(
            "<h3>Kick-Ass flows that fell back to TCP</h3><p>A flow of a Kick-Ass period whose "
            "handshake fell back to TCP from the start (the negotiated protocol stored with "
            "each flow) ran as TCP. It stays in its arm's figures, completion rates and speedup "
            "(compared as assigned), so the share says how much of each Kick-Ass arm was TCP. "
            "Flows stored before the negotiated protocol was recorded count as not fallen "
            "back.</p>"
        )
        sec.body.append(
            _table(["access", "arm", "Kick-Ass flows", "fell back to TCP", "share (95% CI)"], frows)
        )
    what = "Speedup of Kick-Ass over the baseline, on matched flows"
    fig = figures.speedups("speedup", what, data.speedups)
    source = (
        "computed from the flows shown (rollups.compute)"
        if data.speedups_computed
        else "v_trial_speedups, the refresh rollup"
    )
    sec.body.append(
        _figure(
            fig,
            what,
            f"{what}: geometric mean of FCT(baseline) / FCT(Kick-Ass) over the "
            f"same flows under each arm, with a 95% interval over period pairs ({source}; "
            "none from a single pair); the "
            "shaded band is the paper's 1.2-4x.",
        )
    )
    if fig is not None:
        sec.figures.append(fig)
        sec.empty = False
    srows = []
    for r in data.speedups:
        if r.get("size_bucket") != rollups.ALL_SIZES:
            continue
        if r.get("speedup") is None and r.get("sooner") is None:
            continue
        speedup = "-"
        if r.get("speedup") is not None:
            speedup = (
                f"{r['speedup']:.2f}x ({_f(r['speedup_low'], '{:.2f}')}-"
                f"{_f(r['speedup_high'], '{:.2f}')})"
            )
        sooner = "-"
        if r.get("sooner") is not None:
            sooner = (
                f"{_f(r['sooner'])} ({_f(r.get('sooner_low'))}-{_f(r.get('sooner_high'))}) "
                f"of {r['sooner_pairs']}"
            )
        srows.append(
            [
                r["destination"],
                _capacity(r["access_capacity_bps"]),
                r["arm"],
                r["baseline_arm"],
                f"{r['matched']}/{r['pairs']}",
                speedup,
                f"{_f(r['completion_arm'])} / {_f(r['completion_baseline'])}",
                sooner,
                "1.2-4x",
            ]
        )
    summary["speedups"] = [
        {
            k: r.get(k)
            for k in (
                "destination",
                "arm",
                "baseline_arm",
                "size_bucket",
                "pairs",
                "matched",
                "speedup",
                "speedup_low",
                "speedup_high",
                "completion_arm",
                "completion_baseline",
                "sooner",
                "sooner_low",
                "sooner_high",
                "sooner_pairs",
            )
        }
        for r in data.speedups
    ]
    if srows:
        sec.body.append(
            "<p>Two comparisons of the same flows, each with its 95% interval over period "
            "pairs. The <strong>speedup</strong> is how much faster the arm finished the flows "
            "that both arms finished: the geometric mean of FCT(baseline) / FCT(arm). A pair in "
            "which either arm did not finish its flow leaves it, so it says nothing of those "
            "flows and flatters the arm that fails more. <strong>Finished sooner</strong> keeps "
            "every matched flow: the share in which the arm's flow finished before the "
            "baseline's, a flow that did not finish counted slower than any that did and a tie "
            "as half (50%: no difference); only flows never given their time (a skipped period, "
            "a stopped trial) are left out, and how many it compares follows it. It says how "
            "often the arm was sooner, not by how much. Completion (the share of matched flows "
            "each arm finished) is beside both.</p>"
        )
        sec.body.append(
            _table(
                [
                    "destination",
                    "access",
                    "arm",
                    "baseline",
                    "matched/pairs",
                    "speedup, all sizes (95% CI)",
                    "completed: arm / baseline",
                    "finished sooner under the arm (95% CI), failures kept",
                    "paper",
                ],
                srows,
            )
        )
    modes = {
        f"{r['arm']} @ {_capacity(r['access_capacity_bps'])}": stats.KaModeTime(
            int(r["flows"]),
            r["mean"],
            r["median"],
            r["share_of_time"],
            (list(r["cdf_x"] or []), list(r["cdf_y"] or [])),
        )
        for r in data.ka_mode
    }
    modes = dict(sorted(modes.items()))
    what = "Time in Kick-Ass mode"
    fig = figures.cdfs(
        "kickass-mode-cdf",
        what,
        "share of the flow's time in Kick-Ass mode",
        {k: m.cdf for k, m in modes.items()},
    )
    sec.body.append(
        _figure(
            fig,
            what,
            f"{what}: the CDF over Kick-Ass flows of the share of each flow's time "
            "spent in Kick-Ass mode (the rest in TCP mode). The paper: at 10 Mbit/s flows "
            "stay in Kick-Ass mode; at 100 Mbit/s on a ~2000-mile path about half the time "
            "is in TCP mode.",
        )
    )
    if fig is not None:
        sec.figures.append(fig)
        sec.empty = False
    mrows = [
        [k, m.flows, _f(m.mean), _f(m.median), _f(m.share_of_time)]
        for k, m in modes.items()
        if m.flows
    ]
    summary["kickass_mode"] = {k: m.to_json() for k, m in modes.items()}
    if mrows:
        sec.body.append(
            _table(["arm @ access", "flows", "mean", "median", "share of all time"], mrows)
        )
    return sec, summary


def router_section(data: ReportData) -> tuple[Section, dict[str, Any]]:
    sec = Section("router", "The edge router")
    what = "The router over time"
    fig = figures.router("router", what, data.router_series)
    sec.body.append(
        _figure(
            fig,
            what,
            f"{what}: advertised rate, leading-fragment length, queue and the "
            "share of samples in Kick-Ass marking mode (0: TCP mode), per run; long runs "
            f"are drawn as the means of {figures.MAX_POINTS} time buckets.",
        )
    )
    if fig is not None:
        sec.figures.append(fig)
        sec.empty = False
    rows = [
        [
            _run_label(r),
            _capacity(r["capacity_bps"]),
            r["samples"],
            _f((r["last_at"] - r["first_at"]).total_seconds(), "{:.0f} s"),
            _f(
                r["advertised_rate_mean"] / 1e6 if r["advertised_rate_mean"] is not None else None,
                "{:.2f}",
            ),
            _f(r["queue_mean"] / 1e3 if r["queue_mean"] is not None else None, "{:.1f}"),
            _f(r["kickass_share"]),
        ]
        for r in data.router_runs
    ]
    if rows:
        more = len(data.router_runs) - MAX_ROUTER_RUNS
        if more > 0:
            sec.body.append(
                f"<p>The figure shows the {MAX_ROUTER_RUNS} latest runs of "
                f"{len(data.router_runs)}.</p>"
            )
        sec.body.append(
            _table(
                [
                    "run",
                    "capacity",
                    "samples",
                    "duration",
                    "mean advertised rate (Mbit/s)",
                    "mean queue (kB)",
                    "in Kick-Ass mode",
                ],
                rows,
            )
        )
    return sec, {"router_runs": len(data.router_runs)}


def health_section(data: ReportData) -> tuple[Section, dict[str, Any]]:
    sec = Section("health", "Schedule health")
    counts: dict[str, dict[str, int]] = {}
    for r in data.item_outcomes:
        counts.setdefault(f"{r['item']} ({r['kind']})", {})[r["outcome"]] = int(r["runs"])
    what = "Scheduled runs by outcome"
    fig = figures.stacked_counts("item-runs", what, counts)
    sec.body.append(_figure(fig, what, f"{what}, per item of the schedule (v_item_runs)."))
    if fig is not None:
        sec.figures.append(fig)
        sec.empty = False
    if data.item_failures:
        sec.body.append("<h3>Failed and timed-out runs</h3>")
        sec.body.append(
            _table(
                ["item", "kind", "due", "host", "attempt", "outcome", "reason", "duration"],
                [
                    [
                        r["item"],
                        r["kind"],
                        _when(r["due_at"]),
                        r["host"],
                        r["attempt"],
                        r["outcome"],
                        r["reason"] or "(no reason given)",
                        _f(r["duration_s"], "{:.0f} s"),
                    ]
                    for r in data.item_failures
                ],
                "failures",
            )
        )
    elif counts:
        sec.body.append("<p>No run failed or timed out.</p>")
    status: dict[str, dict[str, int]] = {}
    for r in data.atlas_measurements:
        row = status.setdefault(r["campaign"], {})
        key = r["status_name"] or "unknown"
        row[key] = row.get(key, 0) + 1
    what = "RIPE Atlas measurements by status"
    fig = figures.stacked_counts("atlas-status", what, status, colours={}, xlabel="measurements")
    sec.body.append(_figure(fig, what, f"{what}, per campaign (v_atlas_measurements)."))
    if fig is not None:
        sec.figures.append(fig)
        sec.empty = False
        sec.body.append(
            _table(
                [
                    "campaign",
                    "msm_id",
                    "phase",
                    "IP length",
                    "status",
                    "results",
                    "credits",
                    "last fetch",
                    "last error",
                ],
                [
                    [
                        r["campaign"],
                        r["msm_id"],
                        r["phase"],
                        r["ip_len"],
                        r["status_name"] or "-",
                        r["results_fetched"],
                        r["credits_spent"],
                        _when(r["last_fetch_at"]),
                        r["last_error"] or "",
                    ]
                    for r in data.atlas_measurements
                ],
            )
        )
    outcomes: dict[str, int] = {}
    for r in data.item_outcomes:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + int(r["runs"])
    return sec, {"item_runs": outcomes, "atlas_measurements": len(data.atlas_measurements)}


def _when(t: datetime | None) -> str:
    return "-" if t is None else t.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


# -- the page ---------------------------------------------------------------------------------

CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:0 auto;max-width:62rem;
padding:1rem 1.5rem;color:#222;line-height:1.45}
h1{font-size:1.6rem;margin-bottom:.2rem}h2{border-bottom:1px solid #ccc;margin-top:2.2rem}
h3{margin-bottom:.3rem}.meta{color:#555;font-size:.9rem}
figure{margin:1rem 0}figure svg{width:100%;height:auto}
figcaption{font-size:.85rem;color:#444}
table{border-collapse:collapse;font-size:.85rem;margin:.6rem 0}
th,td{border:1px solid #ddd;padding:.2rem .5rem;text-align:left;vertical-align:top}
th{background:#f3f3f3}.nodata{color:#777;font-style:italic}
nav a{margin-right:1rem}
"""


@dataclass(frozen=True)
class ReportResult:
    path: Path
    bytes: int
    sections: dict[str, bool]  # section -> has data
    figures: dict[str, dict[str, int]]  # figure -> series -> marks
    summary: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "bytes": self.bytes,
            "sections": self.sections,
            "figures": self.figures,
            "summary": self.summary,
        }


def render(
    data: ReportData,
) -> tuple[str, dict[str, bool], dict[str, dict[str, int]], dict[str, Any]]:
    """The report's HTML, which sections have data, the figures' marks, the headline numbers."""
    sections = []
    summary: dict[str, Any] = {}
    for build in (
        study_section,
        trials_section,
        router_section,
        experiments_section.section,
        health_section,
    ):
        sec, numbers = build(data)
        sections.append(sec)
        summary.update(numbers)
    e = html.escape
    f = data.filters
    scope = []
    if f.campaign:
        scope.append(
            f"Atlas campaign {e(f.campaign)} (volunteers, trials, router and "
            "scheduled runs have no campaign: shown whole)"
        )
    if f.since:
        scope.append(f"since {e(_when(f.since))}")
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        # Nothing to fetch, not even the favicon: the file stands alone.
        '<link rel="icon" href="data:,">',
        "<title>Kick-Ass measurement report</title>",
        f"<style>{CSS}</style></head><body>",
        "<h1>Kick-Ass measurement report</h1>",
        f'<p class="meta">Generated {e(_when(data.generated_at))} from {e(data.database)} by '
        f"kickass-analysis {e(__version__)}; "
        + (e("; ".join(scope)) if scope else "everything measured")
        + ". Every number from kickass_analysis.stats; the paper's numbers beside ours.</p>",
        "<nav>" + "".join(f'<a href="#{s.key}">{e(s.title)}</a>' for s in sections) + "</nav>",
    ]
    for s in sections:
        out.append(f'<section id="{s.key}" data-empty="{str(s.empty).lower()}">')
        out.append(f"<h2>{e(s.title)}</h2>")
        if s.empty:
            out.append(f'<p class="nodata">{e(s.title)}: {NO_DATA}.</p>')
        else:
            out.extend(s.body)
        out.append("</section>")
    out.append("</body></html>")
    marks = {fig.name: fig.marks for s in sections for fig in s.figures}
    return "\n".join(out) + "\n", {s.key: not s.empty for s in sections}, marks, summary


def write_report(
    database_url: str | None,
    path: str | Path,
    campaign: str | None = None,
    since: datetime | None = None,
    *,
    network_table: str | Path | None = None,
) -> ReportResult:
    """Write the report of the database at ``database_url`` (None: the
    configured one) to ``path`` (replaced atomically) and say what it holds."""
    networks = NetworkTable.load(network_table) if network_table else None
    with ReportStore(database_url) as store:
        data = store.read(Filters(campaign, since), networks)
    page, sections, marks, summary = render(data)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    raw = page.encode("utf-8")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(raw)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return ReportResult(target.resolve(), len(raw), sections, marks, summary)


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
