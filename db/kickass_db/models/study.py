"""The fragment viability study's tables: clients, sessions, probe outcomes.

These models describe the schema; they never create it. Alembic
(db/migrations) is the only schema truth, and a test checks that the two
agree. Analysis views (``v_*``) live only in the migrations: they are SQL,
read by dashboards, notebooks and the HTTP API, never written through the ORM.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from kickass_core.plan import PHASES
from kickass_core.states import LIVE_STATES, OUTCOMES, SESSION_STATES
from kickass_core.verdict import VERDICTS
from sqlalchemy import (
    REAL,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    ForeignKey,
    Identity,
    Index,
    Integer,
    LargeBinary,
    SmallInteger,
    Text,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import INET, JSONB
from sqlalchemy.orm import Mapped, mapped_column

from ..base import Base, bounds_checks, check_in

SESSION_ID_PATTERN = "^[0-9a-f]{16}$"


class ClientRow(Base):
    """A probe client installation (or one anonymous run when it sent no install id)."""

    __tablename__ = "clients"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    install_id: Mapped[str | None] = mapped_column(Text, unique=True)
    first_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    last_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    last_address: Mapped[str | None] = mapped_column(INET)
    client_version: Mapped[str | None] = mapped_column(Text)
    platform: Mapped[str | None] = mapped_column(Text)


class SessionRow(Base):
    """One fragment-viability measurement of one client, from HTTP request to verdict."""

    __tablename__ = "sessions"
    __table_args__ = (
        CheckConstraint(check_in("state", SESSION_STATES), name="state"),
        CheckConstraint(check_in("verdict", VERDICTS), name="verdict"),
        CheckConstraint(f"session_id ~ '{SESSION_ID_PATTERN}'", name="session_id_format"),
        CheckConstraint("sent >= 0 AND acked >= 0", name="counters"),
        *bounds_checks("sessions"),
        Index(None, "client_id"),
        Index(None, "created_at"),
        Index(None, "server_instance", "state"),
        # Where the study views' live branch starts (0020): the few sessions
        # still counted from their raw rows.
        Index("ix_sessions_live", "id", postgresql_where=text(check_in("state", LIVE_STATES))),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    session_id: Mapped[str] = mapped_column(Text, unique=True)
    # SET NULL: forgetting a client (a volunteer asks) must not erase the
    # measurements, which carry no identity of their own.
    client_id: Mapped[int | None] = mapped_column(
        BigInteger, ForeignKey("clients.id", ondelete="SET NULL")
    )
    # Only a hash: a database dump must not let anyone impersonate a client.
    cookie_hash: Mapped[bytes | None] = mapped_column(LargeBinary)
    source_address: Mapped[str | None] = mapped_column(INET)
    probe_address: Mapped[str | None] = mapped_column(INET)
    probe_port: Mapped[int | None] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(Text, server_default="created")
    plan: Mapped[dict[str, Any]] = mapped_column(JSONB)
    client_version: Mapped[str | None] = mapped_column(Text)
    server_version: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), onupdate=func.now()
    )
    sent: Mapped[int] = mapped_column(Integer, server_default="0")
    acked: Mapped[int] = mapped_column(Integer, server_default="0")
    rtt_ms: Mapped[float | None] = mapped_column(REAL)
    verdict: Mapped[str | None] = mapped_column(Text)
    verdict_reason: Mapped[str | None] = mapped_column(Text)
    end_reason: Mapped[str | None] = mapped_column(Text)
    # The server process running it: a restarting server ends only its own
    # orphans, so servers sharing a database leave each other alone.
    server_instance: Mapped[str | None] = mapped_column(Text)
    # What the client reported about itself (0007): "reassembly" (its kernel's
    # reassembly limits and counters before, during and after the split
    # phase; the flow-control budget) and "fragment_observation".
    client_metadata: Mapped[dict[str, Any]] = mapped_column(
        JSONB, server_default=text("'{}'::jsonb")
    )


class ProbeOutcomeRow(Base):
    """What happened to one probe: the raw data every drop rate is computed from."""

    __tablename__ = "probe_outcomes"
    __table_args__ = (
        CheckConstraint(check_in("phase", PHASES), name="phase"),
        CheckConstraint(check_in("outcome", OUTCOMES), name="outcome"),
        CheckConstraint("seq >= 0", name="seq"),
        *bounds_checks("probe_outcomes"),
        # Every per-size view groups by exactly these.
        Index(None, "session_pk", "phase", "ip_len"),
        # One partition per UTC day of the session's creation (migration 0022):
        # a session's rows are in one partition, a day retires whole sessions.
        {"postgresql_partition_by": "RANGE (session_created_at)"},
    )

    session_pk: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("sessions.id", ondelete="CASCADE"), primary_key=True
    )
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    phase: Mapped[str] = mapped_column(Text)
    # whole: the packet's IP length; split: the leading fragment's IP length.
    ip_len: Mapped[int] = mapped_column(SmallInteger)
    sent_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # 'late' = acked after its timeout: lost for the drop rate (as in the
    # paper), kept apart so slow paths can be told from lossy ones.
    outcome: Mapped[str] = mapped_column(Text)
    acked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    rtt_ms: Mapped[float | None] = mapped_column(REAL)
    ack_count: Mapped[int] = mapped_column(SmallInteger, server_default="0")
    received_len: Mapped[int | None] = mapped_column(Integer)
    # The client's IP_RECVFRAGSIZE: largest fragment's IP length, 0 = arrived whole.
    observed_frag_size: Mapped[int | None] = mapped_column(Integer)
    # 0007: measured while the client's kernel refused fragments (reassembly
    # memory full); with outcome 'lost' the probe is invalid, not lost.
    reassembly_invalid: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    # 0007, the privileged observation (AF_PACKET before reassembly): IP length
    # of the fragment at offset 0 and how many distinct fragments arrived.
    observed_leading_len: Mapped[int | None] = mapped_column(SmallInteger)
    observed_fragments: Mapped[int | None] = mapped_column(SmallInteger)
    # 0022: the session's created_at, the partition key (the upsert copies it).
    session_created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
