"""Grafana provisioning and dashboards: every panel's SQL runs on the real schema.

There is no Grafana binary here, so the test does what Grafana would
(tests/support/grafana.py: pick the template variables' values, expand the
macros as the PostgreSQL data source does) and executes every panel's query
on a migrated database seeded through the real stores (tests/support/seed.py:
the study, paired trials, router telemetry, a RIPE Atlas campaign, scheduled
runs), after the scheduled refresh has rolled them up and with more sessions
finished since — as the read-only role docker/grant_reader.py creates, which
may read the analysis views and nothing else. A panel that touches a table,
returns no rows or lacks the columns its field config names fails here.

And a static check: every column a panel, a notebook or the report reads must
exist in the schema at head, so a migration that drops one fails here, naming
who reads it.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import kickass_db as db
import nbformat
import psycopg
import pytest
import yaml
from kickass_analysis import rollups, stats
from kickass_core import verdict
from kickass_core.study_events import (
    ClockAnchor,
    OutcomeBatch,
    OutcomeEntry,
    RunFinished,
    RunProbing,
)
from kickass_db.study_store import StudyStore
from psycopg import sql
from support.grafana import (
    DASHBOARD_DIR,
    GRAFANA,
    POSTGRES_TYPES,
    PanelQuery,
    Selection,
    TimeRange,
    custom_options,
    dashboards,
    expand,
    grafana_time,
    load,
    panel_interval,
    panel_queries,
    panels,
    select,
    template_variables,
)
from support.seed import (
    default_plan,
    seed_atlas,
    seed_item_runs,
    seed_paired_trials,
    seed_router,
    seed_study,
)

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = dashboards()
DATASOURCES = GRAFANA / "provisioning" / "datasources" / "postgres.yaml"
PROVIDERS = GRAFANA / "provisioning" / "dashboards" / "dashboards.yaml"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
REPORT = ROOT / "analysis" / "kickass_analysis" / "report" / "readers.py"
SOURCES = {
    "fragment-viability.json": "the study: sources, countries, networks",
    "wide-area-trials.json": "the paired trials",
    "edge-router.json": "the edge router",
    "schedule-health.json": "schedule health",
}


# -- the expander against Grafana's own expectations -------------------------------

# Grafana's macros_test.go for the macros we implement, and templateSrv's
# formatting of single and multi-value variables.
_T0 = datetime(2018, 4, 12, 18, 0, tzinfo=UTC)
_TR = TimeRange(_T0, _T0 + timedelta(minutes=5))
_VARS = {
    "session": Selection(("it's",)),
    "source": Selection(("volunteer", "atlas"), multi=True),
    "country": Selection(("NL", "DE"), multi=True, all_value="'__all'"),
    "one": Selection(("NL",), multi=True),
    "hours": Selection(("24",)),
}


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
        ("where $__interval_ms >= 60000", "where 3600000 >= 60000"),
        ("where id = ${session:sqlstring}", "where id = 'it''s'"),
        ("where id = '$session'", "where id = 'it's'"),
        # Multi-value: quoted and joined, by the data source or by :sqlstring.
        ("where s IN ($source)", "where s IN ('volunteer','atlas')"),
        ("where s IN (${source:sqlstring})", "where s IN ('volunteer','atlas')"),
        ("where s IN (${source})", "where s IN ('volunteer','atlas')"),
        ("where c IN ($one)", "where c IN ('NL')"),
        ("where c IN (${source:csv})", "where c IN (volunteer,atlas)"),
        # "All" with a custom all value: inserted as it is, whatever the format.
        ("where '__all' IN (${country:sqlstring})", "where '__all' IN ('__all')"),
        ("where '__all' IN ($country)", "where '__all' IN ('__all')"),
        ("make_interval(hours => $hours)", "make_interval(hours => 24)"),
    ],
)
def test_expander_matches_grafana(raw: str, expected: str) -> None:
    assert expand(raw, _TR, "1h", _VARS) == expected


def test_expander_refuses_what_it_does_not_know() -> None:
    with pytest.raises(ValueError, match="not implemented"):
        expand("WHERE $__unixEpochFilter(t)", _TR)
    with pytest.raises(ValueError, match="not implemented"):
        expand("WHERE x IN (${source:json})", _TR, variables=_VARS)
    with pytest.raises(ValueError, match="not defined"):
        expand("WHERE x = $nosuch", _TR)
    assert grafana_time(datetime(2024, 1, 2, 3, 4, 5, 120000, tzinfo=UTC)) == (
        "2024-01-02T03:04:05.12Z"
    )


@pytest.mark.parametrize(
    ("span", "min_interval", "expected"),
    [
        (timedelta(days=30), None, "30m"),  # 2592 s per point
        (timedelta(days=7), None, "10m"),
        (timedelta(hours=6), None, "20s"),
        (timedelta(minutes=5), None, "200ms"),
        (timedelta(minutes=5), "1s", "1s"),  # never below the panel's minimum
        (timedelta(days=30), "1h", "1h"),
    ],
)
def test_interval_is_grafanas(span: timedelta, min_interval: str | None, expected: str) -> None:
    # Grafana: range / max data points, rounded by rangeutil.roundInterval.
    assert panel_interval(TimeRange.last(span), min_interval) == expected


def test_custom_variable_options() -> None:
    assert custom_options("volunteer,atlas") == [("volunteer", "volunteer"), ("atlas", "atlas")]
    assert custom_options("Volunteers : volunteer, a\\,b") == [
        ("Volunteers", "volunteer"),
        ("a,b", "a,b"),
    ]
    var = {"multi": True, "includeAll": True, "allValue": "'__all'"}
    assert select(var, ["NL", "DE"], choose_all=True) == Selection(("NL", "DE"), True, "'__all'")
    assert select(var, ["NL", "DE"], choose_all=False) == Selection(("NL",), True)
    assert select({"multi": False}, ["24", "6"], choose_all=True) == Selection(("24",))


# -- the dashboards as files -------------------------------------------------------------


# The study's test of split loss against the two-fragment bound, and the
# trials' fallbacks (issue 18): checked on data seeded for them below.
ABOVE_BOUND = "Split drop above the two-fragment bound + 3 SE (the verdict's test; paper: never)"
EXCESS_HISTOGRAM = "Split drop minus the two-fragment bound, per session (paper: never above)"
EXCESS_TABLE = (
    "Split drop against the two-fragment bound, per session, with the excess's 95% interval"
)
FALLBACKS = "Kick-Ass flows that fell back to TCP, by arm"
SPEEDUP_STAT = "Kick-Ass speedup over TCP (paper: 1.2x-4x)"

# Columns a panel needs: the SQL may return more, never fewer.
EXPECTED_COLUMNS: dict[str, set[str]] = {
    # the study
    "Clients with a verdict": {"clients"},
    "Fragment-intolerant clients (paper: 8.3%)": {"measured", "paper (405 clients)"},
    ABOVE_BOUND: {
        "above the bound", "share of tested sessions", "tested sessions",
        "excess interval above 0",
    },
    EXCESS_HISTOGRAM: {"split drop - bound"},
    EXCESS_TABLE: {
        "session_id", "verdict", "whole_drop_rate", "split_drop_rate", "two-fragment bound",
        "bound + 3 SE", "above the bound", "split_excess_drop", "split_excess_low",
        "split_excess_high", "split_to_whole_ratio",
    },
    "Pooled split / whole drop ratio": {"split / whole"},
    "Clients by latest verdict": {"verdict", "clients"},
    "Fragment-intolerant by source (paper: 8.3% of 405 clients)": {
        "source", "intolerant share", "paper (405 clients)",
    },
    "By country": {"source", "country", "intolerant share"},
    "By network (ASN)": {"source", "ASN", "whole drop", "split drop"},
    "Sessions over time by verdict": {"time", "metric", "sessions"},
    "Drop rate by packet size, by source (whole packets)": {
        "IP length", "volunteers", "RIPE Atlas",
    },
    "Sessions": {"session_id", "created_at", "state", "verdict", "whole_drop_rate"},
    # the trials
    SPEEDUP_STAT: {
        "speedup", "finished sooner, failures kept", "completed: Kick-Ass", "completed: TCP",
        "paper: from", "paper: to",
    },
    "Paired speedup with its 95% interval, by destination and arm": {
        "arm", "baseline_arm", "speedup", "speedup_low", "speedup_high", "clusters",
        "completion_arm", "completion_baseline",
        "sooner", "sooner_low", "sooner_high", "sooner_pairs", "sooner_clusters",
    },
    "Speedup by flow size (paired, 95% interval)": {
        "size_bucket", "speedup", "completion_arm", "completion_baseline",
        "sooner", "sooner_low", "sooner_high", "sooner_pairs",
    },
    "Mean FCT by flow size": {"size_from", "Kick-Ass", "TCP"},
    "Per-trial speedup over time (paired, 95% interval)": {"time", "metric", "speedup"},
    "FCT by destination, protocol and size": {"protocol", "arm", "fct_ms_mean", "speedup"},
    "Period starts: late by (schedule vs actual)": {"time", "metric", "late by (ms)"},
    FALLBACKS: {"destination", "arm", "Kick-Ass flows", "fell back to TCP", "share fell back"},
    # the router
    "Advertised rate": {"time", "metric", "advertised rate", "capacity"},
    "Leading-fragment length": {"time", "metric", "leading fragment (bytes)"},
    "Queue": {"time", "metric", "mean queue", "largest queue"},
    "Time in Kick-Ass mode (ka_mode)": {"time", "metric", "ka_mode"},
    # schedule health
    "Runs by outcome over time": {"time", "metric", "runs"},
    "Items with no ok run in the last $overdue_hours hours": {"item", "last_ok_at"},
    "Failures with reasons": {"item", "outcome", "reason"},
    "RIPE Atlas measurements": {"status_name", "credits_spent"},
    "RIPE Atlas credits spent, by campaign": {"campaign", "of the budget"},
}  # fmt: skip


def provisioned_datasource() -> dict[str, Any]:
    (ds,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    return ds


def test_there_are_dashboards_for_every_source() -> None:
    assert {p.name for p in DASHBOARDS} == set(SOURCES)
    queries = panel_queries()
    titles = {q.title for q in queries}
    assert set(EXPECTED_COLUMNS) <= titles, set(EXPECTED_COLUMNS) - titles
    for path in DASHBOARDS:
        assert len([q for q in queries if q.dashboard == path.name]) >= 7, path.name
    names = {v["name"] for v in template_variables(DASHBOARD_DIR / "fragment-viability.json")}
    assert {"source", "country", "asn"} <= names


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
    uids = set()
    for path in DASHBOARDS:
        d = load(path)
        assert d["uid"] and d["title"] and d["uid"] not in uids
        uids.add(d["uid"])
        assert d["schemaVersion"] >= 36
        assert d["time"]["from"].startswith("now-") and d["time"]["to"] == "now"
        ids = [p["id"] for p in panels(d)]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
        cells: set[tuple[int, int]] = set()
        for p in panels(d):
            if p["type"] == "row":
                continue
            g = p["gridPos"]
            assert {"x", "y", "w", "h"} <= set(g), p["title"]
            assert g["x"] + g["w"] <= 24, p["title"]
            mine = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                    for y in range(g["y"], g["y"] + g["h"])}  # fmt: skip
            assert not mine & cells, f"{path.name}: {p['title']} overlaps another panel"
            cells |= mine
            assert p["targets"], p["title"]
            refs = [p.get("datasource")] + [t.get("datasource") for t in p["targets"]]
            for ref in refs:
                assert ref == {"type": ref["type"], "uid": uid}, f"{p['title']}: {ref}"
                assert ref["type"] in POSTGRES_TYPES
            for t in p["targets"]:
                assert t.get("rawQuery") and t.get("editorMode") == "code", p["title"]
        for v in template_variables(path):
            assert v["type"] in ("query", "custom"), v["name"]
            if v["type"] == "query":
                assert v["datasource"]["uid"] == uid
            if v.get("allValue"):
                # A custom all value skips formatting: it must be SQL on its own.
                assert re.fullmatch(r"'[^']*'", v["allValue"]), v["name"]


def test_panels_read_only_the_views() -> None:
    # The static half of the rule; running as the views-only role below is the real one.
    relation = re.compile(r"\b(?:FROM|JOIN)\s+([a-zA-Z_][\w.]*)", re.IGNORECASE)
    for q in panel_queries():
        assert q.raw_sql.strip(), q.name
        assert q.fmt in ("table", "time_series"), q.name
        names = relation.findall(q.raw_sql)
        assert names, q.name
        assert all(n.startswith("v_") for n in names), f"{q.name} reads {names}"
    for path in DASHBOARDS:
        for v in template_variables(path):
            if v["type"] == "query":
                names = relation.findall(v["query"])
                assert names and all(n.startswith("v_") for n in names), v["name"]


# -- executing every panel ---------------------------------------------------------------


def _load_grant_reader() -> Callable[..., list[str]]:
    spec = importlib.util.spec_from_file_location("grant_reader", ROOT / "docker/grant_reader.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.grant_reader


@dataclass
class Seeded:
    conn: psycopg.Connection
    router_window: TimeRange  # the first seeded router run, a minute either side


@contextmanager
def reader(database_url: str) -> Iterator[psycopg.Connection]:
    """A connection acting as the views-only reader role Grafana uses."""
    role = f"kickass_reader_{secrets.token_hex(4)}"
    url = db.libpq_url(database_url)
    with psycopg.connect(url, autocommit=True) as admin:
        granted = _load_grant_reader()(admin, role)
        assert {"v_drop_rollup", "v_router_telemetry_1s", "v_item_health"} <= set(granted)
        try:
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(role)))
                conn.execute("SET TIME ZONE 'UTC'")  # Grafana reads times as UTC
                yield conn
        finally:
            # Roles are cluster-wide: leave none behind.
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


@pytest.fixture
def seeded(database_url: str, store: StudyStore) -> Iterator[Seeded]:
    """A seeded database, rolled up by the scheduled refresh and then added to,
    read through a connection acting as the views-only reader role."""
    seed_study(store, n_clients=30, rng=11, spread=timedelta(days=14), live=True)
    seed_paired_trials(database_url, fallbacks=2)
    (run_id, _) = seed_router(database_url)
    seed_atlas(database_url)
    seed_item_runs(database_url)
    rollups.refresh(database_url)
    # Sessions finished after the refresh: the rollup views add them live.
    seed_study(store, n_clients=10, rng=12, spread=timedelta(days=3))
    with psycopg.connect(db.libpq_url(database_url)) as admin:
        row = admin.execute(
            "SELECT min(recorded_at), max(recorded_at) FROM router_telemetry WHERE run_id = %s",
            (run_id,),
        ).fetchone()
    assert row is not None
    window = TimeRange(row[0] - timedelta(minutes=1), row[1] + timedelta(minutes=1))
    with reader(database_url) as conn:
        yield Seeded(conn, window)


def _run(conn: psycopg.Connection, query: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    cur = conn.execute(query)
    assert cur.description is not None
    return [c.name for c in cur.description], cur.fetchall()


def test_reader_role_cannot_read_tables_or_rollups(seeded: Seeded) -> None:
    tables = (
        "sessions", "probe_outcomes", "clients", "flows", "trials", "runners", "item_runs",
        "router_telemetry_1s", "router_telemetry_1m", "rollup_refreshes", "unit_counts",
        "unit_counts_daily", "unit_counts_pending", "mv_flow_hourly",
    )  # fmt: skip
    for table in tables:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            seeded.conn.execute(f"SELECT 1 FROM {table} LIMIT 1")
    _, rows = _run(seeded.conn, "SELECT count(*) FROM v_session_rollup")
    assert rows[0][0] > 0


def variable_values(
    conn: psycopg.Connection,
    path: Path,
    time_range: TimeRange,
    pinned: dict[str, str],
    *,
    choose_all: bool,
) -> dict[str, Selection]:
    """Each variable's selection, in order (later ones may use earlier ones):
    "All" where offered and ``choose_all``, else the first value, or the value
    ``pinned`` names. A query variable's values come from running its query."""
    out: dict[str, Selection] = {}
    for v in template_variables(path):
        if v["type"] == "custom":
            values = [value for _, value in custom_options(v["query"])]
        else:
            columns, rows = _run(conn, expand(v["query"], time_range, variables=out))
            at = columns.index("__value") if "__value" in columns else 0
            values = [str(r[at]) for r in rows]
        if v["name"] in pinned:
            assert pinned[v["name"]] in values, (v["name"], values)
            out[v["name"]] = Selection((pinned[v["name"]],), bool(v.get("multi")))
        elif not values and v.get("includeAll"):
            out[v["name"]] = select(v, values, choose_all=True)  # Grafana falls back to All
        else:
            assert values, f"variable ${v['name']} has no values"
            out[v["name"]] = select(v, values, choose_all=choose_all)
    return out


