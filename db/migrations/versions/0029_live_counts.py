"""Live counts: a session's counts kept as its rows are written, so its finish reads few raw rows.

Revision ID: 0029
Revises: 0028
Create Date: 2026-11-29

Issue 28 allows ``finish_session`` at most 100 ms more at p95 for a full-plan
session. With 0027 the finish counted the session's 36,600 raw rows again
(``write_unit_counts``), 35 ms of the backend's CPU alone and 140-185 ms of
wall clock at p95 on this shared machine (bench/README.md). Now most of
them are counted while the session is live.

- ``live_counts``: per live session, phase and IP length, the counts of its
  rows below its mark: how many (``probes``), 0020's counters under 0007's
  rules, the RTT sum and count of acked probes, and the whole phase's acked
  RTTs themselves (``rtts``, unsorted: the exact median needs them all).
- ``live_count_marks``: per live session, the mark (``counted_below``): its
  rows with a lower seq are in ``live_counts``, the others not yet.
- ``fold_live_counts(pk, below, span)``: the session's rows from its mark up
  to ``below`` added to ``live_counts``, and the mark moved there, when that
  is ``span`` (8,192 seqs) or more ahead; it locks the mark and returns
  it. ``StudyStore`` calls it before each batch of a live session, with the
  batch's first seq: a fold every 29 or so of the engine's batches of 280,
  one index range scan of the rows and one update per size (366 for a full
  plan). Counting each batch as it came would update about 280 rows per
  batch (a full plan goes round-robin over its sizes): with an insert
  trigger doing it, the store's write path was 29% slower
  (bench/README.md).
- Two statement-level triggers on ``probe_outcomes`` (AFTER UPDATE and
  DELETE, with their transition tables) run ``count_live_outcomes()``: what
  a statement changed below a live session's mark (the counters of the rows
  written minus those of the rows replaced; RTTs of rows replaced or deleted
  taken out of ``rtts``, a multiset difference, ``EXCEPT ALL``; those
  written appended), whichever writer changed them (the store's upsert of a
  batch that repeats stored seqs: a late ack turning 'lost' into 'late', a
  re-sent batch; a client report marking probes invalid or adding
  observations). Rows above the mark are read as they are when folded. The
  transition tables hold the row versions really replaced, and each trigger
  locks its sessions' marks first, as a fold does, so a fold and a change
  never interleave. No trigger on INSERT: one with a transition table on a
  partitioned table makes COPY insert row by row (PostgreSQL's ``CopyFrom``
  gives up its batches), which made the store's COPY of a batch a quarter
  slower. New rows go in through ``StudyStore`` only, which counts those
  below the mark (an outcome that came late) by
  ``count_new_live_rows(pk, seqs)``, under the mark's lock. Rows of a final
  session are not counted here (a late write for one counts its raw rows
  again, as before: ``write_unit_counts``). Statements on a day partition
  itself, rather than on ``probe_outcomes``, fire no trigger; nothing
  writes a live session's rows that way (a restore attaches a day of final
  sessions).
- ``write_unit_counts_from_live(pks)``: folds what is left of each session
  (at most 8,192 rows and a batch), then runs 0027's ``write_unit_counts``
  with its count of raw rows replaced by a read of ``live_counts``, then
  deletes the sessions' live counts and marks; the same arguments, result
  and writes. ``StudyStore`` calls it when a live session reaches a final
  state (a ``RunFinished``, an orphan at a server's start).

What is stored is unchanged: every counter is a sum of the same rows'
counts, and the medians and the histogram come from the same RTTs sorted
and binned. The RTT sums are added in another order (fold by fold instead
of in one scan); each RTT is a ``real`` (24 bits), so a size's sum in
double precision (53 bits) is exact, whatever the order, while its RTTs lie
within a factor of 2^25 of each other (0.01 ms to 300 s).

Nothing is backfilled: a session live at the upgrade has no mark, so its
finish folds all its rows. Downgrading drops the triggers, the functions and
the tables.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0029"
down_revision: str | None = "0028"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _migration(prefix: str) -> ModuleType:
    """An earlier migration module, for its definitions."""
    (path,) = Path(__file__).parent.glob(f"{prefix}_*.py")
    spec = importlib.util.spec_from_file_location(f"_kickass_migration_{prefix}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_0020 = _migration("0020")
_0027 = _migration("0027")

COUNTERS = tuple(_0020.COUNTERS)
LIVE = _0020.LIVE
# A row's RTT counted in the sum and count (0020: acked probes) and, in the
# whole phase, kept for the median and the histogram (0020: the whole phase's).
_TIMED = "o.outcome = 'acked' AND o.rtt_ms IS NOT NULL"
_KEPT = f"o.phase = 'whole' AND {_TIMED}"


def _add(rows: str, where: str) -> str:
    """Add to ``live_counts`` the signed counts of ``rows`` (probe rows with a
    ``sign``: +1 written, -1 replaced) that ``where`` keeps, per session,
    phase and IP length; the written rows' RTTs appended."""
    counters = ",\n    ".join(
        f"coalesce(sum(o.sign) FILTER (WHERE {cond}), 0)::integer"
        for cond in _0020.COUNTERS.values()
    )
    added = ",\n        ".join(f"{c} = t.{c} + excluded.{c}" for c in ("probes", *COUNTERS))
    return f"""
INSERT INTO live_counts AS t (session_pk, phase, ip_len, probes, {", ".join(COUNTERS)},
                              rtt_ms_sum, rtt_ms_n, rtts)
SELECT o.session_pk, o.phase, o.ip_len, sum(o.sign)::integer,
    {counters},
    coalesce(sum(o.sign * o.rtt_ms::double precision) FILTER (WHERE {_TIMED}), 0),
    coalesce(sum(o.sign) FILTER (WHERE {_TIMED}), 0)::integer,
    array_agg(o.rtt_ms) FILTER (WHERE o.sign > 0 AND {_KEPT})
FROM ({rows}) o
WHERE {where}
GROUP BY o.session_pk, o.phase, o.ip_len
ON CONFLICT (session_pk, phase, ip_len) DO UPDATE SET
        {added},
        rtt_ms_sum = t.rtt_ms_sum + excluded.rtt_ms_sum,
        rtt_ms_n = t.rtt_ms_n + excluded.rtt_ms_n,
        rtts = CASE WHEN excluded.rtts IS NULL THEN t.rtts
                    ELSE coalesce(t.rtts, '{{}}') || excluded.rtts END;"""


