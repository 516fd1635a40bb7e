"""Study sources as a registry (issue 26 part 1): a new source is a package
of its own. The throwaway ``demo`` source (tests/support/sources/) is put on
PYTHONPATH beside a ``*.dist-info`` naming it in ``kickass.sources``, with no
edit to any other package; the real ``kickass`` command then takes it
everywhere the sources are named."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, date, datetime
from pathlib import Path

import psycopg
import pytest
from kickass_core import sources
from kickass_core.errors import KickassError
from support.grafana import DASHBOARD_DIR, TimeRange, expand, template_variables

SUPPORT = Path(__file__).parent / "support" / "sources"
DASHBOARD = DASHBOARD_DIR / "fragment-viability.json"
KICKASS = str(Path(sys.executable).with_name("kickass"))


def _run(*argv: str, demo: bool, url: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("KICKASS_DATABASE_URL", "KICKASS_CONFIG", "PYTHONPATH")}  # fmt: skip
    if demo:
        env["PYTHONPATH"] = str(SUPPORT)
    if url:
        env["KICKASS_DATABASE_URL"] = url
    return subprocess.run(list(argv), capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture
def registry() -> Iterator[None]:
    sources.sources.cache_clear()
    yield
    sources.sources.cache_clear()


def _drop_rollup(conn: psycopg.Connection) -> list[tuple[object, ...]]:
    return conn.execute(
        "SELECT source, (day AT TIME ZONE 'UTC')::date, phase, ip_len, sessions::int, sent::int, "
        "acked::int FROM v_drop_rollup ORDER BY 1, 2, 3, 4"
    ).fetchall()


def _size_by_source(conn: psycopg.Connection) -> list[tuple[object, ...]]:
    return conn.execute(
        "SELECT source, ip_len, sessions::int, sent::int, acked::int, rtt_ms_median, "
        "fragmented_on_arrival::int FROM v_size_drop_by_source WHERE source = 'demo' "
        "ORDER BY ip_len"
    ).fetchall()


def _dist(root: Path, name: str, entry: str) -> None:
    info = root / f"{name.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[kickass.sources]\n{entry}\n")


def test_volunteers_and_atlas_are_the_registered_sources(registry: None) -> None:
    assert sources.names() == ("volunteer", "atlas")
    atlas = sources.get("atlas")
    assert atlas.item_kind == "atlas" and atlas.item_needs == ("campaign",)
    assert sources.by_kind("atlas") is atlas and sources.by_kind("refresh") is None
    with pytest.raises(KickassError, match="no study source 'mars'") as err:
        sources.get("mars")
    assert err.value.hint and "volunteer, atlas" in err.value.hint


def test_a_duplicate_or_misnamed_source_is_refused_naming_the_packages(
    registry: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(SUPPORT))
    assert sources.names() == ("volunteer", "atlas", "demo")
    twin = tmp_path / "twin"
    _dist(twin, "kickass-demo-twin", "demo = kickass_demo_source:SOURCE")
    monkeypatch.syspath_prepend(str(twin))
    sources.sources.cache_clear()
    with pytest.raises(KickassError, match="two study sources register the name 'demo'") as err:
        sources.sources()
    assert "kickass-demo-source" in err.value.message
    assert "kickass-demo-twin" in err.value.message
    monkeypatch.syspath_prepend(str(SUPPORT))  # only the misnamed one beside it
    sys.path.remove(str(twin))
    misnamed = tmp_path / "misnamed"
    _dist(misnamed, "kickass-misnamed", "other = kickass_demo_source:SOURCE")
    monkeypatch.syspath_prepend(str(misnamed))
    sources.sources.cache_clear()
    with pytest.raises(KickassError, match="registered as 'other' but is named 'demo'"):
        sources.sources()


def test_a_new_source_is_a_package_of_its_own(database_url: str, tmp_path: Path) -> None:
    sys.path.insert(0, str(SUPPORT))
    try:
        demo = importlib.import_module("kickass_demo_source")
    finally:
        sys.path.remove(str(SUPPORT))
    # Its one migration, then its rows.
    with psycopg.connect(database_url, autocommit=True) as conn:
        for statement in demo.MIGRATION:
            conn.execute(statement)
        conn.execute(
            "INSERT INTO demo_units VALUES ('p1-1500', '2026-11-20T10:00Z', 'whole', 1500, 10, 9),"
            " ('p1-1400', '2026-11-20T11:00Z', 'whole', 1400, 10, 10),"
            " ('p2-1500', '2026-11-01T10:00Z', 'whole', 1500, 10, 2)"
        )
    # Its durable counts: in v_drop_rollup (0026), so in the report and the
    # dashboards' source filter, before and after the refresh folds them.
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(demo.WRITE_COUNTS)
        counted = [
            ("demo", date(2026, 11, 1), "whole", 1500, 1, 10, 2),
            ("demo", date(2026, 11, 20), "whole", 1400, 1, 10, 10),
            ("demo", date(2026, 11, 20), "whole", 1500, 1, 10, 9),
        ]
        assert _drop_rollup(conn) == counted
        # ... and pooled per size in v_size_drop_by_source (0028), no union of its own.
        pooled = [("demo", 1400, 1, 10, 10, None, 0), ("demo", 1500, 2, 20, 11, None, 0)]
        assert _size_by_source(conn) == pooled
        conn.execute("SELECT fold_unit_count_changes()")
        assert _drop_rollup(conn) == counted
        assert _size_by_source(conn) == pooled
        (source_filter,) = [v for v in template_variables(DASHBOARD) if v["name"] == "source"]
        month = TimeRange(datetime(2026, 10, 25, tzinfo=UTC), datetime(2026, 11, 25, tzinfo=UTC))
        listed = conn.execute(expand(source_filter["query"], month)).fetchall()
        assert listed == [("demo",)]
    res = _run(
        KICKASS, "report", "-o", str(tmp_path / "r.html"), "--json", demo=True, url=database_url
    )
    assert res.returncode == 0, res.stderr
    assert '"size_demo"' in res.stdout, res.stdout
    page = (tmp_path / "r.html").read_text()
    assert (
        "<td>demo university probes</td>" in page and 'data-series="demo-university-probes"' in page
    )
    assert "#2ca02c" in page  # its colour
    # export: its view, filtered by its source and its time column.
    out = tmp_path / "out"
    argv = [KICKASS, "export", "v_demo_units", "--format", "csv", "--source", "demo",
            "--since", "2026-11-15", "-o", str(out), "--json"]  # fmt: skip
    res = _run(*argv, demo=True, url=database_url)
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["rows"] == 2 and summary["filters"]["source"] == "demo", summary
    res = _run(*argv, demo=False, url=database_url)
    assert res.returncode == 2 and "no study source 'demo' here" in res.stderr, res.stderr
    assert "volunteer, atlas" in res.stderr
    # Another source's view refuses it, naming the demo's own view.
    res = _run(KICKASS, "export", "v_session_summary", "--format", "csv", "--source", "demo",
               "-o", str(out), demo=True, url=database_url)  # fmt: skip
    assert res.returncode == 2 and "only volunteer rows" in res.stderr, res.stderr
    assert "demo rows only: v_demo_units" in res.stderr
    # The schedule file takes its kind, with the settings the source says it needs.
    schedule = tmp_path / "s.toml"
    schedule.write_text('[[item]]\nname = "demo-hourly"\nkind = "demo"\ncron = "0 * * * *"\n'
                        'directory = "demo-out"\n')  # fmt: skip
    res = _run(KICKASS, "schedule", "check", str(schedule), "--json", demo=True)
    assert res.returncode == 0, res.stderr
    (row,) = json.loads(res.stdout)["items"]
    assert row["kind"] == "demo" and row["note"] is None, row
    # A host without the package reads the file and leaves the item to others.
    res = _run(KICKASS, "schedule", "check", str(schedule), "--json", demo=False)
    assert res.returncode == 0, res.stderr
    (row,) = json.loads(res.stdout)["items"]
    assert row["note"].startswith("not run here: kind 'demo' is not known on this host"), row
    schedule.write_text('[[item]]\nname = "demo-hourly"\nkind = "demo"\ncron = "0 * * * *"\n')
    res = _run(KICKASS, "schedule", "check", str(schedule), demo=True)
    assert res.returncode != 0 and "a demo item needs 'directory'" in res.stderr, res.stderr
    # Its runner, its colour in the figures, its title in the report.
    probe = (
        "from datetime import UTC, datetime\n"
        "from types import SimpleNamespace as NS\n"
        "from kickass_analysis import figures\n"
        "from kickass_analysis.report import study\n"
        "from kickass_operations.items import kind_function\n"
        "from kickass_operations.schedule_file import database_kinds, kinds\n"
        "ctx = NS(due_at=datetime(2026, 11, 20, tzinfo=UTC))\n"
        "r = kind_function('demo')(NS(directory='d'), ctx)\n"
        "print(r.outcome, r.counts['directory'], figures.source_colour('demo'),"
        " study.source_title('demo'), 'demo' in kinds(), 'demo' in database_kinds(), sep='|')\n"
    )
    res = _run(sys.executable, "-c", probe, demo=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok|d|#2ca02c|demo university probes|True|True"