def test_every_panel_query_runs_on_seeded_data(seeded: Seeded, subtests: pytest.Subtests) -> None:
    month = TimeRange.last(timedelta(days=30))
    scenarios: list[tuple[str, list[Path], TimeRange, dict[str, str], bool]] = [
        # The dashboards as they open: every panel shows something.
        ("all", DASHBOARDS, month, {}, True),
        # One value per variable (Atlas, its first country and network).
        ("first", DASHBOARDS, month, {}, False),
        ("atlas", [DASHBOARD_DIR / "fragment-viability.json"], month, {"source": "atlas"}, False),
        # Zoomed in on one router run: the per-second rollup.
        ("zoom", [DASHBOARD_DIR / "edge-router.json"], seeded.router_window, {}, True),
    ]
    for scenario, paths, time_range, pinned, choose_all in scenarios:
        for path in paths:
            variables = variable_values(
                seeded.conn, path, time_range, pinned, choose_all=choose_all
            )
            for q in panel_queries([path]):
                with subtests.test(msg=f"{scenario}: {q.name}"):
                    interval = panel_interval(time_range, q.min_interval)
                    query = expand(q.raw_sql, time_range, interval, variables)
                    columns, rows = _run(seeded.conn, query)
                    if scenario in ("all", "zoom"):
                        assert rows, f"{q.name} returned no rows"
                    if rows:
                        check_columns(q, columns, rows)


