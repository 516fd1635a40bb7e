"""The database's side of the archive (migration 0023): which days may leave,
the claim, the record, ``DETACH PARTITION ... CONCURRENTLY`` and ``DROP``.

The files are ``kickass_analysis.archive``'s (it writes, reads and verifies
them); this module never touches them. What it holds once for both sides:

- ``CHECKS``: what a day's checks count (``pg_checks`` computes them in
  PostgreSQL, the archive from its files; ``same_checks`` compares them);
- ``SIDECAR``: the sessions' columns that leave with their probe rows (no
  address, no cookie hash; the client key salted and hashed);
- the order of a retirement, each step its own short transaction, so a
  process killed between any two leaves a state the next run finishes:
  ``claim`` (late writes for the day refused from then on: 0023's
  ``archive_claimed``), ``written``, ``verified``, ``detach`` (CONCURRENTLY:
  readers and writers of other days go on), ``drop`` (with the day's row
  marked dropped in the same transaction; only with a verified row, and a
  CHECK of 0023 refuses a detached or dropped day without one).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any, NoReturn

from kickass_core.errors import KickassError
from kickass_core.states import FINAL_STATES
from sqlalchemy import Connection, text
from sqlalchemy.exc import DBAPIError, OperationalError

from . import partitions
from .models.archive import ARCHIVED_TABLES
from .tx import StoreBase

# How long DETACH ... CONCURRENTLY and DROP may wait for their locks. DROP
# takes ACCESS EXCLUSIVE on the table its foreign key names (sessions,
# router_runs: PostgreSQL drops the key's triggers there) for the few
# milliseconds it runs; a short timeout, tried again, keeps a long read of
# that table from queueing every other reader behind the DROP.
DETACH_LOCK_TIMEOUT = "5s"
DROP_LOCK_TIMEOUT = "200ms"
DROP_ATTEMPTS = 5
MAX_BLOCKERS = 20  # named in a report; the rest counted
FLOAT_SUM_TOLERANCE = 1e-9  # relative: a sum of floats depends on its order


@dataclass(frozen=True)
class CheckSpec:
    """What a day's checks count: its rows, rows per value of ``group``, the
    sum of ``total``, the least and greatest of each of ``times``, and rows
    where each of ``flags`` is true (a boolean) or not NULL (anything else).
    ``order``: the files' row order (the primary key)."""

    group: str
    total: str | None
    times: tuple[str, ...]
    flags: tuple[str, ...]
    order: tuple[str, ...]


CHECKS: dict[str, CheckSpec] = {
    "probe_outcomes": CheckSpec(
        group="outcome",
        total="seq",
        times=("session_created_at", "sent_at", "acked_at"),
        flags=("reassembly_invalid", "observed_frag_size", "observed_leading_len"),
        order=("session_pk", "seq"),
    ),
    "router_telemetry": CheckSpec(
        group="marking_mode",
        total="t",
        times=("recorded_at",),
        flags=("leading_fragment_len", "output_rate_bps"),
        order=("run_id", "t"),
    ),
    # A settled Atlas campaign's outcomes (archived, never dropped).
    "atlas_outcomes": CheckSpec(
        group="outcome",
        total="packet_index",
        times=("result_at", "replied_at"),
        flags=("rtt_ms", "error"),
        order=("msm_id", "prb_id", "result_at", "packet_index"),
    ),
    # The sessions' sidecar of a probe_outcomes day.
    "sessions": CheckSpec(
        group="state",
        total="session_pk",
        times=("created_at", "finished_at"),
        flags=("verdict", "client_key_hash"),
        order=("session_pk",),
    ),
}
SIDECAR = "sessions"

# The sessions of a day as they leave the database beside their probe rows:
# what a researcher needs to read them (the plan, the verdict, the client's
# version) and the client key of 0016 (an address block) salted and hashed
# (archive_secrets of 0023), so one client is one client on every day of the
# archive. No address, no cookie hash. ``session_pk`` joins probe_outcomes.
SIDECAR_SELECT = """
SELECT s.id AS session_pk, s.session_id, s.created_at, s.finished_at, s.state, s.verdict,
       s.verdict_reason, s.client_version, s.plan,
       encode(sha256(k.secret || convert_to(client_key(s.source_address), 'UTF8')), 'hex')
           AS client_key_hash
FROM sessions s CROSS JOIN archive_secrets k
WHERE k.name = 'client_key' AND s.created_at >= '{low}' AND s.created_at < '{high}'
ORDER BY s.id
"""

