"""The RIPE Atlas tables (migrations 0006 and 0009) as typed models on the one ``Base``.

Written only by ``kickass_atlas.store``; read through the views
(``v_atlas_*``, ``v_*_by_source``). Like models.py, these describe the schema
and never create it: Alembic is the schema truth, a test compares the two.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from kickass_core.plan import PHASES
from kickass_core.verdict import VERDICTS
from sqlalchemy import (
    REAL,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    ForeignKey,
    ForeignKeyConstraint,
    Identity,
    Index,
    Integer,
    SmallInteger,
    Text,
    UniqueConstraint,
    Uuid,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import INET, JSONB
from sqlalchemy.orm import Mapped, mapped_column

from ..base import Base, bounds_checks, check_in

# Per echo request of an Atlas ping: the volunteers' acked/lost/late, plus two
# outcomes no drop rate counts (the request never reached the responder, or
# the probe could not send it).
ATLAS_OUTCOMES = ("acked", "lost", "late", "unanswered", "error")
# How an Atlas result was joined to the reply log (kickass_atlas.ingest);
# "invalid" (0009): one of our results that could not be read or joined.
JOIN_STATUSES = ("exact", "ambiguous", "inconsistent", "no-log", "aggregate", "invalid")
# Where a stored result came from (0009): the results API or `kickass atlas import`.
RESULT_ORIGINS = ("fetch", "import")


class AtlasCampaignRow(Base):
    """One campaign file, as it was when last planned, created or answered."""

    __tablename__ = "atlas_campaigns"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    name: Mapped[str] = mapped_column(Text, unique=True)
    definition: Mapped[dict[str, Any]] = mapped_column(JSONB)
    credit_budget: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class AtlasMeasurementRow(Base):
    """One Atlas ping measurement of a campaign, its status and the fetch watermark."""

    __tablename__ = "atlas_measurements"
    __table_args__ = (
        CheckConstraint(check_in("phase", PHASES), name="phase"),
        UniqueConstraint("campaign_id", "key"),
    )

    msm_id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    campaign_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("atlas_campaigns.id", ondelete="CASCADE")
    )
    key: Mapped[str] = mapped_column(Text)  # "split-1500", "whole-576"
    phase: Mapped[str] = mapped_column(Text)
    target: Mapped[str] = mapped_column(INET)
    ip_len: Mapped[int] = mapped_column(SmallInteger)
    size: Mapped[int] = mapped_column(Integer)  # Atlas size: ICMP data bytes
    packets: Mapped[int] = mapped_column(SmallInteger)
    interval_s: Mapped[int] = mapped_column(Integer)
    packet_interval_ms: Mapped[int] = mapped_column(Integer)
    probes_requested: Mapped[int] = mapped_column(Integer)
    definition: Mapped[dict[str, Any]] = mapped_column(JSONB)
    estimated_credits: Mapped[int] = mapped_column(BigInteger)
    credits_per_result: Mapped[int | None] = mapped_column(Integer)
    status_id: Mapped[int | None] = mapped_column(SmallInteger)
    status_name: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    start_time: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    stop_time: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Every result with a timestamp before this is stored: fetch resumes here.
    fetched_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    results_fetched: Mapped[int] = mapped_column(Integer, server_default="0")
    last_fetch_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_error: Mapped[str | None] = mapped_column(Text)
    # 0009, late uploads: every window before this was read a second time,
    # late_horizon after its time; the results only that second read found.
    rechecked_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    results_late: Mapped[int] = mapped_column(Integer, server_default="0")


class AtlasProbeRow(Base):
    """An Atlas probe's metadata (through Cousteau), for per-ASN and per-country views."""

    __tablename__ = "atlas_probes"

    prb_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    asn_v4: Mapped[int | None] = mapped_column(BigInteger)
    asn_v6: Mapped[int | None] = mapped_column(BigInteger)
    country_code: Mapped[str | None] = mapped_column(Text)
    address_v4: Mapped[str | None] = mapped_column(INET)
    prefix_v4: Mapped[str | None] = mapped_column(Text)
    status_name: Mapped[str | None] = mapped_column(Text)
    is_anchor: Mapped[bool | None] = mapped_column(Boolean)
    meta: Mapped[dict[str, Any]] = mapped_column(JSONB)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class AtlasReplyLogRow(Base):
    """One echo reply the ICMP responder sent (kickass_atlas.responder_core.ReplyRecord)."""

    __tablename__ = "atlas_reply_log"
    __table_args__ = (
        CheckConstraint(check_in("phase", PHASES), name="phase"),
        Index(None, "campaign_id", "responder_address", "sent_at"),
    )

    # (run, reply number) makes a re-sent batch harmless.
    responder_run: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True)
    reply_no: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    campaign_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("atlas_campaigns.id", ondelete="CASCADE")
    )
    responder_address: Mapped[str] = mapped_column(INET)
    dst_address: Mapped[str] = mapped_column(INET)
    icmp_id: Mapped[int] = mapped_column(Integer)
    icmp_seq: Mapped[int] = mapped_column(Integer)
    request_len: Mapped[int] = mapped_column(SmallInteger)
    phase: Mapped[str] = mapped_column(Text)
    # whole: the reply's IP length; split: the leading fragment's IP length.
    ip_len: Mapped[int] = mapped_column(SmallInteger)
    sent_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # 0009: the probe firmware re-uses a sequence number after a lost reply;
    # each re-send (new data, same sequence) is a new attempt and a new reply.
    attempt: Mapped[int] = mapped_column(SmallInteger, server_default="0")
    # 0009: a byte-identical copy of a request already answered (same split again).
    duplicate: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))


