"""Raw rows partitioned by UTC day: probe_outcomes and router_telemetry.

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-01

The two tables that hold about 99% of the bytes (issue 28: 150.5 B per probe
row, 5.5 MB per full-plan session; 463 B per 10 ms router sample, 4 GB per
router-day) become natively partitioned by day (``PARTITION BY RANGE``), so
a day is retired by detaching and dropping one partition rather than by
deleting rows:

- ``probe_outcomes`` gains ``session_created_at`` (the session's
  ``created_at``, copied by the upsert from ``sessions``) and is partitioned
  by it: a session's rows never straddle two partitions, so retiring a day
  retires whole sessions. The primary key is (``session_pk``, ``seq``,
  ``session_created_at``), the upsert's ``ON CONFLICT`` target with it. Every
  join from ``sessions`` adds ``o.session_created_at = s.created_at``: a
  per-session read executes one partition, the others "never executed".
- ``router_telemetry`` is partitioned by ``recorded_at``, primary key
  (``run_id``, ``t``, ``recorded_at``); the ingest records a line without
  ``ts`` at its run's start + ``t`` (not at the time of the ingest, which
  would store a re-ingested line twice under the new key).

A partition is ``<table>_pYYYYMMDD`` and holds [day 00:00 UTC, the next
day). There is no DEFAULT partition (PostgreSQL refuses ``DETACH PARTITION
... CONCURRENTLY`` when one exists): a write for a day without a partition
fails, and is kept, never dropped (the probe engine's journal sets the batch
aside in ``failed-*`` with PostgreSQL's error; the telemetry ingest counts
the line as refused). ``ensure_day_partition(table, day)`` makes one (``LIKE``
the parent, then ``ATTACH PARTITION``, which takes only SHARE UPDATE
EXCLUSIVE on the parent: readers and writers go on); it does nothing for a
day that has one. This migration makes the days that hold data and today
plus 7 days ahead; then the scheduled ``housekeeping`` keeps 7 days ahead,
and ``StudyStore.create_session`` and the telemetry ingest make their own
day's (today's, and tomorrow's near midnight) so a server or a demo without
cron never stops storing. No pg_partman: these few statements are all it takes.

The upgrade carries the data: the old table is renamed aside, the
partitioned one made under the old name, the rows copied in batches (100
sessions, or one hour of a router run, per statement), the views made again
with the same columns, the old table dropped. Downgrading does the reverse
(with the views and ``write_unit_counts`` of 0020).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from alembic import context, op
from sqlalchemy import text

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

AHEAD = 7  # days of partitions made ahead
SESSION_BATCH = 100  # sessions' probe rows per copying statement
TELEMETRY_BATCH_S = 3600.0  # seconds of a router run per copying statement

ENSURE = """
CREATE FUNCTION ensure_day_partition(parent regclass, day date) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    base text := (SELECT relname FROM pg_class WHERE oid = parent);
    name text := base || '_p' || to_char(day, 'YYYYMMDD');
    low timestamptz := day::timestamp AT TIME ZONE 'UTC';