# A campaign's Atlas outcomes as they leave the database (its snapshot).
CAMPAIGN_SELECT = "SELECT * FROM atlas_outcomes WHERE campaign_id = {campaign_id}"

_FINAL = "(" + ", ".join(f"'{s}'" for s in FINAL_STATES) + ")"

# A probe_outcomes day may go once every session created that day is final
# and every one with rows has its durable counts (0020): a live one blocks.
_PROBE_BLOCKERS = f"""
SELECT s.session_id, s.state,
       s.state IN {_FINAL} AS final
FROM sessions s
WHERE s.created_at >= :low AND s.created_at < :high
  AND (s.state NOT IN {_FINAL}
       OR (EXISTS (SELECT 1 FROM {{part}} o WHERE o.session_pk = s.id)
           AND NOT EXISTS (SELECT 1 FROM unit_counts u
                           WHERE u.source = 'volunteer' AND u.unit = s.session_id)))
ORDER BY s.id
"""
# A router_telemetry day may go once the refresh has rolled every second of
# its samples into router_telemetry_1s (the report and the dashboards read
# the seconds and minutes once the raw samples are gone).
_ROUTER_BLOCKERS = """
SELECT p.run_id, count(*) AS seconds
FROM (SELECT run_id, floor(t) AS sec, count(*) AS n FROM {part} GROUP BY run_id, floor(t)) p
JOIN router_runs r ON r.id = p.run_id
LEFT JOIN router_telemetry_1s x
  ON x.run_id = p.run_id
 AND x.at = date_trunc('second', r.started_at) + make_interval(secs => p.sec)
WHERE x.samples IS NULL OR x.samples < p.n
GROUP BY p.run_id ORDER BY p.run_id
"""

_LOCK_DAY = text(
    "SELECT pg_advisory_xact_lock(archive_lock_key(:table), CAST(:day AS date) - date '2000-01-01')"
)
# One archiver per day (or campaign) at a time, held by a connection for as
# long as it works on it: the table and the day (or the campaign's id).
_ARCHIVER = "hashtext('kickass: archiver of ' || :table), CAST(:n AS integer)"
_TRY_ARCHIVER = text(f"SELECT pg_try_advisory_lock({_ARCHIVER})")
_UNLOCK_ARCHIVER = text(f"SELECT pg_advisory_unlock({_ARCHIVER})")
_EPOCH = date(2000, 1, 1)
_CLAIM = text("""
INSERT INTO archive_partitions (table_name, day, range_from, range_to, claimed_at)
VALUES (:table, :day, :low, :high, now())
ON CONFLICT (table_name, day) DO UPDATE SET claimed_at = coalesce(archive_partitions.claimed_at,
                                                                  excluded.claimed_at)
""")
_NOTE = text("""
INSERT INTO archive_partitions (table_name, day, range_from, range_to)
VALUES (:table, :day, :low, :high)
ON CONFLICT (table_name, day) DO NOTHING
""")
_ROW = text("SELECT * FROM archive_partitions WHERE table_name = :table AND day = :day")
_STATE = text("""
SELECT i.inhdetachpending FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = CAST(:table AS regclass) AND c.relname = :name
""")
_EXISTS = text("SELECT to_regclass(quote_ident(:name)) IS NOT NULL")
_LIST = text("""
SELECT table_name, day, range_from, range_to, rows, bytes, files, manifest_sha256, claimed_at,
       written_at, verified_at, detached_at, dropped_at, restored_at
FROM archive_partitions
WHERE (CAST(:table AS text) IS NULL OR table_name = CAST(:table AS text))
ORDER BY table_name, day
""")
_RECOUNT = text(f"""
SELECT count(*) FROM write_unit_counts(ARRAY(
    SELECT s.id FROM sessions s
    WHERE s.created_at >= :low AND s.created_at < :high AND s.state IN {_FINAL}))
""")

# Where a partition is: attached, detach pending (a DETACH ... CONCURRENTLY
# that did not finish), detached (a table of its own), or absent.
ATTACHED, PENDING, DETACHED, ABSENT = "attached", "pending", "detached", "absent"


def bounds(day: date) -> tuple[datetime, datetime]:
    """[the day's 00:00 UTC, the next day's): a partition's range."""
    low = datetime(day.year, day.month, day.day, tzinfo=UTC)
    return low, low + timedelta(days=1)


