"""Trials a reviewer would accept (issue 18): the paired design, equal
treatment, the schedule as it happened, the environment, the speedup on
matched flows; one name per view.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25

- ``flows``: ``pair`` (both periods of a pair replay the same flows: the
  same pair and index is the same flow under the other arm), ``arm`` (what
  its period ran: ``kickass``, ``kickass:paper``, ``tcp:cubic``, ``tcp:reno``,
  ``tcp:bbr``; an A/A twin ``#2``; a handicap ``+50ms``), ``queued_ms`` (the
  wait for a concurrency slot after it was due; ``fct_ms`` now counts from
  when it was due, this wait included, for both protocols) and
  ``negotiated_protocol`` (a Kick-Ass period's flow that fell back to TCP from
  the start says ``tcp``). NULL for flows stored before this revision.
- ``trial_periods``: ``arm``, ``handshake``, ``handicap_ms`` and
  ``actual_start_offset_s`` (when the period really started, from the trial's
  start: telemetry is attributed by it).
- ``trials.environment``: both ends' record (kernels, TCP settings and the
  metrics cache, routes, qdiscs, offloads, path MTU, versions, clock offset).
- ``trial_speedups``: the speedup on matched flows per size bucket (and over
  all sizes), with its bootstrap interval and both arms' completion rates,
  per trial and pooled; computed in Python (``kickass_analysis.rollups``)
  and written here by the scheduled ``refresh``.

Views. ``flow_results`` and ``flow_summary`` had a second name each
(``v_flow_results``, ``v_flow_summary``); only the ``v_`` names stay (the
reader role is granted ``v_*`` views only). Their columns are kept, in order,
and new ones added at the end; ``v_flow_summary`` is now per arm, and gains
``completion_rate``. New: ``v_trial_periods`` (the schedule and what
happened, readable by the reader role), ``v_trial_speedups``.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BUCKET = """CASE WHEN f.size_packets <= 10 THEN '1-10'
                    WHEN f.size_packets <= 100 THEN '11-100'
                    WHEN f.size_packets <= 1000 THEN '101-1000'
                    ELSE '1001+' END"""

FLOW_RESULTS = f"""
CREATE VIEW v_flow_results AS
SELECT t.trial_id, t.destination, f.protocol, f.congestion_control,
       t.access_capacity_bps, f.size_packets, f.fct_ms, f.ka_mode_fraction,
       f.mode_switches, f.retransmissions, f.started_at,
       f.flow_id, f.period_index, f.handshake, f.size_bytes, f.completed,
       f.srtt_ms, f.min_rtt_ms, f.advertised_rate_last_bps, f.error,
       {BUCKET} AS size_bucket,
       f.pair, f.arm, f.queued_ms, f.negotiated_protocol, f.ka_mode_ms,
       f.advertised_rate_min_bps, f.advertised_rate_max_bps, f.advertised_rates_seen,
       p.handicap_ms, p.actual_start_offset_s AS period_actual_start_s,
       t.router_run_name,
       -- The flow's index in its period: with the pair, what matches it
       -- with its twin under the other arm (kickass_core.flow_record.flow_id).
       (regexp_match(f.flow_id, '-([0-9]+)$'))[1]::bigint % 100000 AS flow_index