def check_columns(q: PanelQuery, columns: list[str], rows: list[tuple[Any, ...]]) -> None:
    """The columns the panel reads are there, with values of the right kind."""
    assert EXPECTED_COLUMNS.get(q.title, set()) <= set(columns), columns
    if q.fmt == "time_series":
        _check_time_series(columns, rows)
    # Field overrides name the columns they style.
    for o in q.field_config.get("overrides", []):
        matcher = o["matcher"]
        if matcher["id"] == "byName":
            assert matcher["options"] in columns, f"override for {matcher['options']}: {columns}"
        elif matcher["id"] == "byRegexp":
            pattern = re.compile(matcher["options"])
            assert any(pattern.fullmatch(c) for c in columns), f"{pattern.pattern}: {columns}"
    for t in q.transformations:
        names = set(t.get("options", {}).get("renameByName", {}))
        names |= set(t.get("options", {}).get("indexByName", {}))
        assert names <= set(columns), (t["id"], names - set(columns))
    x_field = q.options.get("xField")
    if x_field:
        assert x_field in columns, f"xField {x_field} not among {columns}"
        # Bar charts take x as text (categories) in row order: sizes must
        # come in numeric order, not text order ('1004' before '108').
        xs = [int(r[columns.index(x_field)]) for r in rows]
        assert xs == sorted(xs), f"{x_field} out of numeric order"
    if q.panel_type in ("barchart", "histogram", "bargauge"):
        numeric = [
            c for c in columns if c != x_field and not isinstance(rows[0][columns.index(c)], str)
        ]
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
        assert all(isinstance(r[i], int | float) for i in values), r
    if "metric" in columns:
        m = columns.index("metric")
        assert all(isinstance(r[m], str) for r in rows)


