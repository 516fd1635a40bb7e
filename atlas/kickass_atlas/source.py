"""RIPE Atlas as a study source: probes' pings answered by the responder,
their results joined to its reply log (``atlas_*`` tables, source ``atlas``
in the ``*_by_source`` views and ``v_drop_rollup``). Its schedule kind
``atlas`` creates a campaign's measurements once and fetches their results
until they settle (``kickass_operations.items.run_atlas``, which calls
``kickass_atlas.service``)."""

from __future__ import annotations

from kickass_core.sources import Source, SourceView

SOURCE = Source(
    name="atlas",
    title="RIPE Atlas probes",
    colour="#ff7f0e",
    order=20,
    views=(
        SourceView("v_atlas_whole_drop"),
        SourceView("v_atlas_split_drop"),
        SourceView("v_atlas_measurements", time="created_at"),
        SourceView("v_atlas_campaigns", time="created_at"),
    ),
    item_kind="atlas",
    item_runner="kickass_operations.items:run_atlas",
    item_needs=("campaign",),
)
