"""`kickass experiment` through the real `kickass` entry point (issue 24 item 6),
without namespaces: a run's outcome (built by tests/support/experiments.py,
figures by ``kickass_testbed.congestion.figures``) stored from its file,
listed and shown as JSON and as text beside the paper's words; bad input is
an ERROR line with a hint, never a traceback, and stores nothing. `run`
itself builds namespaces (tests/wan owns those runs): here only what it
refuses before it builds anything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kickass_core import cli
from support.experiments import seed_router_telemetry, synthetic_outcome

KICKASS = str(Path(sys.executable).parent / "kickass")


def kickass(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [KICKASS, "experiment", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def _error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.startswith("ERROR: "), proc.stderr
    assert "Traceback" not in proc.stderr
    return proc.stderr


def test_store_list_and_show_as_json(database_url: str, tmp_path: Path) -> None:
    a = synthetic_outcome("a")
    seed_router_telemetry(database_url, a)
    floor = synthetic_outcome("floor", router_run_name=None)
    for name, outcome in (("a", a), ("floor", floor)):
        (tmp_path / f"{name}.json").write_text(json.dumps(outcome))
    # `run --json` prints the outcome inside an object: `store` takes either.
    (tmp_path / "floor-run.json").write_text(json.dumps({"run_id": None, "outcome": floor}))

    stored = kickass("store", str(tmp_path / "a.json"), "--db", database_url, "--json")
    assert stored.returncode == 0, stored.stderr
    a_id = json.loads(stored.stdout)["run_id"]
    # The database from the environment, as every command takes it.
    env = {"KICKASS_DATABASE_URL": database_url}
    floor_id = json.loads(kickass("store", str(tmp_path / "floor.json"), "--json", env=env).stdout)[
        "run_id"
    ]
    again = kickass("store", str(tmp_path / "floor-run.json"), env=env)
    assert again.returncode == 0 and again.stdout.strip() == f"stored as run {floor_id}"

    listed = kickass("list", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    runs = json.loads(listed.stdout)
    assert [(r["run_id"], r["experiment"], r["router_mode"]) for r in runs] == [
        (a_id, "a", "kickass"),
        (floor_id, "floor", "droptail"),
    ]
    assert runs[0]["figures"]["epochs"] == a["epochs"]
    assert runs[0]["flows"] == {"kickass": 8, "tcp": 8}
    assert runs[0]["samples"] == sum(len(v) for v in a["rates"].values())

    shown = kickass("show", str(a_id), "--json", env=env)
    assert shown.returncode == 0, shown.stderr
    got: dict[str, Any] = json.loads(shown.stdout)
    assert got["run"]["parameters"] == a["spec"]
    rates = {s["flow"]: s for s in got["rates"]}
    assert set(rates) == set(a["rates"])
    for flow, points in a["rates"].items():
        assert rates[flow]["protocol"] == a["protocols"][flow]
        assert [list(p) for p in zip(rates[flow]["t_s"], rates[flow]["rate_bps"],
                                     rates[flow]["ka_mode"], strict=True)] == points  # fmt: skip
    (epoch,) = got["summary"]["epochs"]
    assert epoch["jain"] == a["epochs"][0]["jain"]
    assert (epoch["router_enter_rtts"], epoch["router_leave_rtts"]) == (1.5, 3.5)
    assert epoch["misses"] == []
    # The router's TCP mode from its telemetry: one interval, from 8.15 to 20.35 s.
    assert got["tcp_mode_intervals"]["source"] == "router-tcp-mode"
    ((start, end),) = got["tcp_mode_intervals"]["intervals"]
    assert start == pytest.approx(8.15, abs=1e-3) and end == pytest.approx(20.35, abs=1e-3)

    # The floor has no telemetry: the flows' own mode, in TCP mode all along.
    f = json.loads(kickass("show", str(floor_id), "--json", env=env).stdout)
    assert f["tcp_mode_intervals"]["source"] == "flows-tcp-mode"
    assert f["summary"]["router_tcp_share"] is None


def test_show_prints_the_paper_beside_ours(database_url: str, tmp_path: Path) -> None:
    b = synthetic_outcome("b", router_run_name="exp-b")
    seed_router_telemetry(database_url, b)
    (tmp_path / "b.json").write_text(json.dumps(b))
    run_id = kickass("store", str(tmp_path / "b.json"), "--db", database_url).stdout.split()[-1]
    out = kickass("show", run_id, "--db", database_url)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "experiment (b): the bottleneck is a legacy drop-tail router behind ours" in text
    assert "20 Mbit/s, 100 ms, 8 Kick-Ass + 8 TCP flows, 28 s, TCP on 8-20 s" in text
    assert f"{b['epochs'][0]['jain']:.3f}" in text and "all met" in text
    assert '§III-D2, Fig. 7: "We verify that Kick-Ass flows and native TCP flows' in text
    # The endpoints found the legacy bottleneck 2 RTTs in; the router never left Kick-Ass mode.
    assert "most Kick-Ass flows in TCP mode after 2 RTT" in text
    assert "the router was in TCP mode in 0.0% of its samples" in text
    listed = kickass("list", "--db", database_url)
    assert listed.returncode == 0
    assert listed.stdout.splitlines()[1].split()[:4] == [
        run_id,
        "b",
        "legacy-bottleneck",
        "kickass",
    ]


def test_bad_input_is_an_error_and_stores_nothing(database_url: str, tmp_path: Path) -> None:
    env = {"KICKASS_DATABASE_URL": database_url}
    bad = synthetic_outcome("a")
    bad["rates"]["tcp-5"][10][1] = 1e300
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    err = _error(kickass("store", str(tmp_path / "bad.json"), env=env))
    assert "experiment not stored: flow 'tcp-5', sample 10" in err and "rate_bps" in err
    assert "hint: nothing of this run was stored" in err
    (tmp_path / "nan.json").write_text(json.dumps(synthetic_outcome("a")).replace("0.9", "NaN", 1))
    assert "is not JSON: NaN is not a JSON number" in _error(
        kickass("store", str(tmp_path / "nan.json"), env=env)
    )
    assert "cannot read" in _error(kickass("store", str(tmp_path / "none.json"), env=env))
    assert "no experiment run 42" in _error(kickass("show", "42", env=env))
    empty = kickass("list", env=env)
    assert empty.returncode == 0 and empty.stdout == "" and "no experiment runs" in empty.stderr
    assert json.loads(kickass("list", "--json", env=env).stdout) == []
    assert "no database URL given" in _error(
        kickass("list", env={"KICKASS_DATABASE_URL": "", "KICKASS_CONFIG": ""})
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["a", "--epochs", "8-40"], "ERROR: epoch 8-40 is not inside the run"),
        (["b", "--epochs", "2-10,8-20"], "ERROR: epochs overlap"),
        (["floor", "--capacity", "fast"], "ERROR: bad --capacity 'fast'"),
        (["a", "--duration", "0.5"], "ERROR: --duration must lie within 1 and 3600 seconds"),
        (["a", "--flows-tcp", "0"], "ERROR: --flows-tcp must lie within 1 and 256"),
    ],
)
def test_run_refuses_bad_arguments_before_it_builds_anything(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """In process (the entry point's own main): as root these would build
    namespaces if the check were missing, so a passing test built none."""
    assert cli.main(["experiment", "run", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and "hint: " in err and "Traceback" not in err


def test_run_says_it_needs_root(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert cli.main(["experiment", "run", "a"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "ERROR: `kickass experiment run` builds network namespaces and needs root"
    )
    assert "list, show and store need no root" in err