# -- panels checked on data seeded for them ---------------------------------------------------


def panel_rows(
    conn: psycopg.Connection,
    dashboard: str,
    title: str,
    pinned: dict[str, str] | None = None,
    forced: dict[str, Selection] | None = None,
) -> list[dict[str, Any]]:
    """One panel's rows over the last 30 days, its variables at "All" (or
    ``pinned``; ``forced``: a value the variable does not offer, as a link's
    ``var-NAME=VALUE`` gives it), as Grafana would ask for them; its columns
    checked."""
    path = DASHBOARD_DIR / dashboard
    month = TimeRange.last(timedelta(days=30))
    variables = variable_values(conn, path, month, pinned or {}, choose_all=True) | (forced or {})
    (q,) = [q for q in panel_queries([path]) if q.title == title]
    query = expand(q.raw_sql, month, panel_interval(month, q.min_interval), variables)
    columns, rows = _run(conn, query)
    if rows:
        check_columns(q, columns, rows)
    return [dict(zip(columns, r, strict=True)) for r in rows]


@dataclass(frozen=True)
class KnownSession:
    """A session with known counts: the first ``whole_lost`` whole probes and
    the first ``split_lost`` splits lost, ``split_invalid`` of those while the
    client's kernel refused fragments; ``probes`` of each phase at most."""

    name: str
    whole_lost: int
    split_lost: int
    split_invalid: int = 0
    probes: int | None = None