FROM flows f
JOIN trials t ON t.id = f.trial_pk
LEFT JOIN trial_periods p ON p.trial_pk = f.trial_pk AND p.period_index = f.period_index
"""

FLOW_SUMMARY = """
CREATE VIEW v_flow_summary AS
WITH pooled AS (
    SELECT destination, access_capacity_bps, protocol, coalesce(arm, protocol) AS arm,
           size_bucket,
           count(*) AS flows,
           count(fct_ms) AS completed,
           avg(fct_ms) AS fct_ms_mean,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY fct_ms) AS fct_ms_p50,
           percentile_cont(0.95) WITHIN GROUP (ORDER BY fct_ms) AS fct_ms_p95,
           avg(ka_mode_fraction) AS ka_mode_fraction_mean
    FROM v_flow_results
    GROUP BY destination, access_capacity_bps, protocol, coalesce(arm, protocol), size_bucket
)
SELECT k.destination, k.access_capacity_bps, k.protocol, k.size_bucket,
       k.flows, k.completed, k.fct_ms_mean, k.fct_ms_p50, k.fct_ms_p95,
       k.ka_mode_fraction_mean,
       -- The pooled ratio of means (kept for old readers): the paired speedup
       -- with its interval is v_trial_speedups.
       CASE WHEN k.protocol = 'kickass' AND k.fct_ms_mean > 0
            THEN tcp.fct_ms_mean / k.fct_ms_mean END AS speedup,
       k.arm,
       k.completed::double precision / nullif(k.flows, 0) AS completion_rate
FROM pooled k
LEFT JOIN pooled tcp
  ON tcp.arm IN ('tcp', 'tcp:cubic') AND tcp.destination = k.destination
 AND tcp.size_bucket = k.size_bucket
 AND tcp.access_capacity_bps IS NOT DISTINCT FROM k.access_capacity_bps
"""

TRIAL_PERIODS = """
CREATE VIEW v_trial_periods AS
SELECT t.trial_id, t.destination, t.router_run_name, t.started_at AS trial_started_at,
       p.period_index, p.pair, p.protocol, coalesce(p.arm, p.protocol) AS arm,
       p.congestion_control, p.handshake, p.handicap_ms,
       p.start_offset_s, p.duration_s, p.actual_start_offset_s,
       p.actual_start_offset_s - p.start_offset_s AS start_deviation_s,
       t.started_at + make_interval(secs => coalesce(p.actual_start_offset_s, p.start_offset_s))
           AS period_started_at
FROM trial_periods p JOIN trials t ON t.id = p.trial_pk
"""

TRIAL_SPEEDUPS = """
CREATE VIEW v_trial_speedups AS
SELECT scope, key, destination, access_capacity_bps, arm, baseline_arm, size_bucket,
       pairs, matched, speedup, speedup_low, speedup_high,
       completion_arm, completion_baseline, workload, computed_at
FROM trial_speedups
"""

OLD_FLOW_RESULTS = f"""
CREATE VIEW flow_results AS
SELECT t.trial_id, t.destination, f.protocol, f.congestion_control,
       t.access_capacity_bps, f.size_packets, f.fct_ms, f.ka_mode_fraction,
       f.mode_switches, f.retransmissions, f.started_at,
       f.flow_id, f.period_index, f.handshake, f.size_bytes, f.completed,
       f.srtt_ms, f.min_rtt_ms, f.advertised_rate_last_bps, f.error,
       {BUCKET} AS size_bucket
FROM flows f JOIN trials t ON t.id = f.trial_pk
"""

OLD_FLOW_SUMMARY = """
CREATE VIEW flow_summary AS
WITH pooled AS (
    SELECT destination, access_capacity_bps, protocol, size_bucket,
           count(*) AS flows,
           count(fct_ms) AS completed,
           avg(fct_ms) AS fct_ms_mean,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY fct_ms) AS fct_ms_p50,
           percentile_cont(0.95) WITHIN GROUP (ORDER BY fct_ms) AS fct_ms_p95,
           avg(ka_mode_fraction) AS ka_mode_fraction_mean
    FROM flow_results
    GROUP BY destination, access_capacity_bps, protocol, size_bucket
)
SELECT k.destination, k.access_capacity_bps, k.protocol, k.size_bucket,
       k.flows, k.completed, k.fct_ms_mean, k.fct_ms_p50, k.fct_ms_p95,
       k.ka_mode_fraction_mean,
       CASE WHEN k.protocol = 'kickass' AND k.fct_ms_mean > 0
            THEN tcp.fct_ms_mean / k.fct_ms_mean END AS speedup
FROM pooled k
LEFT JOIN pooled tcp
  ON tcp.protocol = 'tcp' AND tcp.destination = k.destination
 AND tcp.size_bucket = k.size_bucket
 AND tcp.access_capacity_bps IS NOT DISTINCT FROM k.access_capacity_bps
