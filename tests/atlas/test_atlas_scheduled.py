"""The scheduled ``atlas`` item, against the RIPE Atlas stand-in.

- From nothing: the first run creates the campaign's measurements, later
  runs fetch what arrived and never create again, a settled campaign is
  skipped without asking Atlas for results; status and metrics count the
  credits spent today.
- A run killed with SIGKILL in the middle of its fetch is found dead by the
  next run (its advisory lock is free), taken over in place, and finishes
  the work; nothing is created twice and no result is stored twice.
- PostgreSQL restarted under a run: what it had acknowledged survives, the
  run's outcome is the one its timing determines, and it is recorded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import yaml
from atlas_standin import StandIn, running
from kickass_atlas.campaign import Campaign
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


def test_an_atlas_item_creates_once_fetches_until_settled_then_skips(
    tmp_path: Path, standin: StandIn, database_url: str
) -> None:
    """The scheduled ``atlas`` item from nothing: its first run creates the
    campaign's measurements, later runs never create them again and fetch
    what arrived, and once every measurement has stopped and its late
    re-read is done the item is ``skipped`` ("settled") without asking Atlas
    for results. ``schedule status --json`` and the metrics say what the
    runs spent today."""
    campaign = tmp_path / "campaign.yaml"
    campaign.write_text(yaml.safe_dump(campaign_dict()))
    schedule = tmp_path / "schedule.toml"
    metrics = tmp_path / "metrics.prom"
    env = schedule_env(
        database_url, "host-a", KICKASS_ATLAS_KEY=KEY, KICKASS_ATLAS_SERVER=standin.server,
        KICKASS_ATLAS_CA_BUNDLE=str(standin.ca_bundle),
    )  # fmt: skip
    planned = len(Campaign.from_dict(campaign_dict()).plan().measurements)

    def run_due(minutes_ago: int) -> tuple[dict, list]:
        # Each pass at a due time of its own: the daily item's time is moved
        # on between passes, as if its next hour had come.
        cron, due = stable_cron(minutes_ago)
        write_schedule(
            schedule,
            [{"name": "atlas-study", "kind": "atlas", "cron": cron, "campaign": "campaign.yaml"},
             # Status only: an hourly item with a slip, never run here.
             {"name": "later", "kind": "refresh", "cron": f"{due.minute} * * * *",
              "slip_s": 600.0, "enabled": False}],
            name="atlas-settle",
        )  # fmt: skip
        seen = len(standin.seen)
        proc = run_schedule(schedule, env, "--metrics-file", str(metrics))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        [done] = [e for e in events(proc.stdout) if e["event"] == "finished"]
        assert done["due_at"] == due.isoformat()
        return done, standin.seen[seen:]

    def asked(seen: list, method: str, suffix: str) -> int:
        return sum(1 for s in seen if s.method == method and s.path.rstrip("/").endswith(suffix))

    # 1. Nothing exists: the measurements are created, nothing to fetch yet.
    first, seen = run_due(8)
    assert first["outcome"] == "ok", first
    # The ids Atlas gave, each measurement of the plan once.
    assert sorted(first["counts"]["created"]) == sorted(standin.measurements)
    assert len(standin.measurements) == planned
    assert asked(seen, "POST", "/measurements") == 1
    assert first["counts"]["results_new"] == 0

    # The measurements ran three days ago and stopped: results wait at Atlas.
    start = int(time.time()) - 3 * 86400
    for msm_id, m in standin.measurements.items():
        m["start_time"], m["stop_time"] = start, start + 3600
        standin.set_status(msm_id, 4)  # Stopped
        play(standin, database_url, msm_id, [start + 100, start + 160, start + 220])
    total = planned * len(PROBES) * 3

    # 2. Never created twice; everything that arrived is fetched.
    second, seen = run_due(6)
    assert second["outcome"] == "ok", second
    assert "created" not in second["counts"] and asked(seen, "POST", "/measurements") == 0
    assert second["counts"]["results_new"] == total
    assert asked(seen, "GET", "/results") >= planned

    # 3. Stopped for longer than the late horizon: each window is read once
    # more for late uploads (none), and the campaign is settled.
    third, seen = run_due(4)
    assert third["outcome"] == "skipped" and third["reason"].startswith("settled"), third
    assert (third["counts"]["results_new"], third["counts"]["results_late"]) == (0, 0)
    assert asked(seen, "GET", "/results") == planned
    assert asked(seen, "POST", "/measurements") == 0

    # 4. Settled: skipped again, and Atlas is not asked for results at all.
    fourth, seen = run_due(2)
    assert fourth["outcome"] == "skipped" and fourth["reason"].startswith("settled"), fourth
    assert asked(seen, "GET", "/results") == 0 and asked(seen, "POST", "/measurements") == 0

    runs = item_runs(database_url)
    assert [r["outcome"] for r in runs] == ["ok", "ok", "skipped", "skipped"]
    assert rows(database_url, "SELECT count(*) AS n FROM atlas_results")[0]["n"] == total
    # Credits as Atlas charges them: each result at its measurement's price.
    charged = sum(
        len(standin.results.get(i, [])) * m["credits_per_result"]
        for i, m in standin.measurements.items()
    )
    assert charged > 0
    assert sum(r["counts"]["credits_delta"] for r in runs) == charged
    assert runs[-1]["counts"]["credits_spent"] == charged

    st = subprocess.run(
        [KICKASS, "schedule", "status", str(schedule), "--json"], env=env,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert st.returncode == 0, st.stderr
    status = json.loads(st.stdout)
    assert status["atlas_credits_today"] == charged
    assert status["runs_today"] == {"ok": 2, "skipped": 2}
    items = {i["name"]: i for i in status["items"]}
    due = datetime.fromisoformat(fourth["due_at"])
    assert datetime.fromisoformat(items["atlas-study"]["next_start"]) == due + timedelta(days=1)
    later = datetime.fromisoformat(items["later"]["next_start"])
    assert due + timedelta(hours=1) <= later < due + timedelta(hours=1, seconds=600)
    assert items["later"]["enabled"] is False and items["later"]["last"] is None
    assert f"kickass_schedule_atlas_credits_today {float(charged)}" in metrics.read_text()


# What the database had acknowledged before it went down: every result and
# every per-packet outcome, by key.
COMMITTED = {
    "results": "SELECT msm_id, prb_id, result_at FROM atlas_results",
    "outcomes": "SELECT msm_id, prb_id, result_at, packet_index FROM atlas_outcomes",
}


def committed(url: str) -> dict[str, set[tuple]]:
    return {k: {tuple(r.values()) for r in rows(url, sql)} for k, sql in COMMITTED.items()}


def watermarks(url: str) -> dict[int, datetime]:
    """Each measurement's fetched_until: the fetch resumes after it."""
    return {
        r["msm_id"]: r["fetched_until"]
        for r in rows(url, "SELECT msm_id, fetched_until FROM atlas_measurements")
        if r["fetched_until"] is not None
    }