# With the seed's plan: 125 whole probes and 115 splits.
KNOWN = (
    # No whole loss: no split/whole ratio (the old panel left it out), a bound
    # of 0 and a slack of 3/115; 10 lost splits are well above it.
    KnownSession("no whole loss, above", 0, 10),
    KnownSession("above, ratio 8.7", 5, 40),
    # A ratio of 3.3 (the old panel: "above 2x"), but within the bound
    # (4.7%) plus 3 standard errors (5.9 points) at 115 splits.
    KnownSession("ratio 3.3, within", 3, 9),
    KnownSession("no loss", 0, 0),
    # The verdict's test does not apply: rules 2, 1, 1 and 0.
    KnownSession("intolerant", 2, 115),
    KnownSession("too lossy", 70, 80),
    KnownSession("too few probes", 0, 5, probes=15),
    KnownSession("kernel refused fragments", 1, 20, split_invalid=12),
)


def seed_known(store: StudyStore, k: KnownSession, n: int) -> dict[str, Any]:
    """Stored through the StudyStore as the engine would, the verdict by
    kickass_core.verdict.decide; returns its valid counts and verdict."""
    plan = default_plan()
    sid = f"{0xC0FFEE00 + n:016x}"
    t0 = datetime.now(UTC) - timedelta(hours=1)
    store.create_session(
        session_id=sid, cookie_hash=bytes(32), plan=plan.to_json(),
        source_address="192.0.2.7", expires_at=t0 + timedelta(hours=3),
        server_version="0.1.0", client_version="0.1.0", install_id=f"known-{n}",
    )  # fmt: skip
    store.apply(RunProbing(sid, "192.0.2.7", 40000, 20.0))
    seen = {"whole": 0, "split": 0}
    outcomes = []
    for seq in range(plan.total_probes):
        probe = plan.probe(seq)
        i = seen[probe.phase]
        seen[probe.phase] += 1
        if k.probes is not None and i >= k.probes:
            continue
        lost = i < (k.whole_lost if probe.phase == "whole" else k.split_lost)
        sent_at = 0.002 * seq  # seconds after t0, the batch's anchor
        outcomes.append(
            OutcomeEntry(seq, probe.phase, probe.ip_len, "lost", sent_at, None, 0, None, None,
                         reassembly_invalid=probe.phase == "split" and i < k.split_invalid)
            if lost
            else OutcomeEntry(seq, probe.phase, probe.ip_len, "acked", sent_at, sent_at + 0.020,
                              ack_count=1, received_len=probe.udp_payload_len,
                              observed_frag_size=None)
        )  # fmt: skip
    store.apply(OutcomeBatch(sid, tuple(outcomes), ClockAnchor(t0.timestamp(), 0.0)))
    counts = {
        phase: (
            sum(o.phase == phase and not o.reassembly_invalid for o in outcomes),
            sum(o.phase == phase and o.outcome == "acked" for o in outcomes),
        )
        for phase in ("whole", "split")
    }
    v = verdict.decide(*counts["whole"], *counts["split"], split_invalid=k.split_invalid)
    assert store.apply(RunFinished(sid, "complete", v.verdict, v.reason, None))
    return {"session_id": sid, "counts": counts, "verdict": v}


