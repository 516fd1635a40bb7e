"""Durable per-session counts: what a researcher sees no longer depends on raw rows.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-01

Every study view and rollup aggregated ``probe_outcomes`` on every read, and
the rollups of 0012/0014 were materialised views that each refresh
recomputed in full from them: a refresh after deleting raw rows forgot those
sessions (issue 28). From here on a session's counts are stored when it
reaches a final state, in the same transaction, and every reader of a final
session reads them; raw rows are read only for sessions still live.

Tables (source-neutral: ``source`` is 'volunteer' or 'atlas', a ``unit`` is
one volunteer session (its ``session_id``) or one Atlas probe result; only
the volunteers' source writes here so far):

- ``unit_counts``: per unit and phase, every counter of the study views under
  0007's rules (sent = valid probes, acked, late, reassembly_invalid,
  frag_observed, largest_fragment_as_sent, fragments_observed,
  fragmented_observed, leading_as_sent, leading_swapped, the RTT sum and
  count of acked probes) for the phase and per IP length (parallel arrays
  ordered by ``ip_lens``; an array that would hold only zeros is NULL), and
  the exact median RTT per size of the whole phase (``v_whole_drop``). The
  UTC day of the unit's start and its ``client_key`` (0016) are kept with it.
  Written by ``write_unit_counts(session pks)``: from
  ``StudyStore.finish_session``, ``mark_orphans_incomplete`` and
  ``record_client_report`` (which marks probes invalid and adds
  observations after the finish), each in the transaction that sets the
  state or changes the rows.
- ``unit_count_changes``: what each write changed, per size (new minus old),
  not yet in the rollups below; a unit's first write also carries its RTT
  histogram (a later write changes no RTT: a report marks lost probes and
  adds observations, a re-sent batch is the same batch).
- ``unit_counts_daily`` (per source, UTC day, phase and IP length) and
  ``unit_counts_total`` (per source, phase and IP length, all time): sums of
  the changes folded in, a mergeable RTT histogram, and in the total the
  distinct clients. ``fold_unit_count_changes()`` (the scheduled refresh)
  moves the changes in, incrementally: its time grows with what changed.
- ``client_sizes``: per source, client (``client_key``) and phase, the IP
  lengths it measured; what makes the distinct-client count add up.

The RTT histogram has fixed log-spaced bins 1% wide (bin i holds
1.01^i <= rtt_ms < 1.01^(i+1)); a bin stands for 2 * 1.01^(i+1) / 2.01, so
any RTT it holds is within (1.01 - 1) / (1.01 + 1) = 0.4975% of it, and so
is a median taken from the bins (an RTT under 1 microsecond counts as 0).
It is kept for the whole phase, the one whose pooled median a view shows;
the split phase's rows hold none (its counting would cost every finish
another 20 ms or so, for no reader). Functions: ``rtt_bin``,
``rtt_bin_value``, ``rtt_hist_add``, ``rtt_hist_median``.

Views, same columns: the study views read ``unit_counts`` for final sessions
and ``probe_outcomes`` for live ones (``v_whole_drop``, ``v_split_drop``,
``v_session_summary``); the pooled views and the day rollup read the rollups
plus the changes not yet folded (``v_size_drop_all``, ``v_split_drop_all``,
``v_drop_rollup``): every final session is in them at once, none is read
from raw rows. ``v_size_drop_all.rtt_ms_median`` (and the volunteers' half
of ``v_size_drop_by_source``) is the histogram's median, within 0.4975% of
the exact one. ``v_session_rollup`` is ``v_session_summary`` (which no
longer needs a materialised copy). ``mv_session_summary``, ``mv_probe_daily``
and ``mv_size_clients`` are gone: the tables above replace them.

The upgrade backfills every final session from its raw rows. Downgrading
puts 0012's and 0016's materialised views and 0007's views back (computed
from the raw rows) and drops the tables.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy import text
from sqlalchemy.dialects import postgresql

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FINAL = "('complete', 'ended', 'expired', 'incomplete')"
LIVE = "('created', 'probing')"
PHASES = "('whole', 'split')"

# The study views' counters (0007's rules), per probe row ``o``: name -> condition.
COUNTERS: dict[str, str] = {
    "sent": "NOT (o.reassembly_invalid AND o.outcome = 'lost')",
    "acked": "o.outcome = 'acked'",
    "late": "o.outcome = 'late'",
    "reassembly_invalid": "o.reassembly_invalid AND o.outcome = 'lost'",
    "frag_observed": "o.outcome = 'acked' AND o.observed_frag_size > 0",
    "largest_fragment_as_sent": (
        "o.phase = 'split' AND o.outcome = 'acked' "
        "AND o.observed_frag_size = greatest(o.ip_len::integer, 1520 - o.ip_len)"
    ),
    "fragments_observed": "o.outcome = 'acked' AND o.observed_fragments IS NOT NULL",
    "fragmented_observed": "o.outcome = 'acked' AND o.observed_fragments > 1",
    "leading_as_sent": (
        "o.phase = 'split' AND o.outcome = 'acked' AND o.observed_fragments = 2 "
        "AND o.observed_leading_len = o.ip_len"
    ),
    "leading_swapped": (
        "o.phase = 'split' AND o.outcome = 'acked' AND o.observed_fragments = 2 "
        "AND o.observed_leading_len = 1520 - o.ip_len AND o.ip_len <> 760"
    ),
}
# Per size also the RTT sum and count of acked probes.
SIZED = (*COUNTERS, "rtt_ms_sum", "rtt_ms_n")
# 1% bins: a median from them is within GAMMA_ERROR of the exact one.
GAMMA = "1.01"
ZERO_BIN = -32768  # an RTT under 1 microsecond


def _cols(prefix: str = "", suffix: str = "", names: Sequence[str] = SIZED) -> str:
    return ", ".join(f"{prefix}{n}{suffix}" for n in names)


FUNCTIONS = f"""
CREATE FUNCTION rtt_bin(rtt_ms double precision) RETURNS smallint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT CASE WHEN rtt_ms < 0.001 THEN {ZERO_BIN}
            ELSE floor(ln(rtt_ms) / ln({GAMMA}::double precision))::smallint END
