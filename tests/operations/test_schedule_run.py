"""`kickass schedule run|status` as real processes against a real PostgreSQL:
exactly once across hosts, every run recorded (failures, timeouts and
skips too), dead runs found, exit codes a monitor can use, metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import kickass_db as db
import pytest
from kickass_db.schedule_store import ScheduleStore
from support.schedule import (
    KICKASS,
    events,
    item_runs,
    run_schedule,
    schedule_env,
    stable_cron,
    write_schedule,
)


def test_due_items_run_once_and_a_second_run_does_nothing(
    tmp_path: Path, database_url: str
) -> None:
    cron, due = stable_cron()
    schedule = write_schedule(
        tmp_path / "s.toml",
        [
            {"name": "refresh", "kind": "refresh", "cron": cron},
            {"name": "house", "kind": "housekeeping", "cron": cron, "journals": ["journal"]},
            {"name": "off", "kind": "refresh", "cron": cron, "enabled": False},
            {"name": "elsewhere", "kind": "refresh", "cron": cron, "host": "other-host"},
        ],
        name="once",
    )
    env = schedule_env(database_url, "host-a")
    first = run_schedule(schedule, env, "--json")
    assert first.returncode == 0, first.stderr
    log = events(first.stdout)
    summary = log[-1]
    assert summary["due"] == 2 and summary["exit_code"] == 0
    assert sorted(r["item"] for r in summary["ran"]) == ["house", "refresh"]
    finished = [e for e in log if e.get("event") == "finished"]
    assert all(e["schedule"] == "once" and e["host"] == "host-a" for e in finished)
    assert {e["outcome"] for e in finished} == {"ok"}
    runs = item_runs(database_url)
    assert sorted((r["item"], r["outcome"], r["due_at"]) for r in runs) == [
        ("house", "ok", due), ("refresh", "ok", due),
    ]  # fmt: skip
    assert all(r["finished_at"] >= r["claimed_at"] for r in runs)
    assert all("_locked" not in r["counts"] and "duration_s" in r["counts"] for r in runs)

    again = run_schedule(schedule, env, "--json")
    assert again.returncode == 0 and events(again.stdout)[-1] == {
        "due": 0, "ran": [], "refused": [], "unreachable": None, "exit_code": 0,
    }  # fmt: skip
    assert len(item_runs(database_url)) == 2


BARRIER = """
import sys, time
at = float(sys.argv[1])
from kickass_core.cli import main
time.sleep(max(0.0, at - time.time()))
sys.exit(main(sys.argv[2:]))
"""


def test_two_hosts_released_together_do_every_due_item_exactly_once(
    tmp_path: Path, database_url: str
) -> None:
    cron, due = stable_cron()
    names = [f"r{i}" for i in range(8)]
    schedule = write_schedule(
        tmp_path / "s.toml",
        # Housekeeping: items that may run side by side (refreshes take turns).
        [{"name": n, "kind": "housekeeping", "cron": cron} for n in names],
        name="barrier",
    )
    # Both processes import everything first, then wait for the same instant.
    at = time.time() + 4.0
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BARRIER, str(at), "schedule", "run", str(schedule), "--json"],
            env=schedule_env(database_url, host),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for host in ("host-a", "host-b")
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    runs = item_runs(database_url)
    # Every due item exactly once (UNIQUE (item, due_at) could not say more).
    assert sorted(r["item"] for r in runs) == names
    assert {(r["outcome"], r["attempt"], r["due_at"]) for r in runs} == {("ok", 1, due)}
    by_host: dict[str, list[dict]] = {}
    for r in runs:
        by_host.setdefault(r["host"], []).append(r)
    assert set(by_host) == {"host-a", "host-b"}, "both hosts did some of the work"
    # Their claims overlapped in time: they really ran side by side.
    a0 = min(r["claimed_at"] for r in by_host["host-a"])
    a1 = max(r["finished_at"] for r in by_host["host-a"])
    b0 = min(r["claimed_at"] for r in by_host["host-b"])
    b1 = max(r["finished_at"] for r in by_host["host-b"])
    assert a0 < b1 and b0 < a1, (a0, a1, b0, b1)
    # What each reported is what the table says it did.
    for host, (out, _) in zip(("host-a", "host-b"), outs, strict=True):
        ran = sorted(r["item"] for r in events(out)[-1]["ran"])
        assert ran == sorted(r["item"] for r in by_host[host])


def test_failures_timeouts_and_late_due_times_are_recorded_with_exit_codes(
    tmp_path: Path, database_url: str
) -> None:
    cron, due = stable_cron()
    long_ago = datetime.now(UTC) - timedelta(hours=3)
    schedule = write_schedule(
        tmp_path / "s.toml",
        [
            # The campaign file is missing: a clear failure, not a traceback.
            {"name": "atlas-missing", "kind": "atlas", "cron": cron, "campaign": "nope.yaml"},
            # Far too short to even start its process.
            {"name": "hurried", "kind": "refresh", "cron": cron, "timeout_s": 0.05},
            {"name": "late", "kind": "refresh", "cron": f"{long_ago.minute} {long_ago.hour} * * *"},
        ],  # fmt: skip
        name="failing",
    )
    log_file = tmp_path / "logs" / "schedule.log"
    proc = run_schedule(schedule, schedule_env(database_url, "host-a"), "--log-file",
                        str(log_file))  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""  # with --log-file, only failures reach cron's mail
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR: ")]
    assert sorted(line.split()[1] for line in errors) == ["atlas-missing", "hurried"]
    assert "Traceback" not in proc.stderr
    log = events(log_file.read_text())
    assert {e["item"] for e in log if e["event"] == "finished"} == {
        "atlas-missing", "hurried", "late",
    }  # fmt: skip
    runs = {r["item"]: r for r in item_runs(database_url)}
    assert runs["atlas-missing"]["outcome"] == "failed"
    assert "nope.yaml" in runs["atlas-missing"]["reason"]
    assert runs["hurried"]["outcome"] == "timeout"
    assert "timeout of 0.05 s" in runs["hurried"]["reason"]
    assert runs["late"]["outcome"] == "skipped" and "too late" in runs["late"]["reason"]
    assert runs["atlas-missing"]["due_at"] == due


def test_the_store_refuses_a_database_host_the_item_does_not_name_and_a_future_due(
    database_url: str,
) -> None:
    """What the server enforces for runner tokens, the store enforces for
    database hosts: a host the item does not name, or a due time ahead of the
    database's clock, is refused (ClaimRefused), stores no run, and is
    counted; and a live run is judged by the stale limit the schedule says."""
    from kickass_db.schedule_store import FUTURE_S, ClaimRefused

    due = datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(minutes=1)
    store = ScheduleStore(database_url)
    try:
        with pytest.raises(ClaimRefused) as exc:
            store.claim("round", "trials", due, "host-a", owners=["host-b", "runner:edge-1"])
        assert exc.value.reason == "not-owner" and "not by host-a" in exc.value.message
        ahead = datetime.now(UTC) + timedelta(seconds=FUTURE_S + 60)
        with pytest.raises(ClaimRefused) as exc:
            store.claim("round", "trials", ahead, "host-b", owners=["host-b"])
        assert exc.value.reason == "not-due"
        assert item_runs(database_url) == []
        assert {(r["host"], r["item"], r["reason"], r["refusals"]) for r in store.refusals()} == {
            ("host-a", "round", "not-owner", 1), ("host-b", "round", "not-due", 1),
        }  # fmt: skip
        # An owner claims; the due time of a clock a little ahead is still due.
        held = store.claim("round", "trials", due, "host-b", owners=["host-b"], lock=False)
        assert held is not None
        soon = store.claim("round", "trials", datetime.now(UTC) + timedelta(seconds=30), "host-b")
        assert soon is not None
        time.sleep(2.5)
        # Another owner, judging by the schedule's stale limit: the run is alive.
        assert store.claim("round", "trials", due, "host-c", stale_s=40.0) is None
    finally:
        store.close()


def test_a_dead_run_whose_due_time_passed_is_closed_by_the_next_run(
    tmp_path: Path, database_url: str
) -> None:
    cron, due = stable_cron(minutes_ago=2)
    schedule = write_schedule(
        tmp_path / "s.toml",
        [{"name": "hourly", "kind": "refresh", "cron": f"{due.minute} * * * *"}],
        name="reap",
        stale_s=30,
        heartbeat_s=5,
    )
    # An earlier due time's run whose host went silent an hour ago.
    store = ScheduleStore(database_url)
    try:
        dead = store.claim("hourly", "refresh", due - timedelta(hours=1), "gone-host", lock=False)
        assert dead is not None
        store.run(
            lambda c: c.exec_driver_sql(
                "UPDATE item_runs SET heartbeat_at = now() - interval '1 hour' WHERE id = %s",
                (dead.run_id,),
            )
        )
    finally:
        store.close()
    proc = run_schedule(schedule, schedule_env(database_url, "host-a"))
    assert proc.returncode == 0, proc.stderr
    [reaped] = [e for e in events(proc.stdout) if e["event"] == "reaped"]
    assert reaped["run_id"] == dead.run_id and "no heartbeat" in reaped["reason"]
    runs = {r["due_at"]: r for r in item_runs(database_url)}
    old = runs[due - timedelta(hours=1)]
    assert old["outcome"] == "failed" and old["reason"].startswith("killed: no heartbeat")
    assert runs[due]["outcome"] == "ok"


def test_status_shows_last_runs_failures_and_overdue_items(
    tmp_path: Path, database_url: str
) -> None:
    cron, due = stable_cron(minutes_ago=10)
    schedule = write_schedule(
        tmp_path / "s.toml",
        [
            {"name": "refresh", "kind": "refresh", "cron": cron},
            {"name": "broken", "kind": "atlas", "cron": cron, "campaign": "nope.yaml"},
            # Only a runner host that never ran the schedule may run this one.
            {
                "name": "ghost-round",
                "kind": "trials",
                "cron": cron,
                "host": "ghost",
                "trials": {"agents": [{"name": "far-1", "url": "http://192.0.2.1:7000"}]},
            },
        ],  # fmt: skip
        name="status",
    )
    env = schedule_env(database_url, "host-a")
    assert run_schedule(schedule, env).returncode == 1
    metrics = tmp_path / "metrics.prom"
    assert run_schedule(schedule, env, "--metrics-file", str(metrics)).returncode == 0
    st = subprocess.run(
        [KICKASS, "schedule", "status", str(schedule), "--json"], env=env,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert st.returncode == 0, st.stderr
    status = json.loads(st.stdout)
    items = {i["name"]: i for i in status["items"]}
    assert items["refresh"]["last"]["outcome"] == "ok"
    assert items["broken"]["last"]["outcome"] == "failed"
    assert status["overdue"] == ["ghost-round"]
    assert "host ghost has not claimed it" in items["ghost-round"]["overdue"]
    [failure] = status["failures"]
    assert failure["item"] == "broken" and "nope.yaml" in failure["reason"]
    assert status["runs_today"] == {"ok": 1, "failed": 1}
    human = subprocess.run(
        [KICKASS, "schedule", "status", str(schedule)], env=env,
        capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    assert "OVERDUE:" in human and "ghost-round" in human and "recent failures:" in human
    text = metrics.read_text()
    assert 'kickass_schedule_item_runs{item="refresh",kind="refresh",outcome="ok"} 1.0' in text
    assert 'kickass_schedule_item_overdue{item="ghost-round"} 1.0' in text
    assert 'kickass_schedule_item_overdue{item="refresh"} 0.0' in text


def test_an_unreachable_database_is_exit_3_and_claims_nothing(tmp_path: Path) -> None:
    cron, _ = stable_cron()
    schedule = write_schedule(
        tmp_path / "s.toml", [{"name": "r", "kind": "refresh", "cron": cron}], name="down"
    )
    # A port nothing listens on (connection refused at once).
    env = schedule_env("postgresql://kickass@127.0.0.1:1/kickass?connect_timeout=3", "h")
    proc = run_schedule(schedule, env)
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert "ERROR: database unavailable" in proc.stderr and "Traceback" not in proc.stderr
    assert "the next run tries again" in proc.stderr


def test_no_database_and_no_server_is_a_usage_error(tmp_path: Path) -> None:
    cron, _ = stable_cron()
    schedule = write_schedule(
        tmp_path / "s.toml", [{"name": "r", "kind": "refresh", "cron": cron}], name="nowhere"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KICKASS_")}
    proc = run_schedule(schedule, env)
    assert proc.returncode == 2 and "nowhere to claim runs" in proc.stderr


def test_a_reaped_trial_round_closes_its_trial_and_no_other(database_url: str) -> None:
    """A trials run whose host died and whose due time passed is reaped; the
    trial it had uploaded (open) is closed at its last heartbeat and named
    in the run's counts; another round's open trial is left alone."""
    from kickass_db.trial_store import TrialStore

    due = datetime(2026, 11, 1, 3, 0, tzinfo=UTC)
    store = ScheduleStore(database_url)
    trials = TrialStore(database_url)
    try:
        dead = store.claim("round", "trials", due, "gone-host", lock=False)
        other = store.claim("other-round", "trials", due, "live-host", lock=False)
        assert dead is not None and other is not None
        for tid, run in (("a" * 32, dead), ("b" * 32, other)):
            trials.put_trial(None, {
                "trial_id": tid, "destination": "far-1", "started_at": due.isoformat(),
                "parameters": {"scheduled": {"item": run.item, "run_id": run.run_id,
                                             "attempt": run.attempt}},
            })  # fmt: skip
        store.run(
            lambda c: c.exec_driver_sql(
                "UPDATE item_runs SET heartbeat_at = now() - interval '1 hour' WHERE id = %s",
                (dead.run_id,),
            )
        )
        [reaped] = store.reap({"round": due + timedelta(hours=1)}, stale_s=30)
        assert reaped["run_id"] == dead.run_id
    finally:
        trials.close()
        store.close()
    runs = {r["item"]: r for r in item_runs(database_url)}
    assert runs["round"]["outcome"] == "failed"
    assert runs["round"]["counts"]["interrupted_trials"] == ["a" * 32]
    engine = db.make_engine(database_url)
    try:
        with engine.connect() as conn:
            closed: dict[str, Any] = dict(
                conn.exec_driver_sql("SELECT trial_id, finished_at FROM trials").all()
            )
    finally:
        engine.dispose()
    assert closed == {"a" * 32: runs["round"]["heartbeat_at"], "b" * 32: None}


def test_a_claim_is_one_record_from_the_store_to_the_runner(database_url: str) -> None:
    """The store's claim is the runner's claim (``kickass_core.claims.Claim``), passed on
    as it is, a taken-over run's history with it: no copy of the record to drift."""
    from kickass_core.claims import Claim
    from kickass_operations.claims import DatabaseClaims
    from kickass_operations.schedule_file import parse

    cron, due = stable_cron()
    schedule = parse({"item": [{"name": "refresh", "kind": "refresh", "cron": cron}]})
    claims = DatabaseClaims(database_url, "host-a", schedule.schedule)
    try:
        claim = claims.claim(schedule.item[0], due)
    finally:
        claims.close()
    assert type(claim) is Claim
    assert (claim.item, claim.due_at, claim.attempt, claim.took_over) == ("refresh", due, 1, None)
