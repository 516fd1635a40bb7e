"""The volunteers' study source: sessions of the probe client, measured by the
server's probe engine and stored in the study tables (``sessions``,
``probe_outcomes``, their durable counts in ``unit_counts`` as source
``volunteer``). Registered here, with the tables, because every host that
reads them has this package (a researcher's export or report host need not
have the server). No schedule kind: volunteers come when they come."""

from __future__ import annotations

from kickass_core.sources import Source, SourceView

SOURCE = Source(
    name="volunteer",
    title="volunteers",
    colour="#1f77b4",
    order=10,
    views=(
        SourceView("v_session_summary", time="created_at"),
        SourceView("v_whole_drop", session_time=True),
        SourceView("v_split_drop", session_time=True),
        SourceView("v_client_verdicts", time="latest_finished_at"),
        SourceView("v_size_drop_all"),
        SourceView("v_split_drop_all"),
        SourceView("v_session_rollup", time="created_at"),
    ),
)