$$;
COMMENT ON FUNCTION rtt_bin(double precision) IS
'The RTT histogram''s bin of rtt_ms: i with 1.01^i <= rtt_ms < 1.01^(i+1); {ZERO_BIN} under 1 us.';

CREATE FUNCTION rtt_bin_value(bin smallint) RETURNS double precision
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT CASE WHEN bin = {ZERO_BIN} THEN 0::double precision
            ELSE 2 * power({GAMMA}::double precision, bin + 1) / (1 + {GAMMA}::double precision) END
$$;
COMMENT ON FUNCTION rtt_bin_value(smallint) IS
'What a bin stands for: within 0.4975% of every RTT it holds.';

CREATE FUNCTION rtt_hist_add(bins1 smallint[], counts1 bigint[], bins2 smallint[],
                             counts2 bigint[], OUT bins smallint[], OUT counts bigint[])
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT coalesce(array_agg(b ORDER BY b), '{{}}'), coalesce(array_agg(n ORDER BY b), '{{}}')
FROM (
    SELECT b, sum(n)::bigint AS n
    FROM (SELECT * FROM unnest(bins1, counts1)
          UNION ALL SELECT * FROM unnest(bins2, counts2)) u(b, n)
    GROUP BY b
) m
WHERE n <> 0
$$;

CREATE FUNCTION rtt_hist_median(bins smallint[], counts bigint[]) RETURNS double precision
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
WITH h AS (
    SELECT b, sum(n) AS n FROM unnest(bins, counts) u(b, n) GROUP BY b HAVING sum(n) > 0
), r AS (
    SELECT b, sum(n) OVER (ORDER BY b) AS upto, sum(n) OVER () AS total FROM h
)
-- percentile_cont(0.5)'s ranks (0-based): floor and ceil of (n - 1) / 2.
SELECT ((SELECT rtt_bin_value(b) FROM r WHERE upto > floor((total - 1) / 2) ORDER BY b LIMIT 1)
      + (SELECT rtt_bin_value(b) FROM r WHERE upto > ceil((total - 1) / 2) ORDER BY b LIMIT 1)) / 2
$$;
COMMENT ON FUNCTION rtt_hist_median(smallint[], bigint[]) IS
'The median of a histogram of RTTs (bins in any order, repeated bins added): within 0.4975% '
'of the exact median of the RTTs counted.';
"""

# -- the writer -----------------------------------------------------------------------------

_PER_SIZE_COUNTS = ",\n        ".join(
    f"count(*) FILTER (WHERE {cond}) AS {name}" for name, cond in COUNTERS.items()
)
# A session's rows; 0022 adds its partition to the condition.
_SESSION_ROWS = "o.session_pk = s.id"


def write_unit_counts(session_rows: str = _SESSION_ROWS) -> str:
    """``write_unit_counts(pks)``: the counts of these sessions from their raw
    rows into ``unit_counts``, what changed into ``unit_count_changes``; per
    session and phase (sent, delivered = acked or late, reassembly_invalid,
    late), what the verdict is decided from."""
    arrays = ",\n        ".join(
        f"CASE WHEN bool_or(p.{n} <> 0) THEN array_agg(p.{n}::smallint ORDER BY p.ip_len) END "
        f"AS {n}_by_size"
        for n in (*COUNTERS, "rtt_ms_n")
    )
    totals = ",\n        ".join(
        f"coalesce(sum(p.{n}), 0)::integer AS {n}" for n in (*COUNTERS, "rtt_ms_n")
    )
    new_vs_old = ",\n        ".join(
        f"coalesce(n.{c}, 0) - coalesce(o.{c}, 0) AS {c}" for c in SIZED
    )
    changed = " OR ".join(f"d.{c} <> 0" for c in ("units", *SIZED))
    delta_arrays = ",\n        ".join(
        f"array_agg(d.{c}{'' if c == 'rtt_ms_sum' else '::smallint'} ORDER BY d.ip_len) "
        f"AS {c}_by_size"
        for c in ("units", *SIZED)
    )
    queued_cols = _cols(suffix="_by_size", names=("units", *SIZED))
    return f"""
CREATE FUNCTION write_unit_counts(pks bigint[])
RETURNS TABLE (session_pk bigint, phase text, sent integer, delivered integer,
               reassembly_invalid integer, late integer)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
