"""What Grafana sends to PostgreSQL for a panel: dashboards as data and a macro expander.

There is no Grafana binary here, so tests/analysis/test_grafana.py and
bench/dashboards_bench.py do what Grafana would: read each dashboard file's
panels and template variables, pick the variables' values, and expand a
panel's raw SQL into the query the PostgreSQL data source runs.

Grafana turns a panel's raw SQL into the query it sends in three passes,
and so does ``expand`` below:

1. template variables (``$name``, ``${name}``, ``${name:format}``) — the
   frontend (``templateSrv.replace`` with the data source's
   ``interpolateVariable``): a multi-value or include-All variable's values
   are quoted as SQL strings and joined with commas; a single-value one is
   inserted raw; ``:sqlstring`` quotes every value; "All" with a custom
   ``allValue`` inserts that value as it is, unformatted;
2. ``$__interval`` and ``$__interval_ms`` — the backend's substitutions;
3. macros ``$__name(args)`` — the PostgreSQL data source's macro engine
   (pkg/tsdb/grafana-postgresql-datasource/macros.go). Arguments end at
   the first ')', as in Grafana, so macro arguments hold no parentheses.

Only the macros and formats our dashboards use are implemented; any other
raises, so a dashboard cannot start using one this expander does not know.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "grafana"
DASHBOARD_DIR = GRAFANA / "dashboards"
POSTGRES_TYPES = ("grafana-postgresql-datasource", "postgres")
# Grafana's default points per panel when the panel's width is not known.
MAX_DATA_POINTS = 1000


@dataclass(frozen=True)
class TimeRange:
    start: datetime
    end: datetime

    @classmethod
    def last(cls, span: timedelta, now: datetime | None = None) -> TimeRange:
        now = now or datetime.now(UTC)
        return cls(now - span, now)


@dataclass(frozen=True)
class Selection:
    """A template variable's current value, as Grafana holds it."""

    values: tuple[str, ...]
    multi: bool = False  # the variable is multi-value or include-All
    all_value: str | None = None  # set when "All" is selected and the variable has a custom one


