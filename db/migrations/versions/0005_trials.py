"""Wide-area trials: runners, trials, interleaved periods, flows; flow_results views.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22

``flow_results`` is the stable per-flow view researchers read;
``flow_summary`` pools it per destination x access capacity x protocol x
size bucket (n, mean, p50, p95 FCT) with the Kick-Ass speedup (mean TCP FCT /
mean Kick-Ass FCT of the same destination, capacity and bucket). Only
completed flows have an FCT; ``flow_summary`` also counts the others.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "runners",
        sa.Column("id", sa.BigInteger(), sa.Identity(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("token_hash", sa.LargeBinary(), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runners")),
        sa.UniqueConstraint("name", name=op.f("uq_runners_name")),
    )
    op.create_table(
        "trials",
        sa.Column("id", sa.BigInteger(), sa.Identity(), nullable=False),
        sa.Column("trial_id", sa.Text(), nullable=False),
        sa.Column("runner_id", sa.BigInteger(), nullable=True),
        sa.Column("destination", sa.Text(), nullable=False),
        sa.Column("access_capacity_bps", sa.Float(), nullable=True),
        sa.Column("router_run_name", sa.Text(), nullable=True),
        sa.Column("parameters", postgresql.JSONB(), nullable=False),
        sa.Column("versions", postgresql.JSONB(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "received_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.CheckConstraint("trial_id ~ '^[0-9a-f]{32}$'", name=op.f("ck_trials_trial_id_format")),
        sa.ForeignKeyConstraint(
            ["runner_id"],
            ["runners.id"],
            name=op.f("fk_trials_runner_id_runners"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_trials")),
        sa.UniqueConstraint("trial_id", name=op.f("uq_trials_trial_id")),
    )
    op.create_index(
        op.f("ix_trials_destination_started_at"), "trials", ["destination", "started_at"]
    )
    op.create_table(
        "trial_periods",
        sa.Column("trial_pk", sa.BigInteger(), nullable=False),
        sa.Column("period_index", sa.Integer(), nullable=False),
        sa.Column("pair", sa.Integer(), nullable=False),
        sa.Column("protocol", sa.Text(), nullable=False),
        sa.Column("congestion_control", sa.Text(), nullable=True),
        sa.Column("start_offset_s", sa.Float(), nullable=False),
        sa.Column("duration_s", sa.Float(), nullable=False),
        sa.CheckConstraint(
            "protocol IN ('kickass', 'tcp')", name=op.f("ck_trial_periods_protocol")
        ),
        sa.ForeignKeyConstraint(
            ["trial_pk"],
            ["trials.id"],
            name=op.f("fk_trial_periods_trial_pk_trials"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("trial_pk", "period_index", name=op.f("pk_trial_periods")),
    )
    op.create_table(
        "flows",
        sa.Column("id", sa.BigInteger(), sa.Identity(), nullable=False),
        sa.Column("flow_id", sa.Text(), nullable=False),
        sa.Column("trial_pk", sa.BigInteger(), nullable=False),
        sa.Column("period_index", sa.Integer(), nullable=False),
        sa.Column("protocol", sa.Text(), nullable=False),
        sa.Column("congestion_control", sa.Text(), nullable=True),
        sa.Column("handshake", sa.Text(), nullable=True),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("size_packets", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("completed", sa.Boolean(), nullable=False),
        sa.Column("fct_ms", sa.Float(), nullable=True),
        sa.Column("ka_mode_ms", sa.Float(), nullable=True),
        sa.Column("ka_mode_fraction", sa.REAL(), nullable=True),
        sa.Column("mode_switches", sa.Integer(), nullable=True),
        sa.Column("retransmissions", sa.Integer(), nullable=True),
        sa.Column("srtt_ms", sa.REAL(), nullable=True),
        sa.Column("min_rtt_ms", sa.REAL(), nullable=True),
        sa.Column("advertised_rate_min_bps", sa.Float(), nullable=True),
        sa.Column("advertised_rate_max_bps", sa.Float(), nullable=True),
        sa.Column("advertised_rate_last_bps", sa.Float(), nullable=True),
        sa.Column("advertised_rates_seen", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("extra", postgresql.JSONB(), nullable=True),
        sa.CheckConstraint("protocol IN ('kickass', 'tcp')", name=op.f("ck_flows_protocol")),
        sa.CheckConstraint("size_packets >= 1 AND size_bytes >= 1", name=op.f("ck_flows_size")),
        sa.CheckConstraint(
            "ka_mode_fraction IS NULL OR (ka_mode_fraction >= 0 AND ka_mode_fraction <= 1)",
            name=op.f("ck_flows_ka_mode_fraction"),
        ),
        sa.ForeignKeyConstraint(
            ["trial_pk"], ["trials.id"], name=op.f("fk_flows_trial_pk_trials"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_flows")),
        sa.UniqueConstraint("flow_id", name=op.f("uq_flows_flow_id")),
    )
    op.create_index(op.f("ix_flows_trial_pk_period_index"), "flows", ["trial_pk", "period_index"])
    op.execute(
        """
        CREATE VIEW flow_results AS
        SELECT t.trial_id, t.destination, f.protocol, f.congestion_control,
               t.access_capacity_bps, f.size_packets, f.fct_ms, f.ka_mode_fraction,
               f.mode_switches, f.retransmissions, f.started_at,
               f.flow_id, f.period_index, f.handshake, f.size_bytes, f.completed,
               f.srtt_ms, f.min_rtt_ms, f.advertised_rate_last_bps, f.error,
               CASE WHEN f.size_packets <= 10 THEN '1-10'
                    WHEN f.size_packets <= 100 THEN '11-100'
                    WHEN f.size_packets <= 1000 THEN '101-1000'
                    ELSE '1001+' END AS size_bucket
        FROM flows f JOIN trials t ON t.id = f.trial_pk
        """
    )
    op.execute(
        """
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
    )
    # The reader role (Grafana, notebooks) is granted the v_* views: the same
    # two under that convention's names.
    op.execute("CREATE VIEW v_flow_results AS SELECT * FROM flow_results")
    op.execute("CREATE VIEW v_flow_summary AS SELECT * FROM flow_summary")


def downgrade() -> None:
    op.execute("DROP VIEW v_flow_summary")
    op.execute("DROP VIEW v_flow_results")
    op.execute("DROP VIEW flow_summary")
    op.execute("DROP VIEW flow_results")
    op.drop_index(op.f("ix_flows_trial_pk_period_index"), table_name="flows")
    op.drop_table("flows")
    op.drop_table("trial_periods")
    op.drop_index(op.f("ix_trials_destination_started_at"), table_name="trials")
    op.drop_table("trials")
    op.drop_table("runners")
