"""Rollups for the dashboards (issue 20): every panel under a second at scale.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-26

At 10 million probe rows, a million flows and a month of router telemetry the
analysis views recompute everything on every read (v_session_summary,
v_size_drop_all: seconds; v_flow_summary: seconds; v_router_telemetry: a
month of 10 ms samples). The dashboards read these rollups instead; the
exact views stay as they are (the API and the notebooks read them).
``kickass_analysis.rollups.refresh`` (the scheduled ``refresh`` item)
brings them up to date, concurrently: readers keep reading the old rows.

Materialised views (refreshed with REFRESH ... CONCURRENTLY):

- ``mv_session_summary``: ``v_session_summary`` of the sessions in a final
  state; ``mv_probe_daily``: probe counts per day of session creation,
  phase and IP length, of the same sessions. Both refresh in one
  REPEATABLE READ transaction, so they hold the same sessions, and the views
  over them add what finished since (``v_session_rollup``, ``v_drop_rollup``
  compute the sessions missing from ``mv_session_summary`` live, by index):
  a finished session is on the dashboards at once.
- ``mv_atlas_probe_drop``: Atlas outcomes per campaign, probe, phase and IP length.
- ``mv_flow_summary``: ``v_flow_summary``; ``mv_flow_hourly``: flow counts and
  sums per hour, destination, capacity, arm and size bucket.

Tables, filled incrementally (a month of 10 ms samples is 259 million rows
per router; each refresh reads only what arrived since the last):

- ``router_telemetry_1s``: per router run and second, the samples' sums,
  minima and maxima (so coarser buckets re-aggregate exactly);
  ``router_telemetry_1m``: the same per minute, from the seconds.
- ``rollup_refreshes``: when each rollup was last refreshed, its rows, the time taken.

Views (the reader role reads views only; these are its way in):
``v_session_rollup`` (v_session_summary's columns), ``v_verdicts_rollup``
(v_verdicts_by_source's columns), ``v_drop_rollup``, ``v_flow_summary_rollup``
(v_flow_summary's columns), ``v_flow_hourly``, ``v_router_runs``,
``v_router_telemetry_1s``, ``v_router_telemetry_1m``, ``v_item_health``
(campaign health per scheduled item, overdue ones flagged),
``v_atlas_campaigns`` (credits against the budget, measurements by status),
``v_rollup_status``.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FINAL = "('complete', 'ended', 'expired', 'incomplete')"

# v_session_summary's columns, in order (0002 + 0007).
SESSION_COLUMNS = """session_id, state, verdict, verdict_reason, created_at, finished_at,
    client_version, server_version, source_address, whole_sent, whole_acked,
    whole_drop_rate, split_sent, split_acked, split_drop_rate, split_to_whole_ratio,
    whole_reassembly_invalid, split_reassembly_invalid, split_excess_drop,
    split_excess_low, split_excess_high, whole_fragmented_on_arrival,
    split_largest_fragment_as_sent, split_fragments_observed, split_leading_as_sent,
    split_leading_swapped, reassembly_refused, reassembly_max_memory,
    reassembly_high_thresh"""

MV_SESSION_SUMMARY = f"""
CREATE MATERIALIZED VIEW mv_session_summary AS
SELECT {SESSION_COLUMNS}
FROM v_session_summary
WHERE state IN {FINAL}
"""

# Per session, phase and IP length first (hash aggregates), then per day:
# a session counts once per day, so ``sessions`` adds up across days.
# The counts are the study views' (0007): invalid probes are not sent.
_PROBE_COUNTS = """
SELECT date_trunc('day', s.created_at, 'UTC') AS day, p.phase, p.ip_len,
       count(*) AS sessions,
       sum(p.sent)::bigint AS sent, sum(p.acked)::bigint AS acked,
       sum(p.late)::bigint AS late,
       sum(p.reassembly_invalid)::bigint AS reassembly_invalid,
       sum(p.frag_observed)::bigint AS frag_observed,
       sum(p.largest_fragment_as_sent)::bigint AS largest_fragment_as_sent,
       sum(p.fragments_observed)::bigint AS fragments_observed,
       sum(p.fragmented_observed)::bigint AS fragmented_observed,
       sum(p.leading_as_sent)::bigint AS leading_as_sent,
       sum(p.leading_swapped)::bigint AS leading_swapped,
       sum(p.rtt_ms_sum) AS rtt_ms_sum, sum(p.rtt_ms_n)::bigint AS rtt_ms_n