def test_split_drop_panels_are_the_verdicts_test(database_url: str, store: StudyStore) -> None:
    """The study's split-against-whole panels apply the verdict's rule 3 (split
    drop above the two-fragment bound plus 3 standard errors) to exactly the
    sessions the rule decides, sessions without whole loss included, and show
    the stored excess with its interval: on sessions seeded with known counts,
    half rolled up by the refresh and half finished since."""
    known = {}
    for n, k in enumerate(KNOWN):
        if n == len(KNOWN) // 2:
            rollups.refresh(database_url)
        known[k.name] = seed_known(store, k, n)
    tested, above, excess = set(), set(), {}
    for name, s in known.items():
        (ws, wa), (ss, sa) = s["counts"]["whole"], s["counts"]["split"]
        # The rule's own words: rule 3 decided it (within, or above: inconclusive).
        if "two-fragment bound" in s["verdict"].reason:
            tested.add(name)
            if s["verdict"].verdict == verdict.INCONCLUSIVE:
                above.add(name)
            excess[name] = verdict.excess(ws, wa, ss, sa)
    assert tested == {"no whole loss, above", "above, ratio 8.7", "ratio 3.3, within", "no loss"}
    assert above == {"no whole loss, above", "above, ratio 8.7"}
    by_id = {s["session_id"]: name for name, s in known.items()}
    with reader(database_url) as conn:
        (stat,) = panel_rows(conn, "fragment-viability.json", ABOVE_BOUND)
        assert stat["tested sessions"] == len(tested) == 4
        assert stat["above the bound"] == len(above) == 2
        assert stat["share of tested sessions"] == pytest.approx(0.5)
        assert stat["excess interval above 0"] == sum(e.low > 0 for e in excess.values()) >= 2

        table = panel_rows(conn, "fragment-viability.json", EXCESS_TABLE)
        rows = {by_id[r["session_id"]]: r for r in table}
        assert set(rows) == tested
        for name, r in rows.items():
            (ws, wa), (ss, sa) = known[name]["counts"]["whole"], known[name]["counts"]["split"]
            bound = verdict.two_fragment_bound(1 - wa / ws)
            assert r["two-fragment bound"] == pytest.approx(bound, abs=1e-12)
            assert r["bound + 3 SE"] == pytest.approx(bound + verdict.slack(bound, ss), abs=1e-12)
            assert r["above the bound"] is (name in above), name
            e = excess[name]
            got = (r["split_excess_drop"], r["split_excess_low"], r["split_excess_high"])
            assert got == pytest.approx((e.estimate, e.low, e.high), abs=1e-9), name
        # Above the bound first; the ratio the old panel tested says otherwise.
        assert {by_id[r["session_id"]] for r in table[:2]} == above
        assert rows["no whole loss, above"]["split_to_whole_ratio"] is None
        assert rows["ratio 3.3, within"]["split_to_whole_ratio"] > 2
        assert rows["no loss"]["split_excess_low"] < 0 < rows["no loss"]["split_excess_high"]

        histogram = panel_rows(conn, "fragment-viability.json", EXCESS_HISTOGRAM)
        want = sorted(e.estimate for e in excess.values())
        assert [r["split drop - bound"] for r in histogram] == pytest.approx(want, abs=1e-9)

        # Atlas probes alone: none of these volunteer sessions. The source
        # filter offers the sources with rows (volunteers alone here), so
        # Atlas is asked for as a link would.
        only_atlas = {"source": Selection(("atlas",), multi=True)}
        (atlas,) = panel_rows(conn, "fragment-viability.json", ABOVE_BOUND, forced=only_atlas)
        assert atlas["tested sessions"] == 0
        assert panel_rows(conn, "fragment-viability.json", EXCESS_TABLE, forced=only_atlas) == []


def test_fallback_panel_counts_what_each_flow_negotiated(database_url: str) -> None:
    """Kick-Ass flows that negotiated TCP are counted per arm: three seeded
    per trial, out of 2 pairs x 20 Kick-Ass flows, before and after the
    refresh that rolls the flows up."""
    seed_paired_trials(database_url, pairs=2, flows_per_period=20, fallbacks=3)
    rollups.refresh(database_url)
    with reader(database_url) as conn:
        rows = panel_rows(conn, "wide-area-trials.json", FALLBACKS)
        truth = conn.execute(
            "SELECT destination, arm, count(*), "
            "count(*) FILTER (WHERE negotiated_protocol = 'tcp') FROM v_flow_results "
            "WHERE protocol = 'kickass' GROUP BY 1, 2 ORDER BY 1, 2"
        ).fetchall()
    got = [(r["destination"], r["arm"], r["Kick-Ass flows"], r["fell back to TCP"]) for r in rows]
    assert got == truth == [("far-1", "kickass", 40, 3), ("far-2", "kickass", 40, 3)]
    assert all(r["share fell back"] == pytest.approx(3 / 40) for r in rows)


