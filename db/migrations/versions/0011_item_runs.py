"""Scheduled work (issue 19): every run of a scheduled item is a row.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-25

``item_runs``: one row per item of a schedule file and due time, claimed by
the first host that inserts it (``UNIQUE (item, due_at)``: at most one
claim whatever the number of hosts running ``kickass schedule run`` at the
same moment). The row follows the run: ``running`` with a heartbeat, then
``ok``, ``failed``, ``skipped`` or ``timeout`` with a reason and counts
(results fetched, flows uploaded, credits spent...). A run whose host died
(its heartbeat stale, or for a run of this database's hosts its advisory
lock free) is taken over by the next ``schedule run``: the row's attempt is
incremented and the dead attempt kept in ``history``, with why. Nothing here
is ever deleted by the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OUTCOMES = "('running', 'ok', 'failed', 'skipped', 'timeout')"


def upgrade() -> None:
    op.create_table(
        "item_runs",
        sa.Column("id", sa.BigInteger(), sa.Identity(), nullable=False),
        sa.Column("item", sa.Text(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("due_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("host", sa.Text(), nullable=False),
        sa.Column("attempt", sa.Integer(), server_default=sa.text("1"), nullable=False),
        sa.Column("definition_hash", sa.Text(), nullable=True),
        sa.Column(
            "claimed_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),  # fmt: skip
        sa.Column(
            "heartbeat_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),  # fmt: skip
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("outcome", sa.Text(), server_default=sa.text("'running'"), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column(
            "counts", postgresql.JSONB(), server_default=sa.text("'{}'::jsonb"), nullable=False
        ),  # fmt: skip
        sa.Column(
            "history", postgresql.JSONB(), server_default=sa.text("'[]'::jsonb"), nullable=False
        ),  # fmt: skip
        sa.CheckConstraint(f"outcome IN {OUTCOMES}", name=op.f("ck_item_runs_outcome")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_item_runs")),
        sa.UniqueConstraint("item", "due_at", name=op.f("uq_item_runs_item_due_at")),
    )
    op.create_index(op.f("ix_item_runs_finished_at"), "item_runs", ["finished_at"])
    op.create_index(
        "ix_item_runs_running",
        "item_runs",
        ["item"],
        postgresql_where=sa.text("outcome = 'running'"),
    )
    op.execute(
        """
        CREATE VIEW v_item_runs AS
        SELECT id, item, kind, due_at, host, attempt, claimed_at, heartbeat_at, finished_at,
               outcome, reason, counts,
               extract(epoch FROM finished_at - claimed_at) AS duration_s,
               jsonb_array_length(history) AS dead_attempts
        FROM item_runs
        """
    )


def downgrade() -> None:
    op.execute("DROP VIEW v_item_runs")
    op.drop_index("ix_item_runs_running", table_name="item_runs")
    op.drop_index(op.f("ix_item_runs_finished_at"), table_name="item_runs")
    op.drop_table("item_runs")
