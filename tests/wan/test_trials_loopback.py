"""`kickass trials run` end to end on loopback: a real agent, a real server, real TCP flows.

Kick-Ass periods need the emulated edge router and live in the namespace
tests; here the TCP baseline exercises the runner, the spool and the uploads:
every flow lands in v_flow_results exactly once, also when the server was away
during the trial and the results were re-sent later.
"""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import kickass_db as db
import kickass_wan
import pytest
from kickass_db.trial_store import TrialStore
from sqlalchemy import create_engine, text
from support.live_server import free_port as _free_port
from support.live_server import server
from support.slow_relay import SlowRelay
from test_wan_agent import SECRET, agent, start_agent

KICKASS = str(Path(sys.executable).parent / "kickass")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the server's probe engine needs root")


def _trial(
    agent_port: int,
    server_url: str,
    token_file: Path,
    spool: Path,
    arms: tuple[str, ...] = ("--protocols", "tcp", "--pairs", "2"),
) -> dict:
    proc = subprocess.run(
        [KICKASS, "trials", "run", "--agent", f"far-1=http://127.0.0.1:{agent_port}",
         *arms, "--period", "1.5", "--mean-gap", "0.15",
         "--max-packets", "200", "--mean-packets", "20", "--seed", "5",
         "--server", server_url, "--runner-token-file", str(token_file),
         "--spool-dir", str(spool), "--json"],
        env={**os.environ, "KICKASS_AGENT_SECRET": SECRET},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _stored(database_url: str) -> tuple[int | None, int | None]:
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


ROOT = Path(__file__).resolve().parents[2]
SYSCTL = Path("/proc/sys/net/ipv4")
BASELINES = {"tcp:cubic": "cubic", "tcp:reno": "reno", "tcp:bbr": "bbr"}  # the paper's


def test_the_trial_stores_both_ends_environment(database_url: str, tmp_path: Path) -> None:
    """What a reviewer needs to reproduce a trial is stored with it, from both
    ends (issue 18 item 6): through a real agent's signed /v1/environment and
    the runner's own record, uploaded to a real server. Both ends are this
    host here, so every value is known: the kernel, the congestion control in
    effect (the host's default, and each flow's own as tcp_info's socket
    reported it), the TCP metrics cache and what the trial did with it, the
    agent's version, the tool versions and git commit, the route, and the
    clock offset between the two ends (zero within its stated bound)."""
    token_file = tmp_path / "runner-token"
    store = TrialStore(database_url)
    token_file.write_text(store.add_runner("edge-1"))
    store.close()
    default_cc = (SYSCTL / "tcp_congestion_control").read_text().strip()
    metrics_before = (SYSCTL / "tcp_no_metrics_save").read_text().strip()
    http = _free_port(socket.SOCK_STREAM)
    arms = ("--arms", ",".join(BASELINES), "--pairs", "1")
    with (
        agent(tmp_path / "agent") as (agent_port, _),
        server(database_url, _free_port(socket.SOCK_DGRAM), http),
    ):
        result = _trial(agent_port, f"http://127.0.0.1:{http}", token_file, tmp_path / "sp", arms)
    assert result["failed_flows"] == 0 and result["spooled"] == 0
    engine = create_engine(db.sqlalchemy_url(database_url))
    try:
        with engine.connect() as conn:
            (trial,) = conn.execute(text("SELECT environment, versions FROM trials")).mappings()
            flows = (
                conn.execute(text("SELECT arm, congestion_control, completed, extra FROM flows"))
                .mappings()
                .all()
            )
    finally:
        engine.dispose()
    env, versions = trial["environment"], trial["versions"]
    runner, far = env["runner"], env["agent"]

    # Kernels, both ends.
    assert runner["kernel"] == far["kernel"] == platform.release()
    # Congestion control: the host's default and what it offers, both ends ...
    for end in (runner, far):
        assert end["sysctl"]["tcp_congestion_control"] == default_cc
        assert set(BASELINES.values()) <= set(
            end["sysctl"]["tcp_available_congestion_control"].split()
        )
    # ... and each flow's, as its socket reported it: every arm ran its own.
    assert {f["arm"] for f in flows} == set(BASELINES)
    for f in flows:
        assert f["completed"], f
        assert f["congestion_control"] == BASELINES[f["arm"]]
        assert f["extra"]["cc_in_effect"] == BASELINES[f["arm"]], f
    # The TCP metrics cache: disabled for the trial (this runner is root) or
    # off already; the runner's record is taken with it in effect, the
    # agent's before (a remote agent's own setting is reported, not changed).
    cache = env["tcp_metrics_cache"]
    assert cache == result["tcp_metrics_cache"]
    assert cache["tcp_no_metrics_save"] == "1" and runner["sysctl"]["tcp_no_metrics_save"] == "1"
    if metrics_before == "1":
        assert cache["mode"] == "off already", cache
    else:
        assert cache == {"mode": "disabled for the trial", "tcp_no_metrics_save": "1",
                         "restored_to": metrics_before}  # fmt: skip
        assert (SYSCTL / "tcp_no_metrics_save").read_text().strip() == metrics_before
    assert far["sysctl"]["tcp_no_metrics_save"] == metrics_before
    # The agent: its own version and name, from its signed /v1/environment.
    assert far["agent"]["version"] == kickass_wan.__version__
    assert far["agent"]["name"] == "far-1" and versions["agent:far-1"] == "far-1"
    # Tool versions and the commit the runner ran from.
    tools = runner["versions"]
    assert tools["kickass-wan"] == versions["kickass-wan"] == kickass_wan.__version__
    assert tools["python"] == platform.python_version()
    ka_send = Path(sys.executable).parent / "ka-send"
    if ka_send.exists():
        want = subprocess.run([ka_send, "--version"], capture_output=True, text=True, check=True)
        assert tools["ka-send"] == want.stdout.strip()
    commit = tools["git_commit"]
    if os.environ.get("KICKASS_GIT_COMMIT"):
        assert commit == os.environ["KICKASS_GIT_COMMIT"]
    elif (ROOT / ".git").exists():
        # Others may commit while the test runs: the recorded commit is in
        # the history of the current one.
        assert re.fullmatch(r"[0-9a-f]{40}", commit), commit
        subprocess.run(["git", "-C", str(ROOT), "merge-base", "--is-ancestor", commit, "HEAD"],
                       check=True, timeout=30)  # fmt: skip
    # The route the flows took and the path MTU the kernel knew: the
    # device's, capped at an IPv4 datagram's largest length.
    (route,) = runner["routes"]
    lo_mtu = int(Path("/sys/class/net/lo/mtu").read_text())
    assert (route["address"], route["dev"]) == ("127.0.0.1", "lo")
    assert route["path_mtu"] == min(lo_mtu, 65535)
    # The clock offset between the ends: one clock here, so zero within the
    # bound (half the round trip of the request that read the agent's clock).
    assert 0 < far["clock_offset_bound_s"] < 5
    assert abs(far["clock_offset_s"]) <= far["clock_offset_bound_s"] + 2e-6


def test_periods_start_on_time_when_the_agent_answers_slowly(tmp_path: Path) -> None:
    """Each answer from the agent's control port takes 2 s (a relay holds it
    back). A period's flow tokens are fetched during the period before it and
    its predecessor's ending overlaps it, so every period still starts at
    its scheduled time: within 0.5 s, where asking for tokens between
    periods made each one after the first start 2 s - 1 s of quiet = at
    least 1 s late.
    Every flow completes: tokens fetched ahead are still valid when used."""
    common = ["--protocols", "tcp", "--pairs", "3", "--period", "1.5", "--gap", "3",
              "--mean-gap", "0.15", "--max-packets", "50", "--mean-packets", "10",
              "--seed", "5"]  # fmt: skip
    with agent(tmp_path / "agent") as (agent_port, _):
        slow = SlowRelay(agent_port, delay_s=2.0)
        try:
            proc = subprocess.run(
                [KICKASS, "trials", "run", "--agent", f"far-1=http://127.0.0.1:{slow.port}",
                 *common, "--spool-dir", str(tmp_path / "spool"), "--json"],
                env={**os.environ, "KICKASS_AGENT_SECRET": SECRET},
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
        finally:
            slow.close()
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    starts = result["period_starts"]
    assert len(starts) == 3
    late = {i: s["actual_s"] - s["scheduled_s"] for i, s in starts.items()}
    assert all(0 <= d < 0.5 for d in late.values()), (late, proc.stderr)
    assert result["late_periods"] == [] and result["skipped_periods"] == []
    assert result["failed_flows"] == 0
    flows = [f for f in (tmp_path / "spool").glob("flow.*.json")]
    assert flows and all(json.loads(f.read_text())["record"]["completed"] for f in flows)


def test_ctrl_c_ends_the_trial_at_once_and_keeps_every_flow_of_the_period(
    tmp_path: Path,
) -> None:
    """Ctrl-C a second into a 20 s period: the runner exits 130 within a few
    seconds (not at the period's end), and every flow the period planned is
    spooled: run, or recorded as not run because the trial was stopped."""
    common = ["--protocols", "tcp", "--pairs", "2", "--period", "20", "--gap", "3",
              "--mean-gap", "0.3", "--max-packets", "50", "--mean-packets", "10",
              "--seed", "5"]  # fmt: skip
    plan = subprocess.run(
        [KICKASS, "trials", "plan", "--destination", "far-1", *common, "--json"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    planned = json.loads(plan.stdout)["periods"][0]["flows"]
    spool = tmp_path / "spool"
    with agent(tmp_path / "agent") as (agent_port, _):
        run = subprocess.Popen(
            [KICKASS, "trials", "run", "--agent", f"far-1=http://127.0.0.1:{agent_port}",
             *common, "--spool-dir", str(spool), "--json"],
            env={**os.environ, "KICKASS_AGENT_SECRET": SECRET},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert run.stderr is not None
            for line in run.stderr:
                if line.startswith("period 1:"):
                    break
            time.sleep(1.0)
            interrupted = time.monotonic()
            run.send_signal(signal.SIGINT)
            _, err = run.communicate(timeout=60)
            took = time.monotonic() - interrupted
        finally:
            run.kill()
            run.wait(10)
    assert run.returncode == 130, err
    assert took < 5.0, took
    assert "interrupted: results so far are in" in err
    flows = [json.loads(p.read_text())["record"] for p in spool.glob("flow.*.json")]
    assert len(flows) == planned > 10
    assert {f["period_index"] for f in flows} == {0}
    not_run = [f for f in flows if not f["completed"]]
    assert not_run, "the period was cut a second in: most of its flows were still due"
    assert all(f["error"] == "not run: the trial was stopped before it was due" for f in not_run)


def test_a_closed_loop_runs_its_flows_one_after_another_and_stores_what_they_offered(
    database_url: str, tmp_path: Path
) -> None:
    """The paper's on-off sender (III-B): each flow starts its off time after
    the previous one ended, none after the period's end; the period stores
    what its flows offered and the trial which loop it ran."""
    token_file = tmp_path / "runner-token"
    store = TrialStore(database_url)
    token_file.write_text(store.add_runner("edge-2"))
    store.close()
    http = _free_port(socket.SOCK_STREAM)
    with (
        agent(tmp_path / "agent") as (agent_port, _),
        server(database_url, _free_port(socket.SOCK_DGRAM), http),
    ):
        result = _trial(
            agent_port,
            f"http://127.0.0.1:{http}",
            token_file,
            tmp_path / "spool",
            ("--protocols", "tcp", "--pairs", "1", "--loop", "closed"),
        )
    assert result["failed_flows"] == 0 and result["spooled"] == 0
    engine = create_engine(db.sqlalchemy_url(database_url))
    try:
        with engine.connect() as conn:
            flows = sorted(
                conn.execute(
                    text("SELECT flow_id, size_bytes FROM v_flow_results WHERE trial_id = :t"),
                    {"t": result["trials"]["far-1"]},
                ).all(),
                key=lambda f: int(f.flow_id.rsplit("-", 1)[1]),
            )
            period = conn.execute(
                text(
                    "SELECT offered_load_bps, workload_loop, duration_s FROM v_trial_periods "
                    "WHERE trial_id = :t"
                ),
                {"t": result["trials"]["far-1"]},
            ).one()
    finally:
        engine.dispose()
    from kickass_wan.trials.workload import Workload, pair_flows

    planned = pair_flows(
        Workload(mean_gap_s=0.15, mean_packets=20, max_packets=200, seed=5, loop="closed"), 0, 1.5
    )
    # The draws in order (on loopback a flow takes milliseconds, so about
    # every draw fits in the period; the namespace tests see fewer).
    assert 0 < len(flows) <= len(planned)
    assert [f.size_bytes for f in flows] == [f.size_bytes for f in planned[: len(flows)]]
    assert period.workload_loop == "closed"
    assert period.offered_load_bps == pytest.approx(
        sum(f.size_bytes for f in flows) * 8 / period.duration_s
    )
