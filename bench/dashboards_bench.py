"""Every dashboard panel's query at scale, with and without the rollups of migration 0012.

    .venv/bin/python bench/dashboards_bench.py [--quick] [--data-dir DIR] \
        > bench/dashboards_bench.json

A benchmark, not a test. It seeds an embedded PostgreSQL (kickass_testbed.pg)
through INSERT ... SELECT generate_series into the real tables, at the scale
of issue 20: 10 million probe rows (sessions of 10,000 probes over 30 days),
a million flows (500 paired trials), a month of router telemetry for two
routers at one-second resolution (the 10 ms samples rolled up to a second:
2.6 million rows each), a RIPE Atlas campaign of 500 probes and a month of
scheduled runs. Then, for every panel and template variable of
grafana/dashboards/*.json, Grafana's query (macros expanded as
tests/support/grafana.py does, every variable "All", the panel's $__interval
for the range) is timed over the last 7 and the last 30 days:

* ``with``: the dashboards as they are, reading the rollup views (after
  ``kickass_analysis.rollups.refresh``, with a few sessions finished since, as
  between two scheduled refreshes);
* ``without``: the same SQL with every rollup view replaced by a view of the
  same columns computed from the base tables on every read (schema
  ``exact``: what the panels would cost on the plain analysis views).

Each figure is the median of 3 runs after one warm-up (``without``: of 2,
each cut at --timeout seconds). It also reports the time to build the
rollups (the migration), a full refresh, and an incremental one after an
hour of 10 ms samples and a few sessions. Goal (issue 20): every panel under
one second on this 2-core machine.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import kickass_db as db
import psycopg
from kickass_analysis import rollups
from kickass_atlas.store import AtlasStore
from kickass_testbed.pg import create_database, embedded_postgres

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from support.grafana import (  # noqa: E402 - the expander the tests use
    Selection,
    TimeRange,
    custom_options,
    dashboards,
    expand,
    panel_interval,
    panel_queries,
    select,
    template_variables,
)

VERSION = 1
DB_NAME = "dashboards_bench"
RANGES = {"7d": timedelta(days=7), "30d": timedelta(days=30)}
FINAL = "('complete', 'ended', 'expired', 'incomplete')"


@dataclass(frozen=True)
class Scale:
    probes: int
    per_session: int
    trials: int
    flows_per_period: int
    days: int
    routers: int
    atlas_probes: int

    @property
    def sessions(self) -> int:
        return self.probes // self.per_session

    @property
    def flows(self) -> int:
        return self.trials * 8 * self.flows_per_period


FULL = Scale(10_000_000, 10_000, 500, 250, 30, 2, 500)
QUICK = Scale(200_000, 10_000, 20, 100, 3, 2, 50)


def log(msg: str) -> None:
    print(f"[{datetime.now(UTC):%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def timed(out: dict[str, float], key: str) -> Iterator[None]:
    started = time.monotonic()
    yield
    out[key] = round(time.monotonic() - started, 2)
    log(f"{key}: {out[key]} s")


def migration_0012() -> ModuleType:
    path = REPO / "db" / "migrations" / "versions" / "0012_rollups.py"
    spec = importlib.util.spec_from_file_location("rollups_0012", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- seeding, straight into the real tables ---------------------------------------------


def seed_study(conn: psycopg.Connection, s: Scale) -> None:
    """Sessions of ``per_session`` probes (half whole: 183 sizes 44..1500; half
    split: 182 leading lengths 44..1492), created over the last ``days``. One
    session in twelve is fragment-intolerant (8.3%), one in ten lossy (5%)."""
    clients = max(1, s.sessions * 9 // 10)
    conn.execute("SELECT setseed(0.42)")
    conn.execute(
        """INSERT INTO clients (install_id, first_seen, last_seen, client_version, platform)
           SELECT 'bench-' || i, now() - make_interval(days => %s), now(), '0.1.0',
                  'Linux-x86_64'
           FROM generate_series(1, %s) i""",
        (s.days, clients),
    )
    conn.execute(
        f"""INSERT INTO sessions (session_id, client_id, state, plan, server_version,
               client_version, source_address, created_at, started_at, finished_at, verdict,
               verdict_reason, sent, acked)
           SELECT lpad(to_hex(i), 16, '0'), 1 + (i - 1) % {clients},
                  CASE WHEN i % 100 = 0 THEN 'probing' WHEN i % 50 = 1 THEN 'expired'
                       ELSE 'complete' END,
                  '{{}}'::jsonb, '0.1.0', '0.1.0', ('198.51.100.' || (i % 250 + 1))::inet,
                  c, c, c + interval '20 minutes',
                  CASE WHEN i % 100 = 0 THEN NULL WHEN i % 12 = 0 THEN 'fragment-intolerant'
                       ELSE 'fragments-ok' END,
                  'bench', {s.per_session}, {s.per_session}
           FROM (SELECT i, now() - make_interval(secs => random() * {s.days} * 86400) AS c
                 FROM generate_series(1, {s.sessions}) i) x""",
    )
    conn.execute("UPDATE sessions SET finished_at = NULL WHERE state = 'probing'")
    conn.execute("DROP INDEX ix_probe_outcomes_session_pk_phase_ip_len")
    chunk = max(1, 1_000_000 // s.per_session)
    for first in range(1, s.sessions + 1, chunk):
        insert_probes(conn, first, first + chunk - 1, s.per_session)
        log(f"  probe rows: sessions {first}..{min(first + chunk - 1, s.sessions)}")
    conn.execute(
        "CREATE INDEX ix_probe_outcomes_session_pk_phase_ip_len "
        "ON probe_outcomes (session_pk, phase, ip_len)"
    )


def insert_probes(
    conn: psycopg.Connection, first: int, last: int, per_session: int, partitioned: bool = False
) -> None:
    """Probe rows of sessions ``first``..``last``; ``partitioned``: at 0022 or
    later, where each row carries its session's created_at (its partition key)."""
    half = per_session // 2
    key, value = (", session_created_at", ", created_at") if partitioned else ("", "")
    conn.execute(
        f"""INSERT INTO probe_outcomes (session_pk, seq, phase, ip_len, sent_at, outcome,
               acked_at, rtt_ms, ack_count, received_len, observed_frag_size{key})
           SELECT id, seq, phase, ip_len, sent_at, outcome,
                  CASE WHEN outcome = 'acked' THEN sent_at + make_interval(secs => rtt / 1000) END,
                  CASE WHEN outcome = 'acked' THEN rtt END,
                  CASE WHEN outcome = 'acked' THEN 1 ELSE 0 END,
                  CASE WHEN outcome = 'acked' THEN ip_len - 28 END,
                  CASE WHEN outcome = 'acked' AND phase = 'split'
                       THEN greatest(ip_len, 1520 - ip_len) END{value}
           FROM (
               SELECT s.id, s.created_at, g.seq,
                      CASE WHEN g.seq < {half} THEN 'whole' ELSE 'split' END AS phase,
                      CASE WHEN g.seq < {half} THEN 44 + 8 * (g.seq % 183)
                           ELSE 44 + 8 * ((g.seq - {half}) % 182) END AS ip_len,
                      s.created_at + g.seq * interval '2 ms' AS sent_at,
                      CASE WHEN (g.seq >= {half} AND s.id % 12 = 0)
                                OR random() < CASE WHEN s.id % 10 = 1 THEN 0.05 ELSE 0.005 END
                           THEN 'lost' ELSE 'acked' END AS outcome,
                      (20 + 150 * random())::real AS rtt
               FROM sessions s CROSS JOIN generate_series(0, {per_session - 1}) g(seq)
               WHERE s.id BETWEEN {int(first)} AND {int(last)}
           ) o"""
    )


