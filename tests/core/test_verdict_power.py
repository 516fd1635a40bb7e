"""The verdict's statistics (issue 11, part 3): the power table in
kickass_core.verdict's documentation is what ``detectable_excess`` computes,
the excess comes with an honest interval, invalid probes change the verdict
only as documented."""

from __future__ import annotations

import random
import re

import pytest
from kickass_core import verdict
from kickass_core.verdict import decide, detectable_excess, excess, two_fragment_bound


def test_the_documented_power_table_is_computed() -> None:
    rows = re.findall(
        r"^\s+(\d+)%\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$", verdict.__doc__ or "", re.M
    )
    assert len(rows) == 4
    for w, *cells in rows:
        for n, cell in zip((230, 1820, 18200), cells, strict=True):
            places = len(cell.split(".")[1])
            got = round(100 * detectable_excess(int(w) / 100, n), places)
            assert got == float(cell), (w, n, got)


def test_detectable_excess_is_detected_at_80_percent() -> None:
    """Simulated sessions: splits lost at the bound plus the detectable excess
    fail rule 3 about 80% of the time (whole loss known exactly here)."""
    rng = random.Random(7)
    w, n = 0.04, 1820
    e = detectable_excess(w, n)
    p = two_fragment_bound(w) + e
    flagged = 0
    for _ in range(400):
        lost = sum(rng.random() < p for _ in range(n))
        whole_lost = round(w * 20000)
        v = decide(20000, 20000 - whole_lost, n, n - lost)
        flagged += v.verdict != verdict.FRAGMENTS_OK
    assert 0.72 <= flagged / 400 <= 0.88


def test_excess_interval() -> None:
    x = excess(1000, 980, 1000, 950)  # whole 2%, split 5%: bound 3.96%
    assert x is not None
    assert x.estimate == pytest.approx(0.05 - two_fragment_bound(0.02))
    assert x.low < x.estimate < x.high
    # No loss at all: the estimate is 0, the interval is not a point.
    z = excess(500, 500, 500, 500)
    assert z is not None and z.estimate == 0.0 and z.low < 0 < z.high
    assert excess(0, 0, 10, 10) is None


def test_invalid_probes_in_the_verdict() -> None:
    # A few invalid: the verdict from the valid ones, with a note.
    v = decide(1000, 990, 950, 930, split_invalid=20)
    assert v.verdict == "fragments-ok" and "20 probes invalid" in v.reason
    # Many: inconclusive, and why.
    v = decide(1000, 990, 500, 495, split_invalid=500)
    assert v.verdict == "inconclusive" and "reassembly memory full" in v.reason
    # None: the reason is as before.
    assert "invalid" not in decide(1000, 990, 1000, 985).reason