FROM (
    SELECT o.session_pk, o.phase, o.ip_len::integer AS ip_len,
           count(*) FILTER (WHERE NOT (o.reassembly_invalid AND o.outcome = 'lost')) AS sent,
           count(*) FILTER (WHERE o.outcome = 'acked') AS acked,
           count(*) FILTER (WHERE o.outcome = 'late') AS late,
           count(*) FILTER (WHERE o.reassembly_invalid AND o.outcome = 'lost')
               AS reassembly_invalid,
           count(*) FILTER (WHERE o.outcome = 'acked' AND o.observed_frag_size > 0)
               AS frag_observed,
           count(*) FILTER (WHERE o.phase = 'split' AND o.outcome = 'acked'
                            AND o.observed_frag_size = greatest(o.ip_len::integer, 1520 - o.ip_len))
               AS largest_fragment_as_sent,
           count(*) FILTER (WHERE o.outcome = 'acked' AND o.observed_fragments IS NOT NULL)
               AS fragments_observed,
           count(*) FILTER (WHERE o.outcome = 'acked' AND o.observed_fragments > 1)
               AS fragmented_observed,
           count(*) FILTER (WHERE o.phase = 'split' AND o.outcome = 'acked'
                            AND o.observed_fragments = 2 AND o.observed_leading_len = o.ip_len)
               AS leading_as_sent,
           count(*) FILTER (WHERE o.phase = 'split' AND o.outcome = 'acked'
                            AND o.observed_fragments = 2
                            AND o.observed_leading_len = 1520 - o.ip_len AND o.ip_len <> 760)
               AS leading_swapped,
           sum(o.rtt_ms::double precision) FILTER (WHERE o.outcome = 'acked') AS rtt_ms_sum,
           count(o.rtt_ms) FILTER (WHERE o.outcome = 'acked') AS rtt_ms_n
    FROM probe_outcomes o
    JOIN sessions s0 ON s0.id = o.session_pk
    WHERE {where}
    GROUP BY o.session_pk, o.phase, o.ip_len
) p
JOIN sessions s ON s.id = p.session_pk
GROUP BY 1, 2, 3
"""

MV_PROBE_DAILY = "CREATE MATERIALIZED VIEW mv_probe_daily AS" + _PROBE_COUNTS.format(
    where=f"s0.state IN {FINAL}"
)

MV_ATLAS_PROBE_DROP = """
CREATE MATERIALIZED VIEW mv_atlas_probe_drop AS
SELECT o.campaign_id, o.prb_id, o.phase, o.ip_len::integer AS ip_len,
       count(*) FILTER (WHERE o.outcome IN ('acked', 'lost', 'late')) AS sent,
       count(*) FILTER (WHERE o.outcome = 'acked') AS acked,
       count(*) FILTER (WHERE o.outcome = 'late') AS late,
       count(*) FILTER (WHERE o.outcome = 'unanswered') AS unanswered,
       count(*) FILTER (WHERE o.outcome = 'error') AS errors,
       sum(o.rtt_ms::double precision) FILTER (WHERE o.outcome = 'acked') AS rtt_ms_sum,
       count(o.rtt_ms) FILTER (WHERE o.outcome = 'acked') AS rtt_ms_n,
       min(o.result_at) AS first_result_at, max(o.result_at) AS last_result_at
