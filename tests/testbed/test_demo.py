"""`kickass demo` (what `make demo` runs) works end to end and cleans up."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces"),
    pytest.mark.skipif(not shutil.which("nft"), reason="needs nftables"),
]


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_demo_quick_json(database_url: str) -> None:
    before = _netns()
    kickass = Path(sys.executable).parent / "kickass"
    env = {**os.environ, "KICKASS_DATABASE_URL": database_url}
    proc = subprocess.run(
        [str(kickass), "demo", "--quick", "--json", "--trial-period", "8"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    verdicts = {c["client"]: c["verdict"] for c in summary["clients"]}
    assert verdicts == {
        "clean": "fragments-ok",
        "fragdrop": "fragment-intolerant",
        "lossy": "fragments-ok",
        "natted": "fragments-ok",
    }
    # Act two: both protocols ran through the edge router, every flow finished,
    # and Kick-Ass flows were faster (paper: 1.2x-4x; ~1.6x measured here).
    trial = summary["trial"]
    assert trial["failed_flows"] == 0
    assert trial["kickass_flows"] >= 5 and trial["tcp_flows"] >= 5
    rows = [r for r in trial["summary"] if r["protocol"] == "kickass"]
    assert all(r["ka_mode_fraction_mean"] >= 0.95 for r in rows), rows
    weighted = sum(r["speedup"] * r["completed"] for r in rows if r["speedup"]) / sum(
        r["completed"] for r in rows if r["speedup"]
    )
    assert weighted > 1.1, trial["summary"]
    assert not _netns() - before  # every namespace it built is gone
