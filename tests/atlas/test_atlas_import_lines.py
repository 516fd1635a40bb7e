"""`kickass atlas import` line by line: a bad line is skipped and named, the rest stored.

The real command in its own process on a real PostgreSQL: a 10,000-line
result file of one of the campaign's measurements with 100 hostile lines at
seeded random positions stores exactly the 9,900 good results, names exactly
the injected line numbers, exits 1 and prints no traceback. Before, a value
its column could not hold (an RTT of 1e308, a ``sent`` past smallint, a
firmware past integer, a NaN in the raw JSON) failed the whole window's
write with a traceback, and a time past Python's died in the join.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from atlas_standin import ping_result
from kickass_atlas.campaign import Campaign
from kickass_atlas.result_files import MAX_LINE_BYTES, SourceLine, import_campaign
from kickass_atlas.store import AtlasStore
from kickass_db import libpq_url

KICKASS = str(Path(sys.executable).parent / "kickass")
LINES = 10_000
HOSTILE = 100
MSM_ID = 4242
TARGET = "192.0.2.10"
T0 = 1_790_000_000  # 2026-09-21, Unix seconds
CAMPAIGN = {
    "name": "hostile-lines",
    "target": {"whole": TARGET, "split": "192.0.2.11"},
    "probes": {"ids": [1001]},
    "whole": {"sizes": [1000]},
    "split": {"leading": [548]},
    "packets": 1,
    "interval": 3600,
    "packet_interval": 1000,
    "duration": 86400,
    "credit_budget": 1_000_000,
}


def result(n: int, **over: Any) -> dict[str, Any]:
    """The n-th result: its own probe and time, one reply."""
    line = ping_result(
        MSM_ID, 2000 + n % 97, T0 + n, dst=TARGET, src="10.0.0.5", public="198.51.100.7",
        size=972, entries=[{"rtt": 25.125}],
    )  # fmt: skip
    return {**line, **over}


def text(n: int, **over: Any) -> str:
    return json.dumps(result(n, **over))


HOSTILE_KINDS: list[tuple[str, Any]] = [
    ("NaN for an RTT", lambda n: text(n).replace("25.125", "NaN")),
    ("an RTT of 1e308", lambda n: text(n, result=[{"rtt": 1e308}])),
    ("an RTT as text past real", lambda n: text(n, result=[{"rtt": "1e300"}])),
    ("a negative RTT", lambda n: text(n, result=[{"rtt": -5.0}])),
    ("sent past smallint", lambda n: text(n, sent=99_999)),
    ("sent as text past smallint", lambda n: text(n, sent="99999")),
    ("firmware past integer", lambda n: text(n, fw=10**12)),
    ("a size past an IPv4 length", lambda n: text(n, size=10**7)),
    ("a probe id past integer", lambda n: text(n, prb_id=2**40)),
    ("a negative probe id", lambda n: text(n, prb_id=-3)),
    ("a time past Python's", lambda n: text(n, timestamp=10**20)),
    ("a time before 1970", lambda n: text(n, timestamp=-5)),
    ("a time as a float", lambda n: text(n, timestamp=1.79e9)),
    ("a stored time past Python's", lambda n: text(n, stored_timestamp=10**15)),
    ("no time", lambda n: text(n, timestamp=None)),
    ("no probe", lambda n: text(n, prb_id=None)),
    ("a source that is no address", lambda n: text(n, **{"from": "not-an-ip"})),
    ("a target that is no address", lambda n: text(n, dst_addr="999.1.1.1")),
    ("a NUL character", lambda n: text(n, dst_name="a\u0000b")),
    ("a lone surrogate", lambda n: text(n).replace('"Ping"', '"\\ud800"')),
    ("Infinity", lambda n: text(n).replace('"lts": 17', '"lts": Infinity')),
    ("not JSON", lambda n: f'{{"msm_id": {MSM_ID}, "prb_id": 1, garbage'),
    ("a cut line", lambda n: text(n)[:80]),
    ("a JSON list", lambda n: json.dumps([result(n)])),
    ("deep nesting", lambda n: text(n, x="[").replace('"["', "[" * 100 + "]" * 100)),
    ("5000 entries", lambda n: text(n, result=[{"rtt": 1.0}] * 5000)),
    ("an endless line", lambda n: text(n, pad="x" * (MAX_LINE_BYTES + 10))),
    ("not UTF-8", lambda n: text(n).replace('"Ping"', '"P\udcffing"')),
]


@pytest.fixture
def campaign_file(database_url: str, tmp_path: Path) -> Path:
    """The campaign and its one whole-size measurement, as `atlas create` stored them."""
    campaign = Campaign.from_dict(CAMPAIGN)
    with AtlasStore(database_url) as store:
        cid = store.upsert_campaign(campaign)
        (planned,) = [m for m in campaign.plan(all_sizes=True).measurements if m.phase == "whole"]
        store.record_measurement(cid, MSM_ID, planned, planned.definition("test"), None)
    path = tmp_path / "campaign.yaml"
    path.write_text(yaml.safe_dump(CAMPAIGN))
    return path


def results_file(path: Path, seed: int) -> list[int]:
    r = random.Random(seed)
    hostile = sorted(r.sample(range(1, LINES + 1), HOSTILE))
    bad = set(hostile)
    with path.open("wb") as fp:
        for n in range(1, LINES + 1):
            line = r.choice(HOSTILE_KINDS)[1](n) if n in bad else text(n)
            fp.write(line.encode("utf-8", "surrogateescape") + b"\n")
    return hostile


def stored(database_url: str) -> list[tuple[int, int]]:
    with psycopg.connect(libpq_url(database_url)) as conn:
        rows = conn.execute(
            "SELECT prb_id, extract(epoch FROM result_at)::bigint FROM atlas_results "
            "ORDER BY result_at"
        ).fetchall()
    return [(p, t) for p, t in rows]


def test_hostile_lines_are_skipped_by_number_and_the_rest_stored(
    database_url: str, campaign_file: Path, tmp_path: Path
) -> None:
    path = tmp_path / "results.ndjson"
    hostile = results_file(path, seed=27)
    env = {**os.environ, "KICKASS_DATABASE_URL": database_url, "KICKASS_CONFIG": ""}
    run = subprocess.run(
        [KICKASS, "atlas", "import", str(campaign_file), str(path), "--json"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr
    report = json.loads(run.stdout)
    assert [s["line"] for s in report["skipped_lines"]] == hostile
    assert {s["source"] for s in report["skipped_lines"]} == {str(path)}
    assert report["skipped"] == HOSTILE and report["ignored"] == {}
    good = [n for n in range(1, LINES + 1) if n not in set(hostile)]
    assert report["results_new"] == len(good) == LINES - HOSTILE
    assert stored(database_url) == [(2000 + n % 97, T0 + n) for n in good]
    # Again, as text: nothing new, the same lines named on the way.
    run = subprocess.run(
        [KICKASS, "atlas", "import", str(campaign_file), str(path)],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert f"{HOSTILE} lines skipped" in run.stderr
    assert f"skipped {path}, line {hostile[0]}: " in run.stdout
    assert len(stored(database_url)) == LINES - HOSTILE


@pytest.mark.parametrize(("kind", "make"), HOSTILE_KINDS, ids=[k for k, _ in HOSTILE_KINDS])
def test_each_hostile_kind_costs_its_line_only(
    database_url: str, campaign_file: Path, kind: str, make: Any
) -> None:
    lines = [
        SourceLine("f", n, (make(n) if n == 2 else text(n)).encode("utf-8", "surrogateescape"))
        for n in (1, 2, 3)
    ]
    with AtlasStore(database_url) as store:
        report = import_campaign(store, Campaign.from_dict(CAMPAIGN), lines)
    assert [w.number for w, _ in report.skipped] == [2], (kind, report.skipped)
    assert report.results_new == 2
    assert stored(database_url) == [(2001, T0 + 1), (2003, T0 + 3)]


def test_a_json_list_names_its_items(
    database_url: str, campaign_file: Path, tmp_path: Path
) -> None:
    """The results API's JSON list: an element with NaN costs that element only."""
    path = tmp_path / "api.json"
    items = [text(1), text(2).replace("25.125", "NaN"), text(3), "[1, 2]"]
    path.write_text("[" + ", ".join(items) + "]")
    env = {**os.environ, "KICKASS_DATABASE_URL": database_url, "KICKASS_CONFIG": ""}
    run = subprocess.run(
        [KICKASS, "atlas", "import", str(campaign_file), str(path), "--json"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == 1 and "Traceback" not in run.stderr
    skipped = json.loads(run.stdout)["skipped_lines"]
    assert [(s.get("item"), s["reason"]) for s in skipped] == [
        (2, "holds NaN or an infinity"),
        (4, "not a JSON object"),
    ]
    assert stored(database_url) == [(2001, T0 + 1), (2003, T0 + 3)]