FROM atlas_outcomes o
WHERE o.ip_len IS NOT NULL
GROUP BY o.campaign_id, o.prb_id, o.phase, o.ip_len
"""

FLOW_SUMMARY_COLUMNS = """destination, access_capacity_bps, protocol, size_bucket, flows,
    completed, fct_ms_mean, fct_ms_p50, fct_ms_p95, ka_mode_fraction_mean, speedup, arm,
    completion_rate"""

# v_flow_summary can hold two rows of one group (a TCP arm named 'tcp' beside
# 'tcp:cubic'): the row number is the unique key REFRESH CONCURRENTLY needs.
MV_FLOW_SUMMARY = f"""
CREATE MATERIALIZED VIEW mv_flow_summary AS
SELECT row_number() OVER () AS rn, {FLOW_SUMMARY_COLUMNS}
FROM v_flow_summary
"""

BUCKET = """CASE WHEN f.size_packets <= 10 THEN '1-10'
                    WHEN f.size_packets <= 100 THEN '11-100'
                    WHEN f.size_packets <= 1000 THEN '101-1000'
                    ELSE '1001+' END"""

MV_FLOW_HOURLY = f"""
CREATE MATERIALIZED VIEW mv_flow_hourly AS
SELECT date_trunc('hour', f.started_at, 'UTC') AS hour, t.destination, t.access_capacity_bps,
       f.protocol, coalesce(f.arm, f.protocol) AS arm, {BUCKET} AS size_bucket,
       count(*) AS flows, count(f.fct_ms) AS completed, sum(f.fct_ms) AS fct_ms_sum,
       sum(f.ka_mode_fraction) AS ka_mode_fraction_sum,
       count(f.ka_mode_fraction) AS ka_mode_fraction_n,
       sum(f.mode_switches)::bigint AS mode_switches,
       sum(f.retransmissions)::bigint AS retransmissions,
       count(*) FILTER (WHERE f.protocol = 'kickass' AND f.negotiated_protocol = 'tcp')
           AS fell_back_to_tcp
FROM flows f JOIN trials t ON t.id = f.trial_pk
GROUP BY 1, 2, 3, 4, 5, 6
"""

MATVIEW_KEYS = {
    "mv_session_summary": "(session_id)",
    "mv_probe_daily": "(day, phase, ip_len)",
    "mv_atlas_probe_drop": "(campaign_id, prb_id, phase, ip_len)",
    "mv_flow_summary": "(rn)",
    "mv_flow_hourly": (
        "(hour, destination, access_capacity_bps, protocol, arm, size_bucket) NULLS NOT DISTINCT"
    ),
}

V_SESSION_ROLLUP = f"""
CREATE VIEW v_session_rollup AS
SELECT {SESSION_COLUMNS} FROM mv_session_summary
UNION ALL
SELECT {SESSION_COLUMNS} FROM v_session_summary v
WHERE NOT EXISTS (SELECT 1 FROM mv_session_summary m WHERE m.session_id = v.session_id)
"""

V_VERDICTS_ROLLUP = f"""
CREATE VIEW v_verdicts_rollup AS
SELECT 'volunteer'::text AS source, s.session_id, s.verdict, s.verdict_reason, s.finished_at,
       s.whole_sent, s.whole_acked, s.whole_drop_rate, s.split_sent, s.split_acked,
       s.split_drop_rate, s.split_to_whole_ratio,
       NULL::text AS campaign, NULL::integer AS prb_id, NULL::bigint AS asn,
       NULL::text AS country_code
FROM v_session_rollup s
WHERE s.state IN {FINAL}
UNION ALL
SELECT 'atlas'::text, 'atlas:' || c.name || ':' || v.prb_id, v.verdict, v.verdict_reason,
       v.updated_at, v.whole_sent::bigint, v.whole_acked::bigint,
       (v.whole_sent - v.whole_acked)::double precision / nullif(v.whole_sent, 0),
       v.split_sent::bigint, v.split_acked::bigint,
       (v.split_sent - v.split_acked)::double precision / nullif(v.split_sent, 0),
       ((v.split_sent - v.split_acked)::double precision / nullif(v.split_sent, 0))
         / nullif((v.whole_sent - v.whole_acked)::double precision
                  / nullif(v.whole_sent, 0), 0),
       c.name, v.prb_id, p.asn_v4, p.country_code
FROM atlas_verdicts v
JOIN atlas_campaigns c ON c.id = v.campaign_id
LEFT JOIN atlas_probes p ON p.prb_id = v.prb_id
"""

_VOLUNTEER_DROP = """
SELECT 'volunteer'::text AS source, d.day, NULL::text AS campaign, NULL::text AS country_code,
       NULL::bigint AS asn, d.phase, d.ip_len, d.sessions, d.sent, d.acked, d.late,
       d.reassembly_invalid, d.frag_observed, d.largest_fragment_as_sent,
       d.fragments_observed, d.fragmented_observed, d.leading_as_sent, d.leading_swapped,
       NULL::bigint AS unanswered, d.rtt_ms_sum, d.rtt_ms_n