def relation(table: str, day: date) -> str:
    """The partition's name (a detached one keeps it)."""
    if table not in ARCHIVED_TABLES:
        raise ValueError(f"{table} is not archived (one of {ARCHIVED_TABLES})")
    return partitions.partition_name(table, day)


def pg_checks(conn: Connection, spec: CheckSpec, source: str, booleans: set[str]) -> dict[str, Any]:
    """The checks of ``source`` (a table name, or a parenthesised query with an
    alias) computed by PostgreSQL; ``booleans``: the boolean columns among
    ``spec.flags``. Values as in the manifest: times in ISO 8601 UTC."""
    parts = ["count(*)"]
    if spec.total:
        parts.append(f"sum({spec.total})")
    for t in spec.times:
        parts += [f"min({t})", f"max({t})"]
    for f in spec.flags:
        parts.append(f"count(*) FILTER (WHERE {f})" if f in booleans else f"count({f})")
    row = conn.execute(text(f"SELECT {', '.join(parts)} FROM {source}")).one()
    values = list(row)
    out: dict[str, Any] = {"rows": int(values.pop(0))}
    groups = conn.execute(
        text(f"SELECT {spec.group}, count(*) FROM {source} GROUP BY 1 ORDER BY 1")
    ).all()
    out[f"by_{spec.group}"] = {_key(v): int(n) for v, n in groups}
    if spec.total:
        total = values.pop(0)
        out[f"sum_{spec.total}"] = _number(total)
    for t in spec.times:
        out[f"min_{t}"] = iso(values.pop(0))
        out[f"max_{t}"] = iso(values.pop(0))
    for f in spec.flags:
        out[f"rows_{f}"] = int(values.pop(0))
    return out


def _key(value: Any) -> str:
    return "null" if value is None else str(value)


def _number(value: Any) -> int | float | None:
    if value is None:
        return None
    if isinstance(value, float):
        return value
    as_int = int(value)
    return as_int if as_int == value else float(value)


def iso(value: datetime | None) -> str | None:
    return None if value is None else value.astimezone(UTC).isoformat()