# A statement's rows that live_counts hold (its session's seqs below its mark).
_COUNTED_OF = (
    "SELECT {sign} AS sign, r.* FROM {table} r JOIN live_count_marks m "
    "ON m.session_pk = r.session_pk AND r.seq < m.counted_below"
)
_WRITTEN = _COUNTED_OF.format(sign=1, table="new_rows")
_REPLACED = _COUNTED_OF.format(sign=-1, table="old_rows")
_IN_LIVE = "o.session_pk = ANY(live)"

# The RTTs of replaced or deleted rows out of their sizes' multisets (after
# _add appended the new ones: each value taken out is there).
_TAKE_OUT = f"""
UPDATE live_counts t SET rtts = ARRAY(SELECT unnest(t.rtts) EXCEPT ALL SELECT unnest(g.rtts))
FROM (SELECT o.session_pk, o.phase, o.ip_len, array_agg(o.rtt_ms) AS rtts
      FROM ({_REPLACED}) o WHERE o.session_pk = ANY(live) AND {_KEPT}
      GROUP BY o.session_pk, o.phase, o.ip_len) g
WHERE t.session_pk = g.session_pk AND t.phase = g.phase AND t.ip_len = g.ip_len;"""

# The live sessions' marks locked (made at 0 for a session's first rows), in
# order: a fold and a statement changing the session's rows never interleave.
_LOCK_MARKS = """
INSERT INTO live_count_marks AS m (session_pk, counted_below)
SELECT pk, 0 FROM unnest(live) pk ORDER BY pk
ON CONFLICT (session_pk) DO UPDATE SET counted_below = m.counted_below;"""

_BOTH = "(SELECT session_pk FROM new_rows UNION SELECT session_pk FROM old_rows) r"


def _live_of(table: str) -> str:
    return (
        f"SELECT s.id FROM sessions s WHERE s.id = ANY(ARRAY(SELECT DISTINCT session_pk "
        f"FROM {table})) AND s.state IN {LIVE}"
    )


# How far ahead of its mark a session's rows go before they are folded into
# live_counts: 8,192 seqs, about 29 of the engine's batches of 280. A fold
# updates at most a row per size (366 for a full plan) where counting every
# batch would update about 280 per batch; the finish folds what is left, at
# most this many rows and a batch.
FOLD_SPAN = 8192

