"""Atlas lands its counts in the durable counts; the by-source views read every source from them.

Revision ID: 0028
Revises: 0027
Create Date: 2026-11-28

Issue 28 item 1 made the durable counts source-neutral (``unit_counts``,
``unit_count_changes``, their rollups: a ``source`` column), but only the
volunteers wrote there; Atlas's pooled numbers were recomputed from
``atlas_outcomes`` on every read, and ``v_size_drop_by_source`` /
``v_split_drop_by_source`` named their two sources (issue 26 item 1).

**The writer.** ``AtlasStore.store_window`` (fetch, late re-read, import)
calls ``write_atlas_unit_counts(msm_ids, prb_ids, result_ats)`` with the
results it just stored with their outcomes, in the same transaction:

- the unit is the probe within its campaign, ``atlas:<campaign>:<probe
  id>`` (0006's ``session_id`` of an Atlas probe): the by-source views'
  ``sessions`` are probes, so ``units`` must be; each result's counts are
  added to its probe's row and queued as a change (its new sizes count a
  unit), with the RTT histogram of the replies it adds (0020's bins);
- the unit's ``day`` is its last result's UTC day, its ``client_key`` that
  of the address the probe measured from (0016's ``client_key``);
- counted per phase and IP length are the outcomes a drop rate counts
  (acked, lost, late: 0006's rules; ``unanswered``, ``error`` and outcomes
  no log row gave an IP length stay out): sent, acked, late, the RTT sum and
  count of acked. Atlas observes no fragments and no reassembly (those
  counters 0, their arrays NULL); no exact per-probe median is kept
  (``rtt_ms_median_by_size`` NULL: a median does not add up, and
  ``v_atlas_whole_drop`` has it from the outcomes).

A result's outcomes are stored once, when the result is new or replaces an
unreadable copy (which had none), and the store passes only those results:
a re-fetched window, a re-import or a second read of a stored result adds
nothing; a late result adds to its probe.

**The views.** ``v_size_drop_by_source`` and ``v_split_drop_by_source`` read
every source of the counts per source and IP length (``unit_counts_total``
plus ``unit_counts_pending``, as 0020's pooled views do for the
volunteers), so a new source appears without editing them and Atlas's rows
outlive ``atlas_outcomes``. Same columns; the same rows for the data of
today, Atlas's median now the histogram's (within 0.4975% of the exact
one, as the volunteers' already was). Atlas's fragment and reassembly
columns stay NULL (named here: it cannot observe them). ``v_drop_rollup``
keeps Atlas's rows from its own tables (per campaign, probe country and
ASN, with ``unanswered``: the counts hold none of these).

The upgrade backfills every stored result (folded after each batch, as
0020's backfill). Downgrading puts 0020's by-source views back, removes
Atlas's rows from the count tables and drops the function.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from alembic import context, op
from sqlalchemy import text

revision: str = "0028"
down_revision: str | None = "0027"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# 0020's counters, in the order of every array. Atlas counts the first three.
COUNTED_HERE = ("sent", "acked", "late")
NOT_OBSERVED = (
    "reassembly_invalid", "frag_observed", "largest_fragment_as_sent", "fragments_observed",
    "fragmented_observed", "leading_as_sent", "leading_swapped",
)  # fmt: skip
COUNTERS = (*COUNTED_HERE, *NOT_OBSERVED)
KEY = "msm_id, prb_id, result_at"
# An Atlas probe within a campaign plays the part of a volunteer's session
# (0006's session_id of v_verdicts_by_source): its unit.
UNIT = "'atlas:' || c.name || ':' || r.prb_id"

_ARRAY_COLS = ", ".join(f"{c}_by_size" for c in COUNTERS)
_TOTAL_COLS = ", ".join(COUNTERS)
SUMMED = (*COUNTED_HERE, "rtt_ms_sum", "rtt_ms_n")
_MERGED_ARRAYS = ", ".join(
    f"array_agg(m.{c}{'' if c == 'rtt_ms_sum' else '::smallint'} ORDER BY m.ip_len) AS {c}_by_size"
    for c in SUMMED
)
_ADDED_ARRAYS = _MERGED_ARRAYS.replace("m.", "a.").replace("ORDER BY a.", "ORDER BY m.")
# unit_count_changes holds every array, zeros included.
_ZERO_ARRAYS = ", ".join(
    "array_fill(0::smallint, ARRAY[cardinality(c.ip_lens)])" for _ in NOT_OBSERVED
)

WRITE = f"""
CREATE FUNCTION write_atlas_unit_counts(msm_ids bigint[], prb_ids integer[],
                                        result_ats timestamptz[])
RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    written integer;
BEGIN
-- One writer of a unit at a time, in a fixed order: a unit's new counts are
-- its stored ones plus the results', read after the lock (READ COMMITTED:
-- each statement sees what committed before it), so two stores adding
-- results of one probe at once never lose one's.
PERFORM count(*) FROM (
    SELECT pg_advisory_xact_lock(hashtext('kickass: atlas unit ' || x.unit))
    FROM (SELECT DISTINCT {UNIT} AS unit
          FROM unnest(msm_ids, prb_ids, result_ats) AS k({KEY})
          JOIN atlas_results r USING ({KEY})
          JOIN atlas_campaigns c ON c.id = r.campaign_id
          ORDER BY 1) x
) locked;
WITH r AS (
    SELECT r.msm_id, r.prb_id, r.result_at, {UNIT} AS unit,
           (r.result_at AT TIME ZONE 'UTC')::date AS day,
           client_key(r.from_address) AS client_key
    FROM unnest(msm_ids, prb_ids, result_ats) AS k({KEY})
    JOIN atlas_results r USING ({KEY})
    JOIN atlas_campaigns c ON c.id = r.campaign_id
), o AS (
    SELECT r.unit, o.phase, o.ip_len, o.outcome, o.rtt_ms
    FROM r JOIN atlas_outcomes o USING ({KEY})
    WHERE o.ip_len IS NOT NULL AND o.outcome IN ('acked', 'lost', 'late')
), unit AS (
    -- Per unit and phase, the results' day (the first: its new sizes count
    -- there) and client (the last's).
    SELECT r.unit, o.phase, min(r.day) AS day,
           (array_agg(r.client_key ORDER BY r.result_at DESC))[1] AS client_key,
           max(r.day) AS last_day
    FROM r JOIN (SELECT DISTINCT unit, phase FROM o) o USING (unit)
    GROUP BY r.unit, o.phase
), added AS (
    SELECT o.unit, o.phase, o.ip_len,
        count(*)::integer AS sent,
        count(*) FILTER (WHERE o.outcome = 'acked')::integer AS acked,
        count(*) FILTER (WHERE o.outcome = 'late')::integer AS late,
        coalesce(sum(o.rtt_ms::double precision) FILTER (WHERE o.outcome = 'acked'), 0)
            AS rtt_ms_sum,
        count(o.rtt_ms) FILTER (WHERE o.outcome = 'acked')::integer AS rtt_ms_n
    FROM o GROUP BY o.unit, o.phase, o.ip_len
), old AS (
    SELECT u.* FROM unit_counts u
    WHERE u.source = 'atlas' AND u.unit IN (SELECT unit FROM unit)
), old_sizes AS (
    SELECT u.unit, u.phase, x.*
    FROM old u CROSS JOIN LATERAL unnest(
        u.ip_lens, u.sent_by_size, u.acked_by_size, u.late_by_size, u.rtt_ms_sum_by_size,
        u.rtt_ms_n_by_size) AS x(ip_len, sent, acked, late, rtt_ms_sum, rtt_ms_n)
), merged AS (
    SELECT coalesce(a.unit, b.unit) AS unit, coalesce(a.phase, b.phase) AS phase,
           coalesce(a.ip_len, b.ip_len) AS ip_len,
           {", ".join(f"coalesce(a.{c}, 0) + coalesce(b.{c}, 0) AS {c}" for c in SUMMED)},
           a.ip_len IS NOT NULL AND b.ip_len IS NULL AS new_size
    FROM added a
    FULL JOIN (SELECT * FROM old_sizes
               WHERE (unit, phase) IN (SELECT unit, phase FROM unit)) b
        ON b.unit = a.unit AND b.phase = a.phase AND b.ip_len = a.ip_len
), units AS (
    SELECT m.unit, m.phase, array_agg(m.ip_len ORDER BY m.ip_len) AS ip_lens,
        {", ".join(f"sum(m.{c})::integer AS {c}" for c in COUNTED_HERE)},
        sum(m.rtt_ms_sum) AS rtt_ms_sum, sum(m.rtt_ms_n)::integer AS rtt_ms_n,
        {_MERGED_ARRAYS}
    FROM merged m GROUP BY m.unit, m.phase
), stored AS (
    INSERT INTO unit_counts AS t (source, unit, phase, day, client_key, counted_at,
                                  {_TOTAL_COLS}, rtt_ms_sum, rtt_ms_n, ip_lens,
                                  {_ARRAY_COLS}, rtt_ms_sum_by_size, rtt_ms_n_by_size,
                                  rtt_ms_median_by_size)
    SELECT 'atlas', u.unit, u.phase, n.last_day, n.client_key, now(),
           u.sent, u.acked, u.late, {", ".join("0" for _ in NOT_OBSERVED)},
           CASE WHEN u.rtt_ms_n > 0 THEN u.rtt_ms_sum END, u.rtt_ms_n, u.ip_lens,
           -- 0020: an array that would hold only zeros is NULL.
           u.sent_by_size, CASE WHEN u.acked > 0 THEN u.acked_by_size END,
           CASE WHEN u.late > 0 THEN u.late_by_size END,
           {", ".join("NULL" for _ in NOT_OBSERVED)},
           CASE WHEN u.rtt_ms_n > 0 THEN u.rtt_ms_sum_by_size END,
           CASE WHEN u.rtt_ms_n > 0 THEN u.rtt_ms_n_by_size END, NULL
    FROM units u JOIN unit n USING (unit, phase)
    ON CONFLICT (source, unit, phase) DO UPDATE SET
        day = greatest(t.day, excluded.day), client_key = excluded.client_key,
        counted_at = excluded.counted_at,
        {", ".join(f"{c} = excluded.{c}" for c in (*COUNTED_HERE, "rtt_ms_sum", "rtt_ms_n"))},
        ip_lens = excluded.ip_lens,
        {", ".join(f"{c}_by_size = excluded.{c}_by_size" for c in SUMMED)}
), hist AS (
    -- The RTT histogram of the whole phase's new acked replies (0020's bins).
    SELECT h.unit, h.phase, array_agg(h.ip_len ORDER BY h.ip_len, h.bin) AS ip_lens,
           array_agg(h.bin ORDER BY h.ip_len, h.bin) AS bins,
           array_agg(h.n ORDER BY h.ip_len, h.bin) AS counts
    FROM (
        SELECT o.unit, o.phase, o.ip_len, rtt_bin(o.rtt_ms) AS bin, count(*)::integer AS n
        FROM o WHERE o.phase = 'whole' AND o.outcome = 'acked' AND o.rtt_ms IS NOT NULL
        GROUP BY 1, 2, 3, 4
    ) h
    GROUP BY h.unit, h.phase
), changed AS (
    SELECT m.unit, m.phase, array_agg(m.ip_len ORDER BY m.ip_len) AS ip_lens,
           array_agg(m.new_size::integer::smallint ORDER BY m.ip_len) AS units_by_size,
           {_ADDED_ARRAYS}
    FROM merged m JOIN added a USING (unit, phase, ip_len)
    GROUP BY m.unit, m.phase
), queued AS (
    INSERT INTO unit_count_changes (source, unit, phase, day, client_key, ip_lens,
                                    units_by_size, {_ARRAY_COLS}, rtt_ms_sum_by_size,
                                    rtt_ms_n_by_size, hist_ip_lens, hist_bins, hist_counts)
    SELECT 'atlas', c.unit, c.phase, n.day, n.client_key, c.ip_lens, c.units_by_size,
           c.sent_by_size, c.acked_by_size, c.late_by_size, {_ZERO_ARRAYS},
           c.rtt_ms_sum_by_size, c.rtt_ms_n_by_size, h.ip_lens, h.bins, h.counts
    FROM changed c JOIN unit n USING (unit, phase)
    LEFT JOIN hist h USING (unit, phase)
    RETURNING 1
)
SELECT count(*) INTO written FROM queued;
RETURN written;
END
$$;
COMMENT ON FUNCTION write_atlas_unit_counts(bigint[], integer[], timestamptz[]) IS
'Adds these Atlas results'' counts (each result once: the caller passes the results just '
'stored with their outcomes) to their probe''s unit in unit_counts, and queues the change in '
'unit_count_changes; returns how many changes it queued.';
"""

# -- the by-source views --------------------------------------------------------------------


def _migration(prefix: str) -> ModuleType:
    """An earlier migration module, for its view definitions."""
    (path,) = Path(__file__).parent.glob(f"{prefix}_*.py")
    spec = importlib.util.spec_from_file_location(f"_kickass_migration_{prefix}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_0020 = _migration("0020")
# Atlas cannot see how a reply arrived (fragmented, its fragments' sizes) nor
# the client's reassembly: those columns stay NULL for it, as before.
_OBSERVED = "CASE WHEN t.source <> 'atlas' THEN t.{c} END"


def by_source(phase: str) -> str:
    """Every source of the durable counts per source and IP length: the total
    rollup plus the changes not yet folded into it (0020's pooled views, per
    source); the whole phase's median from the pooled RTT histogram."""
    sums = ", ".join(f"sum({c})::bigint AS {c}" for c in ("units", *COUNTERS))
    cols = ", ".join(("units", *COUNTERS))
    if phase == "whole":
        size = "ip_len"
        extra = f"m.rtt_ms_median, {_OBSERVED.format(c='frag_observed')} AS fragmented_on_arrival"
        medians = """
LEFT JOIN (
    SELECT h.source, h.ip_len, rtt_hist_median(array_agg(h.bin), array_agg(h.n)) AS rtt_ms_median
    FROM (
        SELECT t.source, t.ip_len, b.bin, b.n
        FROM unit_counts_total t
        CROSS JOIN LATERAL unnest(t.rtt_bins, t.rtt_bin_counts) AS b(bin, n)
        WHERE t.phase = 'whole'
        UNION ALL
        SELECT c.source, b.ip_len, b.bin, b.n::bigint
        FROM unit_count_changes c
        CROSS JOIN LATERAL unnest(c.hist_ip_lens, c.hist_bins, c.hist_counts) AS b(ip_len, bin, n)
        WHERE c.phase = 'whole'
    ) h
    GROUP BY h.source, h.ip_len
) m ON m.source = t.source AND m.ip_len = t.ip_len"""
    else:
        size = "leading_ip_len"
        extra = ", ".join(
            f"{_OBSERVED.format(c=c)} AS {name}"
            for c, name in (
                ("frag_observed", "frag_observed"),
                ("largest_fragment_as_sent", "arrived_as_sent"),
                ("largest_fragment_as_sent", "largest_fragment_as_sent"),
                ("reassembly_invalid", "reassembly_invalid"),
            )
        )
        medians = ""
    return f"""
SELECT t.source, t.ip_len::integer AS {size}, t.units AS sessions, t.sent, t.acked, t.late,
       (t.sent - t.acked)::double precision / nullif(t.sent, 0) AS drop_rate,
       {extra}
FROM (
    SELECT source, ip_len, {sums}
    FROM (
        SELECT source, ip_len, {cols} FROM unit_counts_total WHERE phase = '{phase}'
        UNION ALL
        SELECT source, ip_len, {cols} FROM unit_counts_pending WHERE phase = '{phase}'
    ) a
    GROUP BY source, ip_len
    HAVING sum(units) > 0
) t{medians}
"""