FROM ({source}) d
"""

# Sessions finished since the last refresh: counted live, by index (few).
_NOT_ROLLED_UP = (
    f"s0.state IN {FINAL} AND NOT EXISTS "
    "(SELECT 1 FROM mv_session_summary m WHERE m.session_id = s0.session_id)"
)
_VOLUNTEER_ROLLED = _VOLUNTEER_DROP.format(source="SELECT * FROM mv_probe_daily")
_VOLUNTEER_LIVE = _VOLUNTEER_DROP.format(source=_PROBE_COUNTS.format(where=_NOT_ROLLED_UP))

V_DROP_ROLLUP = f"""
CREATE VIEW v_drop_rollup AS
SELECT source, day, campaign, country_code, asn, phase, ip_len, sessions, sent, acked, late,
       (sent - acked)::double precision / nullif(sent, 0) AS drop_rate,
       reassembly_invalid, frag_observed, largest_fragment_as_sent, fragments_observed,
       fragmented_observed, leading_as_sent, leading_swapped, unanswered,
       rtt_ms_sum / nullif(rtt_ms_n, 0) AS rtt_ms_mean, rtt_ms_sum, rtt_ms_n
FROM (
    {_VOLUNTEER_ROLLED}
    UNION ALL
    {_VOLUNTEER_LIVE}
    UNION ALL
    SELECT 'atlas'::text, date_trunc('day', a.last_result_at, 'UTC'), c.name, p.country_code,
           p.asn_v4, a.phase, a.ip_len, count(*), sum(a.sent)::bigint, sum(a.acked)::bigint,
           sum(a.late)::bigint, NULL::bigint, NULL::bigint, NULL::bigint, NULL::bigint,
           NULL::bigint, NULL::bigint, NULL::bigint, sum(a.unanswered)::bigint,
           sum(a.rtt_ms_sum), sum(a.rtt_ms_n)::bigint
    FROM mv_atlas_probe_drop a
    JOIN atlas_campaigns c ON c.id = a.campaign_id
    LEFT JOIN atlas_probes p ON p.prb_id = a.prb_id
    WHERE a.sent > 0
    GROUP BY 2, c.name, p.country_code, p.asn_v4, a.phase, a.ip_len
) u
"""

V_FLOW_SUMMARY_ROLLUP = f"""
CREATE VIEW v_flow_summary_rollup AS
SELECT {FLOW_SUMMARY_COLUMNS} FROM mv_flow_summary
"""

V_FLOW_HOURLY = """
CREATE VIEW v_flow_hourly AS
SELECT hour, destination, access_capacity_bps, protocol, arm, size_bucket, flows, completed,
       completed::double precision / nullif(flows, 0) AS completion_rate,
       fct_ms_sum / nullif(completed, 0) AS fct_ms_mean,
       ka_mode_fraction_sum / nullif(ka_mode_fraction_n, 0) AS ka_mode_fraction_mean,
       fct_ms_sum, ka_mode_fraction_sum, ka_mode_fraction_n, mode_switches, retransmissions,
       fell_back_to_tcp
FROM mv_flow_hourly
"""

V_ROUTER_RUNS = """
CREATE VIEW v_router_runs AS
SELECT id AS run_id, run_name, coalesce(run_name, 'run ' || id) AS label, router_kind,
       capacity_bps, program_version, started_at, finished_at, exit_reason
