"""The Parquet archive of the raw tables' day partitions (migration 0023).

A day of ``probe_outcomes`` or ``router_telemetry`` leaves the database only
through ``kickass_analysis.archive``: written, re-read and verified, recorded
here, detached, dropped. A row is the database's word that the day's files
(the manifest whose sha256 it keeps) hold every row the partition held, and
a CHECK keeps any partition from being detached or dropped without one.
"""

from __future__ import annotations

from datetime import date, datetime

from sqlalchemy import BigInteger, CheckConstraint, Date, DateTime, Integer, LargeBinary, Text, func
from sqlalchemy.orm import Mapped, mapped_column

from ..base import Base, check_in

ARCHIVED_TABLES = ("probe_outcomes", "router_telemetry")


class ArchivePartitionRow(Base):
    """One day of a raw table, archived (and, once verified, retired)."""

    __tablename__ = "archive_partitions"
    __table_args__ = (
        CheckConstraint(check_in("table_name", ARCHIVED_TABLES), name="table_name"),
        # Never detached or dropped without a verified archive.
        CheckConstraint(
            "(detached_at IS NULL AND dropped_at IS NULL) OR verified_at IS NOT NULL",
            name="verified_before_detach",
        ),
    )

    table_name: Mapped[str] = mapped_column(Text, primary_key=True)
    day: Mapped[date] = mapped_column(Date, primary_key=True)
    # The partition's bounds: [range_from, range_to).
    range_from: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    range_to: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    rows: Mapped[int | None] = mapped_column(BigInteger)
    bytes: Mapped[int | None] = mapped_column(BigInteger)
    files: Mapped[int | None] = mapped_column(Integer)
    # sha256 of the day's _manifest.json (which holds every file's).
    manifest_sha256: Mapped[str | None] = mapped_column(Text)
    # A retire has begun: late writes for the day are refused from here on.
    claimed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    written_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    verified_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    detached_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    dropped_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Put back by `kickass archive restore` (the claim and the drop cleared).
    restored_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class ArchiveSecretRow(Base):
    """Secrets of the archive, made once by the migration: ``client_key``
    salts the client key the sessions' sidecar carries (sha256 of it and the
    key), so a client is the same one on every day of the archive without
    its address block being recoverable from the files."""

    __tablename__ = "archive_secrets"

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    secret: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