class AtlasResultRow(Base):
    """One Atlas result (one ping of one probe), raw JSON kept as served."""

    __tablename__ = "atlas_results"
    __table_args__ = (
        CheckConstraint(check_in("join_status", JOIN_STATUSES), name="join_status"),
        CheckConstraint(check_in("origin", RESULT_ORIGINS), name="origin"),
        *bounds_checks("atlas_results"),
    )

    msm_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("atlas_measurements.msm_id", ondelete="CASCADE"), primary_key=True
    )
    prb_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    result_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
    campaign_id: Mapped[int] = mapped_column(BigInteger)
    firmware: Mapped[int | None] = mapped_column(Integer)
    from_address: Mapped[str | None] = mapped_column(INET)
    dst_address: Mapped[str | None] = mapped_column(INET)
    size: Mapped[int | None] = mapped_column(Integer)  # ICMP data bytes, firmware-corrected
    sent: Mapped[int | None] = mapped_column(SmallInteger)
    rcvd: Mapped[int | None] = mapped_column(SmallInteger)
    dup: Mapped[int | None] = mapped_column(SmallInteger)
    join_status: Mapped[str] = mapped_column(Text)
    raw: Mapped[dict[str, Any]] = mapped_column(JSONB)
    fetched_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    # 0009: Atlas's stored_timestamp (probes upload late), the origin, and why
    # an "invalid" result could not be joined.
    stored_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    origin: Mapped[str] = mapped_column(Text, server_default="fetch")
    join_error: Mapped[str | None] = mapped_column(Text)


class AtlasOutcomeRow(Base):
    """What happened to one echo request of an Atlas ping, joined to our reply."""

    __tablename__ = "atlas_outcomes"
    __table_args__ = (
        CheckConstraint(check_in("phase", PHASES), name="phase"),
        CheckConstraint(check_in("outcome", ATLAS_OUTCOMES), name="outcome"),
        *bounds_checks("atlas_outcomes"),
        ForeignKeyConstraint(
            ["msm_id", "prb_id", "result_at"],
            ["atlas_results.msm_id", "atlas_results.prb_id", "atlas_results.result_at"],
            ondelete="CASCADE",
        ),
        Index(None, "campaign_id", "phase", "ip_len"),
    )

    msm_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    prb_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    result_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
    packet_index: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    campaign_id: Mapped[int] = mapped_column(BigInteger)
    phase: Mapped[str] = mapped_column(Text)
    ip_len: Mapped[int | None] = mapped_column(SmallInteger)
    outcome: Mapped[str] = mapped_column(Text)
    rtt_ms: Mapped[float | None] = mapped_column(REAL)
    ack_count: Mapped[int] = mapped_column(SmallInteger, server_default="0")
    icmp_seq: Mapped[int | None] = mapped_column(Integer)
    replied_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    error: Mapped[str | None] = mapped_column(Text)
    # 0009: which logged attempt of its sequence number the reply answered.
    attempt: Mapped[int | None] = mapped_column(SmallInteger)


class AtlasVerdictRow(Base):
    """The volunteers' verdict rule applied to one Atlas probe's pooled counts in a campaign."""

    __tablename__ = "atlas_verdicts"
    __table_args__ = (CheckConstraint(check_in("verdict", VERDICTS), name="verdict"),)

    campaign_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("atlas_campaigns.id", ondelete="CASCADE"), primary_key=True
    )
    prb_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    whole_sent: Mapped[int] = mapped_column(Integer)
    whole_acked: Mapped[int] = mapped_column(Integer)
    split_sent: Mapped[int] = mapped_column(Integer)
    split_acked: Mapped[int] = mapped_column(Integer)
    verdict: Mapped[str] = mapped_column(Text)
    verdict_reason: Mapped[str] = mapped_column(Text)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
