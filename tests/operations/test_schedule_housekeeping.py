"""The scheduled ``housekeeping`` item on what a real study server left behind.

A real `kickass server` (its own PostgreSQL, its own journal folder, an
instance id) runs a study for the real `kickass-probe`; the database stops
in the middle of probing, so the outcomes wait in the server's journal, and
the server is killed with SIGKILL. What it leaves: a session still live in
the database, owned by its instance, and a journal nobody replayed. The
housekeeping run reports both, per instance and per folder, and changes
nothing; the server's own next start replays its journal and ends its
orphan, after which housekeeping finds nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import kickass_db as db
import pytest
from kickass_core.states import LIVE_STATES
from kickass_db.journal import open_records
from kickass_server.probe_core import FLUSH_INTERVAL_S
from kickass_testbed.pg import EmbeddedPostgres
from sqlalchemy import create_engine, text
from support.live_server import free_port
from support.schedule import (
    events,
    item_runs,
    run_schedule,
    schedule_env,
    stable_cron,
    wait_until,
    write_schedule,
)

BIN = Path(sys.executable).parent
INSTANCE = "study-edge-1"
PPS = 300  # the per-address pacing cap the server runs with here

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the probe engine needs a raw socket"),
]


def sql(url: str, query: str) -> list[dict[str, Any]]:
    engine = create_engine(db.sqlalchemy_url(url))
    try:
        with engine.begin() as conn:
            result = conn.execute(text(query))
            return [dict(r) for r in result.mappings()] if result.returns_rows else []
    finally:
        engine.dispose()


def snapshot(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()}


class Server:
    def __init__(self, url: str, journal: Path, logs: Path) -> None:
        self.url, self.journal, self.logs = url, journal, logs
        self.http, self.probe = free_port(socket.SOCK_STREAM), free_port(socket.SOCK_DGRAM)
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs = 0

    def start(self) -> None:
        self.runs += 1
        log = (self.logs / f"server-{self.runs}.log").open("w")
        self.proc = subprocess.Popen(
            [str(BIN / "kickass"), "server", "--listen", f"127.0.0.1:{self.http}",
             "--probe-bind", "127.0.0.1", "--probe-port", str(self.probe),
             "--database-url", self.url, "--journal-dir", str(self.journal),
             "--instance-id", INSTANCE, "--log-level", "info"],
            # Paced so the plan takes ~7 s: the kill lands in the middle of probing.
            env={**os.environ, "KICKASS_POLICY_PPS_PER_ADDRESS": str(PPS)},
            stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip
        wait_until(lambda: "listening http" in self.log(), 30, "the server to listen", step=0.1)

    def log(self) -> str:
        assert self.proc is not None
        text_ = (self.logs / f"server-{self.runs}.log").read_text()
        assert self.proc.poll() is None or "listening http" in text_, text_
        return text_

    def stop(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        self.proc.wait(60)


def test_housekeeping_reports_a_dead_servers_orphans_and_journal_and_deletes_nothing(
    tmp_path: Path,
) -> None:
    pg = EmbeddedPostgres(tmp_path / "pg")
    url = pg.start()
    journal = tmp_path / "journal"
    server = Server(url, journal, tmp_path)
    client = None
    try:
        db.upgrade(url)
        server.start()
        client = subprocess.Popen(
            [str(BIN / "kickass-probe"), "--server", f"http://127.0.0.1:{server.http}",
             "--repetitions", "12", "--step", "16", "--window", "8", "--timeout", "3",
             "--yes", "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        # In the middle of probing: outcomes are being stored.
        wait_until(
            lambda: sql(url, "SELECT count(*) AS n FROM probe_outcomes")[0]["n"] > 0,
            60, "the first stored outcomes",
        )  # fmt: skip
        pg.stop()
        # Probing goes on for a few outcome flushes the database cannot take:
        # they wait in the journal, written before the database is tried.
        time.sleep(3 * FLUSH_INTERVAL_S)
        server.stop(signal.SIGKILL)
        out, err = client.communicate(timeout=120)
        session_id = json.loads(out)["session_id"]
        url = pg.start()

        files = sorted(journal.glob("journal-*.ndjson"))
        waiting = sum(len(open_records(p)) for p in files)
        assert waiting > 0, "the killed server's journal holds what the database never took"
        [session] = sql(url, "SELECT session_id, state, server_instance FROM sessions")
        assert (session["session_id"], session["server_instance"]) == (session_id, INSTANCE)
        assert session["state"] in LIVE_STATES, session
        # An hour passes with nothing written (its server is gone).
        sql(url, "UPDATE sessions SET updated_at = updated_at - interval '2 hours'")
        stored = sql(url, "SELECT count(*) AS n FROM probe_outcomes")[0]["n"]
        before = snapshot(journal)

        cron, due = stable_cron(minutes_ago=4)
        schedule = write_schedule(
            tmp_path / "schedule.toml",
            [{"name": "house", "kind": "housekeeping", "cron": cron, "journals": ["journal"]}],
            name="housekeeping",
        )
        env = schedule_env(url, "ops-host")
        proc = run_schedule(schedule, env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        [done] = [e for e in events(proc.stdout) if e["event"] == "finished"]
        assert done["outcome"] == "ok", done
        counts = done["counts"]
        assert list(counts["lingering_sessions"]) == [INSTANCE]
        assert counts["lingering_sessions"][INSTANCE]["sessions"] == 1
        assert counts["journals"] == {
            "journal": {"live": 0, "unreplayed_files": len(files), "unreplayed_records": waiting,
                        "failed_files": 0, "failed_records": 0},
        }  # fmt: skip
        assert (
            f"1 sessions live with nothing written for 1 h (instances: {INSTANCE}"
            in (done["reason"])
        )
        assert f"{waiting} journaled records wait for their server's next start" in done["reason"]
        [run] = item_runs(url)
        assert (run["outcome"], run["due_at"], run["reason"]) == ("ok", due, done["reason"])
        # A report only: the journal, the session and the outcomes are as they were.
        assert snapshot(journal) == before
        assert sql(url, "SELECT state FROM sessions")[0]["state"] == session["state"]
        assert sql(url, "SELECT count(*) AS n FROM probe_outcomes")[0]["n"] == stored

        # The server's own next start replays its journal and ends its orphan.
        server.start()
        server.stop(signal.SIGTERM)
        assert "earlier run had journaled" in server.log()
        assert sql(url, "SELECT state FROM sessions")[0]["state"] == "incomplete"
        assert sql(url, "SELECT count(*) AS n FROM probe_outcomes")[0]["n"] > stored
        assert not any(open_records(p) for p in journal.glob("journal-*.ndjson"))

        cron, _ = stable_cron(minutes_ago=2)
        write_schedule(
            schedule,
            [{"name": "house", "kind": "housekeeping", "cron": cron, "journals": ["journal"]}],
            name="housekeeping",
        )
        proc = run_schedule(schedule, env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        [done] = [e for e in events(proc.stdout) if e["event"] == "finished"]
        assert (done["outcome"], done.get("reason")) == ("ok", None), done
        assert done["counts"]["lingering_sessions"] == {}
        assert done["counts"]["journals"]["journal"]["unreplayed_records"] == 0
    finally:
        if client is not None and client.poll() is None:
            client.kill()
        if server.proc is not None and server.proc.poll() is None:
            server.proc.kill()
        pg.stop()
