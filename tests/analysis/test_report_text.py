"""Text that came from data is drawn as written, never parsed (issue 27 item 6).

The trials API took the destination ``far-1 $\\kaboom$ (5 Mbit/s)``, and
`kickass report` then died in matplotlib's mathtext parser
(ParseFatalException); an Atlas campaign named ``$x_$`` gave
ParseSyntaxException. Here every kind of text the report's figures draw from
data (a trial's destination, an Atlas campaign's name and a probe's country,
a router run's name, a scheduled item's name) holds dollar signs, TeX and
markup; the report must render, and each label must be in its figure's SVG
exactly as stored.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from kickass_db.study_store import StudyStore
from sqlalchemy import text
from support.seed import seed_atlas, seed_item_runs, seed_paired_trials, seed_router

KICKASS = str(Path(sys.executable).parent / "kickass")
SVG = "{http://www.w3.org/2000/svg}"
DESTINATION = r"far-1 $\kaboom$ (5 Mbit/s)"
CAMPAIGN = "$x_$"
COUNTRY = r"$\frac{1}{0}$"
ROUTER_RUN = r"edge $\alpha^$ & <b>"
ITEM = r"refresh $\$ {x}"


def figure_texts(page: str) -> dict[str, str]:
    """Per figure (data-figure), every text it draws, one string."""
    out = {}
    for svg in re.findall(r"<svg .*?</svg>", page, flags=re.S):
        root = ET.fromstring(svg)
        out[root.get("data-figure", "")] = "\n".join(
            "".join(t.itertext()) for t in root.iter(f"{SVG}text")
        )
    return out


def test_the_report_draws_labels_with_dollars_as_they_are(
    database_url: str, tmp_path: Path
) -> None:
    seed_paired_trials(database_url, destinations=(DESTINATION,))
    seed_router(database_url, runs=((ROUTER_RUN, 10e6),), seconds=2.0)
    campaign = seed_atlas(database_url)
    seed_item_runs(database_url)
    store = StudyStore(database_url)
    try:
        with store.engine.begin() as conn:
            conn.execute(
                text("UPDATE atlas_campaigns SET name = :new WHERE name = :old"),
                {"new": CAMPAIGN, "old": campaign},
            )
            conn.execute(text("UPDATE atlas_probes SET country_code = :cc"), {"cc": COUNTRY})
            item = conn.execute(text("SELECT min(item) FROM item_runs")).scalar_one()
            conn.execute(
                text("UPDATE item_runs SET item = :new WHERE item = :old"),
                {"new": ITEM, "old": item},
            )
    finally:
        store.close()
    out = tmp_path / "report.html"
    proc = subprocess.run(
        [KICKASS, "report", "--database-url", database_url, "-o", str(out), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert json.loads(proc.stdout)["path"] == str(out.resolve())
    texts = figure_texts(out.read_text())
    assert DESTINATION in texts["speedup"], texts["speedup"]
    assert CAMPAIGN in texts["atlas-status"], texts["atlas-status"]
    assert COUNTRY in texts["intolerant-by-country"], texts["intolerant-by-country"]
    assert ROUTER_RUN in texts["router"], texts["router"]
    assert ITEM in texts["item-runs"], texts["item-runs"]
    # Numbers on log axes are plain text too (no mathtext markup left in the SVG).
    assert not [n for n, t in texts.items() if "\\mathdefault" in t], texts["fct-by-size"]
