"""Rollup tables the scheduled ``refresh`` fills (migration 0012).

Written only by ``kickass_analysis.rollups``; read through ``v_router_telemetry_1s``,
``v_router_telemetry_1m`` and ``v_rollup_status``. The materialised views of the
same migration (``mv_*``) are not tables and have no model.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, DateTime, Float, ForeignKey, Integer, SmallInteger, Text
from sqlalchemy.orm import Mapped, mapped_column

from ..base import Base


class _RouterRollup:
    """Sums, minima and maxima of a router run's samples over one bucket, so a
    coarser bucket is an exact re-aggregation (means are sums over counts)."""

    run_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("router_runs.id", ondelete="CASCADE"), primary_key=True
    )
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
    samples: Mapped[int] = mapped_column(Integer)
    advertised_rate_sum: Mapped[float] = mapped_column(Float)
    advertised_rate_min: Mapped[float] = mapped_column(Float)
    advertised_rate_max: Mapped[float] = mapped_column(Float)
    # Over the samples that carried a leading-fragment length (fragmenting).
    leading_fragment_sum: Mapped[float] = mapped_column(Float)
    leading_fragment_n: Mapped[int] = mapped_column(Integer)
    leading_fragment_min: Mapped[int | None] = mapped_column(SmallInteger)
    leading_fragment_max: Mapped[int | None] = mapped_column(SmallInteger)
    input_rate_sum: Mapped[float] = mapped_column(Float)
    output_rate_sum: Mapped[float] = mapped_column(Float)
    output_rate_n: Mapped[int] = mapped_column(Integer)
    queue_bytes_sum: Mapped[float] = mapped_column(Float)
    queue_bytes_max: Mapped[int] = mapped_column(BigInteger)
    # Samples by marking mode: the share in Kick-Ass mode is kickass / samples.
    kickass_samples: Mapped[int] = mapped_column(Integer)
    tcp_samples: Mapped[int] = mapped_column(Integer)
    rtt_ms_sum: Mapped[float] = mapped_column(Float)
    rtt_ms_n: Mapped[int] = mapped_column(Integer)
    # Cumulative counters: their value at the end of the bucket.
    drops_max: Mapped[int] = mapped_column(BigInteger)
    fragmented_max: Mapped[int] = mapped_column(BigInteger)
    mode_switches_max: Mapped[int | None] = mapped_column(BigInteger)


class RouterTelemetry1sRow(_RouterRollup, Base):
    """One second of a router run (100 samples at the 10 ms control interval)."""

    __tablename__ = "router_telemetry_1s"


class RouterTelemetry1mRow(_RouterRollup, Base):
    """One minute of a router run, from its seconds."""

    __tablename__ = "router_telemetry_1m"


class RollupRefreshRow(Base):
    """When a rollup was last refreshed, what it holds and how long it took."""

    __tablename__ = "rollup_refreshes"

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    refreshed_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    rows: Mapped[int] = mapped_column(BigInteger)
    seconds: Mapped[float] = mapped_column(Float)
