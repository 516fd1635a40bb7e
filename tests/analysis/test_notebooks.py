"""Every notebook runs headless, top to bottom, on a seeded database.

The kernel is this interpreter's ipykernel (nbclient starts it as a child
process and hands it ``KICKASS_DATABASE_URL`` through the environment). Its
scratch state — IPython profile, matplotlib font cache, kernel connection
files — goes into the test's temporary directory, not the home directory.
"""

from __future__ import annotations

import json
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import kickass_db as db
import nbformat
import pytest
from kickass_analysis import rollups
from kickass_db.study_store import StudyStore
from nbclient import NotebookClient
from support.seed import (
    ATLAS_INTOLERANT,
    ATLAS_PROBES,
    seed_atlas,
    seed_paired_trials,
    seed_router,
    seed_study,
    seed_study_detailed,
)

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
VIABILITY = ROOT / "notebooks" / "fragment_viability.ipynb"
# One notebook per source of results (issue 20), each executed below.
EXPECTED = {"fragment_viability", "wide_area_trials", "edge_router", "atlas"}


@pytest.fixture
def kernel_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("IPYTHONDIR", "MPLCONFIGDIR", "JUPYTER_RUNTIME_DIR", "JUPYTER_DATA_DIR"):
        d = tmp_path / name.lower()
        d.mkdir()
        monkeypatch.setenv(name, str(d))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")


