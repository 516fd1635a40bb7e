"""`kickass report`'s section of the paper's congestion experiments (issue 24
item 6; ``kickass_analysis.experiments_section``).

Three stored runs, their figures computed by ``kickass_testbed.congestion``
(tests/support/experiments.py): (a) and (b) with the router's telemetry
stored under their ``router_run_name`` as the ingest stores it, the floor
without any. The report, written by the real command and drawn in headless
Chromium, must show per run every flow (Kick-Ass and TCP apart), the
router's TCP-mode intervals (the flows' own mode where no telemetry was
stored), each epoch's figures as stored and the paper's words beside ours;
with no run it says so.
"""

from __future__ import annotations

import html
import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from kickass_analysis.report import write_report
from kickass_db.experiment_store import ExperimentStore
from support import chromium
from support.experiments import router_tcp_intervals, seed_router_telemetry, synthetic_outcome

KICKASS = str(Path(sys.executable).parent / "kickass")
NOW = datetime.now(UTC)


@pytest.fixture
def stored(database_url: str) -> dict[str, tuple[int, dict[str, Any]]]:
    a = synthetic_outcome("a", started_at=NOW - timedelta(hours=3))
    b = synthetic_outcome("b", started_at=NOW - timedelta(hours=2), router_run_name="exp-b")
    floor = synthetic_outcome("floor", started_at=NOW - timedelta(hours=1), router_run_name=None)
    seed_router_telemetry(database_url, a)
    seed_router_telemetry(database_url, b)
    with ExperimentStore(database_url) as s:
        return {name: (s.store(o), o) for name, o in (("a", a), ("b", b), ("floor", floor))}


def _flows(outcome: dict[str, Any]) -> dict[str, int]:
    protocols = list(outcome["protocols"].values())
    return {"kickass": protocols.count("kickass"), "tcp": protocols.count("tcp")}


@pytest.mark.skipif(not chromium.available(), reason="needs chromium")
def test_each_run_is_drawn_with_its_figures_beside_the_paper(
    database_url: str, stored: dict[str, tuple[int, dict[str, Any]]], tmp_path: Path
) -> None:
    out = tmp_path / "report.html"
    proc = subprocess.run(
        [KICKASS, "report", "--database-url", database_url, "-o", str(out), "--json"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["sections"]["experiments"] is True

    want = {}
    for name, (run_id, outcome) in stored.items():
        marks = {**_flows(outcome), "total-kickass": 1, "total-tcp": 1, "kickass-mode": 1}
        if name == "a":  # the router's telemetry: one TCP-mode interval per epoch
            marks["router-tcp-mode"] = router_tcp_intervals(outcome)
            assert marks["router-tcp-mode"] == len(outcome["epochs"]) == 1
        if name == "floor":  # no telemetry: the flows were in TCP mode all along
            marks["flows-tcp-mode"] = 1
        want[f"experiment-{run_id}"] = marks
    got = {k: v for k, v in result["figures"].items() if k.startswith("experiment-")}
    assert got == want
    shown = chromium.render(out.as_uri(), evaluate={"marks": chromium.COUNT_MARKS})
    assert shown.errors == [] and shown.requests == [out.as_uri()]
    assert {k: v for k, v in shown.values["marks"].items() if k in want} == want

    page = out.read_text()
    section = page[page.index('<section id="experiments"') :]
    section = section[: section.index("</section>")]
    for run_id, outcome in stored.values():
        (epoch,) = outcome["epochs"]
        assert f'<h3 id="experiment-{run_id}">run {run_id}: ' in section
        assert f"<td>{epoch['jain']:.3f}</td><td>{epoch['kickass_over_tcp']:.2f}x</td>" in section
        assert f"<td>{epoch['utilisation']:.1%}</td>" in section
    # (a): the router into TCP mode 1.5 RTTs after the TCP flows started, back 3.5 after.
    assert "<td>1.5 RTT</td><td>3.5 RTT</td>" in section
    assert "helps them retain their TCP fair share during such epochs" in section
    assert "§III-D2, Fig. 7" in section and "fairly share the available bandwidth" in section
    assert "the router was in TCP mode in 0.0% of its samples" in section  # (b)
    assert "We see that the performance of Kick-Ass is bounded below by TCP" in section
    assert "No router telemetry was stored with this run" in section  # the floor
    numbers = {x["run_id"]: x for x in result["summary"]["experiments"]}
    for run_id, outcome in stored.values():
        (epoch,) = numbers[run_id]["epochs"]
        assert epoch["jain"] == outcome["epochs"][0]["jain"]
        assert epoch["utilisation"] == outcome["epochs"][0]["utilisation"]
    assert numbers[stored["b"][0]]["epochs"][0]["flows_enter_rtts"] == 2.0


def test_since_keeps_the_runs_started_since(
    database_url: str, stored: dict[str, tuple[int, dict[str, Any]]], tmp_path: Path
) -> None:
    result = write_report(database_url, tmp_path / "r.html", since=NOW - timedelta(minutes=90))
    assert [x["run_id"] for x in result.summary["experiments"]] == [stored["floor"][0]]
    assert result.summary["experiment_runs"] == 1


def test_no_run_stored_says_so(database_url: str, tmp_path: Path) -> None:
    result = write_report(database_url, tmp_path / "empty.html")
    assert result.sections["experiments"] is False
    page = (tmp_path / "empty.html").read_text()
    title = html.escape("The paper's congestion experiments")
    assert (
        f'<section id="experiments" data-empty="true">\n<h2>{title}</h2>\n'
        f'<p class="nodata">{title}: no data yet.</p>'
    ) in page
    assert result.summary["experiments"] == []


def test_a_run_at_the_ends_of_its_bounds_is_stored_and_reported(
    database_url: str, tmp_path: Path
) -> None:
    """Every number the store takes at the end of its bounds
    (``kickass_core.bounds``): the report reads and draws it all the same."""
    from kickass_core import bounds

    runs, rates = bounds.EXPERIMENT_RUNS, bounds.EXPERIMENT_RATES
    top = {f.name: f.maximum for f in (*runs, *rates)}
    outcome = synthetic_outcome("a", started_at=bounds.TIME_MAX)
    outcome["spec"].update(capacity_bps=top["capacity_bps"], rtt_ms=top["rtt_ms"],
                           duration_s=top["t_s"], interval_s=3600.0)  # fmt: skip
    outcome["rates"]["ka-0"][-1] = [top["t_s"], top["rate_bps"], True]
    outcome["rates"]["ka-1"][0] = [0.0, bounds.REAL_MIN, False]
    outcome["rates"]["tcp-0"] = [[0.0, 0.0, False]]
    outcome["epochs"][0].update(jain=0.0, kickass_over_tcp=1e12, utilisation=None,
                                start_s=0.0, end_s=top["t_s"])  # fmt: skip
    with ExperimentStore(database_url) as s:
        run_id = s.store(outcome)
        assert s.get(run_id).started_at == bounds.TIME_MAX
    result = write_report(database_url, tmp_path / "r.html")
    assert result.sections["experiments"] is True
    assert result.figures[f"experiment-{run_id}"]["kickass"] == 8
    (x,) = result.summary["experiments"]
    assert x["epochs"][0]["kickass_over_tcp"] == 1e12
    assert "Jain's index below 0.9" in x["epochs"][0]["misses"]
