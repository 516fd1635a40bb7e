"""One concept, one name; sessions know which server process runs them.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22

* ``router_runs.mode`` (which router: kickass or droptail) becomes
  ``router_kind`` and ``router_telemetry.mode`` (what the router did in that
  interval: kickass marking or TCP mode) becomes ``marking_mode``: two
  concepts had one name. ``v_router_telemetry`` keeps its old columns
  (``router_mode``, ``mode``) and adds the new names at the end.
* ``sessions.server_instance``: the id of the server process that runs the
  session, so a restarting server marks only its own orphans incomplete and
  two servers can share one database (ARCHITECTURE.md, "Sessions have an owner").
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_VIEW_0003 = """
    CREATE VIEW v_router_telemetry AS
    SELECT r.id AS run_id, r.run_name, r.mode AS router_mode, r.capacity_bps,
           s.recorded_at, s.t, s.advertised_rate_bps, s.leading_fragment_len,
           s.input_rate_bps, s.output_rate_bps, s.queue_bytes, s.mode, s.rtt_ms,
           s.drops, s.fragmented,
           CASE WHEN r.capacity_bps > 0 THEN s.output_rate_bps / r.capacity_bps END
             AS utilization
    FROM router_telemetry s JOIN router_runs r ON r.id = s.run_id
"""

_VIEW_0004 = """
    CREATE VIEW v_router_telemetry AS
    SELECT r.id AS run_id, r.run_name, r.router_kind AS router_mode, r.capacity_bps,
           s.recorded_at, s.t, s.advertised_rate_bps, s.leading_fragment_len,
           s.input_rate_bps, s.output_rate_bps, s.queue_bytes, s.marking_mode AS mode,
           s.rtt_ms, s.drops, s.fragmented,
           CASE WHEN r.capacity_bps > 0 THEN s.output_rate_bps / r.capacity_bps END
             AS utilization,
           r.router_kind, s.marking_mode
    FROM router_telemetry s JOIN router_runs r ON r.id = s.run_id
"""


def upgrade() -> None:
    op.execute("DROP VIEW v_router_telemetry")
    op.alter_column("router_runs", "mode", new_column_name="router_kind")
    op.drop_constraint(op.f("ck_router_runs_mode"), "router_runs", type_="check")
    op.create_check_constraint(
        op.f("ck_router_runs_router_kind"), "router_runs", "router_kind IN ('kickass', 'droptail')"
    )
    op.alter_column("router_telemetry", "mode", new_column_name="marking_mode")
    op.drop_constraint(op.f("ck_router_telemetry_mode"), "router_telemetry", type_="check")
    op.create_check_constraint(
        op.f("ck_router_telemetry_marking_mode"),
        "router_telemetry",
        "marking_mode IN ('kickass', 'tcp', 'droptail')",
    )
    op.execute(_VIEW_0004)
    op.add_column("sessions", sa.Column("server_instance", sa.Text(), nullable=True))
    op.create_index(
        op.f("ix_sessions_server_instance_state"), "sessions", ["server_instance", "state"]
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_sessions_server_instance_state"), table_name="sessions")
    op.drop_column("sessions", "server_instance")
    op.execute("DROP VIEW v_router_telemetry")
    op.drop_constraint(op.f("ck_router_telemetry_marking_mode"), "router_telemetry", type_="check")
    op.alter_column("router_telemetry", "marking_mode", new_column_name="mode")
    op.create_check_constraint(
        op.f("ck_router_telemetry_mode"),
        "router_telemetry",
        "mode IN ('kickass', 'tcp', 'droptail')",
    )
    op.drop_constraint(op.f("ck_router_runs_router_kind"), "router_runs", type_="check")
    op.alter_column("router_runs", "router_kind", new_column_name="mode")
    op.create_check_constraint(
        op.f("ck_router_runs_mode"), "router_runs", "mode IN ('kickass', 'droptail')"
    )
    op.execute(_VIEW_0003)