def same_checks(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """Where two sets of checks differ (empty: the same). Counts, integer sums
    and times exactly; a float sum to ``FLOAT_SUM_TOLERANCE`` (its value
    depends on the order the floats were added in)."""
    out = []
    for name in sorted(set(a) | set(b)):
        x, y = a.get(name), b.get(name)
        if isinstance(x, float) or isinstance(y, float):
            if (
                x is not None
                and y is not None
                and math.isclose(float(x), float(y), rel_tol=FLOAT_SUM_TOLERANCE, abs_tol=1e-9)
            ):
                continue
        elif x == y:
            continue
        out.append(f"{name}: {x!r} against {y!r}")
    return out


class ArchiveStore(StoreBase):
    """The archive's rows and the retirement's DDL (see the module doc)."""

    def __init__(self, database_url: str | None = None) -> None:
        super().__init__(database_url)
        self._archiver: Connection | None = None

    def close(self) -> None:
        if self._archiver is not None:
            self._archiver.close()
            self._archiver = None
        super().close()

    # -- what may go ----------------------------------------------------------------------

    def today(self) -> date:
        return self.run(partitions.today)

    def candidates(self, table: str, before: date) -> list[date]:
        """Days of ``table`` to retire: partitions of days before ``before``,
        and days a retirement claimed and did not finish."""

        def work(conn: Connection) -> list[date]:
            days = {d for d in partitions.days(conn, table) if d < before}
            unfinished = conn.execute(
                text(
                    "SELECT day FROM archive_partitions WHERE table_name = :table "
                    "AND claimed_at IS NOT NULL AND dropped_at IS NULL"
                ),
                {"table": table},
            ).scalars()
            return sorted(days | set(unfinished))

        return self.run(work)

    def state(self, table: str, day: date) -> str:
        """ATTACHED, PENDING, DETACHED or ABSENT."""

        def work(conn: Connection) -> str:
            name = relation(table, day)
            pending = conn.execute(_STATE, {"table": table, "name": name}).scalar_one_or_none()
            if pending is not None:
                return PENDING if pending else ATTACHED
            return DETACHED if conn.execute(_EXISTS, {"name": name}).scalar_one() else ABSENT

        return self.run(work)

    def blockers(self, table: str, day: date) -> list[str]:
        """What keeps the day in the database (empty: nothing)."""
        return self.run(lambda conn: _blockers(conn, table, day))

    def booleans(self, table: str) -> set[str]:
        """The boolean columns of ``table``."""
        return self.run(
            lambda conn: set(
                conn.execute(
                    text(
                        "SELECT attname FROM pg_attribute WHERE attrelid = CAST(:t AS regclass) "
                        "AND atttypid = 'boolean'::regtype AND attnum > 0 AND NOT attisdropped"
                    ),
                    {"t": table},
                ).scalars()
            )
        )

    def checks(self, table: str, day: date) -> dict[str, Any]:
        """The checks of the day's partition (attached or detached) in PostgreSQL."""
        name = relation(table, day)
        booleans = self.booleans(table)
        return self.run(lambda conn: pg_checks(conn, CHECKS[table], name, booleans))

    # -- one archiver per day -------------------------------------------------------------

    def lock_day(self, table: str, day: date) -> bool:
        """This store's archiver holds the day (False: another one does)."""
        return self._lock(table, (day - _EPOCH).days)

    def unlock_day(self, table: str, day: date) -> None:
        self._unlock(table, (day - _EPOCH).days)

    def lock_campaign(self, campaign_id: int) -> bool:
        """This store's archiver holds the campaign's snapshot (False: another one does)."""
        return self._lock("atlas_outcomes", campaign_id)

    def unlock_campaign(self, campaign_id: int) -> None:
        self._unlock("atlas_outcomes", campaign_id)

    def _lock(self, table: str, n: int) -> bool:
        if self._archiver is None:
            self._archiver = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        return bool(self._archiver.execute(_TRY_ARCHIVER, {"table": table, "n": n}).scalar_one())

    def _unlock(self, table: str, n: int) -> None:
        if self._archiver is not None:
            self._archiver.execute(_UNLOCK_ARCHIVER, {"table": table, "n": n})

    def campaign_id(self, name: str) -> int | None:
        return self.run(
            lambda conn: conn.execute(
                text("SELECT id FROM atlas_campaigns WHERE name = :name"), {"name": name}
            ).scalar_one_or_none()
        )

    # -- the steps ------------------------------------------------------------------------

    def claim(self, table: str, day: date) -> list[str]:
        """Claim the day for retirement unless something blocks it (returned,
        nothing claimed). From the claim on, a late write for the day is
        refused (0023's archive_claimed): the claim waits for those under way."""
        low, high = bounds(day)

        def work(conn: Connection) -> list[str]:
            conn.execute(_LOCK_DAY, {"table": table, "day": day})
            found = _blockers(conn, table, day)
            if found:
                return found
            conn.execute(_CLAIM, {"table": table, "day": day, "low": low, "high": high})
            return []

        return self.run(work)

    def release(self, table: str, day: date) -> None:
        """Give up a claim on a day still attached (a retirement that failed
        before its detach): late writes for it are taken again."""
        self.run(
            lambda conn: conn.execute(
                text(
                    "UPDATE archive_partitions SET claimed_at = NULL WHERE table_name = :table "
                    "AND day = :day AND detached_at IS NULL AND dropped_at IS NULL"
                ),
                {"table": table, "day": day},
            )
        )

    def note(self, table: str, day: date) -> None:
        """A row for a day archived without being retired (``kickass archive write``)."""
        low, high = bounds(day)
        self.run(
            lambda conn: conn.execute(_NOTE, {"table": table, "day": day, "low": low, "high": high})
        )

    def row(self, table: str, day: date) -> dict[str, Any] | None:
        return self.run(
            lambda conn: (
                None
                if (r := conn.execute(_ROW, {"table": table, "day": day}).first()) is None
                else dict(r._mapping)
            )
        )

    def written(
        self, table: str, day: date, *, rows: int, size: int, files: int, manifest_sha256: str
    ) -> None:
        """The day's files are published: their rows, bytes and manifest. A
        new manifest is verified anew (its verified time cleared)."""
        self.run(
            lambda conn: conn.execute(
                text("""
                UPDATE archive_partitions SET rows = :rows, bytes = :size, files = :files,
                    written_at = now(),
                    verified_at = CASE WHEN manifest_sha256 = :sha THEN verified_at END,
                    manifest_sha256 = :sha
                WHERE table_name = :table AND day = :day
                """),
                {"table": table, "day": day, "rows": rows, "size": size, "files": files,
                 "sha": manifest_sha256},
            )
        )  # fmt: skip

    def verified(self, table: str, day: date, manifest_sha256: str) -> None:
        """The files were read back from disk and verified against the manifest
        whose sha256 the row keeps (anything else is an error)."""

        def work(conn: Connection) -> None:
            n = conn.execute(
                text(
                    "UPDATE archive_partitions SET verified_at = now() "
                    "WHERE table_name = :table AND day = :day AND manifest_sha256 = :sha"
                ),
                {"table": table, "day": day, "sha": manifest_sha256},
            ).rowcount
            if n != 1:
                raise KickassError(
                    f"the archive of {table} {day} is not the one recorded",
                    hint="its _manifest.json changed after it was written; "
                    "kickass archive verify names what differs",
                )

        self.run(work)

    def detach(self, table: str, day: date) -> float:
        """``DETACH PARTITION ... CONCURRENTLY`` (SHARE UPDATE EXCLUSIVE on the
        parent: readers and writers go on), or FINALIZE of one that did not
        finish; the day's row marked detached. Only with a verified row.
        Returns the milliseconds the statement took."""
        name = relation(table, day)
        row = self.row(table, day)
        if row is None or row["verified_at"] is None:
            raise KickassError(
                f"{table} {day} has no verified archive: not detached",
                hint="kickass archive retire writes and verifies it first",
            )
        state = self.state(table, day)
        ms = 0.0
        if state in (ATTACHED, PENDING):
            how = "CONCURRENTLY" if state == ATTACHED else "FINALIZE"
            with self.engine.connect() as conn:
                conn = conn.execution_options(isolation_level="AUTOCOMMIT")
                conn.execute(text(f"SET lock_timeout = '{DETACH_LOCK_TIMEOUT}'"))
                t0 = time.monotonic()
                try:
                    conn.execute(text(f"ALTER TABLE {table} DETACH PARTITION {name} {how}"))
                except OperationalError as exc:
                    raise _lock_error(f"detach {name}", exc) from exc
                ms = (time.monotonic() - t0) * 1000.0
        self.run(
            lambda conn: conn.execute(
                text(
                    "UPDATE archive_partitions SET detached_at = coalesce(detached_at, now()) "
                    "WHERE table_name = :table AND day = :day"
                ),
                {"table": table, "day": day},
            )
        )
        return ms

    def drop(self, table: str, day: date, manifest_sha256: str) -> float:
        """``DROP TABLE`` of the detached day and its row marked dropped, in one
        transaction, only while the row is verified with this manifest.
        Returns the milliseconds the DROP took (its lock wait included)."""
        name = relation(table, day)

        def work(conn: Connection) -> float:
            ok = conn.execute(
                text(
                    "SELECT 1 FROM archive_partitions WHERE table_name = :table AND day = :day "
                    "AND verified_at IS NOT NULL AND detached_at IS NOT NULL "
                    "AND manifest_sha256 = :sha FOR UPDATE"
                ),
                {"table": table, "day": day, "sha": manifest_sha256},
            ).first()
            if ok is None:
                raise KickassError(
                    f"{name} not dropped: its archive row is not verified with this manifest",
                    hint="kickass archive retire verifies it again",
                )
            conn.execute(text(f"SET LOCAL lock_timeout = '{DROP_LOCK_TIMEOUT}'"))
            t0 = time.monotonic()
            conn.execute(text(f"DROP TABLE {name}"))
            ms = (time.monotonic() - t0) * 1000.0
            conn.execute(
                text(
                    "UPDATE archive_partitions SET dropped_at = now() "
                    "WHERE table_name = :table AND day = :day"
                ),
                {"table": table, "day": day},
            )
            return ms

        for attempt in range(DROP_ATTEMPTS):
            try:
                return self.run(work)
            except OperationalError as exc:
                if _sqlstate(exc) != "55P03" or attempt == DROP_ATTEMPTS - 1:
                    raise _lock_error(f"drop {name}", exc) from exc
                time.sleep(0.1 * 2**attempt)
        raise AssertionError("unreachable")

    def reattach(self, table: str, day: date, why: str) -> NoReturn:
        """Put a detached day back (its archive does not hold what it holds):
        attached again, its row no longer claimed, verified nor detached; then
        raise, saying why."""
        name = relation(table, day)
        low, high = bounds(day)

        def work(conn: Connection) -> None:
            conn.execute(text(f"SET LOCAL lock_timeout = '{partitions.LOCK_TIMEOUT}'"))
            conn.execute(
                text(
                    f"ALTER TABLE {table} ATTACH PARTITION {name} "
                    f"FOR VALUES FROM ('{low.isoformat()}') TO ('{high.isoformat()}')"
                )
            )
            conn.execute(
                text(
                    "UPDATE archive_partitions SET claimed_at = NULL, verified_at = NULL, "
                    "detached_at = NULL WHERE table_name = :table AND day = :day"
                ),
                {"table": table, "day": day},
            )

        self.run(work)
        raise KickassError(
            f"{table} {day} differs from its archive ({why}): attached again, not dropped",
            hint="the next kickass archive retire writes the day's archive again",
        )

    def restore(
        self,
        table: str,
        day: date,
        fill: Callable[[Connection, str], None],
        check: Callable[[dict[str, Any]], list[str]],
        *,
        recount: bool = False,
    ) -> dict[str, Any]:
        """Put a retired day back, in one transaction: a detached table is
        attached again; a dropped one is made (LIKE the parent), filled by
        ``fill(conn, name)`` (the archive's rows), checked by ``check`` (its
        checks against the manifest's: empty when equal) and attached. The
        day's claim, detach and drop are cleared (``restored_at`` set), so
        late writes are taken again. ``recount``: the day's final sessions'
        durable counts written again from the rows (probe_outcomes)."""
        name = relation(table, day)
        low, high = bounds(day)
        booleans = self.booleans(table)
        state = self.state(table, day)
        if state in (ATTACHED, PENDING):
            raise KickassError(
                f"{table} {day} is in the database ({name} is {state})",
                hint="only a retired day is restored",
            )

        def work(conn: Connection) -> dict[str, Any]:
            conn.execute(text(f"SET LOCAL lock_timeout = '{partitions.LOCK_TIMEOUT}'"))
            conn.execute(_LOCK_DAY, {"table": table, "day": day})
            if state == ABSENT:
                conn.execute(
                    text(
                        f"CREATE TABLE {name} "
                        f"(LIKE {table} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"
                    )
                )
                fill(conn, name)
            checks = pg_checks(conn, CHECKS[table], name, booleans)
            differ = check(checks)
            if differ:
                raise KickassError(
                    f"the restored rows of {table} {day} differ from the manifest: "
                    + "; ".join(differ[:5]),
                    hint="nothing was restored",
                )
            conn.execute(
                text(
                    f"ALTER TABLE {table} ATTACH PARTITION {name} "
                    f"FOR VALUES FROM ('{low.isoformat()}') TO ('{high.isoformat()}')"
                )
            )
            conn.execute(
                text("""
                UPDATE archive_partitions SET claimed_at = NULL, detached_at = NULL,
                    dropped_at = NULL, restored_at = now()
                WHERE table_name = :table AND day = :day
                """),
                {"table": table, "day": day},
            )
            out: dict[str, Any] = {"rows": checks["rows"], "from": state}
            if recount and table == "probe_outcomes":
                out["recounted_sessions"] = int(
                    conn.execute(_RECOUNT, {"low": low, "high": high}).scalar_one()
                )
            return out

        return self.run(work)

    def listing(self, table: str | None = None) -> list[dict[str, Any]]:
        return self.run(
            lambda conn: [dict(r._mapping) for r in conn.execute(_LIST, {"table": table})]
        )


def _blockers(conn: Connection, table: str, day: date) -> list[str]:
    low, high = bounds(day)
    part = relation(table, day)
    out = []
    if table == "probe_outcomes":
        rows = conn.execute(
            text(_PROBE_BLOCKERS.format(part=part)), {"low": low, "high": high}
        ).all()
        for session_id, state, final in rows:
            why = "has no durable counts" if final else f"is still {state}"
            out.append(f"session {session_id} {why}")
    else:
        for run_id, seconds in conn.execute(text(_ROUTER_BLOCKERS.format(part=part))):
            out.append(
                f"router run {run_id}: {seconds} seconds of samples not rolled up into "
                "router_telemetry_1s (the scheduled refresh rolls them)"
            )
    if len(out) > MAX_BLOCKERS:
        out = out[:MAX_BLOCKERS] + [f"and {len(out) - MAX_BLOCKERS} more"]
    return out


def _sqlstate(exc: DBAPIError) -> str | None:
    return getattr(exc.orig, "sqlstate", None)


def _lock_error(what: str, exc: DBAPIError) -> KickassError:
    reason = str(exc.orig or exc).strip().splitlines()[0]
    return KickassError(
        f"could not {what}: {reason}",
        hint="a long transaction holds a lock it needs; the next retire tries again "
        "(a DETACH that did not finish is finalized then)",
    )