def execute(path: Path, cwd: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    NotebookClient(
        nb,
        timeout=60,
        kernel_name="python3",
        resources={"metadata": {"path": str(cwd)}},
    ).execute()  # raises CellExecutionError, with the traceback, if a cell fails
    return nb


def outputs(nb: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]


def summary_of(nb: nbformat.NotebookNode) -> dict[str, Any]:
    """The notebook's machine-readable SUMMARY line (its cell tagged ``summary``)."""
    (cell,) = [c for c in nb.cells if "summary" in c.metadata.get("tags", [])]
    line = next(
        ln
        for o in cell.outputs
        for ln in o.get("text", "").splitlines()
        if ln.startswith("SUMMARY ")
    )
    data: dict[str, Any] = json.loads(line.removeprefix("SUMMARY "))
    return data


def check_ran(nb: nbformat.NotebookNode) -> None:
    outs = outputs(nb)
    assert not [o for o in outs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outs), "no figure"


def test_there_is_a_notebook_per_source() -> None:
    assert {p.stem for p in NOTEBOOKS} == EXPECTED


def test_notebooks_compute_statistics_through_the_module() -> None:
    # Intervals and tests come from kickass_analysis.stats: the same numbers as
    # the report, the volunteer's page and the dashboards' rollups.
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
        assert re.search(r"^from kickass_analysis import (\w+, )*stats\b", source, re.M), path.name
        assert "PAPER = stats.PAPER" in source, path.name
        for own in ("def wilson", "def two_proportion", "erfc", "sqrt(", "default_rng"):
            assert own not in source, (path.name, own)


def test_notebooks_are_stored_without_outputs() -> None:
    # Outputs belong to a run, not to the repository (and could hold data).
    assert NOTEBOOKS
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, path.name


def test_notebooks_read_only_the_views() -> None:
    # SQL keywords are upper case in the notebooks; Python's `from` is not.
    relation = re.compile(r"\b(?:FROM|JOIN)\s+([a-zA-Z_][\w.]*)")
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
        names = relation.findall(source)
        assert names and all(n.startswith("v_") for n in names), (path.name, names)


@pytest.mark.slow
def test_fragment_viability_notebook_runs_on_seeded_data(
    database_url: str,
    store: StudyStore,
    kernel_env: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seeded = seed_study_detailed(store, n_clients=60, rng=3, spread=timedelta(days=7), live=True)
    monkeypatch.setenv("KICKASS_DATABASE_URL", db.libpq_url(database_url))

    nb = execute(VIABILITY, tmp_path)

    check_ran(nb)
    outs = outputs(nb)
    html = "\n".join(o.get("data", {}).get("text/html", "") for o in outs)
    text = "\n".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in outs)
    # The key tables were produced, with intervals and the paper beside ours.
    assert "drop_rate" in html and "as_sent_share" in html and "drop_low" in html
    assert "Kick-Ass paper" in html and "ci95_low" in html
    assert "pooled split / whole ratio" in html and "pooled excess over the bound" in html
    assert "the paper's share inside our 95% interval" in text

    # The machine-readable summary agrees with what was seeded.
    summary = summary_of(nb)
    latest: dict[str, str | None] = {}
    for s in seeded:  # sessions finish in creation order; the last one per client is its latest
        if s.state != "probing":
            latest[s.install_id] = s.verdict
    intolerant = sum(v == "fragment-intolerant" for v in latest.values())
    conclusive = sum(v in ("fragments-ok", "fragment-intolerant") for v in latest.values())
    assert summary["clients_intolerant"] == intolerant == 5  # round(8.3% of 60)
    assert summary["clients_conclusive"] == conclusive
    low, high = summary["intolerant_ci95"]
    assert low < summary["intolerant_share"] < high
    assert summary["paper_share_inside_ci95"] is True and summary["agrees_with_paper"] is True
    assert 0 < summary["pooled_split_to_whole"] < 2.5
    # Seeded clean paths lose a split when either fragment is lost: no excess.
    excess = summary["pooled_excess"]
    assert excess["low"] < 0.01 and excess["low"] <= excess["estimate"] <= excess["high"]
    assert summary["sizes"] > 20 and summary["splits"] > 20


@pytest.mark.slow
def test_wide_area_trials_notebook_runs_on_seeded_trials(
    database_url: str, kernel_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed_paired_trials(database_url, flows_per_period=30)
    rollups.refresh(database_url)  # v_trial_speedups, as the scheduled refresh writes it
    monkeypatch.setenv("KICKASS_DATABASE_URL", db.libpq_url(database_url))
    nb = execute(ROOT / "notebooks" / "wide_area_trials.ipynb", tmp_path)
    check_ran(nb)
    summary = summary_of(nb)
    # Two destinations x two pairs x 30 flows per arm: 120 twins per arm.
    assert (summary["kickass_flows"], summary["tcp_flows"]) == (120, 120)
    assert summary["pairs"] == 120
    # Three seeded failures, each in a different pair of twins.
    assert summary["matched"] == 120 - 2 * 3
    assert summary["completion"] == {
        "kickass": pytest.approx(118 / 120),
        "tcp:cubic": pytest.approx(116 / 120),
    }
    # Seeded Kick-Ass flows take size*1.2 + 2 RTT; TCP ones pay log2(size) RTTs of slow start.
    low, high = summary["speedup_ci95"]
    assert 1.5 < low <= summary["speedup"] <= high < 4.0 and summary["speedup_within_paper"]
    # The notebook's own computation and the scheduled refresh's agree (one pooled group
    # per destination: the same flows and the same clusters give the same number
    # when there is one destination; with two, the pooled one lies between).
    assert summary["stored_speedup"] == pytest.approx(summary["speedup"], rel=0.2)
    assert 0.9 <= summary["ka_mode_fraction_mean"] <= 1.0


@pytest.mark.slow
def test_trials_notebook_agrees_with_the_rollup(
    database_url: str, kernel_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed_paired_trials(database_url, destinations=("far-1",), pairs=3, flows_per_period=20)
    rollups.refresh(database_url)
    monkeypatch.setenv("KICKASS_DATABASE_URL", db.libpq_url(database_url))
    summary = summary_of(execute(ROOT / "notebooks" / "wide_area_trials.ipynb", tmp_path))
    # One group: the notebook and the refresh compute the same statistic on the same pairs,
    # with the same clusters (three pairs one after the other) behind the same interval.
    assert summary["stored_speedup"] == pytest.approx(summary["speedup"], rel=1e-12)
    assert summary["clusters"] == 3
    assert summary["stored_ci95"] == pytest.approx(summary["speedup_ci95"], rel=1e-12)


@pytest.mark.slow
def test_edge_router_notebook_runs_on_seeded_telemetry(
    database_url: str, kernel_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed_router(database_url, seconds=30.0)
    rollups.refresh(database_url)  # the per-second and per-minute rollups it reads
    monkeypatch.setenv("KICKASS_DATABASE_URL", db.libpq_url(database_url))
    nb = execute(ROOT / "notebooks" / "edge_router.ipynb", tmp_path)
    check_ran(nb)
    summary = summary_of(nb)
    assert summary["runs"] == 2
    slow, fast = summary["per_run"]["edge-10mbit"], summary["per_run"]["edge-100mbit"]
    assert slow["samples"] == fast["samples"] == 3000
    # The paper: 10 Mbit/s stays in Kick-Ass mode; 100 Mbit/s about half the time.
    assert slow["ka_mode"] == 1.0 and slow["paper_ka_mode"] == 1.0
    assert 0.2 < fast["ka_mode"] < 0.9 and fast["paper_ka_mode"] == 0.5
    low, high = fast["ka_mode_ci95"]
    assert low < fast["ka_mode"] < high
    # The stored leading-fragment lengths are the paper's encoding of the advertised rate.
    assert summary["encoding_agreement"] == 1.0


@pytest.mark.slow
def test_atlas_notebook_runs_on_a_seeded_campaign(
    database_url: str,
    store: StudyStore,
    kernel_env: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seed_study(store, n_clients=20, rng=4)  # the volunteers beside the probes
    seed_atlas(database_url)
    monkeypatch.setenv("KICKASS_DATABASE_URL", db.libpq_url(database_url))
    nb = execute(ROOT / "notebooks" / "atlas.ipynb", tmp_path)
    check_ran(nb)
    html = "\n".join(o.get("data", {}).get("text/html", "") for o in outputs(nb))
    assert "RIPE Atlas 2013" in html and "Kick-Ass paper (405 clients)" in html
    summary = summary_of(nb)
    assert summary["probes"] == summary["probes_conclusive"] == len(ATLAS_PROBES)
    assert summary["probes_intolerant"] == len(ATLAS_INTOLERANT)
    low, high = summary["intolerant_ci95"]
    assert low < summary["intolerant_share"] < high
    assert summary["countries"] == len({cc for _, cc, _ in ATLAS_PROBES})
    assert summary["networks"] == len({asn for _, _, asn in ATLAS_PROBES})
    assert (summary["atlas_whole_sizes"], summary["atlas_splits"]) == (3, 6)
    assert 0 < summary["credits_spent"] <= summary["credit_budget"]
