"""A trial runner host's `kickass schedule run` against a real server (`ApiClaims`)
whose schedule disagrees with the host's own: the claim the server refuses is
logged ``refused``, counted where operators look, and the host's other items
go on (the whole round, with a real agent: tests/wan/test_trials_scheduled.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
from kickass_db.trial_store import TrialStore
from support.live_server import free_port, server
from support.schedule import (
    KICKASS,
    events,
    item_runs,
    run_schedule,
    schedule_env,
    stable_cron,
    write_schedule,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the server's probe engine needs root")


def test_a_refused_claim_is_logged_counted_and_the_other_items_go_on(
    database_url: str, tmp_path: Path
) -> None:
    store = TrialStore(database_url)
    (tmp_path / "runner-token").write_text(store.add_runner("edge-1"))
    store.close()
    cron, due = stable_cron()
    # No agents: the round fails at once, and the run is finished through the API.
    round_item: dict[str, Any] = {"kind": "trials", "cron": cron, "trials": {"pairs": 1}}
    server_file = write_schedule(
        tmp_path / "server.toml",
        [{**round_item, "name": "round-mine", "host": "edge-1"},
         {**round_item, "name": "round-theirs", "host": "edge-2"}],
        name="server",
    )  # fmt: skip
    http = free_port(socket.SOCK_STREAM)
    url = f"http://127.0.0.1:{http}"
    # The runner host's copy says round-theirs is its own: the server's says not.
    host_file = write_schedule(
        tmp_path / "host.toml",
        [{**round_item, "name": "round-mine", "host": "edge-1"},
         {**round_item, "name": "round-theirs", "host": "edge-1"}],
        name="runner-host", server=url, runner_token_file=str(tmp_path / "runner-token"),
    )  # fmt: skip
    env = schedule_env(None, "ignored")
    with server(database_url, free_port(socket.SOCK_DGRAM), http, schedule_file=server_file):
        proc = run_schedule(host_file, env, "--json", "--log-file", str(tmp_path / "log"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = events(proc.stdout)[-1]
    [refused] = summary["refused"]
    assert (refused["item"], refused["refusal"]) == ("round-theirs", "not-owner"), refused
    assert "edge-2" in refused["reason"]
    assert [(r["item"], r["outcome"]) for r in summary["ran"]] == [("round-mine", "failed")]
    assert "ERROR: round-theirs" in proc.stderr and "refused" in proc.stderr
    assert "Traceback" not in proc.stderr
    log = events((tmp_path / "log").read_text())
    assert [e["item"] for e in log if e["event"] == "refused"] == ["round-theirs"]
    [run] = item_runs(database_url)
    assert (run["item"], run["host"], run["outcome"]) == ("round-mine", "runner:edge-1", "failed")
    assert run["due_at"] == due
    status = subprocess.run(
        [KICKASS, "schedule", "status", str(server_file), "--json"],
        env=schedule_env(database_url, "ops"), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert status.returncode == 0, status.stderr
    refusals = json.loads(status.stdout)["refused_claims"]
    assert [(r["host"], r["item"], r["reason"], r["refusals"]) for r in refusals] == [
        ("runner:edge-1", "round-theirs", "not-owner", 1)
    ]


def test_a_server_without_a_schedule_file_says_so(database_url: str, tmp_path: Path) -> None:
    store = TrialStore(database_url)
    (tmp_path / "runner-token").write_text(store.add_runner("edge-1"))
    store.close()
    cron, _ = stable_cron()
    http = free_port(socket.SOCK_STREAM)
    url = f"http://127.0.0.1:{http}"
    host_file = write_schedule(
        tmp_path / "host.toml",
        [{"name": "round", "kind": "trials", "cron": cron, "trials": {"pairs": 1}}],
        name="runner-host", server=url, runner_token_file=str(tmp_path / "runner-token"),
    )  # fmt: skip
    with server(database_url, free_port(socket.SOCK_DGRAM), http):
        proc = run_schedule(host_file, schedule_env(None, "ignored"))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "no schedule file" in proc.stderr and "--schedule-file" in proc.stderr, proc.stderr
    assert item_runs(database_url) == []
