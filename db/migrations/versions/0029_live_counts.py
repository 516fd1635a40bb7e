"""Live counts: a session's counts kept as its rows are written, so its finish reads no raw row.

Revision ID: 0029
Revises: 0028
Create Date: 2026-11-29

Issue 28 allows ``finish_session`` at most 100 ms more at p95 for a full-plan
session. With 0027 the finish counted the session's 36,600 raw rows again
(``write_unit_counts``), 35 ms of the backend's CPU alone and 140-185 ms of
wall clock at p95 on this shared machine (bench/README.md). Now the counts
are kept up to date while the session is live, and the finish only sorts
each size's hundred RTTs for the exact median.

- ``live_counts``: per live session, phase and IP length, how many raw rows
  it has (``probes``), 0020's counters under 0007's rules, the RTT sum and
  count of acked probes, and the whole phase's acked RTTs themselves
  (``rtts``, unsorted: the exact median needs them all). Rows exist only
  for sessions in a live state; the finish deletes them.
- Three statement-level triggers on ``probe_outcomes`` (AFTER INSERT, UPDATE,
  DELETE, with their transition tables) run ``count_live_outcomes()``: the
  counters of the rows a statement wrote minus those of the rows it replaced,
  per session, phase and IP length, added to ``live_counts``; RTTs of rows
  replaced or deleted are taken out of ``rtts`` (a multiset difference,
  ``EXCEPT ALL``), those of rows written appended. A trigger, not code in
  each writer: every statement that changes a live session's rows is
  counted, whichever path (the store's COPY of a batch, its upsert when a
  batch repeats a stored seq: a late ack turning 'lost' into 'late', a
  re-sent batch; a client report marking probes invalid or adding
  observations; a seed or a bench writing rows). The transition tables hold
  the row versions really replaced, so two writers of one session at once
  add up right. Rows of a final session are not counted here (a late write
  for one counts its raw rows again, as before: ``write_unit_counts``).
  Statements on a day partition itself, rather than on ``probe_outcomes``,
  fire no trigger; nothing writes a live session's rows that way (a restore
  attaches a day of final sessions).
- ``write_unit_counts_from_live(pks)``: 0027's ``write_unit_counts`` with
  its count of raw rows replaced by a read of ``live_counts`` (366 rows for a
  full plan), then those rows deleted; the same arguments, result and writes.
  ``StudyStore`` calls it when a live session reaches a final state (a
  ``RunFinished``, an orphan at a server's start).

What is stored is unchanged: every counter is a sum of the same rows'
counts, and the medians and the histogram come from the same RTTs sorted
and binned. The RTT sums are added in another order (batch by batch instead
of in the scan's); each RTT is a ``real`` (24 bits), so a size's sum in
double precision (53 bits) is exact, whatever the order, while its RTTs lie
within a factor of 2^25 of each other (0.01 ms to 300 s).

The upgrade fills ``live_counts`` for the sessions live now, from their raw
rows. Downgrading drops the triggers, the functions and the table.
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


# The RTTs of replaced or deleted rows out of their sizes' multisets (after
# _add appended the new ones: each value taken out is there).
_TAKE_OUT = f"""
UPDATE live_counts t SET rtts = ARRAY(SELECT unnest(t.rtts) EXCEPT ALL SELECT unnest(g.rtts))
FROM (SELECT o.session_pk, o.phase, o.ip_len, array_agg(o.rtt_ms) AS rtts
      FROM old_rows o WHERE o.session_pk = ANY(live) AND {_KEPT}
      GROUP BY o.session_pk, o.phase, o.ip_len) g
WHERE t.session_pk = g.session_pk AND t.phase = g.phase AND t.ip_len = g.ip_len;"""

_WRITTEN = "SELECT 1 AS sign, r.* FROM new_rows r"
_REPLACED = "SELECT -1 AS sign, r.* FROM old_rows r"
_IN_LIVE = "o.session_pk = ANY(live)"


_BOTH = "(SELECT session_pk FROM new_rows UNION SELECT session_pk FROM old_rows) r"


def _live_of(table: str) -> str:
    return (
        f"SELECT s.id FROM sessions s WHERE s.id = ANY(ARRAY(SELECT DISTINCT session_pk "
        f"FROM {table})) AND s.state IN {LIVE}"
    )


COUNT_LIVE_OUTCOMES = f"""
CREATE FUNCTION count_live_outcomes() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    -- The sessions of the statement's rows that are live: only theirs are
    -- counted here (a final session's late write counts its raw rows again).
    live bigint[];
BEGIN
IF TG_OP = 'INSERT' THEN
    live := ARRAY({_live_of("new_rows")});
ELSIF TG_OP = 'UPDATE' THEN
    live := ARRAY({_live_of(_BOTH)});
ELSE
    live := ARRAY({_live_of("old_rows")});
END IF;
IF cardinality(live) = 0 THEN
    RETURN NULL;
END IF;
IF TG_OP = 'INSERT' THEN
{_add(_WRITTEN, _IN_LIVE)}
ELSIF TG_OP = 'UPDATE' THEN
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
# triggers with transition tables.
TRIGGERS = {
    "insert": "NEW TABLE AS new_rows",
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
    DELETE FROM live_counts t WHERE t.session_pk = ANY(pks)"""


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
    return head + FROM_LIVE + _SIZED + tail + CLEARED + _LAST + result


# -- the table ------------------------------------------------------------------------------


def create_table() -> None:
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


def backfill() -> None:
    """The live sessions' counts from their raw rows (a statement of the
    upgrade's transaction: a session's rows cannot change meanwhile)."""
    rows = (
        "SELECT 1 AS sign, r.* FROM probe_outcomes r JOIN sessions s "
        f"ON s.id = r.session_pk AND s.created_at = r.session_created_at WHERE s.state IN {LIVE}"
    )
    op.execute(_add(rows, "true"))


def upgrade() -> None:
    create_table()
    op.execute(COUNT_LIVE_OUTCOMES)
    for event in TRIGGERS:
        op.execute(_trigger(event))
    op.execute(write_unit_counts_from_live())
    backfill()


def downgrade() -> None:
    op.execute("DROP FUNCTION write_unit_counts_from_live(bigint[])")
    for event in TRIGGERS:
        op.execute(f"DROP TRIGGER live_counts_{event} ON probe_outcomes")
    op.execute("DROP FUNCTION count_live_outcomes()")
    op.drop_table("live_counts")
