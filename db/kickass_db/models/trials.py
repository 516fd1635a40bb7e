"""Wide-area trials (paper section IV): trials, their interleaved periods, and flows.

A *trial* is one run of `kickass trials run` towards one destination agent; it
holds its schedule of *periods* (alternating Kick-Ass and TCP, 120 s each by
default) and every *flow* started in them. Flow ids come from the runner, so
re-sent uploads are no-ops (nothing counted twice).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from kickass_core.flow_record import HANDSHAKES, PROTOCOLS
from sqlalchemy import (
    REAL,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Identity,
    Index,
    Integer,
    LargeBinary,
    Text,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from ..base import Base, bounds_checks, check_in

TRIAL_ID_PATTERN = "^[0-9a-f]{32}$"


class RunnerRow(Base):
    """A trial runner allowed to upload results; only its token's hash is kept."""

    __tablename__ = "runners"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    name: Mapped[str] = mapped_column(Text, unique=True)
    token_hash: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class RequestNonceRow(Base):
    """A signed request's nonce, kept through the replay window (0008)."""

    __tablename__ = "request_nonces"
    __table_args__ = (Index(None, "seen_at"),)

    runner_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("runners.id", ondelete="CASCADE"), primary_key=True
    )
    nonce: Mapped[str] = mapped_column(Text, primary_key=True)
    seen_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class TrialRow(Base):
    __tablename__ = "trials"
    __table_args__ = (
        CheckConstraint(f"trial_id ~ '{TRIAL_ID_PATTERN}'", name="trial_id_format"),
        Index(None, "destination", "started_at"),
        *bounds_checks("trials"),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    trial_id: Mapped[str] = mapped_column(Text, unique=True)
    runner_id: Mapped[int | None] = mapped_column(
        BigInteger, ForeignKey("runners.id", ondelete="SET NULL")
    )
    destination: Mapped[str] = mapped_column(Text)
    access_capacity_bps: Mapped[float | None] = mapped_column(Float)
    # The ka-router telemetry run the trial overlapped (router_runs.run_name).
    router_run_name: Mapped[str | None] = mapped_column(Text)
    # Workload, schedule, seeds, handshake mode: enough to re-create every flow.
    parameters: Mapped[dict[str, Any]] = mapped_column(JSONB)
    versions: Mapped[dict[str, Any]] = mapped_column(JSONB)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    received_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now()
    )
    # 0010: both ends' environment (kickass_wan.environment).
    environment: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))


class TrialPeriodRow(Base):
    __tablename__ = "trial_periods"
    __table_args__ = (
        CheckConstraint(check_in("protocol", PROTOCOLS), name="protocol"),
        CheckConstraint(check_in("handshake", HANDSHAKES), name="handshake"),  # 0024
        *bounds_checks("trial_periods"),
    )

    trial_pk: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("trials.id", ondelete="CASCADE"), primary_key=True
    )
    period_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    pair: Mapped[int] = mapped_column(Integer)
    protocol: Mapped[str] = mapped_column(Text)
    congestion_control: Mapped[str | None] = mapped_column(Text)
    start_offset_s: Mapped[float] = mapped_column(Float)
    duration_s: Mapped[float] = mapped_column(Float)
    # 0010: what the period ran, and when it really started.
    arm: Mapped[str | None] = mapped_column(Text)
    handshake: Mapped[str | None] = mapped_column(Text)
    handicap_ms: Mapped[float | None] = mapped_column(Float)
    actual_start_offset_s: Mapped[float | None] = mapped_column(Float)
    # 0021: a Kick-Ass arm's TCP mode (ka-transport's congestion control), its
    # share of flows run as kernel TCP, and what the period's flows offered
    # (application bit/s of the flows that started, over its length).
    transport_cc: Mapped[str | None] = mapped_column(Text)
    tcp_share: Mapped[float | None] = mapped_column(Float)
    offered_load_bps: Mapped[float | None] = mapped_column(Float)


