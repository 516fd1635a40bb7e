"""`GET /metrics` of the server: the probe engine's counters and the scheduled
runs, in the Prometheus text format, and only for the allowed networks."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from flask.testing import FlaskClient
from kickass_db.schedule_store import ScheduleStore
from kickass_db.study_store import StudyStore
from kickass_server.api import ApiConfig, create_app
from kickass_server.engine import ProbeEngine
from kickass_server.policy import Policy
from prometheus_client.parser import text_string_to_metric_families
from support.schedule import write_schedule


@pytest.fixture
def app(
    database_url: str, tmp_path: Path
) -> Iterator[tuple[FlaskClient, ProbeEngine, ScheduleStore]]:
    study, schedule = StudyStore(database_url), ScheduleStore(database_url)
    policy = Policy(sessions_per_address=1, sessions_per_prefix=10, max_sessions=100)
    engine = ProbeEngine(study, policy, probe_port=9000, server_version="metrics")
    # The scheduled runs' item labels come from the server's schedule file.
    items = [{"name": "nightly", "kind": "refresh", "cron": "0 3 * * *"}]
    config = ApiConfig(schedule_file=str(write_schedule(tmp_path / "s.toml", items)))
    client = create_app(engine, study, config, schedule=schedule).test_client()
    try:
        yield client, engine, schedule
    finally:
        engine.stop()
        study.close()
        schedule.close()


def samples(client: FlaskClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = client.get("/metrics", environ_base={"REMOTE_ADDR": "127.0.0.1"})
    assert r.status_code == 200 and r.mimetype == "text/plain"
    out = {}
    for fam in text_string_to_metric_families(r.get_data(as_text=True)):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_count_what_the_engine_and_the_schedule_did(
    app: tuple[FlaskClient, ProbeEngine, ScheduleStore],
) -> None:
    client, engine, schedule = app
    before = samples(client)
    assert before[("kickass_server_sessions_live", ())] == 0
    assert before[("kickass_server_admission_denied_total", ())] == 0
    # One session per address: the second is refused by the abuse limits.
    for _ in range(2):
        client.post("/api/v1/sessions", json={"plan": {"quick": True}},
                    environ_base={"REMOTE_ADDR": "198.51.100.7"})  # fmt: skip
    run = schedule.claim("nightly", "refresh", datetime(2026, 11, 25, 3, tzinfo=UTC), "h",
                         lock=False)  # fmt: skip
    assert run is not None and schedule.finish(run.run_id, "h", "failed", "because")
    after = samples(client)
    assert after[("kickass_server_sessions_live", ())] == 1
    assert after[("kickass_server_admission_denied_total", ())] == 1
    assert after[
        ("kickass_schedule_item_runs", (("item", "nightly"), ("kind", "refresh"),
                                        ("outcome", "failed")))
    ] == 1  # fmt: skip
    assert ("kickass_server_probes_sent_total", ()) in after


def test_metrics_are_not_there_for_other_networks(
    app: tuple[FlaskClient, ProbeEngine, ScheduleStore],
) -> None:
    client, _, _ = app
    r = client.get("/metrics", environ_base={"REMOTE_ADDR": "198.51.100.7"})
    assert r.status_code == 404 and "kickass" not in r.get_data(as_text=True)
