"""`kickass schedule run --loop` outside a container, as a real process: it
runs what is due, keeps passing without running it twice, and SIGTERM stops
it cleanly, idle or in the middle of a run, leaving no process behind."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import kickass_db as db
from sqlalchemy import create_engine, text
from support.schedule import (
    KICKASS,
    alive,
    children,
    events,
    item_runs,
    schedule_env,
    stable_cron,
    wait_until,
    write_schedule,
)


def descendants(pid: int) -> set[int]:
    out: set[int] = set()
    todo = [pid]
    while todo:
        for kid in children(todo.pop()):
            if kid not in out:
                out.add(kid)
                todo.append(kid)
    return out


def loop(schedule: Path, database_url: str, log: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [KICKASS, "schedule", "run", str(schedule), "--loop", "--interval", "1",
         "--log-file", str(log), "--json"],
        env=schedule_env(database_url, "loop-host"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_the_loop_runs_what_is_due_once_and_stops_on_sigterm(
    tmp_path: Path, database_url: str
) -> None:
    cron, due = stable_cron()
    schedule = write_schedule(
        tmp_path / "s.toml",
        [{"name": "house", "kind": "housekeeping", "cron": cron}],
        name="loop",
    )
    log = tmp_path / "schedule.log"
    proc = loop(schedule, database_url, log)
    try:
        wait_until(
            lambda: [r for r in item_runs(database_url) if r["outcome"] == "ok"],
            60, "the due item's run",
        )  # fmt: skip
        # Passes go on every second; the item is not run again.
        time.sleep(2.5)
        family = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    passes = events(out)
    assert len(passes) >= 3, out
    assert [(r["item"], r["outcome"]) for r in passes[0]["ran"]] == [("house", "ok")]
    assert all(p["due"] == 0 and p["ran"] == [] for p in passes[1:]), passes
    [run] = item_runs(database_url)
    assert (run["item"], run["due_at"], run["outcome"], run["host"]) == (
        "house", due, "ok", "loop-host",
    )  # fmt: skip
    logged = events(log.read_text())
    assert [e["event"] for e in logged if e["event"] in ("claimed", "finished", "stopping")] == [
        "claimed", "finished", "stopping",
    ]  # fmt: skip
    assert logged[-1]["signal"] == "SIGTERM"
    # Nothing it started outlives it (the item's process, multiprocessing's helpers).
    wait_until(lambda: not any(alive(p) for p in family), 10, "its processes to end")


def test_sigterm_in_the_middle_of_a_run_ends_its_process_and_records_the_run(
    tmp_path: Path, database_url: str
) -> None:
    cron, due = stable_cron()
    schedule = write_schedule(
        tmp_path / "s.toml",
        [{"name": "house", "kind": "housekeeping", "cron": cron}],
        name="loop-stop",
    )
    log = tmp_path / "schedule.log"
    # The housekeeping query waits behind a lock this test holds: a run that
    # stays in the middle for as long as the test wants.
    engine = create_engine(db.sqlalchemy_url(database_url))
    conn = engine.connect()
    proc = None
    try:
        blocker = conn.begin()
        conn.execute(text("LOCK TABLE sessions IN ACCESS EXCLUSIVE MODE"))
        proc = loop(schedule, database_url, log)
        wait_until(
            lambda: [r for r in item_runs(database_url) if r["outcome"] == "running"],
            60, "the run's claim",
        )  # fmt: skip
        item = wait_until(lambda: children(proc.pid), 30, "the item's process")
        waiting = text(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE NOT granted "
            "AND relation = 'sessions'::regclass)"
        )
        wait_until(lambda: conn.execute(waiting).scalar(), 30, "the item to wait for the lock")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        stopped_s = time.monotonic() - t0
        blocker.rollback()
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        conn.close()
        engine.dispose()
    # The item's process is asked to stop, then killed after the grace time
    # (runner.GRACE_S, 10 s): it is stuck in the database and cannot stop itself.
    assert stopped_s < 30, stopped_s
    wait_until(lambda: not any(alive(p) for p in item), 10, "its processes to end")
    assert proc.returncode == 1, err  # a run did not end ok
    assert "Traceback" not in err
    [run] = item_runs(database_url)
    assert (run["due_at"], run["outcome"], run["reason"]) == (
        due, "failed", "interrupted (SIGTERM/SIGINT)",
    )  # fmt: skip
    assert run["finished_at"] is not None
    [summary] = events(out)
    assert [(r["item"], r["outcome"]) for r in summary["ran"]] == [("house", "failed")]
    assert events(log.read_text())[-1]["event"] == "finished"