-- PL/pgSQL, not SQL: its plan is kept between calls (planning a statement
-- this size costs about as much as a tenth of executing it).
RETURN QUERY
WITH s AS (
    SELECT s.id, s.session_id, s.created_at, (s.created_at AT TIME ZONE 'UTC')::date AS day,
           client_key(s.source_address) AS client_key
    FROM sessions s WHERE s.id = ANY(pks)
), counted AS (
    -- Per session, grouped inside its own rows (hashed: no sort of them).
    SELECT s.id AS pk, c.*
    FROM s CROSS JOIN LATERAL (
        SELECT o.phase, o.ip_len,
            {_PER_SIZE_COUNTS},
            sum(o.rtt_ms::double precision) FILTER (WHERE o.outcome = 'acked') AS rtt_ms_sum,
            count(o.rtt_ms) FILTER (WHERE o.outcome = 'acked') AS rtt_ms_n,
            array_agg(o.rtt_ms) FILTER (
                WHERE o.phase = 'whole' AND o.outcome = 'acked' AND o.rtt_ms IS NOT NULL) AS rtts
        FROM probe_outcomes o WHERE {session_rows}
        GROUP BY o.phase, o.ip_len
    ) c
), sized AS MATERIALIZED (
    -- The whole phase's RTTs sorted, each size on its own (a hundred, say),
    -- and their histogram (rtt_bin: how many acked probes per bin).
    SELECT c.pk, c.phase, c.ip_len, {_cols("c.", names=(*COUNTERS, "rtt_ms_sum", "rtt_ms_n"))},
           r.rtts, h.bins, h.counts
    FROM counted c
    CROSS JOIN LATERAL (SELECT array_agg(v ORDER BY v) AS rtts FROM unnest(c.rtts) v) r
    CROSS JOIN LATERAL (
        SELECT array_agg(bin ORDER BY bin) AS bins, array_agg(n ORDER BY bin) AS counts
        FROM (SELECT rtt_bin(v) AS bin, count(*)::integer AS n FROM unnest(r.rtts) v
              GROUP BY 1) b
    ) h
), per_size AS (
    -- The exact median of the whole phase's sizes, as percentile_cont(0.5)
    -- computes it: the two middle values, interpolated (first + (second -
    -- first) * fraction) in double precision.
    SELECT c.pk, c.phase, c.ip_len, {_cols("c.", names=(*COUNTERS, "rtt_ms_sum", "rtt_ms_n"))},
        c.rtts[m.lo]::double precision
            + (c.rtts[m.hi]::double precision - c.rtts[m.lo]::double precision) * m.fraction
            AS rtt_ms_median
    FROM sized c
    CROSS JOIN LATERAL (
        SELECT floor(q)::integer + 1 AS lo, ceil(q)::integer + 1 AS hi, q - floor(q) AS fraction
        FROM (SELECT 0.5::double precision * (cardinality(c.rtts) - 1) AS q) x
    ) m
), hist_phase AS (
    -- The histogram per phase, flat: (IP length, bin, count) in parallel arrays.
    SELECT c.pk, c.phase, array_agg(c.ip_len ORDER BY c.ip_len, x.bin) AS ip_lens,
           array_agg(x.bin ORDER BY c.ip_len, x.bin) AS bins,
           array_agg(x.n ORDER BY c.ip_len, x.bin) AS counts
    FROM sized c CROSS JOIN LATERAL unnest(c.bins, c.counts) x(bin, n)
    GROUP BY c.pk, c.phase
), new AS (
    SELECT s.id AS pk, s.session_id AS unit, ph.phase, s.day, s.client_key,
        coalesce(array_agg(p.ip_len ORDER BY p.ip_len) FILTER (WHERE p.ip_len IS NOT NULL),
                 '{{}}') AS ip_lens,
        {arrays},
        CASE WHEN bool_or(p.rtt_ms_n <> 0)
             THEN array_agg(p.rtt_ms_sum ORDER BY p.ip_len) END AS rtt_ms_sum_by_size,
        CASE WHEN bool_or(p.rtt_ms_median IS NOT NULL)
             THEN array_agg(p.rtt_ms_median ORDER BY p.ip_len) END AS rtt_ms_median_by_size,
        {totals},
        sum(p.rtt_ms_sum) AS rtt_ms_sum
    FROM s CROSS JOIN (VALUES ('whole'), ('split')) ph(phase)
    LEFT JOIN per_size p ON p.pk = s.id AND p.phase = ph.phase
    GROUP BY s.id, s.session_id, ph.phase, s.day, s.client_key
), old AS (
    SELECT u.* FROM unit_counts u JOIN s ON u.source = 'volunteer' AND u.unit = s.session_id
), stored AS (
    INSERT INTO unit_counts (source, unit, phase, day, client_key, counted_at,
                             {_cols(names=(*COUNTERS, "rtt_ms_sum", "rtt_ms_n"))}, ip_lens,
                             {_cols(suffix="_by_size")}, rtt_ms_median_by_size)
    SELECT 'volunteer', unit, phase, day, client_key, now(),
           {_cols(names=(*COUNTERS, "rtt_ms_sum", "rtt_ms_n"))}, ip_lens,
           {_cols(suffix="_by_size")}, rtt_ms_median_by_size
    FROM new
    ON CONFLICT (source, unit, phase) DO UPDATE SET
        day = excluded.day, client_key = excluded.client_key, counted_at = excluded.counted_at,
        {", ".join(f"{c} = excluded.{c}" for c in (*COUNTERS, "rtt_ms_sum", "rtt_ms_n"))},
        ip_lens = excluded.ip_lens,
        {", ".join(f"{c}_by_size = excluded.{c}_by_size" for c in SIZED)},
        rtt_ms_median_by_size = excluded.rtt_ms_median_by_size
), old_sizes AS (
    SELECT u.unit, u.phase, x.*
    FROM old u CROSS JOIN LATERAL unnest(u.ip_lens, {_cols("u.", "_by_size")})
        AS x(ip_len, {_cols()})
), new_sizes AS (
    SELECT s.session_id AS unit, p.phase, p.ip_len, {_cols("p.")}
    FROM per_size p JOIN s ON s.id = p.pk
), delta AS (
    SELECT coalesce(n.unit, o.unit) AS unit, coalesce(n.phase, o.phase) AS phase,
        coalesce(n.ip_len, o.ip_len) AS ip_len,
        (n.ip_len IS NOT NULL)::integer - (o.ip_len IS NOT NULL)::integer AS units,
        {new_vs_old}
    FROM new_sizes n
    FULL JOIN old_sizes o ON o.unit = n.unit AND o.phase = n.phase AND o.ip_len = n.ip_len
), changed AS (
    SELECT d.unit, d.phase, array_agg(d.ip_len ORDER BY d.ip_len) AS ip_lens,
        {delta_arrays}
    FROM delta d WHERE {changed}
    GROUP BY d.unit, d.phase
), queued AS (
    INSERT INTO unit_count_changes (source, unit, phase, day, client_key, ip_lens, {queued_cols},
                                    hist_ip_lens, hist_bins, hist_counts)
    SELECT 'volunteer', c.unit, c.phase, s.day, s.client_key, c.ip_lens,
           {_cols("c.", "_by_size", ("units", *SIZED))},
           h.ip_lens, h.bins, h.counts
    FROM changed c JOIN s ON s.session_id = c.unit
    LEFT JOIN hist_phase h
        ON h.pk = s.id AND h.phase = c.phase
       AND NOT EXISTS (SELECT 1 FROM old WHERE old.unit = c.unit)
)
SELECT n.pk, n.phase, n.sent, n.acked + n.late, n.reassembly_invalid, n.late FROM new n;
END
$$
"""


# -- the rollups ----------------------------------------------------------------------------

_SUMS = ", ".join(f"sum({c}) AS {c}" for c in SIZED)
_ADD = ",\n        ".join(f"{c} = r.{c} + excluded.{c}" for c in ("units", *SIZED))

FOLD = f"""
CREATE FUNCTION fold_unit_count_changes() RETURNS bigint
LANGUAGE sql VOLATILE AS $$
SELECT pg_advisory_xact_lock(hashtext('kickass: fold_unit_count_changes'));
WITH taken AS (
    DELETE FROM unit_count_changes RETURNING *
), sizes AS (
    SELECT t.source, t.day, t.phase, t.client_key, x.*
    FROM taken t CROSS JOIN LATERAL unnest(
        t.ip_lens, {_cols("t.", "_by_size", ("units", *SIZED))}) AS x(ip_len, units, {_cols()})
), hist AS (
    SELECT t.source, t.day, t.phase, h.ip_len, h.bin, sum(h.n)::bigint AS n
    FROM taken t CROSS JOIN LATERAL unnest(t.hist_ip_lens, t.hist_bins, t.hist_counts)
        AS h(ip_len, bin, n)
    GROUP BY 1, 2, 3, 4, 5
), hist_day AS (
    SELECT source, day, phase, ip_len, array_agg(bin ORDER BY bin) AS bins,
           array_agg(n ORDER BY bin) AS counts
    FROM hist GROUP BY 1, 2, 3, 4
), hist_all AS (
    SELECT source, phase, ip_len, array_agg(bin ORDER BY bin) AS bins,
           array_agg(n ORDER BY bin) AS counts
    FROM (SELECT source, phase, ip_len, bin, sum(n)::bigint AS n FROM hist GROUP BY 1, 2, 3, 4) a
    GROUP BY 1, 2, 3
), pairs AS (
    SELECT DISTINCT source, client_key, phase, ip_len FROM sizes
    WHERE units > 0 AND client_key IS NOT NULL
), new_pairs AS (
    SELECT p.* FROM pairs p
    WHERE NOT EXISTS (
        SELECT 1 FROM client_sizes k
        WHERE k.source = p.source AND k.client_key = p.client_key AND k.phase = p.phase
          AND p.ip_len = ANY (k.ip_lens))
), clients AS (
    INSERT INTO client_sizes AS k (source, client_key, phase, ip_lens)
    SELECT source, client_key, phase, array_agg(ip_len ORDER BY ip_len)
    FROM new_pairs GROUP BY 1, 2, 3
    ON CONFLICT (source, client_key, phase) DO UPDATE
    SET ip_lens = (SELECT array_agg(v ORDER BY v) FROM unnest(k.ip_lens || excluded.ip_lens) v)
), daily AS (
    INSERT INTO unit_counts_daily AS r (source, day, phase, ip_len, units, {_cols()},
                                        rtt_bins, rtt_bin_counts)
    SELECT x.*, coalesce(h.bins, '{{}}'), coalesce(h.counts, '{{}}')
    FROM (SELECT source, day, phase, ip_len, sum(units) AS units, {_SUMS}
          FROM sizes GROUP BY 1, 2, 3, 4) x
    LEFT JOIN hist_day h USING (source, day, phase, ip_len)
    ON CONFLICT (source, day, phase, ip_len) DO UPDATE SET
        {_ADD},
        (rtt_bins, rtt_bin_counts) = (SELECT * FROM rtt_hist_add(
            r.rtt_bins, r.rtt_bin_counts, excluded.rtt_bins, excluded.rtt_bin_counts))
), total AS (
    INSERT INTO unit_counts_total AS r (source, phase, ip_len, units, {_cols()}, clients,
                                        rtt_bins, rtt_bin_counts)
    SELECT x.*, coalesce(c.n, 0), coalesce(h.bins, '{{}}'), coalesce(h.counts, '{{}}')
    FROM (SELECT source, phase, ip_len, sum(units) AS units, {_SUMS}
          FROM sizes GROUP BY 1, 2, 3) x
    LEFT JOIN (SELECT source, phase, ip_len, count(*) AS n FROM new_pairs GROUP BY 1, 2, 3) c
        USING (source, phase, ip_len)
    LEFT JOIN hist_all h USING (source, phase, ip_len)
    ON CONFLICT (source, phase, ip_len) DO UPDATE SET
        {_ADD},
        clients = r.clients + excluded.clients,
        (rtt_bins, rtt_bin_counts) = (SELECT * FROM rtt_hist_add(
            r.rtt_bins, r.rtt_bin_counts, excluded.rtt_bins, excluded.rtt_bin_counts))
)
SELECT count(*) FROM taken
$$;
COMMENT ON FUNCTION fold_unit_count_changes() IS
'Moves unit_count_changes into unit_counts_daily, unit_counts_total and client_sizes '
'(the scheduled refresh); returns how many changes it folded.';
"""

# Per source, day, phase and size: the changes not yet folded.
PENDING = f"""
CREATE VIEW unit_counts_pending AS
SELECT c.source, c.day, c.phase, x.ip_len, sum(x.units)::bigint AS units,
       {", ".join(f"sum(x.{c})::bigint AS {c}" for c in SIZED if c != "rtt_ms_sum")},
       sum(x.rtt_ms_sum) AS rtt_ms_sum