def seed_trials(conn: psycopg.Connection, s: Scale) -> None:
    """Paired trials: 4 pairs of (kickass, tcp:cubic) periods replaying the same
    ``flows_per_period`` flows (bounded Pareto sizes, paper IV-A), 10 destinations."""
    conn.execute("SELECT setseed(0.43)")
    arms = '[{"name": "kickass", "protocol": "kickass"}, {"name": "tcp:cubic", "protocol": "tcp"}]'
    conn.execute(
        f"""INSERT INTO trials (trial_id, destination, access_capacity_bps, router_run_name,
               parameters, versions, started_at, finished_at)
           SELECT lpad(to_hex(i), 32, '0'), 'far-' || (i % 10 + 1),
                  CASE WHEN i % 2 = 0 THEN 10e6 ELSE 100e6 END,
                  CASE WHEN i % 2 = 0 THEN 'edge-10mbit' ELSE 'edge-100mbit' END,
                  jsonb_build_object('pairs', 4, 'period_s', 120, 'paired', true,
                      'workload', jsonb_build_object('mean_packets', 100, 'shape', 1.8,
                                                     'seed', i),
                      'arms', '{arms}'::jsonb),
                  '{{}}'::jsonb, t, t + interval '18 minutes'
           FROM (SELECT i, now() - make_interval(secs => {s.days} * 86400.0 * i / {s.trials})
                        AS t
                 FROM generate_series(1, {s.trials}) i) x""",
    )
    conn.execute(
        """INSERT INTO trial_periods (trial_pk, period_index, pair, protocol, arm,
               congestion_control, start_offset_s, duration_s, actual_start_offset_s)
           SELECT t.id, k, k / 2, a.protocol, a.arm, a.cc, k * 130, 120, k * 130 + random() * 0.5
           FROM trials t CROSS JOIN generate_series(0, 7) k
           CROSS JOIN LATERAL (
               SELECT CASE WHEN (k + k / 2) % 2 = 0 THEN 'kickass' ELSE 'tcp' END AS protocol,
                      CASE WHEN (k + k / 2) % 2 = 0 THEN 'kickass' ELSE 'tcp:cubic' END AS arm,
                      CASE WHEN (k + k / 2) % 2 = 0 THEN NULL ELSE 'cubic' END AS cc
           ) a""",
    )
    conn.execute(
        f"""CREATE TEMP TABLE workload AS
           SELECT t.id AS trial_pk, p AS pair, j AS idx,
                  least(2000, greatest(1, floor(45 / power(1 - random(), 1 / 1.8))))::int
                      AS size,
                  j * 0.4 AS offset_s
           FROM trials t CROSS JOIN generate_series(0, 3) p
           CROSS JOIN generate_series(0, {s.flows_per_period - 1}) j"""
    )
    conn.execute(
        """INSERT INTO flows (flow_id, trial_pk, period_index, pair, arm, protocol,
               congestion_control, negotiated_protocol, size_bytes, size_packets, started_at,
               completed, fct_ms, ka_mode_fraction, mode_switches, queued_ms)
           SELECT t.trial_id || '-' || (w.idx + 100000 * p.period_index), t.id, p.period_index,
                  w.pair, p.arm, p.protocol, p.congestion_control, p.protocol, w.size * 1440,
                  w.size, t.started_at + make_interval(secs => p.start_offset_s + w.offset_s),
                  f.done, CASE WHEN f.done THEN f.fct END,
                  CASE WHEN f.done AND p.protocol = 'kickass' THEN 0.9 + 0.1 * random() END,
                  CASE WHEN p.protocol = 'kickass' THEN (random() * 2)::int END, 0
           FROM workload w
           JOIN trials t ON t.id = w.trial_pk
           JOIN trial_periods p ON p.trial_pk = w.trial_pk AND p.pair = w.pair
           CROSS JOIN LATERAL (
               SELECT random() > 0.01 AS done,
                      CASE WHEN p.protocol = 'kickass'
                           THEN w.size * 1.2 + 200 + 20 * random()
                           ELSE w.size * 1.2 + 100 * (2 + log(2, w.size)) + 40 * random()
                      END AS fct
               OFFSET 0
           ) f"""
    )


