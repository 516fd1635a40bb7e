"""What a view's rows are, and the WHERE clause of an export's filters.

``VIEWS`` says, for the views the export knows, which column dates a row
(for ``since``/``until``) and which source every row comes from when the
view has no ``source`` column; a view with a ``source`` or ``campaign``
column is filtered on it. The sources and the views that hold only one
source's rows come from the registry (``kickass_core.sources``): ``views()``
joins them to the shared views listed here. ``_where`` writes the filters as literals (COPY
takes no parameters) and says how each was applied, for the schema file; a
filter a view cannot take is a KickassError naming the views that can.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from kickass_core import sources
from kickass_core.errors import KickassError
from psycopg import sql


@dataclass(frozen=True)
class ViewSpec:
    """What a view's rows are, for the filters.

    ``time``: the view's column that dates a row; ``session_time``: the row's
    time is its session's ``created_at`` (read from ``v_session_summary`` by
    ``session_id``: the export reads views only, so the views-only reader
    role can run it); neither: the view pools all time and takes no
    ``since``/``until``. ``source``: every row comes from this source (views
    with a ``source`` column are filtered on it instead).
    """

    time: str | None = None
    session_time: bool = False
    source: str | None = None


# The views of no one source that this module knows; each source's own views
# come from the registry (``views()``). Any other ``v_*`` view is still
# exportable, unfiltered by time.
SHARED_VIEWS: dict[str, ViewSpec] = {
    "v_size_drop_by_source": ViewSpec(),
    "v_split_drop_by_source": ViewSpec(),
    "v_verdicts_by_source": ViewSpec(time="finished_at"),
    "v_flow_results": ViewSpec(time="started_at"),
    "v_flow_summary": ViewSpec(),
    "v_trial_periods": ViewSpec(time="period_started_at"),
    "v_trial_speedups": ViewSpec(time="computed_at"),
    "v_router_telemetry": ViewSpec(time="recorded_at"),
    "v_item_runs": ViewSpec(time="due_at"),
    # 0012: the rollups (dashboards, report).
    "v_verdicts_rollup": ViewSpec(time="finished_at"),
    "v_drop_rollup": ViewSpec(time="day"),  # a row's time: the start of its day
    "v_flow_hourly": ViewSpec(time="hour"),
    "v_flow_summary_rollup": ViewSpec(),
    "v_router_runs": ViewSpec(time="started_at"),
    "v_router_telemetry_1s": ViewSpec(time="at"),
    "v_router_telemetry_1m": ViewSpec(time="at"),
    "v_item_health": ViewSpec(),
    "v_rollup_status": ViewSpec(),
}


def views() -> dict[str, ViewSpec]:
    """The views the export knows: each registered source's own views, then
    the shared ones. A source's view also listed as shared is a KickassError
    (one view, one description)."""
    out: dict[str, ViewSpec] = {}
    for src in sources.sources():
        for v in src.views:
            if v.name in out or v.name in SHARED_VIEWS:
                raise KickassError(
                    f"the study source {src.name!r} describes the view {v.name}, "
                    "which another source or the shared views describe already",
                    hint="a view holds one source's rows, or has a source column",
                )
            out[v.name] = ViewSpec(time=v.time, session_time=v.session_time, source=src.name)
    return out | SHARED_VIEWS


@dataclass(frozen=True)
class Filters:
    since: datetime | None = None
    until: datetime | None = None
    source: str | None = None
    campaign: str | None = None

    def to_json(self) -> dict[str, str | None]:
        return {
            "since": self.since.isoformat() if self.since else None,
            "until": self.until.isoformat() if self.until else None,
            "source": self.source,
            "campaign": self.campaign,
        }


def _where(
    view: str, columns: set[str], filters: Filters, having: Callable[[str], list[str]]
) -> tuple[sql.Composable, dict[str, str | None]]:
    """The WHERE clause of the filters (values as literals: COPY takes no parameters)
    and how each was applied, for the schema file. ``having(column)``: the views
    with that column, for the hints."""
    known = views()
    spec = known.get(view, ViewSpec())
    clauses: list[sql.Composable] = []
    applied: dict[str, str | None] = {"time": None}
    if filters.since or filters.until:
        if spec.time:
            target: sql.Composable = sql.SQL("v.{}").format(sql.Identifier(spec.time))
            applied["time"] = spec.time
        elif spec.session_time and "session_id" in columns:
            target = sql.SQL("s.created_at")
            applied["time"] = "created_at of the row's session (v_session_summary)"
        else:
            timed = sorted(v for v, s in known.items() if s.time or s.session_time)
            raise KickassError(
                f"{view} has no time column to filter with --since/--until"
                + (" (it pools all time)" if view in known else ""),
                hint="views with a time: " + ", ".join(timed),
            )
        window: list[sql.Composable] = []
        if filters.since:
            window.append(sql.SQL("{} >= {}").format(target, sql.Literal(filters.since)))
        if filters.until:
            window.append(sql.SQL("{} < {}").format(target, sql.Literal(filters.until)))
        condition = sql.SQL(" AND ").join(window)
        if spec.time:
            clauses.append(condition)
        else:
            clauses.append(
                sql.SQL(
                    "v.session_id IN (SELECT s.session_id FROM public.v_session_summary AS s "
                    "WHERE {})"
                ).format(condition)
            )
    if filters.source:
        if "source" in columns:
            clauses.append(sql.SQL("v.source = {}").format(sql.Literal(filters.source)))
        elif spec.source != filters.source:
            what = f"only {spec.source} rows" if spec.source else "no study source's rows"
            raise KickassError(
                f"{view} holds {what}: --source {filters.source} would select nothing",
                hint="views with a source column: "
                + ", ".join(having("source"))
                + "; "
                + "; ".join(
                    f"{src} rows only: " + ", ".join(v for v, x in known.items() if x.source == src)
                    for src in sources.names()
                ),
            )
    if filters.campaign is not None:
        if "campaign" not in columns:
            raise KickassError(
                f"{view} has no campaign column to filter with --campaign",
                hint="views with a campaign column: " + ", ".join(having("campaign")),
            )
        clauses.append(sql.SQL("v.campaign = {}").format(sql.Literal(filters.campaign)))
    if not clauses:
        return sql.SQL(""), applied
    return sql.SQL(" WHERE ") + sql.SQL(" AND ").join(clauses), applied


def _utc(t: datetime | None) -> datetime | None:
    if t is None:
        return None
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)