COMMENTS = {
    "v_size_drop_by_source": (
        "v_size_drop_all for every study source: per source and whole-packet IP length, pooled "
        "over the units of the durable counts (finished volunteer sessions; Atlas probes of a "
        "campaign; a source registered in kickass.sources that writes unit_counts) from their "
        "total rollup plus the changes not yet folded into it (migrations 0020, 0028). "
        + _0020.MEDIAN_NOTE
        + " Atlas cannot observe fragmentation on arrival (NULL)."
    ),
    "v_split_drop_by_source": (
        "v_split_drop_all for every study source of the durable counts: per source and "
        "leading-fragment IP length (migrations 0020, 0028). Atlas probes report no fragment "
        "sizes (frag_observed, arrived_as_sent, largest_fragment_as_sent NULL) and no "
        "reassembly state (reassembly_invalid NULL). arrived_as_sent is the largest fragment "
        "as sent, under its old name."
    ),
}
VIEWS = {"v_size_drop_by_source": by_source("whole"), "v_split_drop_by_source": by_source("split")}


def _comment(name: str, comment: str) -> None:
    op.execute(f"COMMENT ON VIEW {name} IS '{comment.replace(chr(39), chr(39) * 2)}'")


BACKFILL_BATCH = 5000  # results per statement: memory bounded at any size


