"""Rows that broke a bound when the bounds became CHECK constraints (migration 0018).

Nothing measured vanishes without a word: a value out of its column's bounds
(``kickass_core.bounds``) found by the migration is kept here with the whole
row as it was. A nullable column was set to NULL in place (``nulled``); a
row whose value could not be NULL was removed from its table (``removed``),
and the rows that belong to it with it (``columns`` empty). Downgrading
below 0018 puts every one back as it was.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import ARRAY, BigInteger, CheckConstraint, DateTime, Identity, Text, func
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from ..base import Base, check_in

QUARANTINE_ACTIONS = ("nulled", "removed")


class QuarantineRow(Base):
    """One row found out of bounds, as it was (NaN and infinities as JSON strings)."""

    __tablename__ = "quarantine"
    __table_args__ = (CheckConstraint(check_in("action", QUARANTINE_ACTIONS), name="action"),)

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    table_name: Mapped[str] = mapped_column(Text)
    # The row's primary key (to find a nulled row again).
    row_key: Mapped[dict[str, Any]] = mapped_column(JSONB)
    # The columns out of bounds.
    columns: Mapped[list[str]] = mapped_column(ARRAY(Text))
    row: Mapped[dict[str, Any]] = mapped_column(JSONB)
    action: Mapped[str] = mapped_column(Text)
    # The migration that found it.
    revision: Mapped[str] = mapped_column(Text)
    quarantined_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now()
    )