def seed_router(conn: psycopg.Connection, s: Scale) -> None:
    """Two routers for ``days`` at one sample per second: 10 Mbit/s in Kick-Ass
    mode throughout, 100 Mbit/s in TCP mode every other 5 minutes."""
    for n, (name, capacity) in enumerate((("edge-10mbit", 10e6), ("edge-100mbit", 100e6))):
        if n >= s.routers:
            break
        conn.execute(
            """INSERT INTO router_runs (run_name, router_kind, capacity_bps, options, started_at,
                   finished_at)
               VALUES (%s, 'kickass', %s, '{}'::jsonb,
                       date_trunc('second', now()) - make_interval(days => %s), now())""",
            (name, capacity, s.days),
        )
    conn.execute(
        f"""INSERT INTO router_telemetry (run_id, t, recorded_at, advertised_rate_bps,
               leading_fragment_len, input_rate_bps, output_rate_bps, queue_bytes,
               queue_packets, marking_mode, rtt_ms, drops, fragmented, mode_switches)
           SELECT id, t, started_at + make_interval(secs => t), rate,
                  CASE WHEN mode = 'kickass'
                       THEN least(1480, floor(128 * ln(rate / 8000 / 12.4392) / 8) * 8) END,
                  capacity_bps * 0.95, capacity_bps * 0.93,
                  CASE WHEN mode = 'tcp' THEN capacity_bps / 8 * 0.07 ELSE 2000 END, 0, mode,
                  100 + 5 * random(), t / 100, t * 800, t / 300
           FROM (
               SELECT r.id, r.started_at, r.capacity_bps, g.t,
                      r.capacity_bps * (0.9 + 0.1 * sin(g.t / 600.0)) AS rate,
                      CASE WHEN r.capacity_bps > 20e6 AND (g.t / 300) % 2 = 1
                           THEN 'tcp' ELSE 'kickass' END AS mode
               FROM router_runs r CROSS JOIN generate_series(0, {s.days * 86400 - 1}) g(t)
           ) x"""
    )


