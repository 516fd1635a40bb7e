"""Grafana provisioning and dashboards: every panel's SQL runs on the real schema.

There is no Grafana binary here, so the test does what Grafana would: expand
the macros and template variables of each panel's raw SQL (the expander
below mirrors Grafana's PostgreSQL data source) and execute the result on a
migrated database seeded through the StudyStore (tests/seed.py) — as the
read-only role docker/grant_reader.py creates, which may read the analysis
views and nothing else. A panel that touches a table fails here.
"""

from __future__ import annotations

import importlib.util
import json
import re
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import kickass_db as db
import psycopg
import pytest
import yaml
from kickass_db.study_store import StudyStore
from psycopg import sql
from support.seed import seed_study, seed_trials

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
DATASOURCES = GRAFANA / "provisioning" / "datasources" / "postgres.yaml"
PROVIDERS = GRAFANA / "provisioning" / "dashboards" / "dashboards.yaml"
POSTGRES_TYPES = ("grafana-postgresql-datasource", "postgres")


# -- a Grafana macro expander ---------------------------------------------------
#
# Grafana turns a panel's raw SQL into the query it sends in three passes,
# and so does expand() below:
#   1. template variables ($name, ${name}, ${name:sqlstring}) — the frontend;
#   2. $__interval and $__interval_ms — the backend's global substitutions;
#   3. macros $__name(args) — the PostgreSQL data source's macro engine
#      (pkg/tsdb/grafana-postgresql-datasource/macros.go). Arguments end at
#      the first ')', as in Grafana, so macro arguments hold no parentheses.
# Only the macros our dashboards use are implemented; any other raises, so a
# dashboard cannot start using one this test does not understand.


@dataclass(frozen=True)
class TimeRange:
    start: datetime
    end: datetime


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
    raise ValueError(f"macro ${name} is not implemented by this test's expander")


def _format_variable(value: str, fmt: str | None) -> str:
    if fmt is None or fmt == "raw":
        return value
    if fmt == "sqlstring":
        return "'" + value.replace("'", "''") + "'"
    raise ValueError(f"variable format {fmt!r} is not implemented by this test's expander")


def expand(
    raw_sql: str,
    time_range: TimeRange,
    interval: str = "1h",
    variables: dict[str, str] | None = None,
) -> str:
    """The SQL Grafana would send for ``raw_sql`` (see the comment above)."""
    variables = variables or {}

    def variable(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(3)
        if name.startswith("__"):
            return m.group(0)  # a built-in: passes 2 and 3
        if name not in variables:
            raise ValueError(f"template variable ${name} is not defined on the dashboard")
        return _format_variable(variables[name], m.group(2))

    text = _VARIABLE.sub(variable, raw_sql)
    ms = interval_seconds(interval) * 1000
    text = text.replace("$__interval_ms", str(int(ms))).replace("$__interval", interval)

    def macro(m: re.Match[str]) -> str:
        args = [a.strip() for a in m.group(2).split(",")] if m.group(2).strip() else []
        return _macro(m.group(1), args, time_range)

    text = _MACRO.sub(macro, text)
    if "$__" in text:
        raise ValueError(f"unexpanded Grafana syntax left in: {text}")
    return text


# Grafana's own expectations (macros_test.go) for the macros we implement.
_T0 = datetime(2018, 4, 12, 18, 0, tzinfo=UTC)
_TR = TimeRange(_T0, _T0 + timedelta(minutes=5))


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (
            "WHERE $__timeFilter(time_column)",
            "WHERE time_column BETWEEN '2018-04-12T18:00:00Z' AND '2018-04-12T18:05:00Z'",
        ),
        ("select $__timeFrom()", "select '2018-04-12T18:00:00Z'"),
        ("select $__timeTo()", "select '2018-04-12T18:05:00Z'"),
        (
            "GROUP BY $__timeGroup(time_column,'5m')",
            "GROUP BY floor(extract(epoch from time_column)/300)*300",
        ),
        (
            "select $__timeGroupAlias(time_column,'5m')",
            'select floor(extract(epoch from time_column)/300)*300 AS "time"',
        ),
        (
            "select $__timeGroupAlias(created_at, $__interval)",
            'select floor(extract(epoch from created_at)/3600)*3600 AS "time"',
        ),
        ("where id = ${session:sqlstring}", "where id = 'it''s'"),
        ("where id = '$session'", "where id = 'it's'"),
    ],
)
def test_expander_matches_grafana(raw: str, expected: str) -> None:
    assert expand(raw, _TR, "1h", {"session": "it's"}) == expected


