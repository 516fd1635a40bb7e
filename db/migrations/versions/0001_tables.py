"""Tables: clients, sessions, probe_outcomes.

Revision ID: 0001
Revises:
Create Date: 2026-11-21

Values in CHECK constraints are written out, not imported from the models:
a migration must keep meaning what it meant when it was written.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "clients",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("install_id", sa.Text(), nullable=True),
        sa.Column(
            "first_seen",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "last_seen", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.Column("last_address", postgresql.INET(), nullable=True),
        sa.Column("client_version", sa.Text(), nullable=True),
        sa.Column("platform", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_clients")),
        sa.UniqueConstraint("install_id", name=op.f("uq_clients_install_id")),
    )
    op.create_table(
        "sessions",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("session_id", sa.Text(), nullable=False),
        sa.Column("client_id", sa.BigInteger(), nullable=True),
        sa.Column("cookie_hash", sa.LargeBinary(), nullable=True),
        sa.Column("source_address", postgresql.INET(), nullable=True),
        sa.Column("probe_address", postgresql.INET(), nullable=True),
        sa.Column("probe_port", sa.Integer(), nullable=True),
        sa.Column("state", sa.Text(), server_default="created", nullable=False),
        sa.Column("plan", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("client_version", sa.Text(), nullable=True),
        sa.Column("server_version", sa.Text(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("sent", sa.Integer(), server_default="0", nullable=False),
        sa.Column("acked", sa.Integer(), server_default="0", nullable=False),
        sa.Column("rtt_ms", sa.REAL(), nullable=True),
        sa.Column("verdict", sa.Text(), nullable=True),
        sa.Column("verdict_reason", sa.Text(), nullable=True),
        sa.Column("end_reason", sa.Text(), nullable=True),
        sa.CheckConstraint(
            "session_id ~ '^[0-9a-f]{16}$'", name=op.f("ck_sessions_session_id_format")
        ),
        sa.CheckConstraint(
            "state IN ('created', 'probing', 'complete', 'ended', 'expired', 'incomplete')",
            name=op.f("ck_sessions_state"),
        ),
        sa.CheckConstraint(
            "verdict IN ('fragments-ok', 'fragment-intolerant', 'inconclusive')",
            name=op.f("ck_sessions_verdict"),
        ),
        sa.CheckConstraint("sent >= 0 AND acked >= 0", name=op.f("ck_sessions_counters")),
        sa.ForeignKeyConstraint(
            ["client_id"],
            ["clients.id"],
            name=op.f("fk_sessions_client_id_clients"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sessions")),
        sa.UniqueConstraint("session_id", name=op.f("uq_sessions_session_id")),
    )
    op.create_index(op.f("ix_sessions_client_id"), "sessions", ["client_id"])
    op.create_index(op.f("ix_sessions_created_at"), "sessions", ["created_at"])
    op.create_table(
        "probe_outcomes",
        sa.Column("session_pk", sa.BigInteger(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("phase", sa.Text(), nullable=False),
        sa.Column("ip_len", sa.SmallInteger(), nullable=False),
        sa.Column("sent_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("outcome", sa.Text(), nullable=False),
        sa.Column("acked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("rtt_ms", sa.REAL(), nullable=True),
        sa.Column("ack_count", sa.SmallInteger(), server_default="0", nullable=False),
        sa.Column("received_len", sa.Integer(), nullable=True),
        sa.Column("observed_frag_size", sa.Integer(), nullable=True),
        sa.CheckConstraint("phase IN ('whole', 'split')", name=op.f("ck_probe_outcomes_phase")),
        sa.CheckConstraint(
            "outcome IN ('acked', 'lost', 'late')", name=op.f("ck_probe_outcomes_outcome")
        ),
        sa.CheckConstraint("seq >= 0", name=op.f("ck_probe_outcomes_seq")),
        sa.ForeignKeyConstraint(
            ["session_pk"],
            ["sessions.id"],
            name=op.f("fk_probe_outcomes_session_pk_sessions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("session_pk", "seq", name=op.f("pk_probe_outcomes")),
    )
    op.create_index(
        op.f("ix_probe_outcomes_session_pk_phase_ip_len"),
        "probe_outcomes",
        ["session_pk", "phase", "ip_len"],
    )


def downgrade() -> None:
    op.drop_table("probe_outcomes")
    op.drop_table("sessions")
    op.drop_table("clients")