# A session's rows from its mark up to ``below``; the rows of ``seqs``.
_FOLDED = (
    "SELECT 1 AS sign, r.* FROM probe_outcomes r WHERE r.session_pk = pk "
    "AND r.session_created_at = created AND r.seq >= mark AND r.seq < below"
)
_NEW = (
    "SELECT 1 AS sign, r.* FROM probe_outcomes r WHERE r.session_pk = pk "
    "AND r.session_created_at = created AND r.seq = ANY(seqs)"
)

FOLD_LIVE_COUNTS = f"""
CREATE FUNCTION fold_live_counts(pk bigint, below integer, span integer DEFAULT {FOLD_SPAN})
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    mark integer;
    created timestamptz;
BEGIN
-- The mark, locked until the transaction ends (made at 0 for a session's
-- first batch): the caller's writes and a fold never interleave.
INSERT INTO live_count_marks AS m (session_pk, counted_below) VALUES (pk, 0)
ON CONFLICT (session_pk) DO UPDATE SET counted_below = m.counted_below
RETURNING m.counted_below INTO mark;
IF below < mark::bigint + span THEN
    RETURN mark;
END IF;
SELECT s.created_at INTO created FROM sessions s WHERE s.id = pk;
{_add(_FOLDED, "true")}
UPDATE live_count_marks m SET counted_below = below WHERE m.session_pk = pk;
RETURN below;
END
$$;
COMMENT ON FUNCTION fold_live_counts(bigint, integer, integer) IS
'Locks a live session''s mark and returns it; adds its rows from the mark up to seq below '
'(when that is span or more ahead) to live_counts and moves the mark there first (0029).';

CREATE FUNCTION count_new_live_rows(pk bigint, seqs integer[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    created timestamptz;
BEGIN
SELECT s.created_at INTO created FROM sessions s WHERE s.id = pk;
{_add(_NEW, "true")}
END
$$;
COMMENT ON FUNCTION count_new_live_rows(bigint, integer[]) IS
'Adds rows just inserted below a live session''s mark (seqs, under its lock) to live_counts '
'(migration 0029).';
"""


COUNT_LIVE_OUTCOMES = f"""
CREATE FUNCTION count_live_outcomes() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    -- The sessions of the statement's rows that are live: only theirs are
    -- counted here (a final session's late write counts its raw rows again).
    live bigint[];
BEGIN
IF TG_OP = 'UPDATE' THEN
    live := ARRAY({_live_of(_BOTH)});
ELSE
    live := ARRAY({_live_of("old_rows")});
END IF;
IF cardinality(live) = 0 THEN
    RETURN NULL;
END IF;
{_LOCK_MARKS}
IF TG_OP = 'UPDATE' THEN
{_add(f"{_WRITTEN} UNION ALL {_REPLACED}", _IN_LIVE)}
{_TAKE_OUT}
ELSE
{_add(_REPLACED, _IN_LIVE)}
{_TAKE_OUT}
END IF;
RETURN NULL;
END
$$;
COMMENT ON FUNCTION count_live_outcomes() IS
'probe_outcomes'' statement triggers: what a statement changed in a live session''s rows, '
'added to live_counts (migration 0029).';
"""

# (event, transition tables): one trigger per event, as PostgreSQL requires of
# triggers with transition tables. None on INSERT: an insert trigger with a
# transition table on a partitioned table turns COPY's batched inserts into
# one at a time (PostgreSQL's CopyFrom), which made the store's COPY of a
# batch about a quarter slower (bench/README.md); the store counts the new
# rows below the mark itself (count_new_live_rows).
TRIGGERS = {
    "update": "OLD TABLE AS old_rows NEW TABLE AS new_rows",
    "delete": "OLD TABLE AS old_rows",
}


def _trigger(event: str) -> str:
    return (
        f"CREATE TRIGGER live_counts_{event} AFTER {event.upper()} ON probe_outcomes "
        f"REFERENCING {TRIGGERS[event]} FOR EACH STATEMENT EXECUTE FUNCTION count_live_outcomes()"
    )


# -- the finish: 0027's writer reading live_counts ------------------------------------------