FROM router_runs
"""

_ROUTER_ROLLUP_VIEW = """
CREATE VIEW v_router_telemetry_{res} AS
SELECT x.run_id, r.run_name, coalesce(r.run_name, 'run ' || r.id) AS label, r.router_kind,
       r.capacity_bps, x.at, x.samples,
       x.advertised_rate_sum / x.samples AS advertised_rate_bps,
       x.advertised_rate_min AS advertised_rate_min_bps,
       x.advertised_rate_max AS advertised_rate_max_bps,
       x.leading_fragment_sum / nullif(x.leading_fragment_n, 0) AS leading_fragment_len,
       x.leading_fragment_min AS leading_fragment_len_min,
       x.leading_fragment_max AS leading_fragment_len_max,
       x.leading_fragment_n AS fragmenting_samples,
       x.input_rate_sum / x.samples AS input_rate_bps,
       x.output_rate_sum / nullif(x.output_rate_n, 0) AS output_rate_bps,
       CASE WHEN r.capacity_bps > 0
            THEN x.output_rate_sum / nullif(x.output_rate_n, 0) / r.capacity_bps END
           AS utilization,
       x.queue_bytes_sum / x.samples AS queue_bytes, x.queue_bytes_max,
       x.kickass_samples::double precision / x.samples AS ka_mode_share,
       x.kickass_samples, x.tcp_samples,
       x.rtt_ms_sum / nullif(x.rtt_ms_n, 0) AS rtt_ms,
       x.drops_max AS drops, x.fragmented_max AS fragmented, x.mode_switches_max AS mode_switches
FROM router_telemetry_{res} x JOIN router_runs r ON r.id = x.run_id
"""

# An item is overdue when its last due time is more than twice its usual
# period ago (the median gap between its last 20 due times).
V_ITEM_HEALTH = """
CREATE VIEW v_item_health AS
WITH runs AS (
    SELECT item, kind, due_at, outcome, reason, finished_at,
           due_at - lag(due_at) OVER (PARTITION BY item ORDER BY due_at) AS gap,
           row_number() OVER (PARTITION BY item ORDER BY due_at DESC) AS recency
    FROM item_runs
), items AS (
    SELECT item,
           (array_agg(kind ORDER BY due_at DESC))[1] AS kind,
           count(*) AS runs,
           count(*) FILTER (WHERE outcome = 'ok') AS ok_runs,
           count(*) FILTER (WHERE outcome IN ('failed', 'timeout')) AS failed_runs,
           count(*) FILTER (WHERE outcome = 'running') AS running,
           max(due_at) AS last_due_at,
           (array_agg(outcome ORDER BY due_at DESC))[1] AS last_outcome,
           (array_agg(reason ORDER BY due_at DESC))[1] AS last_reason,
           max(finished_at) FILTER (WHERE outcome = 'ok') AS last_ok_at,
           max(finished_at) FILTER (WHERE outcome IN ('failed', 'timeout')) AS last_failure_at,
           extract(epoch FROM percentile_cont(0.5) WITHIN GROUP (ORDER BY gap)
                              FILTER (WHERE recency <= 20)) AS period_s
    FROM runs
    GROUP BY item
)
SELECT item, kind, runs, ok_runs, failed_runs, running, last_due_at, last_outcome,
       last_reason, last_ok_at, last_failure_at, period_s,
       extract(epoch FROM now() - last_ok_at) AS since_ok_s,
       coalesce(extract(epoch FROM now() - last_due_at) > 2 * period_s, false) AS overdue
FROM items
"""

V_ATLAS_CAMPAIGNS = """
CREATE VIEW v_atlas_campaigns AS
SELECT c.name AS campaign, c.credit_budget, c.created_at,
       count(m.msm_id) AS measurements,
       count(m.msm_id) FILTER (WHERE m.status_id IN (0, 1, 2)) AS measurements_running,
       count(m.msm_id) FILTER (WHERE m.status_id = 4) AS measurements_stopped,
       count(m.msm_id) FILTER (WHERE m.status_id IN (5, 6, 7)) AS measurements_failed,
       coalesce(sum(m.estimated_credits), 0)::bigint AS estimated_credits,
       coalesce(sum(m.results_fetched::bigint
                    * coalesce(m.credits_per_result, m.packets * (m.size / 1500 + 1))), 0)::bigint
           AS credits_spent,
       coalesce(sum(m.results_fetched), 0)::bigint AS results_fetched,
       max(m.last_fetch_at) AS last_fetch_at,
       count(m.msm_id) FILTER (WHERE m.last_error IS NOT NULL) AS measurements_with_errors
