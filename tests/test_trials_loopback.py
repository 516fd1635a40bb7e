"""`kickass trials run` end to end on loopback: a real agent, a real server, real TCP flows.

Kick-Ass periods need the emulated edge router and live in the namespace
tests; here the TCP baseline exercises the runner, the spool and the uploads:
every flow lands in flow_results exactly once, also when the server was away
during the trial and the results were re-sent later.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import kickass_db as db
import pytest
from kickass_db.trials import TrialStore
from sqlalchemy import create_engine, text
from test_server_instances import _free_port, server
from test_wan_agent import SECRET, agent

KICKASS = str(Path(sys.executable).parent / "kickass")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the server's probe engine needs root")


def _trial(agent_port: int, server_url: str, token_file: Path, spool: Path) -> dict:
    proc = subprocess.run(
        [KICKASS, "trials", "run", "--agent", f"far-1=http://127.0.0.1:{agent_port}",
         "--protocols", "tcp", "--pairs", "2", "--period", "1.5", "--mean-gap", "0.15",
         "--max-packets", "200", "--mean-packets", "20", "--seed", "5",
         "--server", server_url, "--runner-token-file", str(token_file),
         "--spool-dir", str(spool), "--json"],
        env={**os.environ, "KICKASS_AGENT_SECRET": SECRET},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _stored(database_url: str) -> tuple[int, int]:
    engine = create_engine(db.sqlalchemy_url(database_url))
    try:
        with engine.connect() as conn:
            n = conn.execute(text("SELECT count(*) FROM flow_results")).scalar()
            distinct = conn.execute(
                text("SELECT count(DISTINCT flow_id) FROM flow_results")
            ).scalar()
            return n, distinct
    finally:
        engine.dispose()


def test_trial_results_reach_the_database_once_even_through_an_outage(
    database_url: str, tmp_path: Path
) -> None:
    token_file = tmp_path / "runner-token"
    store = TrialStore(database_url)
    token_file.write_text(store.add_runner("edge-1"))
    store.close()
    spool = tmp_path / "spool"
    http = _free_port(socket.SOCK_STREAM)
    url = f"http://127.0.0.1:{http}"
    with agent(tmp_path / "agent") as (agent_port, _):
        with server(database_url, _free_port(socket.SOCK_DGRAM), http):
            first = _trial(agent_port, url, token_file, spool)
        flows_first = len(first["summary"]["far-1"]["tcp"])
        assert flows_first > 5 and first["failed_flows"] == 0
        assert first["spooled"] == 0
        assert _stored(database_url) == (flows_first, flows_first)
        # The server is down for the whole second trial: everything waits in the spool.
        second = _trial(agent_port, url, token_file, spool)
    flows_second = len(second["summary"]["far-1"]["tcp"])
    assert second["spooled"] == flows_second + 1  # its flows and its trial
    with server(database_url, _free_port(socket.SOCK_DGRAM), http):
        for _ in range(2):  # a second upload finds nothing left and doubles nothing
            up = subprocess.run(
                [KICKASS, "trials", "upload", "--server", url, "--runner-token-file",
                 str(token_file), "--spool-dir", str(spool)],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert up.returncode == 0, up.stderr
    total = flows_first + flows_second
    assert _stored(database_url) == (total, total)
    assert not list(spool.glob("*.json"))
