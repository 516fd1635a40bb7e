"""The congestion experiments (paper §III-D, ``kickass_testbed.congestion``):
one row per run, with its figures, and each flow's rate and mode over time."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from kickass_core.flow_record import PROTOCOLS
from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Identity,
    Text,
    func,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from ..base import Base, bounds_checks, check_in

# kickass_testbed.congestion.KINDS and kickass_testbed.wide_area.KIND (the
# testbed is not a dependency of db); "wide-area" since migration 0025.
EXPERIMENT_KINDS = ("kickass-bottleneck", "legacy-bottleneck", "wide-area")


class ExperimentRunRow(Base):
    __tablename__ = "experiment_runs"
    __table_args__ = (
        CheckConstraint(check_in("kind", EXPERIMENT_KINDS), name="kind"),
        *bounds_checks("experiment_runs"),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    kind: Mapped[str] = mapped_column(Text)
    # When the flows started (t_s = 0 of its rates).
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    capacity_bps: Mapped[float] = mapped_column(Float)
    rtt_ms: Mapped[float] = mapped_column(Float)
    # The ka-router telemetry run it overlapped (router_runs.run_name).
    router_run_name: Mapped[str | None] = mapped_column(Text)
    parameters: Mapped[dict[str, Any]] = mapped_column(JSONB)
    # Per TCP epoch: Jain's index, Kick-Ass/TCP, utilisation, mode switch times.
    figures: Mapped[dict[str, Any]] = mapped_column(JSONB)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class ExperimentRateRow(Base):
    __tablename__ = "experiment_rates"
    __table_args__ = (
        CheckConstraint(check_in("protocol", PROTOCOLS), name="protocol"),
        *bounds_checks("experiment_rates"),
    )

    run_pk: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("experiment_runs.id", ondelete="CASCADE"), primary_key=True
    )
    flow: Mapped[str] = mapped_column(Text, primary_key=True)
    # Seconds from the flows' start to the end of the interval.
    t_s: Mapped[float] = mapped_column(Float, primary_key=True)
    protocol: Mapped[str] = mapped_column(Text)
    # Payload bits per second over the interval before t_s.
    rate_bps: Mapped[float] = mapped_column(Float)
    ka_mode: Mapped[bool] = mapped_column(Boolean)
