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
from kickass_db.study_store import StudyStore
from nbclient import NotebookClient
from support.seed import seed_study_detailed, seed_trials

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
VIABILITY = ROOT / "notebooks" / "fragment_viability.ipynb"


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


def outputs(nb: nbformat.NotebookNode) -> list[dict[str, Any]]:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]


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

    outs = outputs(nb)
    assert not [o for o in outs if o.output_type == "error"]
    html = "\n".join(o.get("data", {}).get("text/html", "") for o in outs)
    text = "\n".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in outs)
    # The key tables and the figure were produced.
    assert "drop_rate" in html and "as_sent_share" in html
    assert "Kick-Ass paper" in html and "ci95_low" in html
    assert "pooled split / whole ratio" in html
    assert any("image/png" in o.get("data", {}) for o in outs), "no figure"
    assert "two-proportion z-test" in text

    # The machine-readable summary agrees with what was seeded.
    (summary_cell,) = [c for c in nb.cells if "summary" in c.metadata.get("tags", [])]
    line = next(
        ln
        for o in summary_cell.outputs
        for ln in o.get("text", "").splitlines()
        if ln.startswith("SUMMARY ")
    )
    summary = json.loads(line.removeprefix("SUMMARY "))
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
    assert summary["paper_share_inside_ci95"] is True
    assert 0 < summary["pooled_split_to_whole"] < 2.5
    assert summary["sizes"] > 20 and summary["splits"] > 20


@pytest.mark.slow
def test_wide_area_trials_notebook_runs_on_seeded_trials(
    database_url: str, kernel_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed_trials(database_url, flows_per_period=30)
    monkeypatch.setenv("KICKASS_DATABASE_URL", db.libpq_url(database_url))
    nb = execute(ROOT / "notebooks" / "wide_area_trials.ipynb", tmp_path)
    outs = outputs(nb)
    assert not [o for o in outs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outs), "no figure"
    (cell,) = [c for c in nb.cells if "summary" in c.metadata.get("tags", [])]
    line = next(
        ln
        for o in cell.outputs
        for ln in o.get("text", "").splitlines()
        if ln.startswith("SUMMARY ")
    )
    summary = json.loads(line.removeprefix("SUMMARY "))
    # Two destinations x four periods x 30 flows, half of the periods each protocol.
    assert (summary["kickass_flows"], summary["tcp_flows"]) == (120, 120)
    # Seeded Kick-Ass flows take size*1.2 + 2 RTT; TCP ones pay log2(size) RTTs of slow start.
    assert 1.5 < summary["speedup"] < 4.0 and summary["speedup_within_paper"]
    assert 0.9 <= summary["ka_mode_fraction_mean"] <= 1.0
