"""`/api/v1/schedule` as an attacker with a valid runner token uses it (issue 27).

Two runners (A and B) and a database host share one schedule; the server
judges every claim by its own copy of the schedule file, never by what the
claim says: who may run an item, which due times are due, when a run is
dead. Through the real Flask app on the real PostgreSQL; each attack
succeeded before (201, a run taken over or closed ``failed killed``, a
metric series per made-up name) and is refused now, storing no run.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient
from kickass_core import signing
from kickass_db.schedule_store import ScheduleStore
from kickass_db.study_store import StudyStore
from kickass_db.trial_store import TrialStore
from kickass_server.api import ApiConfig, create_app
from kickass_server.engine import ProbeEngine
from kickass_server.policy import Policy
from prometheus_client.parser import text_string_to_metric_families
from support.schedule import KICKASS, item_runs, schedule_env, stable_cron, write_schedule


@dataclass
class World:
    client: FlaskClient
    store: ScheduleStore
    url: str
    schedule: Path
    tokens: dict[str, str]
    due: datetime
    cron: str

    def claim(self, runner: str, item: str, due: datetime, **extra: Any) -> Any:
        body = {"item": item, "kind": "trials", "due_at": due.isoformat(), **extra}
        return self.signed(runner, "POST", "/api/v1/schedule/claims", body)

    def heartbeat(self, runner: str, run_id: int) -> Any:
        return self.signed(runner, "POST", f"/api/v1/schedule/runs/{run_id}/heartbeat", {})

    def signed(self, runner: str, method: str, path: str, body: dict[str, Any]) -> Any:
        token = self.tokens[runner]
        data = json.dumps(body).encode()
        key, name = signing.key_from_secret(token), signing.runner_name(token)
        headers = {"Content-Type": "application/json"}
        headers |= signing.sign(key, name, method, path, data)
        return self.client.open(path, method=method, data=data, headers=headers,
                                environ_base={"REMOTE_ADDR": "198.51.100.8"})  # fmt: skip

    def runs(self) -> list[dict[str, Any]]:
        return item_runs(self.url)


@pytest.fixture
def world(database_url: str, tmp_path: Path) -> Iterator[World]:
    cron, due = stable_cron(2)
    trials: dict[str, Any] = {"pairs": 1}
    schedule = write_schedule(
        tmp_path / "schedule.toml",
        [
            {"name": "round-a", "kind": "trials", "cron": cron, "host": "runner-a",
             "trials": trials},
            # One round either runner may run (the stale rule alone decides a takeover).
            {"name": "round-ab", "kind": "trials", "cron": cron,
             "host": ["runner-a", "runner-b"], "trials": trials},
            {"name": "refresh", "kind": "refresh", "cron": cron},
        ],
        name="attack", heartbeat_s=10,
    )  # fmt: skip
    study, trial_store, store = (
        StudyStore(database_url), TrialStore(database_url), ScheduleStore(database_url)
    )  # fmt: skip
    tokens = {name: trial_store.add_runner(name) for name in ("runner-a", "runner-b")}
    engine = ProbeEngine(study, Policy(), probe_port=9000, server_version="schedule")
    app = create_app(engine, study, ApiConfig(schedule_file=str(schedule)), trials=trial_store,
                     schedule=store)  # fmt: skip
    try:
        yield World(app.test_client(), store, database_url, schedule, tokens, due, cron)
    finally:
        engine.stop()
        study.close()
        trial_store.close()
        store.close()


def test_a_runner_cannot_take_over_a_live_run_with_a_short_stale_limit(world: World) -> None:
    """Runner B claimed A's running item with ``stale_s=2``: 201 "took_over",
    and A's next heartbeat got 409. The stale limit is the schedule's (four
    heartbeats of 10 s), whatever the claim says."""
    a = world.claim("runner-a", "round-ab", world.due)
    assert a.status_code == 201, a.json
    time.sleep(2.5)  # A's heartbeat is older than the 2 s B names
    b = world.claim("runner-b", "round-ab", world.due, stale_s=2)
    assert b.status_code == 409 and b.json["error"] == "taken", b.json
    assert world.heartbeat("runner-a", a.json["run_id"]).status_code == 200
    [run] = world.runs()
    assert (run["host"], run["attempt"], run["outcome"]) == ("runner:runner-a", 1, "running")
    # Not A's only: B may not claim A's own item at all.
    own = world.claim("runner-a", "round-a", world.due)
    assert own.status_code == 201
    time.sleep(2.5)
    stolen = world.claim("runner-b", "round-a", world.due, stale_s=2)
    assert stolen.status_code == 403 and stolen.json["error"] == "not-owner", stolen.json
    assert world.heartbeat("runner-a", own.json["run_id"]).status_code == 200


def test_a_due_time_in_2099_closes_nobody_s_run(world: World) -> None:
    """A claim naming a due time in 2099 closed A's live run and a database
    host's live run as ``failed killed`` (reaped as if their due time had
    passed). A due time that has not come, or is not on the item's cron, is
    refused and touches nothing."""
    a = world.claim("runner-a", "round-ab", world.due)
    assert a.status_code == 201
    database_host = world.store.claim("refresh", "refresh", world.due, "db-host")
    assert database_host is not None
    time.sleep(2.5)
    on_cron_2099 = world.due.replace(year=2099)
    for item in ("round-ab", "refresh"):
        r = world.claim("runner-b", item, on_cron_2099, stale_s=2)
        assert r.status_code == 403, (item, r.json)
    assert world.claim("runner-b", "round-ab", on_cron_2099).json["error"] == "not-due"
    # Past, but not one of the item's due times.
    off_cron = world.claim("runner-b", "round-ab", world.due - timedelta(minutes=7), stale_s=2)
    assert off_cron.status_code == 403 and off_cron.json["error"] == "not-due", off_cron.json
    runs = {r["item"]: r for r in world.runs()}
    assert set(runs) == {"round-ab", "refresh"}
    assert all(r["outcome"] == "running" and r["attempt"] == 1 for r in runs.values()), runs
    assert all(r["due_at"] == world.due for r in runs.values())
    assert world.heartbeat("runner-a", a.json["run_id"]).status_code == 200
    assert world.store.heartbeat(database_host.run_id, "db-host")
    world.store.finish(database_host.run_id, "db-host", "ok")


def test_a_runner_claims_only_its_own_items(world: World) -> None:
    """B claimed A's item and a database host's ``refresh`` (as kind trials):
    201, rows stored. Now 403, nothing stored, and A still runs its item."""
    b_on_a = world.claim("runner-b", "round-a", world.due)
    assert b_on_a.status_code == 403 and b_on_a.json["error"] == "not-owner", b_on_a.json
    assert "runner-a" in b_on_a.json["message"]
    b_on_db = world.claim("runner-b", "refresh", world.due)
    assert b_on_db.status_code == 403 and b_on_db.json["error"] == "database-kind", b_on_db.json
    unknown = world.claim("runner-b", "not-scheduled", world.due)
    assert unknown.status_code == 403 and unknown.json["error"] == "not-in-schedule"
    assert world.runs() == []
    a = world.claim("runner-a", "round-a", world.due)
    assert a.status_code == 201 and a.json["host"] == "runner:runner-a"
    [run] = world.runs()
    # The kind stored is the schedule's, not the body's.
    assert (run["item"], run["kind"], run["host"]) == ("round-a", "trials", "runner:runner-a")
    # A runner host from before this rule sends its own stale_s: accepted, and ignored.
    legacy = world.claim("runner-b", "round-ab", world.due, stale_s=45.0,
                         definition_hash="0123456789abcdef")  # fmt: skip
    assert legacy.status_code == 201, legacy.json


def _series(client: FlaskClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = client.get("/metrics", environ_base={"REMOTE_ADDR": "127.0.0.1"})
    assert r.status_code == 200
    out = {}
    for fam in text_string_to_metric_families(r.get_data(as_text=True)):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_made_up_items_add_no_metric_series_and_refusals_are_counted(world: World) -> None:
    """30 made-up item names made 30 ``kickass_schedule_item_runs`` series.
    Now each is a 403 that stores nothing; the metrics' item labels come
    from the schedule only, and the refusals are one counted series (and a
    line of ``kickass schedule status``)."""
    assert world.claim("runner-a", "round-a", world.due).status_code == 201
    before = _series(world.client)
    for i in range(30):
        r = world.claim("runner-b", f"made-up-{i:02d}", world.due)
        assert r.status_code == 403 and r.json["error"] == "not-in-schedule", r.json
    assert world.claim("runner-b", "round-a", world.due).status_code == 403
    after = _series(world.client)
    assert [r["item"] for r in world.runs()] == ["round-a"]
    labelled = {k for k in after if dict(k[1]).get("item", "").startswith("made-up")}
    assert not labelled, labelled
    new = set(after) - set(before)
    assert {name for name, _ in new} <= {"kickass_schedule_claims_refused_total"}, new
    refused = {dict(labels)["item"] or "-": v for (name, labels), v in after.items()
               if name == "kickass_schedule_claims_refused_total"}  # fmt: skip
    assert refused == {"-": 30.0, "round-a": 1.0}, refused
    runs = {(dict(k[1])["item"], dict(k[1])["outcome"]): v
            for k, v in after.items() if k[0] == "kickass_schedule_item_runs"}  # fmt: skip
    assert runs == {("round-a", "running"): 1.0}
    # Where operators look: kickass schedule status.
    proc = subprocess.run(
        [KICKASS, "schedule", "status", str(world.schedule), "--json"],
        env=schedule_env(world.url, "ops"), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    refusals = {(r["host"], r["item"], r["reason"]): r["refusals"]
                for r in json.loads(proc.stdout)["refused_claims"]}  # fmt: skip
    assert refusals == {
        ("runner:runner-b", "", "not-in-schedule"): 30,
        ("runner:runner-b", "round-a", "not-owner"): 1,
    }
    text = subprocess.run(
        [KICKASS, "schedule", "status", str(world.schedule)],
        env=schedule_env(world.url, "ops"), capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    assert "refused claims" in text and "runner:runner-b (not in the schedule)" in text


def test_without_a_schedule_file_no_runner_claims(database_url: str) -> None:
    study, trials, store = (
        StudyStore(database_url), TrialStore(database_url), ScheduleStore(database_url)
    )  # fmt: skip
    token = trials.add_runner("runner-a")
    engine = ProbeEngine(study, Policy(), probe_port=9000, server_version="schedule")
    app = create_app(engine, study, ApiConfig(), trials=trials, schedule=store)
    try:
        world = World(app.test_client(), store, database_url, Path("-"), {"runner-a": token},
                      datetime.now(UTC).replace(second=0, microsecond=0), "* * * * *")  # fmt: skip
        r = world.claim("runner-a", "anything", world.due)
        assert r.status_code == 403 and r.json["error"] == "no-schedule", r.json
        assert "schedule_file" in r.json["message"] and world.runs() == []
    finally:
        engine.stop()
        study.close()
        trials.close()
        store.close()


def test_the_server_reads_its_schedule_again_when_it_changes(world: World) -> None:
    """An owner added to the file is taken at the next claim; a broken edit
    keeps the last good schedule (and the server answers)."""
    assert world.claim("runner-b", "round-a", world.due).status_code == 403
    text = world.schedule.read_text().replace(
        'host = "runner-a"', 'host = ["runner-a", "runner-b"]'
    )
    world.schedule.write_text(text)
    assert world.claim("runner-b", "round-a", world.due).status_code == 201
    world.schedule.write_text(text + "\n[[item]\n")  # not TOML
    r = world.claim("runner-a", "round-ab", world.due)
    assert r.status_code == 201, r.json
