"""Edge-router telemetry: one row per ka-router control interval.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21

``router_runs`` holds one row per router process (its metadata line: options,
capacity, mode); ``router_telemetry`` the NDJSON samples it printed, keyed by
(run, t). ``v_router_telemetry`` is what dashboards and notebooks read.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "router_runs",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("run_name", sa.Text(), nullable=True),
        sa.Column("mode", sa.Text(), nullable=False),
        sa.Column("capacity_bps", sa.Float(), nullable=True),
        sa.Column("program_version", sa.Text(), nullable=True),
        sa.Column("options", postgresql.JSONB(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("exit_reason", sa.Text(), nullable=True),
        sa.Column("counters", postgresql.JSONB(), nullable=True),
        sa.CheckConstraint("mode IN ('kickass', 'droptail')", name=op.f("ck_router_runs_mode")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_router_runs")),
    )
    op.create_table(
        "router_telemetry",
        sa.Column("run_id", sa.BigInteger(), nullable=False),
        sa.Column("t", sa.Float(), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("advertised_rate_bps", sa.Float(), nullable=False),
        sa.Column("leading_fragment_len", sa.SmallInteger(), nullable=True),
        sa.Column("input_rate_bps", sa.Float(), nullable=False),
        sa.Column("output_rate_bps", sa.Float(), nullable=True),
        sa.Column("queue_bytes", sa.BigInteger(), nullable=False),
        sa.Column("queue_packets", sa.BigInteger(), nullable=True),
        sa.Column("mode", sa.Text(), nullable=False),
        sa.Column("rtt_ms", sa.REAL(), nullable=True),
        sa.Column("drops", sa.BigInteger(), nullable=False),
        sa.Column("fragmented", sa.BigInteger(), nullable=False),
        sa.Column("mode_switches", sa.BigInteger(), nullable=True),
        sa.Column("extra", postgresql.JSONB(), nullable=True),
        sa.CheckConstraint(
            "mode IN ('kickass', 'tcp', 'droptail')", name=op.f("ck_router_telemetry_mode")
        ),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["router_runs.id"],
            name=op.f("fk_router_telemetry_run_id_router_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("run_id", "t", name=op.f("pk_router_telemetry")),
    )
    op.execute(
        """
        CREATE VIEW v_router_telemetry AS
        SELECT r.id AS run_id, r.run_name, r.mode AS router_mode, r.capacity_bps,
               s.recorded_at, s.t, s.advertised_rate_bps, s.leading_fragment_len,
               s.input_rate_bps, s.output_rate_bps, s.queue_bytes, s.mode, s.rtt_ms,
               s.drops, s.fragmented,
               CASE WHEN r.capacity_bps > 0 THEN s.output_rate_bps / r.capacity_bps END
                 AS utilization
        FROM router_telemetry s JOIN router_runs r ON r.id = s.run_id
        """
    )


def downgrade() -> None:
    op.execute("DROP VIEW v_router_telemetry")
    op.drop_table("router_telemetry")
    op.drop_table("router_runs")