"""


def upgrade() -> None:
    for view in ("v_flow_summary", "v_flow_results", "flow_summary", "flow_results"):
        op.execute(f"DROP VIEW {view}")
    op.add_column("flows", sa.Column("pair", sa.Integer(), nullable=True))
    op.add_column("flows", sa.Column("arm", sa.Text(), nullable=True))
    op.add_column("flows", sa.Column("queued_ms", sa.Float(), nullable=True))
    op.add_column("flows", sa.Column("negotiated_protocol", sa.Text(), nullable=True))
    op.create_check_constraint(
        op.f("ck_flows_negotiated_protocol"),
        "flows",
        "negotiated_protocol IN ('kickass', 'tcp')",
    )
    op.add_column("trial_periods", sa.Column("arm", sa.Text(), nullable=True))
    op.add_column("trial_periods", sa.Column("handshake", sa.Text(), nullable=True))
    op.add_column("trial_periods", sa.Column("handicap_ms", sa.Float(), nullable=True))
    op.add_column("trial_periods", sa.Column("actual_start_offset_s", sa.Float(), nullable=True))
    op.add_column(
        "trials",
        sa.Column(
            "environment",
            postgresql.JSONB(),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
    )
    op.create_table(
        "trial_speedups",
        # 'trial' (key = trial_id) or 'pooled' (key = destination/capacity/workload).
        sa.Column("scope", sa.Text(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("destination", sa.Text(), nullable=False),
        sa.Column("access_capacity_bps", sa.Float(), nullable=True),
        sa.Column("arm", sa.Text(), nullable=False),
        sa.Column("baseline_arm", sa.Text(), nullable=False),
        sa.Column("size_bucket", sa.Text(), nullable=False),
        sa.Column("pairs", sa.Integer(), nullable=False),
        sa.Column("matched", sa.Integer(), nullable=False),
        sa.Column("speedup", sa.Float(), nullable=True),
        sa.Column("speedup_low", sa.Float(), nullable=True),
        sa.Column("speedup_high", sa.Float(), nullable=True),
        sa.Column("completion_arm", sa.Float(), nullable=True),
        sa.Column("completion_baseline", sa.Float(), nullable=True),
        sa.Column("workload", postgresql.JSONB(), nullable=True),
        sa.Column(
            "computed_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.CheckConstraint("scope IN ('trial', 'pooled')", name=op.f("ck_trial_speedups_scope")),
        sa.PrimaryKeyConstraint(
            "scope", "key", "arm", "baseline_arm", "size_bucket", name=op.f("pk_trial_speedups")
        ),
    )
    op.create_index(op.f("ix_flows_trial_pk_pair"), "flows", ["trial_pk", "pair"])
    for sql in (FLOW_RESULTS, FLOW_SUMMARY, TRIAL_PERIODS, TRIAL_SPEEDUPS):
        op.execute(sql)


def downgrade() -> None:
    for view in ("v_trial_speedups", "v_trial_periods", "v_flow_summary", "v_flow_results"):
        op.execute(f"DROP VIEW {view}")
    op.drop_index(op.f("ix_flows_trial_pk_pair"), table_name="flows")
    op.drop_table("trial_speedups")
    op.drop_column("trials", "environment")
    for col in ("actual_start_offset_s", "handicap_ms", "handshake", "arm"):
        op.drop_column("trial_periods", col)
    op.drop_constraint(op.f("ck_flows_negotiated_protocol"), "flows", type_="check")
    for col in ("negotiated_protocol", "queued_ms", "arm", "pair"):
        op.drop_column("flows", col)
    op.execute(OLD_FLOW_RESULTS)
    op.execute(OLD_FLOW_SUMMARY)
    op.execute("CREATE VIEW v_flow_results AS SELECT * FROM flow_results")
    op.execute("CREATE VIEW v_flow_summary AS SELECT * FROM flow_summary")
