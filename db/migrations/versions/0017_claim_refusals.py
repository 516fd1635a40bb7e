"""Refused claims of scheduled runs, counted: ``claim_refusals``.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-28

Scheduled runs have owners (issue 27): a claim for an item the claimer may
not run (not in the schedule, not one of the item's hosts, a database kind
claimed by a runner host, a disabled item) or for a due time that is not
due (in the future, or not on the item's cron) is refused and stores no run.
What operators see of it (``kickass schedule status``, the metrics) is a
count per claiming host, item and reason, with the first and last time and
the last refusal's message. ``item`` is empty when the schedule has no item
of the claimed name: made-up names add to a count, never a row.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

REASONS = "('not-in-schedule', 'not-owner', 'database-kind', 'disabled', 'not-due')"


def upgrade() -> None:
    op.create_table(
        "claim_refusals",
        sa.Column("host", sa.Text(), nullable=False),
        sa.Column("item", sa.Text(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("refusals", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column(
            "first_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),  # fmt: skip
        sa.Column(
            "last_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),  # fmt: skip
        sa.Column("last_message", sa.Text(), nullable=True),
        sa.CheckConstraint(f"reason IN {REASONS}", name=op.f("ck_claim_refusals_reason")),
        sa.PrimaryKeyConstraint("host", "item", "reason", name=op.f("pk_claim_refusals")),
    )


def downgrade() -> None:
    op.drop_table("claim_refusals")