_COUNTED, _SIZED = "\n), counted AS (\n", "\n), sized AS MATERIALIZED (\n"
_LAST = "\n)\nSELECT n.pk, n.phase, "
_NAME = "FUNCTION write_unit_counts(pks bigint[])"
FROM_LIVE = f"""
), counted AS (
    -- A size's counts as its rows were written (live_counts), in place of
    -- counting them: its rows, its RTTs (whole phase).
    SELECT t.session_pk AS pk, t.phase, t.ip_len, {", ".join(f"t.{c}" for c in COUNTERS)},
           CASE WHEN t.rtt_ms_n > 0 THEN t.rtt_ms_sum END AS rtt_ms_sum, t.rtt_ms_n, t.rtts
    FROM s JOIN live_counts t ON t.session_pk = s.id
    WHERE t.probes > 0"""
CLEARED = """
), cleared AS (
    -- The session is final: its live counts have done their part.
    DELETE FROM live_counts t WHERE t.session_pk = ANY(pks)
), unmarked AS (
    DELETE FROM live_count_marks m WHERE m.session_pk = ANY(pks)"""
# Before counting: the rows not folded yet, folded (span 0: all of them).
_FOLD_ALL = "PERFORM fold_live_counts(p, 2147483647, 0) FROM unnest(pks) p;\nRETURN QUERY\n"
_RETURN = "RETURN QUERY\n"


def write_unit_counts_from_live() -> str:
    """0027's ``write_unit_counts`` named ``write_unit_counts_from_live``, its
    ``counted`` read from ``live_counts`` (``FROM_LIVE``) and those rows
    deleted (``CLEARED``): the same arguments, result and writes."""
    sql = _0027.write_unit_counts()
    for marker in (_COUNTED, _SIZED, _LAST, _NAME):
        assert sql.count(marker) == 1, f"0027's writer changed: {marker!r}"
    head, rest = sql.split(_COUNTED)
    _, tail = rest.split(_SIZED)
    tail, result = tail.split(_LAST)
    head = head.replace(_NAME, "FUNCTION write_unit_counts_from_live(pks bigint[])")
    assert head.count(_RETURN) == 1, "0027's writer changed"
    head = head.replace(_RETURN, _FOLD_ALL)
    return head + FROM_LIVE + _SIZED + tail + CLEARED + _LAST + result


# -- the table ------------------------------------------------------------------------------


def create_tables() -> None:
    op.create_table(
        "live_counts",
        sa.Column("session_pk", sa.BigInteger(), nullable=False),
        sa.Column("phase", sa.Text(), nullable=False),
        sa.Column("ip_len", sa.SmallInteger(), nullable=False),
        sa.Column("probes", sa.Integer(), nullable=False),
        *(sa.Column(c, sa.Integer(), nullable=False) for c in COUNTERS),
        sa.Column("rtt_ms_sum", sa.Float(), nullable=False),
        sa.Column("rtt_ms_n", sa.Integer(), nullable=False),
        sa.Column("rtts", postgresql.ARRAY(sa.REAL()), nullable=True),
        sa.CheckConstraint(f"phase IN {_0020.PHASES}", name=op.f("ck_live_counts_phase")),
        sa.ForeignKeyConstraint(
            ["session_pk"],
            ["sessions.id"],
            name=op.f("fk_live_counts_session_pk_sessions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("session_pk", "phase", "ip_len", name=op.f("pk_live_counts")),
    )
    op.create_table(
        "live_count_marks",
        sa.Column("session_pk", sa.BigInteger(), nullable=False),
        sa.Column("counted_below", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["session_pk"],
            ["sessions.id"],
            name=op.f("fk_live_count_marks_session_pk_sessions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("session_pk", name=op.f("pk_live_count_marks")),
    )


def upgrade() -> None:
    create_tables()
    op.execute(COUNT_LIVE_OUTCOMES)
    op.execute(FOLD_LIVE_COUNTS)
    for event in TRIGGERS:
        op.execute(_trigger(event))
    op.execute(write_unit_counts_from_live())


def downgrade() -> None:
    op.execute("DROP FUNCTION write_unit_counts_from_live(bigint[])")
    for event in TRIGGERS:
        op.execute(f"DROP TRIGGER live_counts_{event} ON probe_outcomes")
    op.execute("DROP FUNCTION count_new_live_rows(bigint, integer[])")
    op.execute("DROP FUNCTION fold_live_counts(bigint, integer, integer)")
    op.execute("DROP FUNCTION count_live_outcomes()")
    op.drop_table("live_count_marks")
    op.drop_table("live_counts")
