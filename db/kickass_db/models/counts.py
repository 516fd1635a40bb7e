"""Durable counts per study unit and their rollups (migration 0020).

A unit is one volunteer session or one Atlas probe of a campaign
(``source``); its counts are stored when it reaches a final state (a
session) or as its results arrive (an Atlas probe: each result's counts
added once), so every reader of it reads them and raw rows can go. Written
only by SQL functions: ``write_unit_counts`` (0020) and
``write_unit_counts_from_live`` (0029, from ``live_counts``), called by
``StudyStore``, ``write_atlas_unit_counts`` (0028, called by
``AtlasStore``) and ``fold_unit_count_changes`` (the scheduled refresh,
``kickass_analysis.rollups``).
Read through the study views (``v_whole_drop``, ``v_size_drop_all``,
``v_drop_rollup``, ...) and the volunteer page.
"""

from __future__ import annotations

from datetime import date, datetime

from kickass_core.plan import PHASES
from sqlalchemy import (
    REAL,
    BigInteger,
    CheckConstraint,
    Date,
    DateTime,
    Float,
    ForeignKey,
    Identity,
    Integer,
    SmallInteger,
    Text,
    func,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Mapped, mapped_column

from ..base import Base, check_in

SOURCES = ("volunteer", "atlas")
# The study views' counters (0007's rules), in the order of every array.
COUNTERS = (
    "sent", "acked", "late", "reassembly_invalid", "frag_observed", "largest_fragment_as_sent",
    "fragments_observed", "fragmented_observed", "leading_as_sent", "leading_swapped",
)  # fmt: skip

_SMALLS = ARRAY(SmallInteger)
_FLOATS = ARRAY(Float)


def _checks() -> tuple[CheckConstraint, ...]:
    return (
        CheckConstraint(check_in("source", SOURCES), name="source"),
        CheckConstraint(check_in("phase", PHASES), name="phase"),
    )


class UnitCountsRow(Base):
    """One unit's counts in one phase: totals, and per IP length parallel arrays
    ordered by ``ip_lens`` (an array that would hold only zeros is NULL)."""

    __tablename__ = "unit_counts"
    __table_args__ = _checks()

    source: Mapped[str] = mapped_column(Text, primary_key=True)
    # volunteer: the session_id; atlas: atlas:<campaign>:<probe id>.
    unit: Mapped[str] = mapped_column(Text, primary_key=True)
    phase: Mapped[str] = mapped_column(Text, primary_key=True)
    # The UTC day the unit started (a session's created_at; an Atlas probe's
    # last result): its day rollup.
    day: Mapped[date] = mapped_column(Date)
    # client_key (migration 0016) of the address the unit came from.
    client_key: Mapped[str | None] = mapped_column(Text)
    counted_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    sent: Mapped[int] = mapped_column(Integer)
    acked: Mapped[int] = mapped_column(Integer)
    late: Mapped[int] = mapped_column(Integer)
    reassembly_invalid: Mapped[int] = mapped_column(Integer)
    frag_observed: Mapped[int] = mapped_column(Integer)
    largest_fragment_as_sent: Mapped[int] = mapped_column(Integer)
    fragments_observed: Mapped[int] = mapped_column(Integer)
    fragmented_observed: Mapped[int] = mapped_column(Integer)
    leading_as_sent: Mapped[int] = mapped_column(Integer)
    leading_swapped: Mapped[int] = mapped_column(Integer)
    rtt_ms_sum: Mapped[float | None] = mapped_column(Float)
    rtt_ms_n: Mapped[int] = mapped_column(Integer)
    ip_lens: Mapped[list[int]] = mapped_column(_SMALLS)
    sent_by_size: Mapped[list[int] | None] = mapped_column(_SMALLS)
    acked_by_size: Mapped[list[int] | None] = mapped_column(_SMALLS)
    late_by_size: Mapped[list[int] | None] = mapped_column(_SMALLS)
    reassembly_invalid_by_size: Mapped[list[int] | None] = mapped_column(_SMALLS)
    frag_observed_by_size: Mapped[list[int] | None] = mapped_column(_SMALLS)
    largest_fragment_as_sent_by_size: Mapped[list[int] | None] = mapped_column(_SMALLS)
    fragments_observed_by_size: Mapped[list[int] | None] = mapped_column(_SMALLS)
    fragmented_observed_by_size: Mapped[list[int] | None] = mapped_column(_SMALLS)
    leading_as_sent_by_size: Mapped[list[int] | None] = mapped_column(_SMALLS)
    leading_swapped_by_size: Mapped[list[int] | None] = mapped_column(_SMALLS)
    rtt_ms_sum_by_size: Mapped[list[float] | None] = mapped_column(_FLOATS)
    rtt_ms_n_by_size: Mapped[list[int] | None] = mapped_column(_SMALLS)
    # The exact median RTT of acked probes per size (whole phase: v_whole_drop).
    rtt_ms_median_by_size: Mapped[list[float] | None] = mapped_column(_FLOATS)


class UnitCountChangeRow(Base):
    """What one write of a unit's counts changed (new minus old, per IP
    length), not yet folded into the rollups; a unit's first write carries its
    RTT histogram (``hist_*``: per IP length and bin, how many acked probes)."""

    __tablename__ = "unit_count_changes"
    __table_args__ = _checks()

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    source: Mapped[str] = mapped_column(Text)
    unit: Mapped[str] = mapped_column(Text)
    phase: Mapped[str] = mapped_column(Text)
    day: Mapped[date] = mapped_column(Date)
    client_key: Mapped[str | None] = mapped_column(Text)
    queued_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    ip_lens: Mapped[list[int]] = mapped_column(_SMALLS)
    units_by_size: Mapped[list[int]] = mapped_column(_SMALLS)
    sent_by_size: Mapped[list[int]] = mapped_column(_SMALLS)
    acked_by_size: Mapped[list[int]] = mapped_column(_SMALLS)
    late_by_size: Mapped[list[int]] = mapped_column(_SMALLS)
    reassembly_invalid_by_size: Mapped[list[int]] = mapped_column(_SMALLS)
    frag_observed_by_size: Mapped[list[int]] = mapped_column(_SMALLS)
    largest_fragment_as_sent_by_size: Mapped[list[int]] = mapped_column(_SMALLS)
    fragments_observed_by_size: Mapped[list[int]] = mapped_column(_SMALLS)
    fragmented_observed_by_size: Mapped[list[int]] = mapped_column(_SMALLS)
    leading_as_sent_by_size: Mapped[list[int]] = mapped_column(_SMALLS)
    leading_swapped_by_size: Mapped[list[int]] = mapped_column(_SMALLS)
    rtt_ms_sum_by_size: Mapped[list[float]] = mapped_column(_FLOATS)
    rtt_ms_n_by_size: Mapped[list[int]] = mapped_column(_SMALLS)
    hist_ip_lens: Mapped[list[int] | None] = mapped_column(_SMALLS)
    hist_bins: Mapped[list[int] | None] = mapped_column(_SMALLS)
    hist_counts: Mapped[list[int] | None] = mapped_column(ARRAY(Integer))


class _Sums:
    """Sums of the folded changes, and the RTT histogram (bins: ``rtt_bin``)."""

    units: Mapped[int] = mapped_column(BigInteger)
    sent: Mapped[int] = mapped_column(BigInteger)
    acked: Mapped[int] = mapped_column(BigInteger)
    late: Mapped[int] = mapped_column(BigInteger)
    reassembly_invalid: Mapped[int] = mapped_column(BigInteger)
    frag_observed: Mapped[int] = mapped_column(BigInteger)
    largest_fragment_as_sent: Mapped[int] = mapped_column(BigInteger)
    fragments_observed: Mapped[int] = mapped_column(BigInteger)
    fragmented_observed: Mapped[int] = mapped_column(BigInteger)
    leading_as_sent: Mapped[int] = mapped_column(BigInteger)
    leading_swapped: Mapped[int] = mapped_column(BigInteger)
    rtt_ms_sum: Mapped[float] = mapped_column(Float)
    rtt_ms_n: Mapped[int] = mapped_column(BigInteger)
    rtt_bins: Mapped[list[int]] = mapped_column(_SMALLS)
    rtt_bin_counts: Mapped[list[int]] = mapped_column(ARRAY(BigInteger))


class UnitCountsDailyRow(_Sums, Base):
    """Per source, UTC day of the unit's start, phase and IP length."""

    __tablename__ = "unit_counts_daily"
    __table_args__ = _checks()

    source: Mapped[str] = mapped_column(Text, primary_key=True)
    day: Mapped[date] = mapped_column(Date, primary_key=True)
    phase: Mapped[str] = mapped_column(Text, primary_key=True)
    ip_len: Mapped[int] = mapped_column(SmallInteger, primary_key=True)


class UnitCountsTotalRow(_Sums, Base):
    """Per source, phase and IP length, all time, with the distinct clients."""

    __tablename__ = "unit_counts_total"
    __table_args__ = _checks()

    source: Mapped[str] = mapped_column(Text, primary_key=True)
    phase: Mapped[str] = mapped_column(Text, primary_key=True)
    ip_len: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    clients: Mapped[int] = mapped_column(BigInteger)


class ClientSizesRow(Base):
    """The IP lengths one client (``client_key``) measured in one phase: a
    new client of a size is one not listed here yet."""

    __tablename__ = "client_sizes"
    __table_args__ = _checks()

    source: Mapped[str] = mapped_column(Text, primary_key=True)
    client_key: Mapped[str] = mapped_column(Text, primary_key=True)
    phase: Mapped[str] = mapped_column(Text, primary_key=True)
    ip_lens: Mapped[list[int]] = mapped_column(_SMALLS)


class LiveCountsRow(Base):
    """A live session's counts in one phase and IP length, of its rows below
    its mark (``LiveCountMarksRow``), kept up to date as they change (migration
    0029: ``probe_outcomes``' update and delete triggers, ``count_live_outcomes``;
    ``count_new_live_rows`` for a late outcome's new row) and
    as the mark moves (``fold_live_counts``), so its finish reads few raw
    rows; the finish (``write_unit_counts_from_live``) deletes them."""

    __tablename__ = "live_counts"
    __table_args__ = (CheckConstraint(check_in("phase", PHASES), name="phase"),)

    session_pk: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("sessions.id", ondelete="CASCADE"), primary_key=True
    )
    phase: Mapped[str] = mapped_column(Text, primary_key=True)
    ip_len: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    # Its raw rows (a size with none left is not one of the session's).
    probes: Mapped[int] = mapped_column(Integer)
    sent: Mapped[int] = mapped_column(Integer)
    acked: Mapped[int] = mapped_column(Integer)
    late: Mapped[int] = mapped_column(Integer)
    reassembly_invalid: Mapped[int] = mapped_column(Integer)
    frag_observed: Mapped[int] = mapped_column(Integer)
    largest_fragment_as_sent: Mapped[int] = mapped_column(Integer)
    fragments_observed: Mapped[int] = mapped_column(Integer)
    fragmented_observed: Mapped[int] = mapped_column(Integer)
    leading_as_sent: Mapped[int] = mapped_column(Integer)
    leading_swapped: Mapped[int] = mapped_column(Integer)
    rtt_ms_sum: Mapped[float] = mapped_column(Float)
    rtt_ms_n: Mapped[int] = mapped_column(Integer)
    # The whole phase's acked RTTs, unsorted (the exact median needs them all).
    rtts: Mapped[list[float] | None] = mapped_column(ARRAY(REAL))


class LiveCountMarksRow(Base):
    """How far a live session's rows are in ``live_counts``: those with a seq
    below ``counted_below`` (``fold_live_counts`` moves it; the rows above it
    are folded in later, at the latest by the finish)."""

    __tablename__ = "live_count_marks"

    session_pk: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("sessions.id", ondelete="CASCADE"), primary_key=True
    )
    counted_below: Mapped[int] = mapped_column(Integer)
