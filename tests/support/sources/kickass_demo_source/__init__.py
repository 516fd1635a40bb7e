"""A throwaway study source, ``demo`` (tests/support/sources/README.md): a
university's probes, say. Its rows: ``demo_units`` (one per probe and size),
read through ``v_demo_units``; its counts in the source-neutral
``unit_counts`` as source ``demo``; its schedule kind ``demo`` needs the
item's ``directory``."""

from __future__ import annotations

from typing import Any

from kickass_core.sources import Source, SourceView

SOURCE = Source(
    name="demo",
    title="demo university probes",
    colour="#2ca02c",
    order=30,
    views=(SourceView("v_demo_units", time="measured_at"),),
    item_kind="demo",
    item_runner="kickass_demo_source:run_item",
    item_needs=("directory",),
)

# The source's one migration (what its Alembic revision would hold): its
# table and view, and its name added to the counts' source CHECK.
COUNT_TABLES = ("unit_counts", "unit_count_changes", "unit_counts_daily", "unit_counts_total",
                "client_sizes")  # fmt: skip
MIGRATION = [
    """CREATE TABLE demo_units (
        unit text PRIMARY KEY, measured_at timestamptz NOT NULL, phase text NOT NULL,
        ip_len integer NOT NULL, sent integer NOT NULL, acked integer NOT NULL)""",
    "CREATE VIEW v_demo_units AS SELECT unit, measured_at, phase, ip_len, sent, acked "
    "FROM demo_units",
    *(
        f"ALTER TABLE {t} DROP CONSTRAINT ck_{t}_source, ADD CONSTRAINT ck_{t}_source "
        "CHECK (source IN ('volunteer', 'atlas', 'demo'))"
        for t in COUNT_TABLES
    ),
]


_COUNTERS = ("sent", "acked", "late", "reassembly_invalid", "frag_observed",
             "largest_fragment_as_sent", "fragments_observed", "fragmented_observed",
             "leading_as_sent", "leading_swapped")  # fmt: skip
# What its writer does when a unit is final: the unit's counts per size into
# the source-neutral queue the scheduled refresh folds (unit_count_changes;
# unit_counts holds the unit's own row, which no pooled view reads).
WRITE_COUNTS = f"""
INSERT INTO unit_count_changes (source, unit, phase, day, ip_lens, units_by_size,
    {", ".join(f"{c}_by_size" for c in _COUNTERS)}, rtt_ms_sum_by_size, rtt_ms_n_by_size)
SELECT 'demo', split_part(unit, '-', 1), phase, measured_at::date,
       array_agg(ip_len ORDER BY ip_len), array_agg(1::smallint),
       array_agg(sent ORDER BY ip_len), array_agg(acked ORDER BY ip_len),
       {", ".join("array_agg(0::smallint)" for _ in _COUNTERS[2:])},
       array_agg(0::float8), array_agg(0::smallint)
FROM demo_units GROUP BY split_part(unit, '-', 1), phase, measured_at::date
"""


def run_item(item: Any, ctx: Any) -> Any:
    """The ``demo`` kind: says where it would write (the runner's contract)."""
    from kickass_operations.items import OK, Result

    return Result(OK, None, {"directory": item.directory, "due_at": ctx.due_at.isoformat()})