FROM atlas_campaigns c
LEFT JOIN atlas_measurements m ON m.campaign_id = c.id
GROUP BY c.id, c.name, c.credit_budget, c.created_at
"""

V_ROLLUP_STATUS = """
CREATE VIEW v_rollup_status AS
SELECT name, refreshed_at, rows, seconds, extract(epoch FROM now() - refreshed_at) AS age_s
FROM rollup_refreshes
"""

VIEWS = (
    "v_rollup_status", "v_atlas_campaigns", "v_item_health", "v_router_telemetry_1m",
    "v_router_telemetry_1s", "v_router_runs", "v_flow_hourly", "v_flow_summary_rollup",
    "v_drop_rollup", "v_verdicts_rollup", "v_session_rollup",
)  # fmt: skip


def _router_rollup(name: str) -> None:
    op.create_table(
        name,
        sa.Column("run_id", sa.BigInteger(), nullable=False),
        # The second (minute) of the run: the run's start, to the second, plus
        # whole seconds of the samples' t (minutes: truncated to the minute).
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("advertised_rate_sum", sa.Float(), nullable=False),
        sa.Column("advertised_rate_min", sa.Float(), nullable=False),
        sa.Column("advertised_rate_max", sa.Float(), nullable=False),
        sa.Column("leading_fragment_sum", sa.Float(), nullable=False),
        sa.Column("leading_fragment_n", sa.Integer(), nullable=False),
        sa.Column("leading_fragment_min", sa.SmallInteger(), nullable=True),
        sa.Column("leading_fragment_max", sa.SmallInteger(), nullable=True),
        sa.Column("input_rate_sum", sa.Float(), nullable=False),
        sa.Column("output_rate_sum", sa.Float(), nullable=False),
        sa.Column("output_rate_n", sa.Integer(), nullable=False),
        sa.Column("queue_bytes_sum", sa.Float(), nullable=False),
        sa.Column("queue_bytes_max", sa.BigInteger(), nullable=False),
        sa.Column("kickass_samples", sa.Integer(), nullable=False),
        sa.Column("tcp_samples", sa.Integer(), nullable=False),
        sa.Column("rtt_ms_sum", sa.Float(), nullable=False),
        sa.Column("rtt_ms_n", sa.Integer(), nullable=False),
        sa.Column("drops_max", sa.BigInteger(), nullable=False),
        sa.Column("fragmented_max", sa.BigInteger(), nullable=False),
        sa.Column("mode_switches_max", sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["router_runs.id"],
            name=op.f(f"fk_{name}_run_id_router_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("run_id", "at", name=op.f(f"pk_{name}")),
    )


def upgrade() -> None:
    for res in ("1s", "1m"):
        _router_rollup(f"router_telemetry_{res}")
    op.create_table(
        "rollup_refreshes",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("refreshed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("rows", sa.BigInteger(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_rollup_refreshes")),
    )
    for sql in (MV_SESSION_SUMMARY, MV_PROBE_DAILY, MV_ATLAS_PROBE_DROP, MV_FLOW_SUMMARY,
                MV_FLOW_HOURLY):  # fmt: skip
        op.execute(sql)
    for mv, key in MATVIEW_KEYS.items():
        op.execute(f"CREATE UNIQUE INDEX ux_{mv} ON {mv} {key}")
    op.execute("CREATE INDEX ix_mv_session_summary_created_at ON mv_session_summary (created_at)")
    for sql in (
        V_SESSION_ROLLUP,
        V_VERDICTS_ROLLUP,
        V_DROP_ROLLUP,
        V_FLOW_SUMMARY_ROLLUP,
        V_FLOW_HOURLY,
        V_ROUTER_RUNS,
        _ROUTER_ROLLUP_VIEW.format(res="1s"),
        _ROUTER_ROLLUP_VIEW.format(res="1m"),
        V_ITEM_HEALTH,
        V_ATLAS_CAMPAIGNS,
        V_ROLLUP_STATUS,
    ):
        op.execute(sql)


def downgrade() -> None:
    for view in VIEWS:
        op.execute(f"DROP VIEW {view}")
    for mv in reversed(MATVIEW_KEYS):
        op.execute(f"DROP MATERIALIZED VIEW {mv}")
    op.drop_table("rollup_refreshes")
    for res in ("1m", "1s"):
        op.drop_table(f"router_telemetry_{res}")
