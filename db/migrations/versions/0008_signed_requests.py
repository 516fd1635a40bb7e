"""Signed requests: the nonces of trial runners' signed uploads (replay refusal).

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-25

Runners no longer send their token: each request carries an HMAC over its
method, path, time, a nonce and its body's digest, keyed by a key derived
from the token (``runners.token_hash`` already holds exactly that key, so
every registered runner keeps working). A nonce is accepted once within the
replay window; ``request_nonces`` is where every server instance sharing the
database sees the nonces of the others. Rows older than twice the window are
deleted as new ones arrive.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "request_nonces",
        sa.Column("runner_id", sa.BigInteger(), nullable=False),
        sa.Column("nonce", sa.Text(), nullable=False),
        sa.Column(
            "seen_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.ForeignKeyConstraint(
            ["runner_id"],
            ["runners.id"],
            name=op.f("fk_request_nonces_runner_id_runners"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("runner_id", "nonce", name=op.f("pk_request_nonces")),
    )
    op.create_index(op.f("ix_request_nonces_seen_at"), "request_nonces", ["seen_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_request_nonces_seen_at"), table_name="request_nonces")
    op.drop_table("request_nonces")
