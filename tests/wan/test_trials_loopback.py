"""`kickass trials run` end to end on loopback: a real agent, a real server, real TCP flows.

Kick-Ass periods need the emulated edge router and live in the namespace
tests; here the TCP baseline exercises the runner, the spool and the uploads:
every flow lands in v_flow_results exactly once, also when the server was away
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
from kickass_db.trial_store import TrialStore
from sqlalchemy import create_engine, text
from support.live_server import free_port as _free_port
from support.live_server import server
from test_wan_agent import SECRET, agent, start_agent

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
            n = conn.execute(text("SELECT count(*) FROM v_flow_results")).scalar()
            distinct = conn.execute(
                text("SELECT count(DISTINCT flow_id) FROM v_flow_results")
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
        flows_first = len(first["summary"]["far-1"]["tcp:cubic"])
        assert flows_first > 5 and first["failed_flows"] == 0
        assert first["spooled"] == 0
        assert _stored(database_url) == (flows_first, flows_first)
        # The server is down for the whole second trial: everything waits in the spool.
        second = _trial(agent_port, url, token_file, spool)
    flows_second = len(second["summary"]["far-1"]["tcp:cubic"])
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


def test_an_agent_away_mid_trial_costs_its_periods_not_the_trial(tmp_path: Path) -> None:
    """The agent is killed when period 2 starts (index 1) and comes back once
    period 3 has been skipped: the runner kept asking for tokens for
    --agent-retry (1 s), then recorded the period's flows as not run and let
    its slot pass. The trial goes on and the later periods run. Every
    planned flow is recorded exactly once."""
    control, tcp = _free_port(socket.SOCK_STREAM), _free_port(socket.SOCK_STREAM)
    common = ["--protocols", "tcp", "--pairs", "6", "--period", "1.5", "--mean-gap", "0.15",
              "--max-packets", "100", "--mean-packets", "10", "--seed", "9"]  # fmt: skip
    plan = subprocess.run(
        [KICKASS, "trials", "plan", "--destination", "far-1", *common, "--json"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    planned = {p["index"]: p["flows"] for p in json.loads(plan.stdout)["periods"]}
    spool = tmp_path / "spool"
    _, agent_proc = start_agent(tmp_path / "agent", control, tcp)
    run = subprocess.Popen(
        [KICKASS, "trials", "run", "--agent", f"far-1=http://127.0.0.1:{control}",
         *common, "--agent-retry", "1", "--spool-dir", str(spool), "--json"],
        env={**os.environ, "KICKASS_AGENT_SECRET": SECRET},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    stderr: list[str] = []
    try:
        assert run.stderr is not None
        for line in run.stderr:
            stderr.append(line)
            if line.startswith("period 2:") and agent_proc.poll() is None:
                agent_proc.kill()
                agent_proc.wait(10)
            if line.startswith("period 3 skipped") and agent_proc.poll() is not None:
                _, agent_proc = start_agent(tmp_path / "agent", control, tcp)
        out, _ = run.communicate(timeout=120)
    finally:
        run.kill()
        agent_proc.kill()
        agent_proc.wait(10)
    assert run.returncode == 1, "".join(stderr)  # flows failed: said in the exit code
    result = json.loads(out)
    skipped = {sp["period"] for sp in result["skipped_periods"]}
    assert 2 in skipped, result["skipped_periods"]
    assert not skipped & {0, 3, 4, 5}, result["skipped_periods"]
    assert all("no flow tokens from agent far-1" in sp["error"] for sp in result["skipped_periods"])
    rows = [json.loads(p.read_text()) for p in spool.glob("*.json")]
    flows = [r["record"] for r in rows if r["kind"] == "flow"]
    by_period: dict[int, list[dict]] = {}
    for f in flows:
        by_period.setdefault(f["period_index"], []).append(f)
    assert {k: len(v) for k, v in by_period.items()} == planned, "".join(stderr)
    assert len({f["flow_id"] for f in flows}) == len(flows)
    assert all(not f["completed"] and f["error"].startswith("not run") for f in by_period[2])
    assert all(f["completed"] for p in (0, 3, 4, 5) for f in by_period[p]), "".join(stderr)
    assert result["failed_flows"] == sum(not f["completed"] for f in flows)