def seed_atlas(conn: psycopg.Connection, url: str, s: Scale) -> None:
    """One campaign: a split sweep (6 leading lengths) and 3 whole sizes, each
    probe's ping of 3 packets every 12 hours; 40 countries, 300 networks; one
    probe in ten drops every fragment. Verdicts by AtlasStore.refresh_verdicts."""
    conn.execute("SELECT setseed(0.44)")
    campaign_id = conn.execute(
        """INSERT INTO atlas_campaigns (name, definition, credit_budget)
           VALUES ('bench-atlas', '{}'::jsonb, 2000000) RETURNING id"""
    ).fetchone()
    assert campaign_id is not None
    cid = campaign_id[0]
    conn.execute(
        """INSERT INTO atlas_measurements (msm_id, campaign_id, key, phase, target, ip_len, size,
               packets, interval_s, packet_interval_ms, probes_requested, definition,
               estimated_credits, credits_per_result, status_id, status_name, results_fetched,
               created_at)
           SELECT 7000000 + m.k, %s, m.phase || '-' || m.ip_len, m.phase, '192.0.2.10', m.ip_len,
                  m.ip_len - 28, 3, 43200, 1000, %s, '{}'::jsonb, 3 * %s * 60, 3, 2, 'Ongoing',
                  0, now() - interval '30 days'
           FROM (VALUES (0, 'split', 1500), (1, 'whole', 576), (2, 'whole', 1000),
                        (3, 'whole', 1480)) m(k, phase, ip_len)""",
        (cid, s.atlas_probes, s.atlas_probes),
    )
    conn.execute(
        f"""INSERT INTO atlas_probes (prb_id, asn_v4, country_code, status_name, is_anchor, meta)
           SELECT 10000 + i, 64496 + i % 300, chr(65 + i % 40 % 26) || chr(65 + i % 40 / 26),
                  'Connected', false, '{{}}'::jsonb
           FROM generate_series(1, {s.atlas_probes}) i"""
    )
    conn.execute(
        f"""INSERT INTO atlas_results (msm_id, prb_id, result_at, campaign_id, firmware, size,
               sent, rcvd, dup, join_status, raw)
           SELECT m.msm_id, p.prb_id, now() - make_interval(hours => 12 * k, secs => p.prb_id),
                  %s, 5080, m.size, 3, 3, 0, 'exact', '{{}}'::jsonb
           FROM atlas_measurements m CROSS JOIN atlas_probes p
           CROSS JOIN generate_series(0, {s.days * 2 - 1}) k""",
        (cid,),
    )
    conn.execute(
        """INSERT INTO atlas_outcomes (msm_id, prb_id, result_at, packet_index, campaign_id,
               phase, ip_len, outcome, rtt_ms, ack_count)
           SELECT r.msm_id, r.prb_id, r.result_at, i, r.campaign_id, m.phase,
                  CASE WHEN m.phase = 'split' THEN (ARRAY[68, 300, 604, 916, 1204, 1484])[
                      1 + ((i + extract(epoch FROM r.result_at)::bigint / 43200) % 6)::int]
                       ELSE m.ip_len END,
                  o.outcome, CASE WHEN o.outcome = 'acked' THEN 20 + 150 * random() END,
                  CASE WHEN o.outcome = 'acked' THEN 1 ELSE 0 END
           FROM atlas_results r JOIN atlas_measurements m ON m.msm_id = r.msm_id
           CROSS JOIN generate_series(0, 2) i
           CROSS JOIN LATERAL (
               SELECT CASE WHEN random() < 0.03 THEN 'unanswered'
                           WHEN (m.phase = 'split' AND r.prb_id % 10 = 0) OR random() < 0.02
                           THEN 'lost' ELSE 'acked' END AS outcome
               OFFSET 0
           ) o"""
    )
    conn.execute(
        """UPDATE atlas_measurements m SET results_fetched = n, fetched_until = now(),
               last_fetch_at = now()
           FROM (SELECT msm_id, count(*) AS n FROM atlas_results GROUP BY 1) r
           WHERE r.msm_id = m.msm_id"""
    )
    with AtlasStore(url) as store:
        store.refresh_verdicts(cid)


def seed_item_runs(conn: psycopg.Connection, s: Scale) -> None:
    """A month of a schedule: refresh every 15 minutes, Atlas and export daily,
    trial rounds every 6 hours; one run in fifty failed."""
    conn.execute(
        f"""INSERT INTO item_runs (item, kind, due_at, host, claimed_at, heartbeat_at,
               finished_at, outcome, reason)
           SELECT i.item, i.kind, d, 'sched-a', d, d + interval '30 s', d + interval '30 s',
                  CASE WHEN n % 50 = 7 THEN 'failed' ELSE 'ok' END,
                  CASE WHEN n % 50 = 7 THEN 'bench: a failure' END
           FROM (VALUES ('refresh', 'refresh', 900), ('atlas-nightly', 'atlas', 86400),
                        ('export-daily', 'export', 86400), ('trials-6h', 'trials', 21600))
                i(item, kind, period)
           CROSS JOIN LATERAL generate_series(
               date_trunc('hour', now()) - make_interval(days => {s.days}),
               now() - interval '1 minute', make_interval(secs => i.period)) WITH ORDINALITY
               g(d, n)"""
    )