_MACRO = re.compile(r"\$(__[_a-zA-Z0-9]+)\(([^)]*)\)")
_VARIABLE = re.compile(r"\$\{([a-zA-Z_]\w*)(?::(\w+))?\}|\$([a-zA-Z_]\w*)")
_INTERVAL = re.compile(r"^(\d+)(ms|s|m|h|d|w)$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def grafana_time(t: datetime) -> str:
    """Go's time.RFC3339Nano in UTC: 'Z', fraction without trailing zeros."""
    t = t.astimezone(UTC)
    text = t.strftime("%Y-%m-%dT%H:%M:%S")
    if t.microsecond:
        text += f".{t.microsecond:06d}".rstrip("0")
    return text + "Z"


def interval_seconds(interval: str) -> float:
    """Grafana's gtime.ParseInterval for the units we use ('5m', '1h', '1d', ...)."""
    m = _INTERVAL.match(interval.strip().strip("'\""))
    if not m:
        raise ValueError(f"unsupported interval {interval!r}")
    return int(m.group(1)) * _UNIT_SECONDS[m.group(2)]


# Grafana's rangeutil.roundInterval: the interval rounded to a "nice" one.
_ROUND = (
    (0.015, "10ms"), (0.035, "20ms"), (0.075, "50ms"), (0.15, "100ms"), (0.35, "200ms"),
    (0.75, "500ms"), (1.5, "1s"), (3.5, "2s"), (7.5, "5s"), (12.5, "10s"), (17.5, "15s"),
    (25, "20s"), (45, "30s"), (90, "1m"), (210, "2m"), (450, "5m"), (750, "10m"),
    (1050, "15m"), (1500, "20m"), (2700, "30m"), (5400, "1h"), (9000, "2h"), (16200, "3h"),
    (32400, "6h"), (86400, "12h"), (604800, "1d"), (1814400, "1w"), (3628800, "30d"),
)  # fmt: skip


def _round_interval(seconds: float) -> str:
    for limit, name in _ROUND:
        if seconds < limit:
            return name
    return "1y"


def panel_interval(
    time_range: TimeRange, min_interval: str | None = None, max_data_points: int = MAX_DATA_POINTS
) -> str:
    """``$__interval`` for a panel: the range over its points, rounded as
    Grafana rounds it, never below the panel's minimum interval."""
    span = (time_range.end - time_range.start).total_seconds()
    chosen = _round_interval(span / max_data_points)
    if min_interval and interval_seconds(min_interval) > interval_seconds(chosen):
        return min_interval
    return chosen


def _go_number(x: float) -> str:
    # Go's %v of a float64: integral values print without a decimal point.
    return str(int(x)) if x == int(x) else repr(x)


def _macro(name: str, args: list[str], tr: TimeRange) -> str:
    frm, to = grafana_time(tr.start), grafana_time(tr.end)
    if name == "__timeFilter":
        return f"{args[0]} BETWEEN '{frm}' AND '{to}'"
    if name == "__timeFrom":
        return f"'{frm}'"
    if name == "__timeTo":
        return f"'{to}'"
    if name in ("__timeGroup", "__timeGroupAlias"):
        if len(args) != 2:
            raise ValueError(f"${name} takes (column, interval); fill modes are not expanded here")
        s = _go_number(interval_seconds(args[1]))
        group = f"floor(extract(epoch from {args[0]})/{s})*{s}"
        return group + (' AS "time"' if name == "__timeGroupAlias" else "")
    raise ValueError(f"macro ${name} is not implemented by this expander")


def _quote(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def format_variable(sel: Selection, fmt: str | None) -> str:
    """A variable's text in the query (templateSrv + the data source's interpolateVariable)."""
    if sel.all_value is not None and fmt not in ("text", "percentencode"):
        return sel.all_value  # a custom all value skips formatting
    if fmt is None:
        # The PostgreSQL data source: quoted when the variable may hold several values.
        if sel.multi:
            return ",".join(_quote(v) for v in sel.values)
        return sel.values[0] if sel.values else ""
    if fmt == "sqlstring":
        return ",".join(_quote(v) for v in sel.values)
    if fmt in ("raw", "csv"):
        return ",".join(sel.values)
    raise ValueError(f"variable format {fmt!r} is not implemented by this expander")


def expand(
    raw_sql: str,
    time_range: TimeRange,
    interval: str = "1h",
    variables: dict[str, Selection] | None = None,
) -> str:
    """The SQL Grafana would send for ``raw_sql`` (see the module docstring)."""
    variables = variables or {}

    def variable(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(3)
        if name.startswith("__"):
            return m.group(0)  # a built-in: passes 2 and 3
        if name not in variables:
            raise ValueError(f"template variable ${name} is not defined on the dashboard")
        return format_variable(variables[name], m.group(2))

    text = _VARIABLE.sub(variable, raw_sql)
    ms = interval_seconds(interval) * 1000
    text = text.replace("$__interval_ms", _go_number(ms)).replace("$__interval", interval)

    def macro(m: re.Match[str]) -> str:
        args = [a.strip() for a in m.group(2).split(",")] if m.group(2).strip() else []
        return _macro(m.group(1), args, time_range)

    text = _MACRO.sub(macro, text)
    if "$__" in text:
        raise ValueError(f"unexpanded Grafana syntax left in: {text}")
    return text


# -- the dashboards as data -----------------------------------------------------


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel_id: int
    title: str
    panel_type: str
    min_interval: str | None
    ref_id: str
    fmt: str
    raw_sql: str
    options: dict[str, Any] = field(default_factory=dict)
    field_config: dict[str, Any] = field(default_factory=dict)
    transformations: list[dict[str, Any]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.dashboard}#{self.panel_id} {self.title} [{self.ref_id}]"


def dashboards() -> list[Path]:
    return sorted(DASHBOARD_DIR.glob("*.json"))


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in dashboard.get("panels", []):
        yield p
        yield from p.get("panels", [])  # collapsed rows keep their panels inside


def panel_queries(paths: list[Path] | None = None) -> list[PanelQuery]:
    out = []
    for path in paths if paths is not None else dashboards():
        for p in panels(load(path)):
            for t in p.get("targets", []):
                out.append(
                    PanelQuery(
                        dashboard=path.name,
                        panel_id=p["id"],
                        title=p["title"],
                        panel_type=p["type"],
                        min_interval=p.get("interval"),
                        ref_id=t["refId"],
                        fmt=t.get("format", "time_series"),
                        raw_sql=t.get("rawSql", ""),
                        options=p.get("options", {}),
                        field_config=p.get("fieldConfig", {}),
                        transformations=p.get("transformations", []),
                    )
                )
    return out


def template_variables(path: Path) -> list[dict[str, Any]]:
    variables: list[dict[str, Any]] = load(path).get("templating", {}).get("list", [])
    return variables


def custom_options(query: str) -> list[tuple[str, str]]:
    """A custom variable's options: 'a,b' or 'text : value, ...' -> [(text, value)]."""
    out = []
    for part in re.split(r"(?<!\\),", query):
        part = part.strip().replace("\\,", ",")
        if not part:
            continue
        text, sep, value = part.partition(" : ")
        out.append((text.strip(), value.strip()) if sep else (part, part))
    return out


def select(variable: dict[str, Any], values: list[str], *, choose_all: bool) -> Selection:
    """The selection Grafana would hold: "All" (every value, or the custom all
    value) when ``choose_all`` and the variable offers it, else the first value."""
    multi = bool(variable.get("multi") or variable.get("includeAll"))
    if choose_all and variable.get("includeAll"):
        custom = variable.get("allValue")
        return Selection(tuple(values), multi, custom if custom else None)
    return Selection(tuple(values[:1]), multi)