def test_expander_refuses_what_it_does_not_know() -> None:
    with pytest.raises(ValueError, match="not implemented"):
        expand("WHERE $__unixEpochFilter(t)", _TR)
    with pytest.raises(ValueError, match="not defined"):
        expand("WHERE x = $nosuch", _TR)
    assert grafana_time(datetime(2024, 1, 2, 3, 4, 5, 120000, tzinfo=UTC)) == (
        "2024-01-02T03:04:05.12Z"
    )


# -- the dashboards as data ------------------------------------------------------


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel_id: int
    title: str
    panel_type: str
    interval: str
    ref_id: str
    fmt: str
    raw_sql: str
    options: dict[str, Any]

    @property
    def name(self) -> str:
        return f"{self.dashboard}#{self.panel_id} {self.title} [{self.ref_id}]"


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in dashboard.get("panels", []):
        yield p
        yield from p.get("panels", [])  # collapsed rows keep their panels inside


def panel_queries() -> list[PanelQuery]:
    out = []
    for path in DASHBOARDS:
        for p in _panels(_load(path)):
            for t in p.get("targets", []):
                out.append(
                    PanelQuery(
                        dashboard=path.name,
                        panel_id=p["id"],
                        title=p["title"],
                        panel_type=p["type"],
                        interval=p.get("interval") or "1h",
                        ref_id=t["refId"],
                        fmt=t.get("format", "time_series"),
                        raw_sql=t.get("rawSql", ""),
                        options=p.get("options", {}),
                    )
                )
    return out


def template_variables(path: Path) -> list[dict[str, Any]]:
    return _load(path).get("templating", {}).get("list", [])