def seed(url: str, s: Scale, timings: dict[str, float]) -> None:
    with psycopg.connect(db.libpq_url(url), autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        conn.execute("SET maintenance_work_mem = '256MB'")
        with timed(timings, "seed_study_s"):
            seed_study(conn, s)
        with timed(timings, "seed_trials_s"):
            seed_trials(conn, s)
        with timed(timings, "seed_router_s"):
            seed_router(conn, s)
        with timed(timings, "seed_atlas_s"):
            seed_atlas(conn, url, s)
        with timed(timings, "seed_item_runs_s"):
            seed_item_runs(conn, s)
        with timed(timings, "vacuum_analyze_s"):
            conn.execute("VACUUM ANALYZE")


def counts(url: str) -> dict[str, int]:
    tables = ("sessions", "probe_outcomes", "trials", "flows", "router_runs", "router_telemetry",
              "router_telemetry_1s", "router_telemetry_1m", "atlas_results", "atlas_outcomes",
              "item_runs", "unit_counts", "unit_counts_daily", "mv_atlas_probe_drop",
              "mv_flow_hourly", "trial_speedups")  # fmt: skip
    with psycopg.connect(db.libpq_url(url)) as conn:
        out = {}
        for t in tables:
            row = conn.execute(f"SELECT count(*) FROM {t}").fetchone()
            out[t] = int(row[0]) if row else 0
        return out


# -- the same columns without rollups --------------------------------------------------


def exact_views(m: ModuleType) -> list[str]:
    """Schema ``exact``: each rollup view under its name, computed from the base
    tables on every read (the migration's own SQL with each materialised view
    or rollup table replaced by its defining query)."""

    def body(create: str) -> str:
        return create.split(" AS", 1)[1]

    mv = {
        "mv_session_summary": body(m.MV_SESSION_SUMMARY),
        "mv_atlas_probe_drop": body(m.MV_ATLAS_PROBE_DROP),
        "mv_flow_summary": body(m.MV_FLOW_SUMMARY),
        "mv_flow_hourly": body(m.MV_FLOW_HOURLY),
    }
    drop = m.V_DROP_ROLLUP.replace(
        m._VOLUNTEER_ROLLED, m._VOLUNTEER_DROP.format(source=m._PROBE_COUNTS.format(
            where=f"s0.state IN {FINAL}"))  # fmt: skip
    ).replace(m._VOLUNTEER_LIVE, m._VOLUNTEER_DROP.format(source=m._PROBE_COUNTS.format(
        where="false")))  # fmt: skip
    views = [
        f"CREATE VIEW exact.v_session_rollup AS SELECT {m.SESSION_COLUMNS} "
        "FROM public.v_session_summary",
        "CREATE VIEW exact.v_verdicts_rollup AS SELECT * FROM public.v_verdicts_by_source",
        drop.replace("CREATE VIEW v_drop_rollup", "CREATE VIEW exact.v_drop_rollup"),
        m.V_FLOW_SUMMARY_ROLLUP.replace("CREATE VIEW v_", "CREATE VIEW exact.v_"),
        m.V_FLOW_HOURLY.replace("CREATE VIEW v_", "CREATE VIEW exact.v_"),
    ]
    for name, query in mv.items():
        # FROM mv_x [alias] -> FROM (its query) alias
        pattern = re.compile(rf"FROM {name}\b(\s+(?!WHERE|JOIN|GROUP|ORDER|UNION)\w+)?")
        views = [
            pattern.sub(lambda m, q=query, n=name: f"FROM ({q}) {(m.group(1) or n).strip()}", v)  # type: ignore[misc]  # defaults bind the loop's values
            for v in views
        ]
    for res, trunc in (("1s", "second"), ("1m", "minute")):
        raw = f"""(SELECT s.run_id,
                date_trunc('{trunc}', date_trunc('second', r0.started_at)
                          + make_interval(secs => floor(s.t)), 'UTC') AS at,
                count(*) AS samples, sum(s.advertised_rate_bps) AS advertised_rate_sum,
                min(s.advertised_rate_bps) AS advertised_rate_min,
                max(s.advertised_rate_bps) AS advertised_rate_max,
                coalesce(sum(s.leading_fragment_len), 0) AS leading_fragment_sum,
                count(s.leading_fragment_len) AS leading_fragment_n,
                min(s.leading_fragment_len) AS leading_fragment_min,
                max(s.leading_fragment_len) AS leading_fragment_max,
                sum(s.input_rate_bps) AS input_rate_sum,
                coalesce(sum(s.output_rate_bps), 0) AS output_rate_sum,
                count(s.output_rate_bps) AS output_rate_n,
                sum(s.queue_bytes) AS queue_bytes_sum, max(s.queue_bytes) AS queue_bytes_max,
                count(*) FILTER (WHERE s.marking_mode = 'kickass') AS kickass_samples,
                count(*) FILTER (WHERE s.marking_mode = 'tcp') AS tcp_samples,
                coalesce(sum(s.rtt_ms), 0) AS rtt_ms_sum, count(s.rtt_ms) AS rtt_ms_n,
                max(s.drops) AS drops_max, max(s.fragmented) AS fragmented_max,
                max(s.mode_switches) AS mode_switches_max
            FROM router_telemetry s JOIN router_runs r0 ON r0.id = s.run_id
            GROUP BY s.run_id, 2) x"""
        views.append(
            m._ROUTER_ROLLUP_VIEW.format(res=res)
            .replace(
                f"CREATE VIEW v_router_telemetry_{res}",
                f"CREATE VIEW exact.v_router_telemetry_{res}",
            )  # fmt: skip
            .replace(f"FROM router_telemetry_{res} x", f"FROM {raw}")
        )
    return views


# -- timing the panels ------------------------------------------------------------------


@dataclass
class Query:
    dashboard: str
    name: str
    sql: dict[str, str]  # range -> expanded SQL


def queries(conn: psycopg.Connection, now: datetime) -> list[Query]:
    """Every variable's and panel's query as Grafana sends it, per range, every
    variable on "All" (or its first value), values read with the rollups."""
    out: list[Query] = []
    for path in dashboards():
        per_range: dict[str, dict[str, Selection]] = {}
        for rng, span in RANGES.items():
            tr = TimeRange(now - span, now)
            chosen: dict[str, Selection] = {}
            for v in template_variables(path):
                if v["type"] == "custom":
                    values = [value for _, value in custom_options(v["query"])]
                else:
                    cur = conn.execute(expand(v["query"], tr, variables=chosen))
                    assert cur.description is not None
                    names = [c.name for c in cur.description]
                    at = names.index("__value") if "__value" in names else 0
                    values = [str(r[at]) for r in cur.fetchall()]
                chosen[v["name"]] = select(v, values, choose_all=True)
            per_range[rng] = chosen
        for v in template_variables(path):
            if v["type"] == "query":
                out.append(Query(path.name, f"${v['name']}", {
                    rng: expand(v["query"], TimeRange(now - span, now),
                                variables=per_range[rng])
                    for rng, span in RANGES.items()}))  # fmt: skip
        for q in panel_queries([path]):
            out.append(Query(path.name, f"#{q.panel_id} {q.title}", {
                rng: expand(q.raw_sql, TimeRange(now - span, now),
                            panel_interval(TimeRange(now - span, now), q.min_interval),
                            per_range[rng])
                for rng, span in RANGES.items()}))  # fmt: skip
    return out


def run_times(
    conn: psycopg.Connection, query: str, repeats: int, timeout_s: float
) -> dict[str, Any]:
    conn.execute(f"SET statement_timeout = {int(timeout_s * 1000)}")
    times: list[float] = []
    rows = 0
    for i in range(repeats + 1):
        started = time.perf_counter()
        try:
            rows = len(conn.execute(query).fetchall())
        except psycopg.errors.QueryCanceled:
            return {"ms": None, "timed_out_after_s": timeout_s}
        if i:  # the first run warms the cache
            times.append((time.perf_counter() - started) * 1000)
    return {"ms": round(statistics.median(times), 1), "rows": rows}


def time_panels(url: str, now: datetime, repeats: int, timeout_s: float) -> list[dict[str, Any]]:
    results = []
    with psycopg.connect(db.libpq_url(url), autocommit=True) as conn:
        conn.execute("SET TIME ZONE 'UTC'")
        for q in queries(conn, now):
            for rng, query in q.sql.items():
                conn.execute("SET search_path = public")
                with_ = run_times(conn, query, repeats, timeout_s)
                conn.execute("SET search_path = exact, public")
                without = run_times(conn, query, max(1, repeats - 1), timeout_s)
                results.append({"dashboard": q.dashboard, "query": q.name, "range": rng,
                                 "with_rollups_ms": with_["ms"], "rows": with_.get("rows"),
                                 "without_rollups_ms": without["ms"],
                                 **({"without_timed_out_s": timeout_s}
                                    if without["ms"] is None else {})})  # fmt: skip
                log(f"  {q.dashboard} {q.name} [{rng}]: {with_['ms']} ms with, "
                    f"{without['ms']} ms without")  # fmt: skip
    return results


# -- timing the report's sections ------------------------------------------------------


def time_report(url: str, repeats: int) -> list[dict[str, Any]]:
    """Each section of `kickass report`: its reader (one REPEATABLE READ
    transaction, as the report runs) and the section's HTML and figures, the
    median of ``repeats`` runs after a warm-up; unfiltered (the rollups) and
    over the last 7 days (the study by day rollup, the trials from the flows)."""
    from kickass_analysis import experiments_section, report

    builders = {
        "study": report.study_section,
        "trials": report.trials_section,
        "router": report.router_section,
        "experiments": experiments_section.section,
        "health": report.health_section,
    }
    results = []
    with report.ReportStore(url) as store:
        for label, since in (("all", None), ("7d", datetime.now(UTC) - timedelta(days=7))):
            for name, read in report.READERS.items():
                times: list[float] = []
                source = None
                for i in range(repeats + 1):
                    started = time.perf_counter()

                    def work(conn: Any, read: Any = read, since: Any = since) -> Any:  # noqa: ANN401
                        data = report.ReportData(
                            report.Filters(None, since), datetime.now(UTC), "bench"
                        )
                        read(conn, data, None)
                        return data

                    data = store.run(work, isolation="REPEATABLE READ")
                    builders[name](data)
                    if i:
                        times.append((time.perf_counter() - started) * 1000)
                    source = data.trials_source if name == "trials" else None
                ms = round(statistics.median(times), 1)
                results.append({"section": name, "filter": label, "ms": ms,
                                **({"trials_from": source} if source else {})})  # fmt: skip
                log(f"  report {name} [{label}]: {ms} ms")
    return results


def time_volunteer_page(url: str, repeats: int) -> dict[str, Any]:
    """The volunteer page's "all other volunteers" group: the pooled counts
    per size over every finished session (what its cache holds, recomputed
    when it expires), from the rollups as the page reads them, and from the
    outcomes of the listed sessions (how a country or network is pooled, and
    how "all" was before the rollups)."""
    from kickass_server import volunteer_page as page
    from sqlalchemy import create_engine

    engine = create_engine(db.sqlalchemy_url(url))
    out: dict[str, Any] = {}
    try:
        with engine.connect() as conn:
            ids = [r[0] for r in conn.execute(page._POPULATION)]
            out["sessions"] = len(ids)
            for how, which in (("with_rollups", None), ("from_outcomes", ids)):
                times: list[float] = []
                for i in range(repeats + 1):
                    started = time.perf_counter()
                    pooled = {ph: page._pooled(conn, ph, which) for ph in ("whole", "split")}
                    if i:
                        times.append((time.perf_counter() - started) * 1000)
                out[f"{how}_ms"] = round(statistics.median(times), 1)
                out[f"{how}_sizes"] = sum(len(v) for v in pooled.values())
                log(f"  volunteer page, all volunteers, {how}: {out[f'{how}_ms']} ms")
    finally:
        engine.dispose()
    return out


def slowest(results: list[dict[str, Any]], key: str) -> dict[str, Any]:
    def value(r: dict[str, Any]) -> float:
        return float("inf") if r[key] is None else float(r[key])

    top = max(results, key=value)
    return {"dashboard": top["dashboard"], "query": top["query"], "range": top["range"],
            "ms": top[key]}  # fmt: skip


# -- refreshes after new data ----------------------------------------------------------


def add_new_data(url: str, s: Scale) -> dict[str, int]:
    """An hour of 10 ms samples on the first router, and five sessions finished
    since the last refresh: what arrives between two scheduled refreshes."""
    with psycopg.connect(db.libpq_url(url), autocommit=True) as conn:
        run = conn.execute(
            "SELECT id, max(t) FROM router_runs r JOIN router_telemetry s ON s.run_id = r.id "
            "GROUP BY id ORDER BY id LIMIT 1"
        ).fetchone()
        assert run is not None
        conn.execute(
            """INSERT INTO router_telemetry (run_id, t, recorded_at, advertised_rate_bps,
                   leading_fragment_len, input_rate_bps, output_rate_bps, queue_bytes,
                   marking_mode, rtt_ms, drops, fragmented)
               SELECT r.id, %s + 1 + g / 100.0, r.started_at + make_interval(secs => %s + 1
                      + g / 100.0), 9.5e6, 600, 9e6, 9e6, 1500, 'kickass', 100, 0, g
               FROM router_runs r CROSS JOIN generate_series(0, 359999) g WHERE r.id = %s""",
            (run[1], run[1], run[0]),
        )
        ids = [
            r[0]
            for r in conn.execute(
                """INSERT INTO sessions (session_id, state, plan, server_version, created_at,
                       finished_at, verdict, verdict_reason)
                   SELECT lpad(to_hex(m + 100000000 + i), 16, '0'), 'complete', '{}'::jsonb,
                          '0.1.0', now() - interval '1 hour', now(), 'fragments-ok', 'bench'
                   FROM generate_series(1, 5) i, (SELECT max(id) AS m FROM sessions) x
                   RETURNING id"""
            )
        ]
        insert_probes(conn, min(ids), max(ids), s.per_session, partitioned=True)
        # Finished: their durable counts, as StudyStore stores them at a RunFinished (0020).
        conn.execute("SELECT count(*) FROM write_unit_counts(%s)", (ids,))
        conn.execute("ANALYZE sessions")
    return {"router_samples_10ms": 360_000, "sessions": 5, "probe_rows": 5 * s.per_session}


def git_revision() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small scale, for a smoke run")
    parser.add_argument("--data-dir", type=Path,
                        help="keep the PostgreSQL cluster here (a second run reuses the seeded "
                        "database and only times)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds before a query is cut (without rollups)")  # fmt: skip
    parser.add_argument("--only", choices=("panels", "report"),
                        help="time only the dashboards' panels, or only the report's sections "
                        "and the volunteer page (default: all)")  # fmt: skip
    args = parser.parse_args()
    scale = QUICK if args.quick else FULL
    result: dict[str, Any] = {
        "version": VERSION,
        "metadata": {
            "benchmark": "dashboards",
            "when": datetime.now(UTC).isoformat(timespec="seconds"),
            "git": git_revision(),
            "cpus": os.cpu_count(),
            "quick": args.quick,
            "scale": {**scale.__dict__, "sessions": scale.sessions, "flows": scale.flows},
            "repeats": args.repeats,
        },
    }
    timings: dict[str, float] = {}
    with embedded_postgres(args.data_dir) as server:
        url = db.libpq_url(server, DB_NAME)
        with psycopg.connect(db.libpq_url(server), autocommit=True) as admin:
            exists = admin.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (DB_NAME,)
            ).fetchone()
            row = admin.execute(
                "SELECT version(), current_setting('shared_buffers'), "
                "current_setting('work_mem'), "
                "current_setting('max_parallel_workers_per_gather')"
            ).fetchone()
            assert row is not None
            result["metadata"]["postgresql"] = {
                "version": row[0], "shared_buffers": row[1], "work_mem": row[2],
                "max_parallel_workers_per_gather": row[3],
            }  # fmt: skip
        if not exists:
            create_database(server, DB_NAME)
            db.upgrade(url, "0011")
            seed(url, scale, timings)
            with timed(timings, "migration_0012_builds_the_rollups_s"):
                db.upgrade(url)
            with timed(timings, "first_refresh_s"):
                result["first_refresh_rows"] = rollups.refresh(url)
            with psycopg.connect(db.libpq_url(url), autocommit=True) as conn:
                conn.execute("CREATE SCHEMA exact")
                for view in exact_views(migration_0012()):
                    conn.execute(view)
            result["new_data"] = add_new_data(url, scale)
            with timed(timings, "refresh_after_new_data_s"):
                result["refresh_after_new_data_rows"] = rollups.refresh(url)
            # And five more sessions after it: the rollup views' live part.
            add_new_data(url, scale)
            with psycopg.connect(db.libpq_url(url), autocommit=True) as conn:
                conn.execute("VACUUM ANALYZE")
                result["refresh_seconds"] = {
                    name: round(seconds, 2)
                    for name, seconds in conn.execute(
                        "SELECT name, seconds FROM rollup_refreshes ORDER BY name"
                    )
                }
        result["rows"] = counts(url)
        result["timings_s"] = timings
        if args.only in (None, "report"):
            log("timing the report's sections")
            sections = time_report(url, args.repeats)
            result["report_sections"] = sections
            result["slowest_report_section"] = max(sections, key=lambda r: r["ms"])
            result["volunteer_page_all_group"] = time_volunteer_page(url, args.repeats)
        if args.only in (None, "panels"):
            log("timing the panels")
            panels = time_panels(url, datetime.now(UTC), args.repeats, args.timeout)
            result["slowest_with_rollups"] = slowest(panels, "with_rollups_ms")
            result["slowest_without_rollups"] = slowest(panels, "without_rollups_ms")
            result["every_panel_under_1s_with_rollups"] = all(
                r["with_rollups_ms"] is not None and r["with_rollups_ms"] < 1000 for r in panels
            )
            result["panels"] = panels
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