def backfill() -> int:
    """Every stored result's counts, folded into the rollups."""
    every = "FROM atlas_results WHERE join_status <> 'invalid'"
    if context.is_offline_mode():
        op.execute(
            f"SELECT write_atlas_unit_counts(ARRAY(SELECT msm_id {every}), "
            f"ARRAY(SELECT prb_id {every}), ARRAY(SELECT result_at {every}))"
        )
        op.execute("SELECT fold_unit_count_changes()")
        return 0
    conn = op.get_bind()
    keys = conn.execute(text(f"SELECT {KEY} {every} ORDER BY {KEY}")).all()
    for start in range(0, len(keys), BACKFILL_BATCH):
        batch = keys[start : start + BACKFILL_BATCH]
        conn.execute(
            text("SELECT write_atlas_unit_counts(:m, :p, :t)"),
            {
                "m": [k.msm_id for k in batch],
                "p": [k.prb_id for k in batch],
                "t": [k.result_at for k in batch],
            },
        )
        conn.execute(text("SELECT fold_unit_count_changes()"))
    return len(keys)


def upgrade() -> None:
    op.execute(WRITE)
    backfill()
    for name, query in VIEWS.items():
        op.execute(f"CREATE OR REPLACE VIEW {name} AS {query}")
        _comment(name, COMMENTS[name])


def downgrade() -> None:
    for name in VIEWS:
        create, comment = _0020.KEPT[name]
        op.execute(create.replace("CREATE VIEW", "CREATE OR REPLACE VIEW", 1))
        _comment(name, comment or "")
    # 0020's comment of v_size_drop_by_source (replace_study_views).
    _comment(
        "v_size_drop_by_source",
        "v_size_drop_all for both sources: per source and IP length. Volunteers' "
        + _0020.MEDIAN_NOTE
        + " Atlas: exact, from atlas_outcomes.",
    )
    for table in ("unit_counts", "unit_count_changes", "unit_counts_daily",
                  "unit_counts_total", "client_sizes"):  # fmt: skip
        op.execute(f"DELETE FROM {table} WHERE source = 'atlas'")
    op.execute("DROP FUNCTION write_atlas_unit_counts(bigint[], integer[], timestamptz[])")
