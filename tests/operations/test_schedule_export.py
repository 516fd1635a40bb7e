"""The scheduled ``export`` item: each run exports what arrived since the last
``ok`` one (its upper bound is the next run's lower bound), in dated files with
each view's schema beside them; views that pool all time go whole."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import kickass_db as db
from kickass_db.study_store import StudyStore
from sqlalchemy import text
from support.schedule import item_runs, run_schedule, schedule_env, stable_cron, write_schedule
from support.seed import seed_study


def count(url: str, sql: str, **params: object) -> int:
    engine = db.make_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(text(sql), params).scalar() or 0)
    finally:
        engine.dispose()


def test_each_export_starts_where_the_last_one_ended(tmp_path: Path, database_url: str) -> None:
    store = StudyStore(database_url)
    try:
        seed_study(store, n_clients=30, rng=3, spread=timedelta(minutes=30))
    finally:
        store.close()
    out = tmp_path / "export"
    item = {"name": "export", "kind": "export", "directory": "export", "format": "csv",
            "views": ["v_verdicts_by_source", "v_size_drop_by_source"]}  # fmt: skip
    env = schedule_env(database_url, "host-a")
    bounds = []
    for minutes_ago in (20, 2):  # two due times of the same item, in order
        cron, due = stable_cron(minutes_ago)
        schedule = write_schedule(tmp_path / "s.toml", [{**item, "cron": cron}], name="export")
        proc = run_schedule(schedule, env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        bounds.append(due)
    first, second = sorted(item_runs(database_url), key=lambda r: r["due_at"])
    assert first["counts"]["since"] is None
    assert first["counts"]["until"] == bounds[0].isoformat()
    assert second["counts"]["since"] == bounds[0].isoformat()
    assert second["counts"]["until"] == bounds[1].isoformat()
    assert second["counts"]["whole_views"] == ["v_size_drop_by_source"]
    # Exactly the rows of each window, as a plain WHERE selects them.
    for run, lo in ((first, None), (second, bounds[0])):
        hi = datetime.fromisoformat(run["counts"]["until"])
        expected = count(
            database_url,
            "SELECT count(*) FROM v_verdicts_by_source WHERE finished_at < :hi "
            "AND (CAST(:lo AS timestamptz) IS NULL OR finished_at >= :lo)",
            lo=lo, hi=hi,
        )  # fmt: skip
        assert run["counts"]["rows"]["v_verdicts_by_source"] == expected
    assert first["counts"]["rows"]["v_verdicts_by_source"] > 0
    # Every file named in the counts exists, each data file with its schema.
    files = [Path(p) for r in (first, second) for p in r["counts"]["files"]]
    assert all(p.exists() and p.parent == out for p in files)
    schemas = [p for p in files if p.name.endswith(".schema.json")]
    assert len(schemas) == 4
    for s in schemas:
        assert json.loads(s.read_text())["view"] in item["views"]
    assert datetime.now(UTC) > bounds[1]
