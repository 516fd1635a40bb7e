"""Scheduled work: every run of an item of a schedule file (migration 0011),
and the claims the schedule refused (migration 0017).

Written by ``kickass_operations`` (directly, or through the server's API for
a trial runner host); read through ``v_item_runs``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    DateTime,
    Identity,
    Index,
    Integer,
    PrimaryKeyConstraint,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from ..base import Base, check_in

RUN_OUTCOMES = ("running", "ok", "failed", "skipped", "timeout")


class ItemRunRow(Base):
    """One scheduled item at one due time: claimed once, then its outcome."""

    __tablename__ = "item_runs"
    __table_args__ = (
        CheckConstraint(check_in("outcome", RUN_OUTCOMES), name="outcome"),
        UniqueConstraint("item", "due_at"),
        Index(None, "finished_at"),
        Index("ix_item_runs_running", "item", postgresql_where=text("outcome = 'running'")),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    item: Mapped[str] = mapped_column(Text)
    kind: Mapped[str] = mapped_column(Text)
    due_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    host: Mapped[str] = mapped_column(Text)
    attempt: Mapped[int] = mapped_column(Integer, server_default=text("1"))
    definition_hash: Mapped[str | None] = mapped_column(Text)
    claimed_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    heartbeat_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now()
    )
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    outcome: Mapped[str] = mapped_column(Text, server_default=text("'running'"))
    reason: Mapped[str | None] = mapped_column(Text)
    counts: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    history: Mapped[list[Any]] = mapped_column(JSONB, server_default=text("'[]'::jsonb"))


CLAIM_REFUSALS = ("not-in-schedule", "not-owner", "database-kind", "disabled", "not-due")


class ClaimRefusalRow(Base):
    """How often a host's claims were refused, and why: counted, not stored one
    by one (a refused claim stores no run). ``item`` is empty for a name the
    schedule does not have, so made-up names add no rows."""

    __tablename__ = "claim_refusals"
    __table_args__ = (
        PrimaryKeyConstraint("host", "item", "reason"),
        CheckConstraint(check_in("reason", CLAIM_REFUSALS), name="reason"),
    )

    host: Mapped[str] = mapped_column(Text)
    item: Mapped[str] = mapped_column(Text)
    reason: Mapped[str] = mapped_column(Text)
    refusals: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    first_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    last_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    last_message: Mapped[str | None] = mapped_column(Text)
