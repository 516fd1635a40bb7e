"""ka-router runs and their telemetry (``kickass telemetry ingest``)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    REAL,
    BigInteger,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Identity,
    SmallInteger,
    Text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from ..base import Base, bounds_checks, check_in

ROUTER_KINDS = ("kickass", "droptail")
MARKING_MODES = ("kickass", "tcp", "droptail")


class RouterRunRow(Base):
    """One ka-router process: its metadata line (options, capacity, mode)."""

    __tablename__ = "router_runs"
    __table_args__ = (
        CheckConstraint(check_in("router_kind", ROUTER_KINDS), name="router_kind"),
        *bounds_checks("router_runs"),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=False), primary_key=True)
    run_name: Mapped[str | None] = mapped_column(Text)
    # Which router ran: Kick-Ass marking, or the plain drop-tail baseline.
    router_kind: Mapped[str] = mapped_column(Text)
    capacity_bps: Mapped[float | None] = mapped_column(Float)
    program_version: Mapped[str | None] = mapped_column(Text)
    options: Mapped[dict[str, Any]] = mapped_column(JSONB)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    exit_reason: Mapped[str | None] = mapped_column(Text)
    counters: Mapped[dict[str, Any] | None] = mapped_column(JSONB)


class RouterTelemetryRow(Base):
    """One control interval of a ka-router run (its NDJSON sample line)."""

    __tablename__ = "router_telemetry"
    __table_args__ = (
        CheckConstraint(check_in("marking_mode", MARKING_MODES), name="marking_mode"),
        # t within the run's clock, rates, queue, counters (migration 0018).
        *bounds_checks("router_telemetry"),
        # One partition per UTC day of recorded_at (migration 0022).
        {"postgresql_partition_by": "RANGE (recorded_at)"},
    )

    run_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("router_runs.id", ondelete="CASCADE"), primary_key=True
    )
    t: Mapped[float] = mapped_column(Float, primary_key=True)
    # The line's wall clock (its "ts"), else the run's start + t; the partition key.
    recorded_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
    advertised_rate_bps: Mapped[float] = mapped_column(Float)
    leading_fragment_len: Mapped[int | None] = mapped_column(SmallInteger)
    input_rate_bps: Mapped[float] = mapped_column(Float)
    output_rate_bps: Mapped[float | None] = mapped_column(Float)
    queue_bytes: Mapped[int] = mapped_column(BigInteger)
    queue_packets: Mapped[int | None] = mapped_column(BigInteger)
    # What the router did this interval: Kick-Ass marking, or TCP mode (queue
    # above half the buffer: paper section III); 'droptail' for the baseline.
    marking_mode: Mapped[str] = mapped_column(Text)
    rtt_ms: Mapped[float | None] = mapped_column(REAL)
    drops: Mapped[int] = mapped_column(BigInteger)
    fragmented: Mapped[int] = mapped_column(BigInteger)
    mode_switches: Mapped[int | None] = mapped_column(BigInteger)
    extra: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
