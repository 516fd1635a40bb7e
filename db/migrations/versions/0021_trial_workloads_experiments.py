"""What a trial period ran and carried; the congestion experiments.

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-28

Issue 24 (Kick-Ass under congestion):

* ``trial_periods`` gains ``transport_cc`` (a Kick-Ass arm's TCP mode in
  ka-transport: cubic or newreno; the arm grammar's ``/cc``), ``tcp_share``
  (a Kick-Ass arm's share of flows run as kernel TCP: ``@tcpNN``) and
  ``offered_load_bps`` (application bit/s of the flows that started in the
  period, over its length: fixed by the workload in an open loop, what the
  protocol let through in a closed one). ``v_trial_periods`` gains them and
  ``workload_loop`` (open or closed: the trial's workload says which) at
  its end.
* ``experiment_runs`` and ``experiment_rates``: a run of the paper's
  congestion experiments (§III-D1 Fig. 5, §III-D2 Fig. 7;
  ``kickass_testbed.congestion``) with its figures, and each flow's rate and
  mode every interval, read through ``v_experiment_runs`` and
  ``v_experiment_rates``.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from kickass_core import bounds
from kickass_core.flow_record import PROTOCOLS
from kickass_db.base import check_bounds, check_in
from sqlalchemy.dialects import postgresql

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PERIODS = """
SELECT t.trial_id, t.destination, t.router_run_name, t.started_at AS trial_started_at,
       p.period_index, p.pair, p.protocol, coalesce(p.arm, p.protocol) AS arm,
       p.congestion_control, p.handshake, p.handicap_ms,
       p.start_offset_s, p.duration_s, p.actual_start_offset_s,
       p.actual_start_offset_s - p.start_offset_s AS start_deviation_s,
       t.started_at + make_interval(secs => coalesce(p.actual_start_offset_s, p.start_offset_s))
           AS period_started_at{added}
FROM trial_periods p JOIN trials t ON t.id = p.trial_pk
"""
ADDED = """,
       p.transport_cc, p.tcp_share, p.offered_load_bps,
       coalesce(t.parameters -> 'workload' ->> 'loop', 'open') AS workload_loop"""
KINDS = ("kickass-bottleneck", "legacy-bottleneck")


def _bounds(table: str, column: str) -> str:
    (f,) = [f for f in bounds.checked(table) if f.name == column]
    return check_bounds(f)


def upgrade() -> None:
    op.add_column("trial_periods", sa.Column("transport_cc", sa.Text(), nullable=True))
    op.add_column("trial_periods", sa.Column("tcp_share", sa.Float(), nullable=True))
    op.add_column("trial_periods", sa.Column("offered_load_bps", sa.Float(), nullable=True))
    for column in ("tcp_share", "offered_load_bps"):
        op.create_check_constraint(
            f"{column}_bounds", "trial_periods", _bounds("trial_periods", column)
        )
    op.execute("CREATE OR REPLACE VIEW v_trial_periods AS" + PERIODS.format(added=ADDED))

    op.create_table(
        "experiment_runs",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("capacity_bps", sa.Float(), nullable=False),
        sa.Column("rtt_ms", sa.Float(), nullable=False),
        sa.Column("router_run_name", sa.Text(), nullable=True),
        sa.Column("parameters", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("figures", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.CheckConstraint(check_in("kind", KINDS), name=op.f("ck_experiment_runs_kind")),
        *(
            sa.CheckConstraint(check_bounds(f), name=op.f(f"ck_experiment_runs_{f.name}_bounds"))
            for f in bounds.checked("experiment_runs")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_experiment_runs")),
    )
    op.create_table(
        "experiment_rates",
        sa.Column("run_pk", sa.BigInteger(), nullable=False),
        sa.Column("flow", sa.Text(), nullable=False),
        sa.Column("t_s", sa.Float(), nullable=False),
        sa.Column("protocol", sa.Text(), nullable=False),
        sa.Column("rate_bps", sa.Float(), nullable=False),
        sa.Column("ka_mode", sa.Boolean(), nullable=False),
        sa.CheckConstraint(
            check_in("protocol", PROTOCOLS), name=op.f("ck_experiment_rates_protocol")
        ),
        *(
            sa.CheckConstraint(check_bounds(f), name=op.f(f"ck_experiment_rates_{f.name}_bounds"))
            for f in bounds.checked("experiment_rates")
        ),
        sa.ForeignKeyConstraint(
            ["run_pk"],
            ["experiment_runs.id"],
            name=op.f("fk_experiment_rates_run_pk_experiment_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("run_pk", "flow", "t_s", name=op.f("pk_experiment_rates")),
    )
    op.execute(
        """
        CREATE VIEW v_experiment_runs AS
        SELECT id AS run_id, kind, started_at, capacity_bps, rtt_ms, router_run_name,
               parameters, figures, created_at
        FROM experiment_runs
        """
    )
    op.execute(
        """
        CREATE VIEW v_experiment_rates AS
        SELECT r.id AS run_id, r.kind, x.flow, x.protocol, x.t_s,
               r.started_at + make_interval(secs => x.t_s) AS at,
               x.rate_bps, x.ka_mode
        FROM experiment_rates x JOIN experiment_runs r ON r.id = x.run_pk
        """
    )


def downgrade() -> None:
    op.execute("DROP VIEW v_experiment_rates")
    op.execute("DROP VIEW v_experiment_runs")
    op.drop_table("experiment_rates")
    op.drop_table("experiment_runs")
    # A view cannot lose a column in place.
    op.execute("DROP VIEW v_trial_periods")
    op.execute("CREATE VIEW v_trial_periods AS" + PERIODS.format(added=""))
    for column in ("offered_load_bps", "tcp_share"):
        op.drop_constraint(f"ck_trial_periods_{column}_bounds", "trial_periods")
    for column in ("offered_load_bps", "tcp_share", "transport_cc"):
        op.drop_column("trial_periods", column)