def provisioned_datasource() -> dict[str, Any]:
    (ds,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    return ds


# Columns a panel needs: the SQL may return more, never fewer.
EXPECTED_COLUMNS: dict[str, set[str]] = {
    "Clients with a verdict": {"clients"},
    "Fragment-intolerant clients (paper: 8.3%)": {"measured", "paper (405 clients)"},
    "Split drop above 2x whole (paper: never)": {"sessions above 2x"},
    "Pooled split / whole drop ratio": {"split / whole"},
    "Clients by latest verdict": {"verdict", "clients"},
    "Sessions over time by verdict": {"time", "metric", "sessions"},
    "Sessions": {"session_id", "created_at", "state", "verdict", "whole_drop_rate"},
    "Kick-Ass speedup over TCP (paper: 1.2x-4x)": {"speedup"},
    "Mean FCT by flow size": {"size_from", "Kick-Ass", "TCP"},
    "FCT by destination, protocol and size": {"protocol", "fct_ms_mean", "speedup"},
}


def test_there_are_dashboards_and_panels() -> None:
    assert DASHBOARDS, "no dashboards in grafana/dashboards"
    assert len(panel_queries()) >= 10
    titles = {q.title for q in panel_queries()}
    assert set(EXPECTED_COLUMNS) <= titles


def test_provisioning_files_parse() -> None:
    ds = provisioned_datasource()
    assert ds["type"] in POSTGRES_TYPES
    assert ds["uid"] and ds["access"] == "proxy"
    # Every connection detail comes from the environment, never the file.
    for value in (ds["url"], ds["user"], ds["jsonData"]["database"]):
        assert re.fullmatch(r"\$\{?KICKASS_[A-Z_]+\}?", value), value
    assert re.fullmatch(r"\$\{?KICKASS_[A-Z_]+\}?", ds["secureJsonData"]["password"])
    assert "password" not in ds  # only secureJsonData is encrypted at rest

    (provider,) = yaml.safe_load(PROVIDERS.read_text())["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"].startswith("/")


def test_dashboards_are_well_formed() -> None:
    uid = provisioned_datasource()["uid"]
    for path in DASHBOARDS:
        d = _load(path)
        assert d["uid"] and d["title"]
        assert d["schemaVersion"] >= 36
        ids = [p["id"] for p in _panels(d)]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
        for p in _panels(d):
            if p["type"] == "row":
                continue
            assert {"x", "y", "w", "h"} <= set(p["gridPos"]), p["title"]
            assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
            refs = [p.get("datasource")] + [t.get("datasource") for t in p["targets"]]
            for ref in refs:
                assert ref == {"type": ref["type"], "uid": uid}, f"{p['title']}: {ref}"
                assert ref["type"] in POSTGRES_TYPES
        for v in template_variables(path):
            assert v["datasource"]["uid"] == uid


def test_panels_read_only_the_views() -> None:
    # The static half of the rule; running as the views-only role below is the real one.
    relation = re.compile(r"\b(?:FROM|JOIN)\s+([a-zA-Z_][\w.]*)", re.IGNORECASE)
    for q in panel_queries():
        assert q.raw_sql.strip(), q.name
        assert q.fmt in ("table", "time_series"), q.name
        names = relation.findall(q.raw_sql)
        assert names, q.name
        assert all(n.startswith("v_") for n in names), f"{q.name} reads {names}"


# -- executing every panel ---------------------------------------------------------


def _load_grant_reader() -> Callable[..., list[str]]:
    spec = importlib.util.spec_from_file_location("grant_reader", ROOT / "docker/grant_reader.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.grant_reader


@pytest.fixture
def reader_conn(database_url: str, store: StudyStore) -> Iterator[psycopg.Connection]:
    """A connection to a seeded database, acting as the views-only reader role."""
    seed_study(store, n_clients=40, rng=11, spread=timedelta(days=14), live=True)
    seed_trials(database_url)
    role = f"kickass_reader_{secrets.token_hex(4)}"
    url = db.libpq_url(database_url)
    with psycopg.connect(url, autocommit=True) as admin:
        _load_grant_reader()(admin, role)
        try:
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(role)))
                conn.execute("SET TIME ZONE 'UTC'")  # Grafana reads times as UTC
                yield conn
        finally:
            # Roles are cluster-wide: leave none behind.
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def _run(conn: psycopg.Connection, query: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    cur = conn.execute(query)
    assert cur.description is not None
    return [c.name for c in cur.description], cur.fetchall()


def test_reader_role_cannot_read_tables(reader_conn: psycopg.Connection) -> None:
    for table in ("sessions", "probe_outcomes", "clients", "flows", "trials", "runners"):
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            reader_conn.execute(f"SELECT 1 FROM {table} LIMIT 1")
    names, rows = _run(reader_conn, "SELECT count(*) FROM v_session_summary")
    assert rows[0][0] > 0


def test_every_panel_query_runs_on_seeded_data(
    reader_conn: psycopg.Connection, subtests: pytest.Subtests
) -> None:
    now = datetime.now(UTC)
    time_range = TimeRange(now - timedelta(days=30), now + timedelta(minutes=5))

    # Template variables first, as Grafana does: each takes its first value.
    variables: dict[str, str] = {}
    for path in DASHBOARDS:
        for v in template_variables(path):
            assert v["type"] == "query", v["name"]
            _, rows = _run(reader_conn, expand(v["query"], time_range, variables=variables))
            assert rows, f"variable ${v['name']} has no values"
            variables[v["name"]] = str(rows[0][0])

    for q in panel_queries():
        with subtests.test(msg=q.name):
            query = expand(q.raw_sql, time_range, q.interval, variables)
            columns, rows = _run(reader_conn, query)
            assert rows, f"{q.name} returned no rows"
            assert EXPECTED_COLUMNS.get(q.title, set()) <= set(columns), columns
            if q.fmt == "time_series":
                _check_time_series(columns, rows)
            x_field = q.options.get("xField")
            if x_field:
                assert x_field in columns, f"xField {x_field} not among {columns}"
                # Bar charts take x as text (categories) in row order: sizes must
                # come in numeric order, not text order ('1004' before '108').
                xs = [int(r[columns.index(x_field)]) for r in rows]
                assert xs == sorted(xs), f"{x_field} out of numeric order"
            if q.panel_type in ("barchart", "histogram"):
                numeric = [c for c in columns if c != x_field]
                assert numeric, columns
                for i, c in enumerate(columns):
                    if c in numeric:
                        assert all(r[i] is None or isinstance(r[i], int | float) for r in rows), c
            if q.panel_type == "stat":
                assert any(v is not None for v in rows[0]), f"{q.name}: all values NULL"


def _check_time_series(columns: list[str], rows: list[tuple[Any, ...]]) -> None:
    # Grafana's SQL time series: a 'time' column (epoch or timestamp), sorted,
    # an optional 'metric' column naming the series, numeric values.
    assert "time" in columns
    t = columns.index("time")
    times = [float(r[t]) if not isinstance(r[t], datetime) else r[t].timestamp() for r in rows]
    assert times == sorted(times), "time series rows must be ordered by time"
    values = [i for i, c in enumerate(columns) if c not in ("time", "metric")]
    assert values
    for r in rows:
        assert all(isinstance(r[i], int | float) for i in values)
    if "metric" in columns:
        m = columns.index("metric")
        assert all(isinstance(r[m], str) for r in rows)