def test_the_headline_pools_the_flows_finished_sooner(database_url: str) -> None:
    """The trials' headline stat shows, beside the matched speedup, the share
    of matched flows finished sooner under Kick-Ass with failures kept and
    each arm's completion, pooled over the destinations shown: as
    ``stats.sooner`` over every matched flow, counted here from the flows
    (seeded: one Kick-Ass and two CUBIC flows of each trial failed)."""
    seed_paired_trials(database_url, pairs=2, flows_per_period=20)
    rollups.refresh(database_url)
    with reader(database_url) as conn:
        (row,) = panel_rows(conn, "wide-area-trials.json", SPEEDUP_STAT)
        flows = conn.execute(
            "SELECT trial_id, pair, flow_index, arm, fct_ms FROM v_flow_results"
        ).fetchall()
    twins: dict[tuple[str, int, int], dict[str, float | None]] = {}
    for trial_id, pair, index, arm, fct in flows:
        twins.setdefault((trial_id, pair, index), {})[arm] = fct
    pairs = [(t["kickass"], t["tcp:cubic"]) for t in twins.values()]
    truth = stats.sooner(pairs)
    assert truth.pairs == 80 and truth.completion_kickass == pytest.approx(78 / 80)
    assert row["finished sooner, failures kept"] == pytest.approx(truth.estimate)
    assert row["completed: Kick-Ass"] == pytest.approx(78 / 80)
    assert row["completed: TCP"] == pytest.approx(76 / 80)
    assert row["speedup"] == pytest.approx(stats.speedup(pairs).estimate)


# -- every column read exists at head ------------------------------------------------------
#
# Each SQL text a panel (expanded), a variable, a notebook or the report runs is
# split into identifiers. Every identifier must be SQL (a keyword, a function,
# a type, a date part), a name the statement itself declares (an alias, a CTE,
# a relation alias), a view it reads, or a column of one of the views it reads
# in the schema at head. A migration that drops (or renames) a column someone
# reads leaves an identifier that is none of these, and the test names it.
# (A column named like an SQL keyword, e.g. ``matched`` or ``day``, or read only
# under an alias of its own name, ``max(x) AS x``, cannot be told from the
# keyword or the alias this way; PostgreSQL itself catches those when the
# panels and notebooks run on the schema, above and in test_notebooks.py.)

_RELATION = re.compile(r"\b(?:FROM|JOIN)\s+([a-zA-Z_]\w*)", re.IGNORECASE)
_WORD = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*")
# extract()'s fields and make_interval()'s argument names.
_DATE_PARTS = {
    "epoch", "second", "minute", "hour", "day", "week", "month", "year", "microseconds",
    "secs", "mins", "hours", "days", "weeks", "months", "years",
}  # fmt: skip


@dataclass(frozen=True)
class Schema:
    columns: dict[str, set[str]]  # view -> its columns
    sql_words: set[str]  # keywords, functions, types (lower case)


@dataclass(frozen=True)
class Reader:
    who: str
    sql: str


def _strip(sql_text: str) -> str:
    """SQL without comments, string literals, quoted identifiers and parameters."""
    s = re.sub(r"--[^\n]*", " ", sql_text)
    s = re.sub(r"/\*.*?\*/", " ", s, flags=re.S)
    s = re.sub(r"'(?:[^']|'')*'", " '' ", s)
    s = re.sub(r'"(?:[^"]|"")*"', " _quoted_ ", s)
    s = re.sub(r"(?<!:):[A-Za-z_]\w*", " 0 ", s)  # :name binds (not ::casts)
    s = re.sub(r"%\(\w+\)s", " 0 ", s)
    # extract(field FROM x) is no relation
    s = re.sub(r"\bextract\s*\(\s*\w+\s+from\b", "extract(", s, flags=re.IGNORECASE)
    return s


def _declared(s: str) -> set[str]:
    names = set(re.findall(r"\bAS\s+([A-Za-z_]\w*)", s, re.IGNORECASE))
    names |= set(re.findall(r"\b([A-Za-z_]\w*)\s+AS\s*\(", s, re.IGNORECASE))  # CTEs
    # Relation and subquery aliases: FROM v_x [AS] a, JOIN v_y b, ) [AS] c
    for m in re.finditer(r"(?:\b(?:FROM|JOIN)\s+[A-Za-z_]\w*|\))\s+(?:AS\s+)?([A-Za-z_]\w*)", s,
                         re.IGNORECASE):  # fmt: skip
        names.add(m.group(1))
    return {n.lower() for n in names}


def unresolved(reader: Reader, schema: Schema) -> tuple[set[str], set[tuple[str, str]]]:
    """(identifiers that are nothing at head, (view, column) pairs read)."""
    s = _strip(reader.sql)
    views = {v.lower() for v in _RELATION.findall(s)}
    declared = _declared(s) - views
    known = schema.sql_words | _DATE_PARTS | views | declared | {"_quoted_"}
    columns = set().union(*(schema.columns.get(v, set()) for v in views)) if views else set()
    bad: set[str] = set()
    used: set[tuple[str, str]] = set()
    for m in _WORD.finditer(s):
        word = m.group(0).lower()
        if word in columns:
            used |= {(v, word) for v in views if word in schema.columns.get(v, set())}
        elif word not in known and not word.isdigit():
            bad.add(word)
    bad |= {v for v in views if v not in schema.columns}
    return bad, used


def _python_sql(source: str) -> list[str]:
    """String constants in Python source that read a view."""
    source = "\n".join(ln for ln in source.splitlines() if not ln.lstrip().startswith(("%", "!")))
    return [
        n.value
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and "FROM v_" in n.value
    ]