class FlowRow(Base):
    """One flow: the paper's per-flow record (FCT, time in Kick-Ass mode, switches...)."""

    __tablename__ = "flows"
    __table_args__ = (
        CheckConstraint(check_in("protocol", PROTOCOLS), name="protocol"),
        CheckConstraint(check_in("negotiated_protocol", PROTOCOLS), name="negotiated_protocol"),
        CheckConstraint(check_in("handshake", HANDSHAKES), name="handshake"),  # 0024
        # Sizes, times, rates and counters within the flow record's bounds
        # (kickass_core.flow_record.FIELDS; migration 0018).
        *bounds_checks("flows"),
        Index(None, "trial_pk", "period_index"),
        Index(None, "trial_pk", "pair"),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    flow_id: Mapped[str] = mapped_column(Text, unique=True)
    trial_pk: Mapped[int] = mapped_column(BigInteger, ForeignKey("trials.id", ondelete="CASCADE"))
    period_index: Mapped[int] = mapped_column(Integer)
    protocol: Mapped[str] = mapped_column(Text)
    congestion_control: Mapped[str | None] = mapped_column(Text)
    handshake: Mapped[str | None] = mapped_column(Text)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    size_packets: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    completed: Mapped[bool] = mapped_column(Boolean)
    # First handshake packet sent -> last byte acknowledged (NULL if not completed).
    fct_ms: Mapped[float | None] = mapped_column(Float)
    ka_mode_ms: Mapped[float | None] = mapped_column(Float)
    ka_mode_fraction: Mapped[float | None] = mapped_column(REAL)
    mode_switches: Mapped[int | None] = mapped_column(Integer)
    retransmissions: Mapped[int | None] = mapped_column(Integer)
    srtt_ms: Mapped[float | None] = mapped_column(REAL)
    min_rtt_ms: Mapped[float | None] = mapped_column(REAL)
    advertised_rate_min_bps: Mapped[float | None] = mapped_column(Float)
    advertised_rate_max_bps: Mapped[float | None] = mapped_column(Float)
    advertised_rate_last_bps: Mapped[float | None] = mapped_column(Float)
    advertised_rates_seen: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    extra: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    # 0010: the paired design (kickass_core.flow_record).
    pair: Mapped[int | None] = mapped_column(Integer)
    arm: Mapped[str | None] = mapped_column(Text)
    queued_ms: Mapped[float | None] = mapped_column(Float)
    negotiated_protocol: Mapped[str | None] = mapped_column(Text)


class TrialSpeedupRow(Base):
    """The speedup on matched flows, per size bucket, per trial or pooled
    (computed by kickass_analysis.rollups in the scheduled refresh)."""

    __tablename__ = "trial_speedups"
    __table_args__ = (CheckConstraint("scope IN ('trial', 'pooled')", name="scope"),)

    scope: Mapped[str] = mapped_column(Text, primary_key=True)
    key: Mapped[str] = mapped_column(Text, primary_key=True)
    destination: Mapped[str] = mapped_column(Text)
    access_capacity_bps: Mapped[float | None] = mapped_column(Float)
    arm: Mapped[str] = mapped_column(Text, primary_key=True)
    baseline_arm: Mapped[str] = mapped_column(Text, primary_key=True)
    size_bucket: Mapped[str] = mapped_column(Text, primary_key=True)
    pairs: Mapped[int] = mapped_column(Integer)
    matched: Mapped[int] = mapped_column(Integer)
    speedup: Mapped[float | None] = mapped_column(Float)
    speedup_low: Mapped[float | None] = mapped_column(Float)
    speedup_high: Mapped[float | None] = mapped_column(Float)
    completion_arm: Mapped[float | None] = mapped_column(Float)
    completion_baseline: Mapped[float | None] = mapped_column(Float)
    workload: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    computed_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now()
    )
    # Independent clusters of period pairs behind the interval (migration 0015).
    clusters: Mapped[int | None] = mapped_column(Integer)
    # Beside it, every matched flow (0019, kickass_analysis.stats.sooner): the
    # share that finished sooner under the arm, a failure ranked slowest.
    sooner: Mapped[float | None] = mapped_column(Float)
    sooner_low: Mapped[float | None] = mapped_column(Float)
    sooner_high: Mapped[float | None] = mapped_column(Float)
    sooner_pairs: Mapped[int | None] = mapped_column(Integer)
    sooner_clusters: Mapped[int | None] = mapped_column(Integer)
