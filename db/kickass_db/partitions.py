"""The raw tables' partitions by UTC day (migration 0022).

``probe_outcomes`` (by ``session_created_at``) and ``router_telemetry`` (by
``recorded_at``) hold one partition per UTC day, ``<table>_pYYYYMMDD``, and
no DEFAULT partition: a write for a day with no partition fails, and is kept
(the writer's ``failed-*``, the ingest's refused lines), never dropped.
Partitions are made ahead (``AHEAD`` days) by the migration and then by the
scheduled ``housekeeping``; ``StudyStore.create_session`` and the telemetry
ingest make their own day's (``ensure_current``). The DDL is the SQL function
``ensure_day_partition`` of 0022: ``LIKE`` the parent, then ``ATTACH
PARTITION`` (SHARE UPDATE EXCLUSIVE on the parent: readers and writers go on).
A day that is archived and retired (0023, ``kickass_analysis.archive``) is
never made again: ``ensure_day_partition`` refuses it (``RETIRED_SQLSTATE``),
and only ``kickass archive restore`` puts it back.
"""

from __future__ import annotations

import re
from datetime import UTC, date, datetime, timedelta
from functools import partial
from typing import Any

from kickass_core.errors import KickassError
from sqlalchemy import Connection, text
from sqlalchemy.exc import DBAPIError

from .tx import StoreBase

# Table -> its partition key.
PARTITIONED = {"probe_outcomes": "session_created_at", "router_telemetry": "recorded_at"}
AHEAD = 7  # days made ahead by housekeeping
# How long making a partition may wait for its locks (ATTACH also locks the
# table its foreign key names against writers while it checks the key).
LOCK_TIMEOUT = "5s"
# ensure_day_partition's error for a retired day (migration 0023).
RETIRED_SQLSTATE = "KA028"

_NAME = re.compile(r"^(?P<table>" + "|".join(PARTITIONED) + r")_p(?P<day>\d{8})$")

_ENSURE = text("SELECT ensure_day_partition(CAST(:table AS regclass), :day)")
_DAYS = text("""
SELECT c.relname FROM pg_inherits i
JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = CAST(:table AS regclass)
""")
_TODAY = text("SELECT (now() AT TIME ZONE 'UTC')::date")


class DayRetired(KickassError):
    """The day is archived and retired: its partition is not made again."""


def retired_error(exc: DBAPIError) -> DayRetired | None:
    """``exc`` as DayRetired when it is ensure_day_partition's refusal of a retired day."""
    if getattr(exc.orig, "sqlstate", None) != RETIRED_SQLSTATE:
        return None
    diag = getattr(exc.orig, "diag", None)
    return DayRetired(
        str(getattr(diag, "message_primary", None) or exc.orig),
        hint=getattr(diag, "message_hint", None),
    )


def partition_name(table: str, day: date) -> str:
    return f"{table}_p{day:%Y%m%d}"


def is_partition(name: str) -> bool:
    """Whether ``name`` is a day partition (not a table of its own: the models
    describe the parent, housekeeping makes these)."""
    return _NAME.match(name) is not None


def day_of(moment: datetime) -> date:
    """The UTC day a time belongs to (its partition's)."""
    return moment.astimezone(UTC).date()


def _check(table: str) -> None:
    if table not in PARTITIONED:
        raise ValueError(f"{table} is not partitioned by day (one of {sorted(PARTITIONED)})")


def ensure(conn: Connection, table: str, day: date) -> bool:
    """Make ``table``'s partition of ``day`` unless it has one; True when made."""
    _check(table)
    conn.execute(text(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"))
    return bool(conn.execute(_ENSURE, {"table": table, "day": day}).scalar_one())


def days(conn: Connection, table: str) -> set[date]:
    """The days ``table`` has a partition of."""
    _check(table)
    out = set()
    for name in conn.execute(_DAYS, {"table": table}).scalars():
        m = _NAME.match(name)
        if m is not None:
            out.add(datetime.strptime(m["day"], "%Y%m%d").date())
    return out


def today(conn: Connection) -> date:
    """The database's UTC day (the one its clock stamps sessions with)."""
    value: date = conn.execute(_TODAY).scalar_one()
    return value


def days_ahead(have: set[date], today: date) -> int:
    """How many days after ``today`` have a partition, one after the other."""
    n = 0
    while today + timedelta(days=n + 1) in have:
        n += 1
    return n


def ahead(conn: Connection) -> dict[str, int]:
    """Per partitioned table, how many days after the database's today have a
    partition (``kickass schedule status`` warns when few are)."""
    now = today(conn)
    return {table: days_ahead(days(conn, table), now) for table in PARTITIONED}


class Partitions(StoreBase):
    """The day partitions of the raw tables: made ahead, counted."""

    def ensure_days(self, table: str, first: date, last: date) -> list[date]:
        """Every day from ``first`` to ``last``; returns the days made."""
        made = []
        day = first
        while day <= last:
            try:
                if self.run(partial(ensure, table=table, day=day)):
                    made.append(day)
            except DBAPIError as exc:
                retired = retired_error(exc)
                if retired is None:
                    raise
                raise retired from None
            day += timedelta(days=1)
        return made

    def ensure_ahead(self, ahead: int = AHEAD) -> dict[str, list[date]]:
        """Today's partition and ``ahead`` days after it, of every table; the days made."""
        start = self.run(today)
        return {
            table: self.ensure_days(table, start, start + timedelta(days=ahead))
            for table in PARTITIONED
        }

    def status(self) -> dict[str, dict[str, Any]]:
        """Per table: its days (first, last, how many) and how many are ahead of today."""

        def work(conn: Connection) -> dict[str, dict[str, Any]]:
            now = today(conn)
            out = {}
            for table in PARTITIONED:
                have = days(conn, table)
                out[table] = {
                    "partitions": len(have),
                    "first_day": min(have).isoformat() if have else None,
                    "last_day": max(have).isoformat() if have else None,
                    "days_ahead": days_ahead(have, now),
                    "today": now in have,
                }
            return out

        return self.run(work)