FROM unit_count_changes c
CROSS JOIN LATERAL unnest(c.ip_lens, {_cols("c.", "_by_size", ("units", *SIZED))})
    AS x(ip_len, units, {_cols()})
GROUP BY c.source, c.day, c.phase, x.ip_len
"""


# -- the views ------------------------------------------------------------------------------


def _migration(prefix: str) -> ModuleType:
    """An earlier migration module, for its view definitions."""
    (path,) = Path(__file__).parent.glob(f"{prefix}_*.py")
    spec = importlib.util.spec_from_file_location(f"_kickass_migration_{prefix}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_0007 = _migration("0007")
_0012 = _migration("0012")
_0016 = _migration("0016")

# A final session's sizes of one phase from its durable counts (``u``), zeros filled in.
_UNIT_SIZES = f"""(
    SELECT x.ip_len::integer AS ip_len,
           {", ".join(f"coalesce(x.{c}, 0)::bigint AS {c}" for c in COUNTERS)},
           x.rtt_ms_median
    FROM unnest(u.ip_lens, {_cols("u.", "_by_size", tuple(COUNTERS))}, u.rtt_ms_median_by_size)
        AS x(ip_len, {_cols(names=tuple(COUNTERS))}, rtt_ms_median)
) x"""
_DROP_RATE = "(x.sent - x.acked)::double precision / nullif(x.sent, 0) AS drop_rate"


def per_session(phase: str, session_rows: str = _SESSION_ROWS) -> str:
    """``v_whole_drop`` / ``v_split_drop``: final sessions from ``unit_counts``,
    live ones from their raw rows (0007's SQL)."""
    if phase == "whole":
        size = "ip_len"
        durable = """x.rtt_ms_median, x.frag_observed AS fragmented_on_arrival,
       x.reassembly_invalid, x.fragments_observed, x.fragmented_observed"""
        raw = f"{_0007.PER_SIZE},{_0007.WHOLE_EXTRA}{_0007.WHOLE_NEW}"
    else:
        size = "leading_ip_len"
        durable = """x.frag_observed, x.largest_fragment_as_sent AS arrived_as_sent,
       x.reassembly_invalid, x.largest_fragment_as_sent, x.fragments_observed,
       x.leading_as_sent, x.leading_swapped"""
        raw = f"{_0007.PER_SIZE},{_0007.SPLIT_EXTRA}{_0007.SPLIT_NEW}"
    return f"""
SELECT s.session_id, x.ip_len AS {size}, x.sent, x.acked, x.late, {_DROP_RATE},
       {durable}
FROM sessions s
JOIN unit_counts u ON u.source = 'volunteer' AND u.unit = s.session_id AND u.phase = '{phase}'
CROSS JOIN LATERAL {_UNIT_SIZES}
WHERE s.state IN {FINAL}
UNION ALL
SELECT s.session_id, r.*
FROM sessions s
CROSS JOIN LATERAL (
    SELECT o.ip_len::integer AS {size},{raw}
    FROM probe_outcomes o
    WHERE {session_rows} AND o.phase = '{phase}'
    GROUP BY o.ip_len
) r
WHERE s.state IN {LIVE}
"""


# v_session_summary's per-session counts: (name, unit_counts column, phase).
_SUMMARY_COUNTS = (
    ("whole_sent", "sent", "whole"),
    ("whole_acked", "acked", "whole"),
    ("split_sent", "sent", "split"),
    ("split_acked", "acked", "split"),
    ("whole_invalid", "reassembly_invalid", "whole"),
    ("split_invalid", "reassembly_invalid", "split"),
    ("whole_fragmented", "frag_observed", "whole"),
    ("split_largest_as_sent", "largest_fragment_as_sent", "split"),
    ("split_observed", "fragments_observed", "split"),
    ("split_leading_as_sent", "leading_as_sent", "split"),
    ("split_leading_swapped", "leading_swapped", "split"),
)
_0007_SUMMARY = _0007.VIEWS["v_session_summary"][0]
_0007_COUNTS_START = _0007_SUMMARY.index("CROSS JOIN LATERAL (\n    SELECT\n        count(*)")
_0007_COUNTS_END = _0007_SUMMARY.index(") c\n") + len(") c\n")
_0007_COUNTS = _0007_SUMMARY[_0007_COUNTS_START:_0007_COUNTS_END]


def session_summary(session_rows: str = _SESSION_ROWS) -> str:
    """0007's ``v_session_summary`` with its counts from ``unit_counts`` for a
    final session, from the raw rows for a live one."""
    raw = _0007_COUNTS.removeprefix("CROSS JOIN LATERAL (").removesuffix(") c\n")
    raw = raw.replace(
        "    WHERE o.session_pk = s.id\n", f"    WHERE {session_rows} AND s.state IN {LIVE}\n"
    )
    assert f"AND s.state IN {LIVE}" in raw, "0007's counts changed shape"
    durable = ",\n            ".join(
        f"sum(u.{col}) FILTER (WHERE u.phase = '{phase}') AS {name}"
        for name, col, phase in _SUMMARY_COUNTS
    )
    picked = ",\n        ".join(
        f"coalesce(d.{name}, r.{name}) AS {name}" for name, _, _ in _SUMMARY_COUNTS
    )
    counts = f"""CROSS JOIN LATERAL (
    SELECT
        {picked}
    FROM (
        SELECT
            {durable}
        FROM unit_counts u
        WHERE u.source = 'volunteer' AND u.unit = s.session_id AND s.state IN {FINAL}
    ) d, ({raw}) r
) c
"""
    return _0007_SUMMARY.replace(_0007_COUNTS, counts)


_POOLED_COLUMNS = {
    "whole": (
        "sessions, sent, acked, late, drop_rate, rtt_ms_median, fragmented_on_arrival, "
        "reassembly_invalid, fragments_observed, fragmented_observed"
    ),
    "split": (
        "sessions, sent, acked, late, drop_rate, frag_observed, arrived_as_sent, "
        "reassembly_invalid, largest_fragment_as_sent, fragments_observed, leading_as_sent, "
        "leading_swapped"
    ),
}
_POOLED_SUMS = ", ".join(f"sum({c})::bigint AS {c}" for c in ("units", *COUNTERS))


def pooled(phase: str) -> str:
    """``v_size_drop_all`` / ``v_split_drop_all``: every final session, from the
    total rollup plus the changes not yet folded into it."""
    size = "ip_len" if phase == "whole" else "leading_ip_len"
    if phase == "whole":
        extra = """m.rtt_ms_median, t.frag_observed AS fragmented_on_arrival,
       t.reassembly_invalid, t.fragments_observed, t.fragmented_observed"""
        medians = """
LEFT JOIN (
    SELECT h.ip_len, rtt_hist_median(array_agg(h.bin), array_agg(h.n)) AS rtt_ms_median
    FROM (
        SELECT t.ip_len, b.bin, b.n
        FROM unit_counts_total t
        CROSS JOIN LATERAL unnest(t.rtt_bins, t.rtt_bin_counts) AS b(bin, n)
        WHERE t.source = 'volunteer' AND t.phase = 'whole'
        UNION ALL
        SELECT b.ip_len, b.bin, b.n::bigint
        FROM unit_count_changes c
        CROSS JOIN LATERAL unnest(c.hist_ip_lens, c.hist_bins, c.hist_counts) AS b(ip_len, bin, n)
        WHERE c.source = 'volunteer' AND c.phase = 'whole'
    ) h
    GROUP BY h.ip_len
) m ON m.ip_len = t.ip_len"""
    else:
        extra = """t.frag_observed, t.largest_fragment_as_sent AS arrived_as_sent,
       t.reassembly_invalid, t.largest_fragment_as_sent, t.fragments_observed,
       t.leading_as_sent, t.leading_swapped"""
        medians = ""
    return f"""
SELECT t.ip_len::integer AS {size}, t.units AS sessions, t.sent, t.acked, t.late,
       (t.sent - t.acked)::double precision / nullif(t.sent, 0) AS drop_rate,
       {extra}
FROM (
    SELECT ip_len, {_POOLED_SUMS}
    FROM (
        SELECT ip_len, units, {_cols(names=tuple(COUNTERS))} FROM unit_counts_total
        WHERE source = 'volunteer' AND phase = '{phase}'
        UNION ALL
        SELECT ip_len, units, {_cols(names=tuple(COUNTERS))} FROM unit_counts_pending
        WHERE source = 'volunteer' AND phase = '{phase}'
    ) a
    GROUP BY ip_len
    HAVING sum(units) > 0
) t{medians}
"""


MEDIAN_NOTE = (
    "rtt_ms_median: the median of the acked probes' RTTs from a histogram of 1% log-spaced "
    "bins per day, phase and IP length, within 0.4975% of the exact median (an RTT under "
    "1 us counts as 0; the exact per-session medians are in v_whole_drop)."
)
DURABLE_NOTE = (
    " Final sessions are read from their durable counts (unit_counts, migration 0020), "
    "live ones from probe_outcomes."
)
POOLED_NOTE = (
    " Every final session, from the rollups of its durable counts (unit_counts_total) plus "
    "the changes not yet folded into them (migration 0020)."
)


def new_views(session_rows: str = _SESSION_ROWS) -> dict[str, tuple[str, str]]:
    """The study views this revision defines, with their comments."""
    v = _0007.VIEWS
    return {
        "v_whole_drop": (per_session("whole", session_rows), v["v_whole_drop"][1] + DURABLE_NOTE),
        "v_split_drop": (per_session("split", session_rows), v["v_split_drop"][1] + DURABLE_NOTE),
        "v_session_summary": (
            session_summary(session_rows),
            v["v_session_summary"][1] + DURABLE_NOTE,
        ),
        "v_size_drop_all": (
            pooled("whole"),
            v["v_size_drop_all"][1] + POOLED_NOTE + " " + MEDIAN_NOTE,
        ),
        "v_split_drop_all": (pooled("split"), v["v_split_drop_all"][1] + POOLED_NOTE),
    }


_VOLUNTEER_DROP = f"""SELECT 'volunteer'::text AS source,
           d.day::timestamp AT TIME ZONE 'UTC' AS day,
           NULL::text AS campaign, NULL::text AS country_code, NULL::bigint AS asn,
           d.phase, d.ip_len::integer AS ip_len, sum(d.units)::bigint AS sessions,
           {", ".join(f"sum(d.{c})::bigint AS {c}" for c in COUNTERS)},
           NULL::bigint AS unanswered,
           CASE WHEN sum(d.rtt_ms_n) > 0 THEN sum(d.rtt_ms_sum) END AS rtt_ms_sum,
           sum(d.rtt_ms_n)::bigint AS rtt_ms_n
    FROM (
        SELECT day, phase, ip_len, units, {_cols()} FROM unit_counts_daily
        WHERE source = 'volunteer'
        UNION ALL
        SELECT day, phase, ip_len, units, {_cols()} FROM unit_counts_pending
        WHERE source = 'volunteer'
    ) d
    GROUP BY d.day, d.phase, d.ip_len
    HAVING sum(d.units) > 0"""
_0012_VOLUNTEER = f"{_0012._VOLUNTEER_ROLLED}\n    UNION ALL\n    {_0012._VOLUNTEER_LIVE}"
assert _0012_VOLUNTEER in _0012.V_DROP_ROLLUP, "0012's v_drop_rollup changed shape"
V_DROP_ROLLUP = _0012.V_DROP_ROLLUP.replace(_0012_VOLUNTEER, _VOLUNTEER_DROP)
V_SESSION_ROLLUP = (
    f"CREATE VIEW v_session_rollup AS SELECT {_0012.SESSION_COLUMNS} FROM v_session_summary"
)
ROLLUP_COMMENTS = {
    "v_session_rollup": "v_session_summary (since 0020 every final session is read from its "
    "durable counts: no materialised copy is needed).",
    "v_drop_rollup": "Per day, phase and IP length: volunteers from the day rollup of their "
    "durable counts (unit_counts_daily) plus the changes not yet folded into it (migration "
    "0020), Atlas per campaign, probe country and ASN. Summed over days it equals "
    "v_size_drop_all / v_split_drop_all and the Atlas rows of the *_by_source views.",
}

# Views over the ones replaced, kept as they are: dropped and made again.
DEPENDANTS = ("v_size_drop_by_source", "v_split_drop_by_source", "v_verdicts_by_source")
# Dropped first (they stand on the others), made last.
ON_TOP = ("v_verdicts_rollup", "v_session_rollup", "v_drop_rollup")
MATVIEWS = ("mv_session_summary", "mv_probe_daily", "mv_size_clients")
REPLACED = ("v_whole_drop", "v_split_drop", "v_session_summary", "v_size_drop_all",
            "v_split_drop_all")  # fmt: skip


def _comment(name: str, comment: str | None) -> None:
    if comment:
        op.execute(f"COMMENT ON VIEW {name} IS '{comment.replace(chr(39), chr(39) * 2)}'")


_0006 = _migration("0006")
# The views that stand on the replaced ones, as their migrations made them.
KEPT: dict[str, tuple[str, str | None]] = {
    "v_size_drop_by_source": (
        f"CREATE VIEW v_size_drop_by_source AS {_0006.VIEWS['v_size_drop_by_source'][0]}",
        _0006.VIEWS["v_size_drop_by_source"][1],
    ),
    "v_split_drop_by_source": (
        f"CREATE VIEW v_split_drop_by_source AS {_0007.SPLIT_BY_SOURCE}",
        _0007.SPLIT_BY_SOURCE_COMMENT,
    ),
    "v_verdicts_by_source": (
        f"CREATE VIEW v_verdicts_by_source AS {_0006.VIEWS['v_verdicts_by_source'][0]}",
        _0006.VIEWS["v_verdicts_by_source"][1],
    ),
    "v_verdicts_rollup": (_0012.V_VERDICTS_ROLLUP, None),
}


def _recreate(names: Sequence[str]) -> None:
    for name in names:
        create, comment = KEPT[name]
        op.execute(create)
        _comment(name, comment)


def replace_study_views(
    views: dict[str, tuple[str, str]], rollup: Sequence[str], matviews: Sequence[str] = ()
) -> None:
    """Drop the study views and what stands on them (``matviews`` too), make
    ``views`` and the rollup views (``rollup``: their CREATE statements), and
    the dependants again as they were. Used by this revision's upgrade and by
    0022's."""
    for name in (*ON_TOP, *DEPENDANTS):
        op.execute(f"DROP VIEW {name}")
    for name in matviews:
        op.execute(f"DROP MATERIALIZED VIEW {name}")
    for name in REPLACED:
        op.execute(f"DROP VIEW {name}")
    for name, (query, comment) in views.items():
        op.execute(f"CREATE VIEW {name} AS {query}")
        _comment(name, comment)
    _recreate(DEPENDANTS)
    for sql in rollup:
        op.execute(sql)
    for name, comment in ROLLUP_COMMENTS.items():
        _comment(name, comment)
    _recreate(("v_verdicts_rollup",))
    _comment(
        "v_size_drop_by_source",
        "v_size_drop_all for both sources: per source and IP length. Volunteers' "
        + MEDIAN_NOTE
        + " Atlas: exact, from atlas_outcomes.",
    )


# -- tables ---------------------------------------------------------------------------------


def _source_phase(table: str) -> list[sa.CheckConstraint]:
    return [
        sa.CheckConstraint("source IN ('volunteer', 'atlas')", name=op.f(f"ck_{table}_source")),
        sa.CheckConstraint(f"phase IN {PHASES}", name=op.f(f"ck_{table}_phase")),
    ]


def _sums() -> list[sa.Column]:
    return [
        sa.Column("units", sa.BigInteger(), nullable=False),
        *(sa.Column(c, sa.BigInteger(), nullable=False) for c in COUNTERS),
        sa.Column("rtt_ms_sum", sa.Float(), nullable=False),
        sa.Column("rtt_ms_n", sa.BigInteger(), nullable=False),
        sa.Column("rtt_bins", postgresql.ARRAY(sa.SmallInteger()), nullable=False),
        sa.Column("rtt_bin_counts", postgresql.ARRAY(sa.BigInteger()), nullable=False),
    ]


def create_tables() -> None:
    small = postgresql.ARRAY(sa.SmallInteger())
    floats = postgresql.ARRAY(sa.Float())
    op.create_table(
        "unit_counts",
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("unit", sa.Text(), nullable=False),
        sa.Column("phase", sa.Text(), nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("client_key", sa.Text(), nullable=True),
        sa.Column("counted_at", sa.DateTime(timezone=True), nullable=False),
        *(sa.Column(c, sa.Integer(), nullable=False) for c in COUNTERS),
        sa.Column("rtt_ms_sum", sa.Float(), nullable=True),
        sa.Column("rtt_ms_n", sa.Integer(), nullable=False),
        sa.Column("ip_lens", small, nullable=False),
        *(sa.Column(f"{c}_by_size", small, nullable=True) for c in COUNTERS),
        sa.Column("rtt_ms_sum_by_size", floats, nullable=True),
        sa.Column("rtt_ms_n_by_size", small, nullable=True),
        sa.Column("rtt_ms_median_by_size", floats, nullable=True),
        *_source_phase("unit_counts"),
        sa.PrimaryKeyConstraint("source", "unit", "phase", name=op.f("pk_unit_counts")),
    )
    op.create_table(
        "unit_count_changes",
        sa.Column("id", sa.BigInteger(), sa.Identity(), nullable=False),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("unit", sa.Text(), nullable=False),
        sa.Column("phase", sa.Text(), nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("client_key", sa.Text(), nullable=True),
        sa.Column(
            "queued_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.Column("ip_lens", small, nullable=False),
        sa.Column("units_by_size", small, nullable=False),
        *(sa.Column(f"{c}_by_size", small, nullable=False) for c in COUNTERS),
        sa.Column("rtt_ms_sum_by_size", floats, nullable=False),
        sa.Column("rtt_ms_n_by_size", small, nullable=False),
        sa.Column("hist_ip_lens", small, nullable=True),
        sa.Column("hist_bins", small, nullable=True),
        sa.Column("hist_counts", postgresql.ARRAY(sa.Integer()), nullable=True),
        *_source_phase("unit_count_changes"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_unit_count_changes")),
    )
    op.create_table(
        "unit_counts_daily",
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("phase", sa.Text(), nullable=False),
        sa.Column("ip_len", sa.SmallInteger(), nullable=False),
        *_sums(),
        *_source_phase("unit_counts_daily"),
        sa.PrimaryKeyConstraint(
            "source", "day", "phase", "ip_len", name=op.f("pk_unit_counts_daily")
        ),
    )
    op.create_table(
        "unit_counts_total",
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("phase", sa.Text(), nullable=False),
        sa.Column("ip_len", sa.SmallInteger(), nullable=False),
        *_sums(),
        sa.Column("clients", sa.BigInteger(), nullable=False),
        *_source_phase("unit_counts_total"),
        sa.PrimaryKeyConstraint("source", "phase", "ip_len", name=op.f("pk_unit_counts_total")),
    )
    op.create_table(
        "client_sizes",
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("client_key", sa.Text(), nullable=False),
        sa.Column("phase", sa.Text(), nullable=False),
        sa.Column("ip_lens", small, nullable=False),
        *_source_phase("client_sizes"),
        sa.PrimaryKeyConstraint("source", "client_key", "phase", name=op.f("pk_client_sizes")),
    )
    # The live branch of every study view starts from these (few) sessions.
    op.create_index(
        "ix_sessions_live", "sessions", ["id"], postgresql_where=sa.text(f"state IN {LIVE}")
    )


TABLES = ("client_sizes", "unit_counts_total", "unit_counts_daily", "unit_count_changes",
          "unit_counts")  # fmt: skip
BACKFILL_BATCH = 1000  # sessions per statement: memory bounded at any size


def backfill() -> int:
    """Every final session's counts from its raw rows, folded into the rollups."""
    if context.is_offline_mode():  # --sql: the statements, for every final session at once
        op.execute(
            f"SELECT count(*) FROM write_unit_counts(ARRAY(SELECT id FROM sessions "
            f"WHERE state IN {FINAL}))"
        )
        op.execute("SELECT fold_unit_count_changes()")
        return 0
    conn = op.get_bind()
    ids = (
        conn.execute(text(f"SELECT id FROM sessions WHERE state IN {FINAL} ORDER BY id"))
        .scalars()
        .all()
    )
    for start in range(0, len(ids), BACKFILL_BATCH):
        batch = list(ids[start : start + BACKFILL_BATCH])
        conn.execute(text("SELECT count(*) FROM write_unit_counts(:ids)"), {"ids": batch})
        conn.execute(text("SELECT fold_unit_count_changes()"))
    return len(ids)


def upgrade() -> None:
    op.execute(FUNCTIONS)
    create_tables()
    op.execute(write_unit_counts())
    op.execute(FOLD)
    op.execute(PENDING)
    replace_study_views(new_views(), (V_SESSION_ROLLUP, V_DROP_ROLLUP), MATVIEWS)
    op.execute(
        "DELETE FROM rollup_refreshes WHERE name IN (" + ", ".join(f"'{n}'" for n in MATVIEWS) + ")"
    )
    backfill()


def downgrade() -> None:
    for name in (*ON_TOP, *DEPENDANTS, *REPLACED):
        op.execute(f"DROP VIEW {name}")
    for name in REPLACED:
        query, comment = _0007.VIEWS[name]
        op.execute(f"CREATE VIEW {name} AS {query}")
        _comment(name, comment)
    _recreate(DEPENDANTS)
    op.execute(_0012.MV_SESSION_SUMMARY)
    op.execute(_0012.MV_PROBE_DAILY)
    for mv in ("mv_session_summary", "mv_probe_daily"):
        op.execute(f"CREATE UNIQUE INDEX ux_{mv} ON {mv} {_0012.MATVIEW_KEYS[mv]}")
    op.execute("CREATE INDEX ix_mv_session_summary_created_at ON mv_session_summary (created_at)")
    op.execute(f"CREATE MATERIALIZED VIEW mv_size_clients AS {_0016.SIZE_CLIENTS}")
    op.execute("CREATE UNIQUE INDEX ux_mv_size_clients ON mv_size_clients (phase, ip_len)")
    op.execute(_0012.V_SESSION_ROLLUP)
    op.execute(_0012.V_DROP_ROLLUP)
    _recreate(("v_verdicts_rollup",))
    op.execute("DROP VIEW unit_counts_pending")
    op.execute("DROP FUNCTION fold_unit_count_changes()")
    op.execute("DROP FUNCTION write_unit_counts(bigint[])")
    op.drop_index("ix_sessions_live", table_name="sessions")
    for table in TABLES:
        op.drop_table(table)
    op.execute("DROP FUNCTION rtt_hist_median(smallint[], bigint[])")
    op.execute("DROP FUNCTION rtt_hist_add(smallint[], bigint[], smallint[], bigint[])")
    op.execute("DROP FUNCTION rtt_bin_value(smallint)")
    op.execute("DROP FUNCTION rtt_bin(double precision)")
