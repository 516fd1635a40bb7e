"""``write_unit_counts`` in less time, storing the same.

Revision ID: 0027
Revises: 0026
Create Date: 2026-11-28

Issue 28 allows ``finish_session`` at most 100 ms more at p95 for a full-plan
session (36,600 probe rows). With 0020's ``write_unit_counts`` (0022's
partition condition) it gained 220 ms at p95. Measured on 36,600 rows, most
of the backend's CPU went to three things:

- **Comparing text once per counter.** Each row evaluated about twenty text
  comparisons, ``o.outcome = 'acked'`` in nine counters and ``o.phase =
  'split'`` in three. Each comparison looks up the collation and detoasts its
  argument. Now a row's ``phase`` and ``outcome`` are compared once, in the
  scan's projection: a subquery kept by ``OFFSET 0``, so that the planner
  does not copy the comparisons back into every FILTER. The counters are
  0020's ``COUNTERS`` over those flags, and the rows are grouped by
  ``phase = 'split'``, a boolean, rather than by the text.
- **The RTT histogram, computed per size.** Each of the 184 sizes ran a
  memoised subquery of its own over its sorted array. Now it is one hashed
  aggregation over every RTT of the phase. The per-size sort of the RTTs,
  needed for the exact median, stays as it was.
- **Planning on every call.** PL/pgSQL planned the statement anew for each
  call, a custom plan, because the generic plan's estimate was the higher.
  That took 3-6 ms a call over 8 daily partitions and 7-18 ms over 38. The
  two plans are the same, so the function now runs with ``plan_cache_mode =
  force_generic_plan``.

The rows grouped are the same, in the same order (the order of the scan),
so every count, sum, median and histogram stored is unchanged. An
``ORDER BY`` inside the aggregation would have sorted the RTTs in the same
pass, but PostgreSQL cannot hash an aggregation with an ordered aggregate:
it sorts all 36,600 rows, which took longer than everything else together.
The CTEs from ``new`` on (``unit_counts``, ``unit_count_changes``) are
0020's, taken from its text. Downgrading puts 0022's function back.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from alembic import op

revision: str = "0027"
down_revision: str | None = "0026"
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
_0022 = _migration("0022")

# A row's text columns as flags, compared once per row. By the table's CHECKs,
# phase is 'whole' or 'split', so NOT split means whole.
FLAGS = {
    "o.phase = 'split'": "split",
    "o.outcome = 'acked'": "acked",
    "o.outcome = 'lost'": "lost",
    "o.outcome = 'late'": "late",
}


def _flagged(condition: str) -> str:
    """One of 0020's conditions on a probe row, over the row's flags."""
    for comparison, flag in FLAGS.items():
        condition = condition.replace(comparison, f"o.{flag}")
    assert "o.phase" not in condition and "o.outcome" not in condition, condition
    return condition


_COUNTS = ",\n            ".join(
    f"count(*) FILTER (WHERE {_flagged(cond)}) AS {name}" for name, cond in _0020.COUNTERS.items()
)
_SIZED = _0020._cols("c.", names=(*_0020.COUNTERS, "rtt_ms_sum", "rtt_ms_n"))
_FLAG_COLUMNS = ", ".join(f"{comparison} AS {flag}" for comparison, flag in FLAGS.items())


def _counting(session_rows: str) -> str:
    """The CTEs ``counted`` to ``hist_phase`` (0020's names and columns)."""
    return f"""
), counted AS (
    -- Per session, grouped inside its own rows (hashed: no sort of them).
    SELECT s.id AS pk, CASE WHEN c.split THEN 'split' ELSE 'whole' END AS phase, c.*
    FROM s CROSS JOIN LATERAL (
        SELECT o.split, o.ip_len,
            {_COUNTS},
            sum(o.rtt_ms::double precision) FILTER (WHERE o.acked) AS rtt_ms_sum,
            count(o.rtt_ms) FILTER (WHERE o.acked) AS rtt_ms_n,
            array_agg(o.rtt_ms) FILTER (
                WHERE NOT o.split AND o.acked AND o.rtt_ms IS NOT NULL) AS rtts
        FROM (
            -- OFFSET 0 keeps this subquery: each text comparison made once a row.
            SELECT {_FLAG_COLUMNS}, o.ip_len, o.reassembly_invalid, o.rtt_ms,
                   o.observed_frag_size, o.observed_fragments, o.observed_leading_len
            FROM probe_outcomes o WHERE {session_rows}
            OFFSET 0
        ) o
        GROUP BY o.split, o.ip_len
    ) c
), sized AS MATERIALIZED (
    -- The whole phase's RTTs sorted, each size on its own (a hundred, say).
    SELECT c.pk, c.phase, c.ip_len, {_SIZED}, r.rtts
    FROM counted c
    CROSS JOIN LATERAL (SELECT array_agg(v ORDER BY v) AS rtts FROM unnest(c.rtts) v) r
), per_size AS (
    -- The exact median of the whole phase's sizes, as percentile_cont(0.5)
    -- computes it: the two middle values, interpolated (first + (second -
    -- first) * fraction) in double precision.
    SELECT c.pk, c.phase, c.ip_len, {_SIZED},
        c.rtts[m.lo]::double precision
            + (c.rtts[m.hi]::double precision - c.rtts[m.lo]::double precision) * m.fraction
            AS rtt_ms_median
    FROM sized c
    CROSS JOIN LATERAL (
        SELECT floor(q)::integer + 1 AS lo, ceil(q)::integer + 1 AS hi, q - floor(q) AS fraction
        FROM (SELECT 0.5::double precision * (cardinality(c.rtts) - 1) AS q) x
    ) m
), hist_phase AS (
    -- The histogram, flat: (IP length, bin, count) in parallel arrays. Only
    -- the whole phase has RTTs here (see 0020), so only it has a histogram.
    SELECT h.pk, 'whole'::text AS phase, array_agg(h.ip_len ORDER BY h.ip_len, h.bin) AS ip_lens,
           array_agg(h.bin ORDER BY h.ip_len, h.bin) AS bins,
           array_agg(h.n ORDER BY h.ip_len, h.bin) AS counts
    FROM (
        SELECT b.pk, b.ip_len, b.bin, count(*)::integer AS n
        FROM (SELECT c.pk, c.ip_len, rtt_bin(unnest(c.rtts)) AS bin FROM counted c) b
        GROUP BY b.pk, b.ip_len, b.bin
    ) h
    GROUP BY h.pk"""


_FIRST, _LAST = "\n), counted AS (\n", "\n), new AS (\n"
_VOLATILE = "LANGUAGE plpgsql VOLATILE AS"
# One plan for every call (the docstring: the generic plan is the custom one).
GENERIC_PLAN = "SET plan_cache_mode = force_generic_plan"


def write_unit_counts(session_rows: str = _0022.SESSION_ROWS) -> str:
    """0020's ``write_unit_counts`` (over ``session_rows``) with its counting
    CTEs replaced by ``_counting``: the same arguments, result and writes."""
    before = _0020.write_unit_counts(session_rows)
    assert before.count(_FIRST) == 1 and before.count(_LAST) == 1, "0020's writer changed"
    head, rest = before.split(_FIRST)
    _, tail = rest.split(_LAST)
    head = head.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)
    assert head.count(_VOLATILE) == 1, "0020's writer changed"
    head = head.replace(_VOLATILE, f"LANGUAGE plpgsql VOLATILE {GENERIC_PLAN} AS", 1)
    return head + _counting(session_rows) + _LAST + tail


def upgrade() -> None:
    op.execute(write_unit_counts())


def downgrade() -> None:
    op.execute(
        _0020.write_unit_counts(_0022.SESSION_ROWS).replace(
            "CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1
        )
    )