BEGIN
    IF EXISTS (SELECT 1 FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
               WHERE i.inhparent = parent AND c.relname = name) THEN
        RETURN false;
    END IF;
    -- One maker at a time (a server, the ingest, housekeeping): look again.
    PERFORM pg_advisory_xact_lock(hashtext('kickass: partitions of ' || base));
    IF EXISTS (SELECT 1 FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
               WHERE i.inhparent = parent AND c.relname = name) THEN
        RETURN false;
    END IF;
    IF to_regclass(quote_ident(name)) IS NOT NULL THEN
        RAISE EXCEPTION 'table % exists but is not a partition of %', name, base
            USING HINT = 'attach it (ALTER TABLE ... ATTACH PARTITION) or drop it';
    END IF;
    -- CREATE TABLE ... PARTITION OF would lock the parent against every reader;
    -- ATTACH PARTITION takes SHARE UPDATE EXCLUSIVE only.
    EXECUTE format('CREATE TABLE %I (LIKE %s INCLUDING DEFAULTS INCLUDING CONSTRAINTS)',
                   name, parent);
    EXECUTE format('ALTER TABLE %s ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                   parent, name, low, low + interval '1 day');
    RETURN true;
END
$$;
COMMENT ON FUNCTION ensure_day_partition(regclass, date) IS
'The partition of a table partitioned by UTC day (<table>_pYYYYMMDD: [day, day + 1)), '
'made if missing; true when made.';
"""

# A session's own rows: by its key and its partition.
SESSION_ROWS = "o.session_pk = s.id AND o.session_created_at = s.created_at"


def _migration(prefix: str) -> ModuleType:
    (path,) = Path(__file__).parent.glob(f"{prefix}_*.py")
    spec = importlib.util.spec_from_file_location(f"_kickass_migration_{prefix}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_0004 = _migration("0004")
_0020 = _migration("0020")

ROUTER_VIEW = _0004._VIEW_0004
ROUTER_COMMENT = (
    "Per router run and control interval: the router's samples (router_telemetry, "
    "partitioned by the UTC day of recorded_at: a range on recorded_at reads only its days)."
)


def _days(source: str) -> str:
    """Every day ``source`` (a query of dates) names, and today + AHEAD days."""
    return f"""
SELECT d FROM ({source}) x(d)
UNION
SELECT (now() AT TIME ZONE 'UTC')::date + g FROM generate_series(0, {AHEAD}) g
"""


def _make_partitions(table: str, days: str) -> None:
    op.execute(f"SELECT ensure_day_partition('{table}', d) FROM ({_days(days)}) days(d) ORDER BY d")


def _aside(table: str, suffix: str, indexes: Sequence[str]) -> None:
    """Rename ``table`` and its indexes out of the way (the views follow it)."""
    op.execute(f"ALTER TABLE {table} RENAME TO {table}_{suffix}")
    for index in indexes:
        op.execute(f"ALTER INDEX {index} RENAME TO {index}_{suffix}")


def _copy_sessions(target: str, source: str, columns: str) -> None:
    """Probe rows from ``source`` into ``target``, ``SESSION_BATCH`` sessions a statement."""
    copy = (
        f"INSERT INTO {target} SELECT {columns} "
        f"FROM {source} o JOIN sessions s ON s.id = o.session_pk"
    )
    if context.is_offline_mode():
        op.execute(copy)
        return
    conn = op.get_bind()
    ids = conn.execute(text("SELECT id FROM sessions ORDER BY id")).scalars().all()
    for start in range(0, len(ids), SESSION_BATCH):
        batch = ids[start : start + SESSION_BATCH]
        conn.execute(
            text(f"{copy} WHERE o.session_pk BETWEEN :a AND :b"), {"a": batch[0], "b": batch[-1]}
        )


def _copy_telemetry(target: str, source: str, columns: str) -> None:
    """Samples from ``source`` into ``target``, an hour of a run a statement."""
    copy = f"INSERT INTO {target} SELECT {columns} FROM {source} s"
    if context.is_offline_mode():
        op.execute(copy)
        return
    conn = op.get_bind()
    runs = conn.execute(
        text(f"SELECT run_id, min(t), max(t) FROM {source} GROUP BY run_id ORDER BY run_id")
    ).all()
    for run_id, low, high in runs:
        t = low
        while t <= high:
            conn.execute(
                text(f"{copy} WHERE s.run_id = :r AND s.t >= :a AND s.t < :b"),
                {"r": run_id, "a": t, "b": t + TELEMETRY_BATCH_S},
            )
            t += TELEMETRY_BATCH_S


PROBE_INDEXES = ("pk_probe_outcomes", "ix_probe_outcomes_session_pk_phase_ip_len")
PROBE_FK = (
    "ALTER TABLE probe_outcomes ADD CONSTRAINT fk_probe_outcomes_session_pk_sessions "
    "FOREIGN KEY (session_pk) REFERENCES sessions (id) ON DELETE CASCADE"
)
PROBE_INDEX = (
    "CREATE INDEX ix_probe_outcomes_session_pk_phase_ip_len "
    "ON probe_outcomes (session_pk, phase, ip_len)"
)
ROUTER_FK = (
    "ALTER TABLE router_telemetry ADD CONSTRAINT fk_router_telemetry_run_id_router_runs "
    "FOREIGN KEY (run_id) REFERENCES router_runs (id) ON DELETE CASCADE"
)
ROLLUP_VIEWS = (_0020.V_SESSION_ROLLUP, _0020.V_DROP_ROLLUP)


def _write_counts(session_rows: str) -> None:
    op.execute(
        _0020.write_unit_counts(session_rows).replace(
            "CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1
        )
    )


def upgrade() -> None:
    op.execute(ENSURE)
    # probe_outcomes
    _aside("probe_outcomes", "0021", PROBE_INDEXES)
    op.execute(
        "CREATE TABLE probe_outcomes (LIKE probe_outcomes_0021 INCLUDING DEFAULTS "
        "INCLUDING CONSTRAINTS, session_created_at timestamptz NOT NULL) "
        "PARTITION BY RANGE (session_created_at)"
    )
    op.execute(
        "ALTER TABLE probe_outcomes ADD CONSTRAINT pk_probe_outcomes "
        "PRIMARY KEY (session_pk, seq, session_created_at)"
    )
    op.execute(PROBE_INDEX)
    _make_partitions(
        "probe_outcomes",
        "SELECT DISTINCT (s.created_at AT TIME ZONE 'UTC')::date FROM sessions s "
        "WHERE EXISTS (SELECT 1 FROM probe_outcomes_0021 o WHERE o.session_pk = s.id)",
    )
    _copy_sessions("probe_outcomes", "probe_outcomes_0021", "o.*, s.created_at")
    _0020.replace_study_views(_0020.new_views(SESSION_ROWS), ROLLUP_VIEWS)
    _write_counts(SESSION_ROWS)
    op.execute("DROP TABLE probe_outcomes_0021")
    op.execute(PROBE_FK)
    # router_telemetry
    _aside("router_telemetry", "0021", ("pk_router_telemetry",))
    op.execute(
        "CREATE TABLE router_telemetry (LIKE router_telemetry_0021 INCLUDING DEFAULTS "
        "INCLUDING CONSTRAINTS) PARTITION BY RANGE (recorded_at)"
    )
    op.execute(
        "ALTER TABLE router_telemetry ADD CONSTRAINT pk_router_telemetry "
        "PRIMARY KEY (run_id, t, recorded_at)"
    )
    _make_partitions(
        "router_telemetry",
        "SELECT DISTINCT (recorded_at AT TIME ZONE 'UTC')::date FROM router_telemetry_0021",
    )
    _copy_telemetry("router_telemetry", "router_telemetry_0021", "s.*")
    op.execute("DROP VIEW v_router_telemetry")
    op.execute(ROUTER_VIEW)
    _0020._comment("v_router_telemetry", ROUTER_COMMENT)
    op.execute("DROP TABLE router_telemetry_0021")
    op.execute(ROUTER_FK)


def downgrade() -> None:
    # router_telemetry: one table again (its partitions go with the old parent)
    _aside("router_telemetry", "0022", ("pk_router_telemetry",))
    op.execute(
        "CREATE TABLE router_telemetry (LIKE router_telemetry_0022 INCLUDING DEFAULTS "
        "INCLUDING CONSTRAINTS)"
    )
    op.execute(
        "ALTER TABLE router_telemetry ADD CONSTRAINT pk_router_telemetry PRIMARY KEY (run_id, t)"
    )
    _copy_telemetry("router_telemetry", "router_telemetry_0022", "s.*")
    op.execute("DROP VIEW v_router_telemetry")
    op.execute(ROUTER_VIEW)
    op.execute("DROP TABLE router_telemetry_0022")
    op.execute(ROUTER_FK)
    # probe_outcomes
    _aside("probe_outcomes", "0022", PROBE_INDEXES)
    op.execute(
        "CREATE TABLE probe_outcomes (LIKE probe_outcomes_0022 INCLUDING DEFAULTS "
        "INCLUDING CONSTRAINTS)"
    )
    op.execute("ALTER TABLE probe_outcomes DROP COLUMN session_created_at")
    op.execute(
        "ALTER TABLE probe_outcomes ADD CONSTRAINT pk_probe_outcomes PRIMARY KEY (session_pk, seq)"
    )
    op.execute(PROBE_INDEX)
    columns = ", ".join(
        f"o.{c}"
        for c in (
            "session_pk", "seq", "phase", "ip_len", "sent_at", "outcome", "acked_at", "rtt_ms",
            "ack_count", "received_len", "observed_frag_size", "reassembly_invalid",
            "observed_leading_len", "observed_fragments",
        )
    )  # fmt: skip
    _copy_sessions("probe_outcomes", "probe_outcomes_0022", columns)
    _0020.replace_study_views(_0020.new_views(), ROLLUP_VIEWS)
    _write_counts(_0020._SESSION_ROWS)
    op.execute("DROP TABLE probe_outcomes_0022")
    op.execute(PROBE_FK)
    op.execute("DROP FUNCTION ensure_day_partition(regclass, date)")