def _report_sql() -> list[str]:
    """The report's SQL (analysis/kickass_analysis/report/readers.py, if it exists):
    its module's strings that read a view, templating placeholders removed;
    a statement whose view name is itself a placeholder is left out."""
    if not REPORT.exists():
        return []
    try:
        import kickass_analysis.report.readers as report

        texts = [v for v in vars(report).values() if isinstance(v, str) and "FROM v_" in v]
    except Exception:  # noqa: BLE001 - another engineer's module mid-change: read its text
        texts = _python_sql(REPORT.read_text())
    out = []
    for t in texts:
        if re.search(r"\b(?:FROM|JOIN)\s+v_\w*\{", t):
            continue
        out.append(re.sub(r"\{+[^{}]*\}+", " ", t))
    return out


def readers(conn: psycopg.Connection | None = None) -> list[Reader]:
    """Every SQL text read by a panel, a variable, a notebook or the report."""
    month = TimeRange.last(timedelta(days=30))
    out = []
    for path in DASHBOARDS:
        variables: dict[str, Selection] = {}
        for v in template_variables(path):
            if v["type"] == "query":
                query = expand(v["query"], month, variables=variables)
                out.append(Reader(f"{path.name} ${v['name']}", query))
                values: tuple[str, ...] = ("1",)
            else:
                values = tuple(value for _, value in custom_options(v["query"]))
            variables[v["name"]] = Selection(values, bool(v.get("multi")))
        for q in panel_queries([path]):
            interval = panel_interval(month, q.min_interval)
            out.append(Reader(q.name, expand(q.raw_sql, month, interval, variables)))
    for nb_path in NOTEBOOKS:
        nb = nbformat.read(nb_path, as_version=4)
        for i, c in enumerate(nb.cells):
            if c.cell_type == "code":
                out += [Reader(f"{nb_path.name} cell {i}", t) for t in _python_sql(c.source)]
    out += [Reader(f"{REPORT.name}", t) for t in _report_sql()]
    return out


@pytest.fixture
def head_schema(database_url: str) -> Schema:
    with psycopg.connect(db.libpq_url(database_url)) as conn:
        columns: dict[str, set[str]] = {}
        for view, column in conn.execute(
            "SELECT table_name, column_name FROM information_schema.columns "
            "WHERE table_schema = 'public' AND table_name LIKE 'v\\_%'"
        ):
            columns.setdefault(view, set()).add(column)
        words = {r[0] for r in conn.execute("SELECT word FROM pg_get_keywords()")}
        words |= {r[0] for r in conn.execute("SELECT DISTINCT proname FROM pg_proc")}
        words |= {r[0] for r in conn.execute("SELECT DISTINCT typname FROM pg_type")}
    return Schema(columns, {w.lower() for w in words})


def test_every_column_read_exists_at_head(head_schema: Schema) -> None:
    found = readers()
    whos = {re.split(r"[ #]", r.who)[0] for r in found}
    assert {p.name for p in DASHBOARDS} <= whos
    assert {p.name for p in NOTEBOOKS} <= whos, "a notebook's SQL was not found"
    problems = []
    used: set[tuple[str, str]] = set()
    for r in found:
        bad, cols = unresolved(r, head_schema)
        used |= cols
        if bad:
            problems.append(f"{r.who}: {sorted(bad)}")
    assert not problems, "read but not in the schema at head:\n" + "\n".join(problems)
    # The check sees real columns: the panels alone read well over a hundred.
    assert len(used) > 100, len(used)


def test_dropping_a_column_someone_reads_is_caught(head_schema: Schema) -> None:
    """The check above on a schema where a migration dropped columns that a
    panel, a notebook and the report read."""
    found = readers()
    for view, column, reader in (
        ("v_session_rollup", "split_to_whole_ratio", "fragment-viability.json"),
        ("v_drop_rollup", "largest_fragment_as_sent", "fragment-viability.json"),
        ("v_trial_speedups", "speedup_low", "wide-area-trials.json"),
        ("v_router_telemetry_1m", "kickass_samples", "edge-router.json"),
        ("v_item_runs", "reason", "schedule-health.json"),
        ("v_size_drop_all", "fragmented_on_arrival", "fragment_viability.ipynb"),
        ("v_trial_speedups", "completion_baseline", "wide_area_trials.ipynb"),
        ("v_router_telemetry_1s", "ka_mode_share", "edge_router.ipynb"),
        ("v_atlas_campaigns", "credits_spent", "atlas.ipynb"),
    ):
        columns = {v: set(c) for v, c in head_schema.columns.items()}
        columns[view].discard(column)
        dropped = Schema(columns, head_schema.sql_words)
        caught = {re.split(r"[ #]", r.who)[0] for r in found if column in unresolved(r, dropped)[0]}
        assert reader in caught, (view, column, caught)
    if REPORT.exists() and _report_sql():
        columns = {v: set(c) for v, c in head_schema.columns.items()}
        columns["v_item_runs"].discard("dead_attempts")
        dropped = Schema(columns, head_schema.sql_words)
        assert any(
            "dead_attempts" in unresolved(r, dropped)[0] for r in found if r.who == REPORT.name
        )
