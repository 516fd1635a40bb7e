"""Scheduled trial rounds (`kickass schedule run`, kind ``trials``), on loopback
with a real agent, a real server and real TCP flows (Kick-Ass periods need
the emulated edge router: the namespace trial tests cover the transport).

- A trial runner host: a fresh virtual environment built from the wheels of
  core, wan-agents and operations only, run under ``env -i``, where
  ``import kickass_db`` fails; with a runner token and no database URL it
  claims and reports its round through the server's schedule API.
- A round killed with SIGKILL half-way: the next run finds it dead, takes it
  over, uploads what the dead attempt had measured and runs the round; the
  dead attempt's trial is closed and named interrupted; no flow is stored
  twice (the Kick-Ass variant in namespaces: test_trials_scheduled_netns.py).
- A round the server cannot take: its records wait in the spool, counted as
  the upload backlog (the run, status, metrics) until the next round sends
  them; status counts the flows stored per agent today.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from datetime import datetime
from pathlib import Path
from typing import Any

import kickass_db as db
import pytest
from kickass_db.trial_store import TrialStore
from sqlalchemy import create_engine, text
from support.live_server import free_port, server
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
from support.wheels import install_offline, wheelhouse
from test_wan_agent import SECRET, agent

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the server's probe engine needs root")


def rows(database_url: str, sql: str) -> list[dict[str, Any]]:
    engine = create_engine(db.sqlalchemy_url(database_url))
    try:
        with engine.connect() as conn:
            return [dict(r) for r in conn.execute(text(sql)).mappings()]
    finally:
        engine.dispose()


def measured(database_url: str, spool: Path) -> int:
    """Flows a round has measured so far: spooled, or already stored."""
    stored = rows(database_url, "SELECT count(*) AS n FROM flows")[0]["n"]
    return int(stored) + len(list(spool.glob("flow.*.json")))


def trials_item(
    name: str, agent_port: int, tmp: Path, *, server_url: str | None, pairs: int, period: float,
    host: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    secret = tmp / "far-1.secret"
    secret.write_text(SECRET)
    cron, _ = stable_cron()
    trials: dict[str, Any] = {
        "agents": [{"name": "far-1", "url": f"http://127.0.0.1:{agent_port}",
                    "secret_file": str(secret)}],
        "protocols": ["tcp"], "pairs": pairs, "period_s": period, "gap_s": 0.5,
        "workload": {"mean_gap_s": 0.15, "max_packets": 200, "mean_packets": 20},
        "spool_dir": str(tmp / "spool"), "agent_retry_s": 5.0,
    }  # fmt: skip
    if server_url:
        trials |= {"server": server_url, "runner_token_file": str(tmp / "runner-token")}
    it = {"name": name, "kind": "trials", "cron": cron, "timeout_s": 300, "trials": trials}
    if host:
        it["host"] = host
    return it


@pytest.mark.slow
def test_a_runner_host_without_database_runs_its_scheduled_round(
    database_url: str, tmp_path: Path
) -> None:
    # Built and installed offline (no package index: tests/support/wheels.py).
    wheels = tmp_path / "wheels"
    ours, _ = wheelhouse(["core", "wan-agents", "operations"], wheels)
    venv = tmp_path / "runner-venv"
    install_offline(venv, wheels, sorted(ours))
    home = tmp_path / "home"
    home.mkdir()
    bare = {"PATH": "/usr/bin:/bin", "HOME": str(home)}
    probe = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import kickass_db"], env=bare,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert probe.returncode != 0 and "No module named 'kickass_db'" in probe.stderr
    frozen = subprocess.run(
        [str(venv / "bin" / "pip"), "freeze"], capture_output=True, text=True, check=True
    ).stdout.lower()
    for heavy in ("flask", "scapy", "sqlalchemy", "psycopg", "kickass-server", "kickass-db"):
        assert heavy not in frozen, frozen

    store = TrialStore(database_url)
    (tmp_path / "runner-token").write_text(store.add_runner("edge-1"))
    store.close()
    http = free_port(socket.SOCK_STREAM)
    url = f"http://127.0.0.1:{http}"
    with agent(tmp_path / "agent") as (agent_port, _):
        item = trials_item("round-edge-1", agent_port, tmp_path, server_url=url, pairs=1,
                           period=1.5, host="edge-1")  # fmt: skip
        schedule = write_schedule(
            tmp_path / "s.toml",
            [item,
             # Not this host's: a database kind, and another runner's round.
             {"name": "refresh", "kind": "refresh", "cron": item["cron"]},
             {**item, "name": "round-edge-2", "host": "edge-2"}],
            name="runner-host", server=url, runner_token_file=str(tmp_path / "runner-token"),
        )  # fmt: skip
        argv = [str(venv / "bin" / "kickass"), "schedule", "run", str(schedule), "--json"]
        # The server judges the runner's claims by the same file.
        with server(database_url, free_port(socket.SOCK_DGRAM), http, schedule_file=schedule):
            first = subprocess.run(argv, env=bare, capture_output=True, text=True, timeout=300)
            assert first.returncode == 0, first.stdout + first.stderr
            summary = events(first.stdout)[-1]
            assert [r["item"] for r in summary["ran"]] == ["round-edge-1"]
            assert summary["ran"][0]["outcome"] == "ok", first.stdout
            again = subprocess.run(argv, env=bare, capture_output=True, text=True, timeout=300)
            assert again.returncode == 0 and events(again.stdout)[-1]["ran"] == []

    [run] = item_runs(database_url)
    assert (run["item"], run["host"], run["outcome"], run["attempt"]) == (
        "round-edge-1", "runner:edge-1", "ok", 1,
    )  # fmt: skip
    assert run["counts"]["upload_backlog"] == 0
    [trial] = rows(database_url, "SELECT trial_id, parameters FROM trials")
    scheduled = trial["parameters"]["scheduled"]
    assert scheduled["item"] == "round-edge-1" and scheduled["run_id"] == run["id"]
    assert scheduled["agent_order"] == ["far-1"]
    assert trial["parameters"]["workload"]["seed"] == scheduled["seed"]
    [flows] = rows(database_url, "SELECT count(*) AS n, count(DISTINCT flow_id) AS d FROM flows")
    assert flows["n"] == flows["d"] > 0


def test_a_round_killed_half_way_is_taken_over_and_nothing_is_stored_twice(
    database_url: str, tmp_path: Path
) -> None:
    store = TrialStore(database_url)
    (tmp_path / "runner-token").write_text(store.add_runner("edge-1"))
    store.close()
    http = free_port(socket.SOCK_STREAM)
    url = f"http://127.0.0.1:{http}"
    with (
        agent(tmp_path / "agent") as (agent_port, _),
        server(database_url, free_port(socket.SOCK_DGRAM), http),
    ):
        item = trials_item("round", agent_port, tmp_path, server_url=url, pairs=2, period=3.0)
        schedule = write_schedule(
            tmp_path / "s.toml", [item], name="kill-round", stale_s=30, heartbeat_s=1
        )
        first = subprocess.Popen(
            [KICKASS, "schedule", "run", str(schedule)],
            env=schedule_env(database_url, "host-a"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            # Half-way: the first period's flows are measured (spooled, or
            # uploaded in a gap long enough for it).
            wait_until(
                lambda: measured(database_url, tmp_path / "spool"), 60, "the first period's flows"
            )
            at_kill = measured(database_url, tmp_path / "spool")
            kids = children(first.pid)
            first.send_signal(signal.SIGKILL)
            first.wait(10)
            wait_until(lambda: not any(alive(k) for k in kids), 10, "the round's process to die")
        finally:
            if first.poll() is None:
                first.kill()
        [dead] = item_runs(database_url)
        assert (dead["outcome"], dead["attempt"]) == ("running", 1)

        second = run_schedule(schedule, schedule_env(database_url, "host-b"))
        assert second.returncode == 0, second.stdout + second.stderr
    log = events(second.stdout)
    [took] = [e for e in log if e["event"] == "took-over"]
    assert took["previous"]["host"] == "host-a" and "lock is free" in took["previous"]["reason"]
    [run] = item_runs(database_url)
    assert (run["outcome"], run["attempt"], run["host"]) == ("ok", 2, "host-b")
    # Two trials for the due time: the dead attempt's (what it measured) and
    # the takeover's; the same seed and agent order in both.
    trials = rows(
        database_url,
        "SELECT trial_id, finished_at, parameters->'scheduled' AS s "
        "FROM trials ORDER BY started_at",
    )
    assert len(trials) == 2
    assert [t["s"]["attempt"] for t in trials] == [1, 2]
    assert trials[0]["s"]["seed"] == trials[1]["s"]["seed"]
    # The dead attempt's trial is closed when it was last heard of, and the
    # run names it as interrupted.
    assert trials[0]["finished_at"] == datetime.fromisoformat(run["history"][0]["heartbeat_at"])
    assert trials[1]["finished_at"] is not None
    assert run["counts"]["interrupted_trials"] == [trials[0]["trial_id"]]
    [flows] = rows(database_url, "SELECT count(*) AS n, count(DISTINCT flow_id) AS d FROM flows")
    assert flows["n"] == flows["d"]
    # What the dead attempt had measured is stored (the takeover uploaded its spool).
    [dead_flows] = rows(
        database_url,
        "SELECT count(*) AS n FROM flows f JOIN trials t ON t.id = f.trial_pk "
        f"WHERE t.trial_id = '{trials[0]['trial_id']}'",
    )
    assert dead_flows["n"] >= at_kill > 0
    # Every flow once in what the analysis reads.
    [seen] = rows(database_url, "SELECT count(*) AS n, count(DISTINCT flow_id) AS d "
                                "FROM v_flow_results")  # fmt: skip
    assert seen["n"] == seen["d"] == flows["n"]
    # Nothing left behind: the dead attempt's spool went up with the takeover.
    assert not list((tmp_path / "spool").rglob("*.json"))


def test_a_round_the_server_cannot_take_is_counted_as_backlog_until_uploaded(
    database_url: str, tmp_path: Path
) -> None:
    """The server is down during a scheduled round: the round still runs, its
    records wait in the spool, and the run, ``schedule status --json`` and the
    metrics all say how many. At the next due time (the server back) the
    round uploads them first: the backlog is 0 and status counts every flow
    stored today for the agent."""
    store = TrialStore(database_url)
    (tmp_path / "runner-token").write_text(store.add_runner("edge-1"))
    store.close()
    http = free_port(socket.SOCK_STREAM)
    url = f"http://127.0.0.1:{http}"
    schedule = tmp_path / "s.toml"
    metrics = tmp_path / "metrics.prom"
    env = schedule_env(database_url, "host-a")

    def run_due(minutes_ago: int) -> dict[str, Any]:
        # Each pass at a due time of its own (the daily item's time moved on).
        item = trials_item("round", agent_port, tmp_path, server_url=url, pairs=1, period=1.5)
        item["cron"], due = stable_cron(minutes_ago)
        write_schedule(schedule, [item], name="backlog")
        proc = run_schedule(schedule, env, "--metrics-file", str(metrics))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        [done] = [e for e in events(proc.stdout) if e["event"] == "finished"]
        assert (done["due_at"], done["outcome"]) == (due.isoformat(), "ok"), done
        return done

    def status() -> dict[str, Any]:
        st = subprocess.run(
            [KICKASS, "schedule", "status", str(schedule), "--json"], env=env,
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert st.returncode == 0, st.stderr
        return json.loads(st.stdout)

    def gauge() -> str:
        [line] = [
            ln for ln in metrics.read_text().splitlines()
            if ln.startswith('kickass_schedule_upload_backlog_records{item="round"}')
        ]  # fmt: skip
        return line.split()[-1]

    with agent(tmp_path / "agent") as (agent_port, _):
        # 1. Nobody listens at the server's address.
        first = run_due(4)
        spooled = len(list((tmp_path / "spool").glob("*.json")))
        assert spooled > 1  # the trial and its flows
        assert first["counts"]["upload_backlog"] == spooled
        assert first["reason"].startswith(f"{spooled} records still spooled for the next upload")
        assert gauge() == f"{float(spooled)}"
        assert status()["upload_backlog"] == {"round": spooled}
        assert rows(database_url, "SELECT count(*) AS n FROM flows")[0]["n"] == 0

        # 2. The server is back: the spool goes up before the round runs.
        with server(database_url, free_port(socket.SOCK_DGRAM), http):
            second = run_due(2)
    assert (second.get("reason"), second["counts"]["upload_backlog"]) == (None, 0)
    assert not list((tmp_path / "spool").glob("*.json"))
    assert gauge() == "0.0"
    [flows] = rows(database_url, "SELECT count(*) AS n, count(DISTINCT trial_pk) AS t FROM flows")
    assert flows["t"] == 2 and flows["n"] > 0  # both rounds' trials, every flow stored
    st = status()
    assert st["upload_backlog"] == {"round": 0}
    assert st["flows_per_agent_today"] == {"far-1": flows["n"]}
    assert st["runs_today"] == {"ok": 2}
