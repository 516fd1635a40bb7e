"""A scheduled trial round with Kick-Ass periods, killed with SIGKILL half-way,
in namespaces (``kickass_testbed.wan``: s1 -- ka-router -- ka-linkem -- r1).

`kickass schedule run` runs in s1 with a `trials` item towards a
kickass-agent in r1, the measurement server in s1 storing into this test's
PostgreSQL. It is killed while ka-send is sending a Kick-Ass period, after an
earlier period's flows were measured. Then:

- nothing it started runs on: the item's process dies with it
  (PR_SET_PDEATHSIG); ka-send, whose stdout that process read, ends at its
  next line (measured: under 3 s);
- the next `schedule run` (another host id) finds the run dead, takes it
  over, uploads what the dead attempt left spooled and runs the round again;
- the dead attempt's trial is closed at its last heartbeat and named in the
  run's counts as interrupted; every flow is stored once, and the rollups
  count each matched flow once: per trial, and pooled the two trials'
  together.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from kickass_analysis import rollups
from kickass_db.trial_store import TrialStore
from kickass_testbed.binaries import rust_binary
from kickass_testbed.topology import Process
from kickass_testbed.trials import AGENT_CONTROL_PORT, start_agents
from kickass_testbed.wan import TestbedConfig as Config
from kickass_testbed.wan import receiver_address, sender_address
from kickass_testbed.wan import testbed as wan_testbed  # not test*: pytest would collect it
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
from test_trials_scheduled import measured, rows

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces"),
]

PAIRS = 2
PERIOD_S = 3.0
GAP_S = 1.0


@pytest.fixture(scope="module", autouse=True)
def _programs() -> None:
    for name in ("ka-router", "ka-linkem", "ka-send", "ka-agent-recv"):
        rust_binary(name)
    if not shutil.which("nft"):
        pytest.skip("nft is missing (tools/setup-system.sh installs it)")


def descendants(pid: int) -> dict[int, str]:
    """Every process below ``pid``, with its command line."""
    out: dict[int, str] = {}
    todo = [pid]
    while todo:
        for kid in children(todo.pop()):
            if kid in out:
                continue
            try:
                out[kid] = Path(f"/proc/{kid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except FileNotFoundError:
                continue
            todo.append(kid)
    return out


def test_a_kickass_round_killed_half_way_is_taken_over_closed_and_counted_once(
    database_url: str, tmp_path: Path
) -> None:
    t0 = time.monotonic()
    store = TrialStore(database_url)
    (tmp_path / "runner-token").write_text(store.add_runner("edge-1"))
    store.close()
    secret = secrets.token_hex(32)
    (tmp_path / "far-1.secret").write_text(secret)
    server_http = f"{sender_address(1)}:8080"
    config = Config(senders=1, receivers=1, capacity="10mbit", rtt_ms=100.0)
    with wan_testbed(config, database_url=database_url) as tb:
        start_agents(tb, secret, tmp_path)
        tb.built.start(
            Process(
                name="server",
                host="s1",
                argv=(KICKASS, "server", "--listen", server_http, "--probe-bind", "127.0.0.1",
                      "--probe-port", "9000", "--journal-dir", str(tmp_path / "journal")),
                env={"KICKASS_DATABASE_URL": database_url},
                ready_text="listening http",
            )
        )  # fmt: skip
        cron, due = stable_cron()
        trials: dict[str, Any] = {
            "agents": [{"name": "far-1", "secret_file": str(tmp_path / "far-1.secret"),
                        "url": f"http://{receiver_address(1)}:{AGENT_CONTROL_PORT}"}],
            "protocols": ["kickass", "tcp"], "pairs": PAIRS, "period_s": PERIOD_S,
            "gap_s": GAP_S,
            "workload": {"mean_gap_s": 0.3, "mean_packets": 20, "max_packets": 200},
            "access_capacity_bps": 10e6, "router_run_name": tb.prefix,
            "ka_send": str(rust_binary("ka-send")),
            "server": f"http://{server_http}",
            "runner_token_file": str(tmp_path / "runner-token"),
            "spool_dir": str(tmp_path / "spool"), "agent_retry_s": 5.0,
        }  # fmt: skip
        schedule = write_schedule(
            tmp_path / "s.toml",
            [{"name": "ka-round", "kind": "trials", "cron": cron, "timeout_s": 300,
              "trials": trials}],
            name="ka-kill", stale_s=30, heartbeat_s=1,
        )  # fmt: skip
        s1 = tb.built["s1"]
        first = s1.popen(
            [KICKASS, "schedule", "run", str(schedule)],
            env=schedule_env(database_url, "host-a"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            # Half-way: an earlier period's flows are measured (spooled, or
            # uploaded in a long enough gap) and ka-send is sending a Kick-Ass
            # period now.
            def sending() -> dict[int, str]:
                if first.poll() is not None:
                    raise AssertionError(f"the run ended before the kill: {first.communicate()}")
                if not measured(database_url, tmp_path / "spool"):
                    return {}
                family = descendants(first.pid)
                return family if any("ka-send" in c for c in family.values()) else {}

            family = wait_until(sending, 90, "a Kick-Ass period after measured flows", step=0.1)
            at_kill = measured(database_url, tmp_path / "spool")
            first.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            first.wait(10)
            # Nothing it started runs on: the item's process, ka-send, helpers.
            wait_until(
                lambda: not any(alive(p) for p in family), 10,
                f"the round's processes to die: {family}",
            )  # fmt: skip
            gone_s = time.monotonic() - killed
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
        [dead] = item_runs(database_url)
        assert (dead["outcome"], dead["attempt"], dead["host"]) == ("running", 1, "host-a")

        second = s1.popen(
            [KICKASS, "schedule", "run", str(schedule), "--json"],
            env=schedule_env(database_url, "host-b"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        out, err = second.communicate(timeout=180)
        assert second.returncode == 0, out + err
    log = events(out)
    [took] = [e for e in log if e.get("event") == "took-over"]
    assert took["previous"]["host"] == "host-a" and "lock is free" in took["previous"]["reason"]
    [run] = item_runs(database_url)
    assert (run["outcome"], run["attempt"], run["host"], run["due_at"]) == (
        "ok", 2, "host-b", due,
    )  # fmt: skip
    # Both arms ran in the takeover (a flow may be cut at a period's deadline:
    # the path is a 10 Mbit/s, 100 ms one and the periods are short).
    assert all(n > 0 for n in run["counts"]["flows_completed"]["far-1"].values()), run["counts"]

    trials_ = rows(
        database_url,
        "SELECT trial_id, finished_at, parameters->'scheduled' AS s FROM trials "
        "ORDER BY started_at",
    )
    assert [t["s"]["attempt"] for t in trials_] == [1, 2]
    assert trials_[0]["s"]["seed"] == trials_[1]["s"]["seed"]
    dead_trial, new_trial = trials_[0]["trial_id"], trials_[1]["trial_id"]
    # The dead attempt's trial: closed at its last heartbeat, named interrupted.
    heard = datetime.fromisoformat(run["history"][0]["heartbeat_at"])
    assert trials_[0]["finished_at"] == heard
    assert run["counts"]["interrupted_trials"] == [dead_trial]
    assert trials_[1]["finished_at"] is not None

    flows = rows(
        database_url,
        "SELECT t.trial_id, f.protocol, count(*) AS n, count(DISTINCT f.flow_id) AS d "
        "FROM flows f JOIN trials t ON t.id = f.trial_pk GROUP BY 1, 2",
    )
    by = {(r["trial_id"], r["protocol"]): r["n"] for r in flows}
    assert all(r["n"] == r["d"] for r in flows)
    # What the dead attempt had measured is stored (the takeover uploaded its spool).
    assert sum(n for (t, _), n in by.items() if t == dead_trial) >= at_kill
    # The takeover ran the whole round, both protocols.
    assert by.get((new_trial, "kickass"), 0) > 0 and by.get((new_trial, "tcp"), 0) > 0
    [seen] = rows(database_url, "SELECT count(*) AS n, count(DISTINCT flow_id) AS d "
                                "FROM v_flow_results")  # fmt: skip
    assert seen["n"] == seen["d"] == sum(by.values())

    # The rollups: each matched flow (the same flow under both arms) counted
    # in its own trial, once; pooled, the two trials' together.
    rollups.refresh(database_url)
    speedups = rows(
        database_url,
        "SELECT scope, key, pairs FROM v_trial_speedups WHERE size_bucket = 'all' "
        "AND arm = 'kickass'",
    )
    per_trial = {r["key"]: r["pairs"] for r in speedups if r["scope"] == "trial"}
    # The takeover's round ran every pair: each of its flows under both arms.
    assert per_trial[new_trial] == by[(new_trial, "kickass")] == by[(new_trial, "tcp")]
    # The dead one matched only pairs it finished both arms of (none, or its first).
    dead_arms = [by.get((dead_trial, p), 0) for p in ("kickass", "tcp")]
    assert per_trial.get(dead_trial, 0) <= min(dead_arms)
    [pooled] = [r["pairs"] for r in speedups if r["scope"] == "pooled"]
    assert pooled == sum(per_trial.values())
    print(f"\nkilled with {at_kill} flows measured (its processes gone in {gone_s:.2f} s); "
          f"{sum(by.values())} in all; "
          f"flows failed {run['counts']['flows_failed']}; matched per trial {per_trial}; "
          f"{time.monotonic() - t0:.1f} s")  # fmt: skip
