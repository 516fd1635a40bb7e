"""The scheduled ``atlas`` item, against the RIPE Atlas stand-in: a run killed
with SIGKILL in the middle of its fetch is found dead by the next run (its
advisory lock is free), taken over in place, and finishes the work; nothing
is created twice and no result is stored twice."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from atlas_standin import StandIn, running
from support.schedule import (
    KICKASS,
    alive,
    children,
    events,
    item_runs,
    run_schedule,
    schedule_env,
    stable_cron,
    wait_until,
    write_schedule,
)
from test_atlas_api import KEY, PROBES, backdate, campaign_dict, created, play, rows


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[StandIn]:
    with running(tmp_path, key=KEY) as s:
        s.add_probe(1001, PROBES[1001], 64500, "NL")
        s.add_probe(1002, PROBES[1002], 64501, "DE")
        yield s


def test_a_run_killed_mid_fetch_is_taken_over_and_nothing_is_duplicated(
    tmp_path: Path, standin: StandIn, database_url: str
) -> None:
    campaign = tmp_path / "campaign.yaml"
    campaign.write_text(yaml.safe_dump(campaign_dict()))
    cron, due = stable_cron()
    schedule = write_schedule(
        tmp_path / "schedule.toml",
        [
            {
                "name": "atlas-study",
                "kind": "atlas",
                "cron": cron,
                "campaign": "campaign.yaml",
                "timeout_s": 120,
            }
        ],  # fmt: skip
        name="atlas-test",
        stale_s=30,
        heartbeat_s=1,
    )
    atlas_env = {
        "KICKASS_ATLAS_KEY": KEY,
        "KICKASS_ATLAS_SERVER": standin.server,
        "KICKASS_ATLAS_CA_BUNDLE": str(standin.ca_bundle),
    }
    # The measurements exist (created by hand); results wait at the stand-in.
    create = subprocess.run(
        [KICKASS, "atlas", "create", str(campaign)],
        env=schedule_env(database_url, "operator", **atlas_env),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert create.returncode == 0, create.stderr
    start = backdate(standin, 1000)
    for msm_id in standin.measurements:
        standin.set_status(msm_id, 2)
        play(standin, database_url, msm_id, [start + 100, start + 160, start + 220])
    total = len(standin.measurements) * len(PROBES) * 3
    split = created(standin)["split-1500"]  # fetched last (whole sizes first)
    gate = standin.gate("GET", f"/api/v2/measurements/{split}/results")

    first = subprocess.Popen(
        [KICKASS, "schedule", "run", str(schedule)],
        env=schedule_env(database_url, "host-a", **atlas_env),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_until(
            lambda: standin.requests_to("GET", f"/api/v2/measurements/{split}/results"),
            60,
            "the fetch to reach the split measurement's results",
        )
        kids = children(first.pid)
        assert kids, "the item runs in a child process"
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        # The child dies with its parent (PR_SET_PDEATHSIG): no orphan fetching on.
        wait_until(lambda: not any(alive(k) for k in kids), 10, "the item's process to die")
    finally:
        if first.poll() is None:
            first.kill()
        gate.set()
    [dead] = item_runs(database_url)
    assert (dead["outcome"], dead["host"], dead["attempt"]) == ("running", "host-a", 1)
    assert dead["due_at"] == due
    # The whole sizes' windows were committed before the kill; the split's not.
    partial = rows(database_url, "SELECT count(*) AS n FROM atlas_results")[0]["n"]
    assert 0 < partial < total

    second = run_schedule(schedule, schedule_env(database_url, "host-b", **atlas_env))
    assert second.returncode == 0, second.stderr + second.stdout
    log = events(second.stdout)
    [took] = [e for e in log if e["event"] == "took-over"]
    assert took["previous"]["host"] == "host-a" and "lock is free" in took["previous"]["reason"]
    [done] = [e for e in log if e["event"] == "finished"]
    assert done["outcome"] == "ok", done
    assert done["counts"]["results_new"] == total - partial

    [run] = item_runs(database_url)
    assert (run["outcome"], run["host"], run["attempt"]) == ("ok", "host-b", 2)
    assert [h["host"] for h in run["history"]] == ["host-a"]
    assert run["history"][0]["outcome"] == "killed"
    # Nothing created twice, nothing stored twice.
    assert len(standin.requests_to("POST", "/api/v2/measurements")) == 1
    stored = rows(
        database_url,
        "SELECT count(*) AS n, count(DISTINCT (msm_id, prb_id, result_at)) AS d FROM atlas_results",
    )[0]
    assert stored["n"] == stored["d"] == total

    # Done is done: the next run finds nothing to do.
    third = run_schedule(schedule, schedule_env(database_url, "host-a", **atlas_env), "--json")
    assert third.returncode == 0, third.stderr
    assert events(third.stdout)[-1]["due"] == 0
    assert len(item_runs(database_url)) == 1
    assert os.environ.get("KICKASS_HOST_ID") is None  # the test's own env untouched


@pytest.mark.parametrize("down_when", ["during-the-fetch", "when-the-run-ends"])
def test_postgresql_restarted_during_a_run(
    tmp_path: Path, standin: StandIn, down_when: str
) -> None:
    """The database restarts under a run: heartbeats fail and say so, the run
    goes on, its outcome is retried until recorded, and every result that was
    committed stays (a later fetch completes the rest, none twice)."""
    import kickass_db as db
    from kickass_testbed.pg import EmbeddedPostgres

    pg = EmbeddedPostgres(tmp_path / "pg")
    url = pg.start()
    try:
        db.upgrade(url)
        campaign = tmp_path / "campaign.yaml"
        campaign.write_text(yaml.safe_dump(campaign_dict()))
        cron, _due = stable_cron()
        schedule = write_schedule(
            tmp_path / "schedule.toml",
            [
                {
                    "name": "atlas-study",
                    "kind": "atlas",
                    "cron": cron,
                    "campaign": "campaign.yaml",
                    "timeout_s": 120,
                }
            ],  # fmt: skip
            name="atlas-restart",
            stale_s=30,
            heartbeat_s=0.5,
        )
        atlas_env = {
            "KICKASS_ATLAS_KEY": KEY,
            "KICKASS_ATLAS_SERVER": standin.server,
            "KICKASS_ATLAS_CA_BUNDLE": str(standin.ca_bundle),
        }
        env = schedule_env(url, "host-a", **atlas_env)
        create = subprocess.run(
            [KICKASS, "atlas", "create", str(campaign)], env=env, capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
        assert create.returncode == 0, create.stderr
        start = backdate(standin, 1000)
        for msm_id in standin.measurements:
            standin.set_status(msm_id, 2)
            play(standin, url, msm_id, [start + 100, start + 160, start + 220])
        total = len(standin.measurements) * len(PROBES) * 3
        split = created(standin)["split-1500"]
        gate = standin.gate("GET", f"/api/v2/measurements/{split}/results")
        proc = subprocess.Popen(
            [KICKASS, "schedule", "run", str(schedule)], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            wait_until(
                lambda: standin.requests_to("GET", f"/api/v2/measurements/{split}/results"),
                60,
                "the fetch to reach the split measurement",
            )
            pg.stop()
            if down_when == "during-the-fetch":
                time.sleep(2.0)  # several heartbeats fail meanwhile
                pg.start()
                gate.set()
            else:
                gate.set()  # the fetch goes on and ends with the database down
                time.sleep(3.0)
                pg.start()
            out, err = proc.communicate(timeout=180)
        finally:
            gate.set()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        log = events(out)
        assert "Traceback" not in err, err
        [done] = [e for e in log if e["event"] == "finished"]
        assert done["recorded"] is True, log
        [run] = item_runs(url)
        assert run["outcome"] == done["outcome"] and run["attempt"] == 1
        assert run["finished_at"] is not None
        troubles = [e for e in log if e["event"] in ("heartbeat-failed", "finish-retry")]
        assert troubles and all("database unavailable" in e["reason"] for e in troubles), log
        if down_when == "during-the-fetch":
            assert done["outcome"] == "ok" and proc.returncode == 0, (out, err)
        else:
            # Whatever the fetch managed, a failure names the database.
            assert done["outcome"] == "ok" or "database" in (done.get("reason") or ""), done
            assert proc.returncode == (0 if done["outcome"] == "ok" else 1)
        # Nothing committed was lost; what is missing comes with the next fetch, once.
        fetch = subprocess.run(
            [KICKASS, "atlas", "fetch", str(campaign)], env=env, capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
        assert fetch.returncode == 0, fetch.stderr
        assert rows(url, "SELECT count(*) AS n FROM atlas_results")[0]["n"] == total
    finally:
        pg.stop()