@pytest.mark.parametrize(
    ("down_when", "down_s"),
    [("while-the-fetch-waits", 2.0), ("under-the-fetch-writes", 3.0), ("past-the-retries", 25.0)],
)
def test_postgresql_restarted_during_a_run(
    tmp_path: Path, standin: StandIn, down_when: str, down_s: float
) -> None:
    """The database restarts under a run: heartbeats fail and say so, the run
    goes on, its outcome is retried until recorded, and everything the
    database had acknowledged before it went down is still there after.

    - while-the-fetch-waits: down while the fetch waits on Atlas, back before
      it writes again: only heartbeats fail; ``ok``.
    - under-the-fetch-writes: the fetch writes while the database is down;
      the item is retried after 2, 4 and 8 s (items.DATABASE_RETRY_S), and
      the database is back within 3 s and its start: ``ok``, every time.
    - past-the-retries: down for longer than those retries (14 s): the run
      ends ``failed`` naming the database while the database is still down,
      its outcome is retried (``finish-retry``) until it is back and then
      recorded; the next fetch completes the rest, none twice.
    """
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
            # The fetch is held at the split measurement: what came before it
            # is committed, window by window.
            before, marks = committed(url), watermarks(url)
            assert 0 < len(before["results"]) < total
            assert before["outcomes"] and marks
            pg.stop()
            if down_when == "while-the-fetch-waits":
                time.sleep(down_s)  # several heartbeats fail meanwhile
                pg.start()
                gate.set()
            else:
                gate.set()  # the fetch goes on and writes with the database down
                time.sleep(down_s)
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
        assert (run["outcome"], run["attempt"]) == (done["outcome"], 1)
        assert run["finished_at"] is not None
        heartbeats = [e for e in log if e["event"] == "heartbeat-failed"]
        assert heartbeats and all("database unavailable" in e["reason"] for e in heartbeats)
        after = committed(url)
        for what, keys in before.items():
            assert keys <= after[what], f"{what} acknowledged before the restart are gone"
        # No watermark went back (a resumed fetch starts after each).
        later = watermarks(url)
        assert all(later[m] >= at for m, at in marks.items()), (marks, later)
        retries = [e for e in log if e.get("step") == "retry"]
        finish_retries = [e for e in log if e["event"] == "finish-retry"]
        if down_when == "past-the-retries":
            assert (done["outcome"], proc.returncode) == ("failed", 1), (out, err)
            assert done["reason"].startswith("database unavailable"), done
            assert len(retries) == 3, log  # after 2, 4 and 8 s, then given up
            assert finish_retries, log  # recorded only once the database was back
            assert len(after["results"]) < total
            # A failed run is that due time's last word: the next run leaves it.
            again = run_schedule(schedule, env, "--json")
            assert again.returncode == 0 and events(again.stdout)[-1]["due"] == 0
        else:
            assert (done["outcome"], proc.returncode) == ("ok", 0), (out, err)
            assert len(after["results"]) == total
            assert not finish_retries, log
            # What the run stored and spent, whatever its attempts (nothing
            # was stored before it).
            counts = done["counts"]
            assert counts["results_stored"] == total
            assert counts["credits_delta"] == counts["credits_spent"] > 0
            if down_when == "under-the-fetch-writes":
                assert retries and all("database unavailable" in e["reason"] for e in retries)
                # The retry's own fetch: what the failed attempt had not committed.
                assert counts["results_new"] == total - len(before["results"])
            else:
                assert not retries, log
                assert counts["results_new"] == total
        # What is missing comes with the next fetch, once; nothing twice.
        fetch = subprocess.run(
            [KICKASS, "atlas", "fetch", str(campaign)], env=env, capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
        assert fetch.returncode == 0, fetch.stderr
        stored = rows(
            url,
            "SELECT count(*) AS n, count(DISTINCT (msm_id, prb_id, result_at)) AS d "
            "FROM atlas_results",
        )[0]
        assert stored["n"] == stored["d"] == total
    finally:
        pg.stop()
