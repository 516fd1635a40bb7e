"""`kickass report` over seeded data, rendered in headless Chromium.

Seeded through the real stores: a volunteer study (tests/support/seed.py),
RIPE Atlas results of probes in two countries, trials (unpaired, and a paired
trial whose speedup the refresh rollup stores), two router runs of telemetry
(NDJSON through `kickass telemetry ingest`'s class) and scheduled item runs.
The report must render without a console error or any request but its own
file, show a non-blank page, and every figure's marks must match the seeded
data, counted independently here (an empty figure fails).
"""

from __future__ import annotations

import json
import math
import re
import secrets
import subprocess
import sys
from collections import Counter, defaultdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from kickass_analysis import figures, stats
from kickass_analysis.report import write_report
from kickass_analysis.rollups import RollupStore
from kickass_atlas.campaign import Campaign, PlannedMeasurement
from kickass_atlas.store import AtlasStore, OutcomeRow, ResultRow
from kickass_core.flow_record import flow_id
from kickass_db.experiment_store import ExperimentStore
from kickass_db.study_store import StudyStore
from kickass_db.telemetry import TelemetryIngest
from kickass_db.trial_store import TrialStore
from sqlalchemy import text
from support import chromium
from support.experiments import synthetic_outcome
from support.seed import default_plan, seed_study_detailed, seed_trials

pytestmark = pytest.mark.skipif(not chromium.available(), reason="needs chromium")

KICKASS = str(Path(sys.executable).parent / "kickass")
NOW = datetime.now(UTC)
# The seed's addresses are in the three documentation prefixes (RFC 5737).
NETWORK_TABLE = (
    "192.0.2.0\t192.0.2.255\t64500\tXA\tDOC-NET-1\n"
    "198.51.100.0\t198.51.100.255\t64501\tXA\tDOC-NET-2\n"
    "203.0.113.0\t203.0.113.255\t64502\tXB\tDOC-NET-3\n"
)
ATLAS_PROBES = {  # prb_id -> (asn, country, loses fragments)
    1001: (3333, "NL", False),
    1002: (3333, "NL", True),
    1003: (7018, "US", False),
}
ATLAS_WHOLE = (100, 1000, 1480)
ATLAS_SPLIT = (548, 1004)
ATLAS_PACKETS = 16
ROUTER_RUNS = {"edge-a": ("kickass", 150), "edge-b": ("droptail", 90)}
FALLBACKS = 3  # Kick-Ass flows per pair of the paired trial that negotiated TCP
ITEM_RUNS = [  # item, kind, outcome, reason
    ("atlas-nightly", "atlas", "ok", None),
    ("atlas-nightly", "atlas", "ok", None),
    ("atlas-nightly", "atlas", "failed", "Atlas answered 403: bad key"),
    ("trials-far", "trials", "ok", None),
    ("trials-far", "trials", "timeout", "round took longer than 3600 s"),
    ("refresh", "refresh", "ok", None),
    ("refresh", "refresh", "skipped", "database not reachable from this host"),
]


# -- seeding ---------------------------------------------------------------------------


def seed_atlas(database_url: str) -> None:
    """One campaign: three whole sizes and two splits, 16 echo requests each,
    to three probes; 1002 loses every split (fragment-intolerant), 1003 the
    first request of every measurement."""
    campaign = Campaign.from_dict(
        {
            "name": "report-campaign",
            "target": {"whole": "192.0.2.10", "split": "192.0.2.11"},
            "probes": {"ids": sorted(ATLAS_PROBES)},
            "whole": {"sizes": list(ATLAS_WHOLE)},
            "packets": ATLAS_PACKETS,
            "duration": 3600,
            "credit_budget": 100_000,
        }
    )
    at = NOW - timedelta(hours=2)
    with AtlasStore(database_url) as store:
        cid = store.upsert_campaign(campaign)
        probes = [
            {"id": p, "asn_v4": asn, "country_code": cc, "status": {"name": "Connected"}}
            for p, (asn, cc, _) in ATLAS_PROBES.items()
        ]
        store.upsert_probes(probes)
        sizes = [("whole", s) for s in ATLAS_WHOLE] + [("split", s) for s in ATLAS_SPLIT]
        for n, (phase, ip_len) in enumerate(sizes):
            msm = 5000 + n
            planned = PlannedMeasurement(
                f"{phase}-{ip_len}", phase, "192.0.2.10", ip_len, ATLAS_PACKETS, 240, 1000, 3, 1
            )
            store.record_measurement(cid, msm, planned, {"size": ip_len - 28}, None)
            status = ("Ongoing", 2) if n == 0 else ("Stopped", 4)
            store.update_measurement(msm, status_id=status[1], status_name=status[0])
            results, outcomes = [], []
            for prb, (_, _, drops) in ATLAS_PROBES.items():
                results.append(
                    ResultRow(
                        msm_id=msm, prb_id=prb, result_at=at, campaign_id=cid, firmware=5080,
                        from_address="192.0.2.200", dst_address="192.0.2.10", size=ip_len - 28,
                        sent=ATLAS_PACKETS, rcvd=ATLAS_PACKETS, dup=0, join_status="exact",
                        raw={"prb_id": prb},
                    )
                )  # fmt: skip
                for i in range(ATLAS_PACKETS):
                    lost = (phase == "split" and drops) or (prb == 1003 and i == 0)
                    outcomes.append(
                        OutcomeRow(
                            msm_id=msm, prb_id=prb, result_at=at, packet_index=i,
                            campaign_id=cid, phase=phase, ip_len=ip_len,
                            outcome="lost" if lost else "acked",
                            rtt_ms=None if lost else 30.0, ack_count=0 if lost else 1,
                            icmp_seq=i, replied_at=None if lost else at, error=None,
                        )
                    )  # fmt: skip
            store.store_chunk(msm, results, outcomes, at)
        store.refresh_verdicts(cid)


def seed_paired_trial(
    database_url: str,
    flows_per_period: int = 30,
    destination: str = "far-3",
    fallbacks: int = 0,
    *,
    failed: int = 0,
    not_run: int = 0,
) -> str:
    """A trial of two arms in two pairs replaying the same flows (30): the rollup's input.
    The first ``fallbacks`` Kick-Ass flows of each pair negotiated TCP (no time
    in Kick-Ass mode); the last ``failed`` Kick-Ass flows of each pair were cut
    at the deadline; the first ``not_run`` TCP flows of the second pair were
    never run (the trial was stopped)."""
    from kickass_wan.trials.runner import CUT_AT_DEADLINE, NOT_RUN_STOPPED

    tid = secrets.token_hex(16)
    arms = [("kickass", "kickass"), ("tcp:cubic", "tcp")]
    periods: list[dict[str, Any]] = [
        {
            "index": 2 * pair + k,
            "pair": pair,
            "protocol": proto,
            "arm": arm,
            "start_s": 130.0 * (2 * pair + k),
            "duration_s": 120.0,
        }
        for pair in range(2)
        for k, (arm, proto) in enumerate(arms)
    ]
    t0 = NOW - timedelta(days=1)
    trial = {
        "trial_id": tid,
        "destination": destination,
        "access_capacity_bps": 100e6,
        "parameters": {
            "workload": {"mean_packets": 100.0, "seed": 1},
            "arms": [{"name": a, "protocol": p} for a, p in arms],
            "period_s": 120.0,
        },
        "started_at": t0.isoformat(),
        "periods": periods,
    }
    flows = []
    for p in periods:
        for i in range(flows_per_period):
            size = 1 + (i * 37) % 900
            fct = size * (1.1 if p["arm"] == "kickass" else 2.5) + 150
            fell_back = p["arm"] == "kickass" and i < fallbacks
            error = None
            if p["arm"] == "kickass" and i >= flows_per_period - failed:
                error = CUT_AT_DEADLINE
            elif p["arm"] != "kickass" and p["pair"] == 1 and i < not_run:
                error = NOT_RUN_STOPPED
            flows.append(
                {
                    "flow_id": flow_id(tid, p["index"], i),
                    "period_index": p["index"],
                    "pair": p["pair"],
                    "arm": p["arm"],
                    "protocol": p["protocol"],
                    "size_bytes": size * 1440,
                    "size_packets": size,
                    "started_at": (
                        t0 + timedelta(seconds=p["start_s"] + i * 100.0 / flows_per_period)
                    ).isoformat(),
                    "completed": error is None,
                    "fct_ms": fct if error is None else None,
                    "error": error,
                    "negotiated_protocol": "tcp" if fell_back else p["protocol"],
                    "ka_mode_fraction": (0.0 if fell_back else 0.5 + (i % 5) / 10)
                    if p["arm"] == "kickass"
                    else None,
                }
            )
    store = TrialStore(database_url)
    try:
        runner = store.authenticate(store.add_runner("report"))
        store.put_trial(runner, trial)
        assert not store.put_flows(runner, tid, flows).conflicts
    finally:
        store.close()
    return tid


def seed_router(database_url: str) -> None:
    t_start = (NOW - timedelta(hours=1)).timestamp()
    for name, (kind, n) in ROUTER_RUNS.items():
        lines = [
            json.dumps(
                {
                    "type": "metadata",
                    "started_unix": t_start,
                    "options": {"router": {"kind": kind, "capacity_bps": 10e6}},
                }
            )
        ]
        for i in range(n):
            mode = "droptail" if kind == "droptail" else ("tcp" if 40 <= i < 60 else "kickass")
            lines.append(
                json.dumps(
                    {
                        "type": "sample",
                        "t": 0.01 * i,
                        "ts": t_start + 0.01 * i,
                        "advertised_rate_bps": 5e6 + 1e4 * i,
                        "leading_fragment_len": 800 + (i % 8) * 8,
                        "input_rate_bps": 8e6,
                        "output_rate_bps": 7e6,
                        "queue_bytes": 1000 * (i % 30),
                        "marking_mode": mode,
                        "drops": i // 10,
                        "fragmented": 3 * i,
                    }
                )
            )
        lines.append(json.dumps({"type": "exit", "ts": t_start + 0.01 * n, "reason": "signal"}))
        ing = TelemetryIngest(database_url, name)
        try:
            ing.feed(line + "\n" for line in lines)
        finally:
            ing.close()


def seed_item_runs(database_url: str) -> None:
    rows = []
    for n, (item, kind, outcome, reason) in enumerate(ITEM_RUNS):
        due = NOW - timedelta(hours=10 - n)
        rows.append(
            {
                "item": item,
                "kind": kind,
                "due": due,
                "done": due + timedelta(minutes=3),
                "outcome": outcome,
                "reason": reason,
            }
        )
    store = StudyStore(database_url)
    try:
        with store.engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO item_runs (item, kind, due_at, host, claimed_at, heartbeat_at, "
                    "finished_at, outcome, reason) VALUES (:item, :kind, :due, 'ops-1', :due, "
                    ":done, :done, :outcome, :reason)"
                ),
                rows,
            )
    finally:
        store.close()


@pytest.fixture
def seeded(database_url: str, store: StudyStore) -> dict[str, Any]:
    sessions = seed_study_detailed(store, 40, 11, spread=timedelta(days=3), live=True)
    seed_trials(database_url, flows_per_period=25)
    seed_paired_trial(database_url, fallbacks=FALLBACKS)
    with RollupStore(database_url) as rollups:
        assert rollups.refresh_speedups() > 0
    seed_atlas(database_url)
    seed_router(database_url)
    seed_item_runs(database_url)
    # A congestion experiment, its router telemetry not stored (the router
    # figure is the two runs above): shaded by the flows' own mode.
    with ExperimentStore(database_url) as experiments:
        experiments.store(synthetic_outcome("a", router_run_name=None))
    return {"sessions": sessions}


def view(database_url: str, sql: str) -> list[dict[str, Any]]:
    store = StudyStore(database_url)
    try:
        with store.engine.connect() as conn:
            return [dict(r) for r in conn.execute(text(sql)).mappings()]
    finally:
        store.close()


# -- what the figures must show, counted here from the seed ----------------------------


def expected_marks(database_url: str) -> dict[str, dict[str, int]]:
    plan = default_plan()
    out: dict[str, dict[str, int]] = {
        "drop-by-size": {"volunteers": len(plan.whole), "ripe-atlas-probes": len(ATLAS_WHOLE)},
        "drop-by-split": {"volunteers": len(plan.split), "ripe-atlas-probes": len(ATLAS_SPLIT)},
    }
    # Countries and networks: the table's for volunteers (by the prefix of the
    # client's address), the probes' own for Atlas.
    table = {
        line.split("\t")[0].rsplit(".", 1)[0]: (line.split("\t")[2], line.split("\t")[3])
        for line in NETWORK_TABLE.splitlines()
    }
    clients = view(
        database_url,
        "SELECT host(last_address) AS a FROM v_client_verdicts "
        "WHERE latest_verdict IN ('fragments-ok', 'fragment-intolerant')",
    )
    nets = [table[c["a"].rsplit(".", 1)[0]] for c in clients]
    out["intolerant-by-country"] = {
        "volunteer": len({cc for _, cc in nets}),
        "atlas": len({cc for _, cc, _ in ATLAS_PROBES.values()}),
    }
    out["intolerant-by-asn"] = {
        "volunteer": len({asn for asn, _ in nets}),
        "atlas": len({asn for asn, _, _ in ATLAS_PROBES.values()}),
    }
    flows = view(
        database_url,
        "SELECT access_capacity_bps, protocol, congestion_control, arm, "
        "size_packets, completed, ka_mode_fraction FROM v_flow_results",
    )
    bins: dict[str, set[int]] = defaultdict(set)
    ka: Counter[str] = Counter()
    for f in flows:
        cap = f"{f['access_capacity_bps'] / 1e6:g} Mbit/s"
        arm = f["arm"] or f["protocol"] + (
            f":{f['congestion_control']}" if f["congestion_control"] else ""
        )
        if f["completed"]:
            bins[f"{cap} {arm}"].add(1 << (f["size_packets"].bit_length() - 1))
        if f["protocol"] == "kickass" and f["ka_mode_fraction"] is not None:
            ka[f"{arm} @ {cap}"] += 1
    out["fct-by-size"] = {figures.slug(k): len(v) for k, v in bins.items()}
    out["kickass-mode-cdf"] = {figures.slug(k): min(n, figures.MAX_POINTS) for k, n in ka.items()}
    speed = view(
        database_url,
        "SELECT * FROM v_trial_speedups WHERE scope = 'pooled' AND speedup IS NOT NULL",
    )
    per: Counter[str] = Counter()
    for r in speed:
        where = f"{r['destination']} {r['access_capacity_bps'] / 1e6:g} Mbit/s"
        per[figures.slug(f"{r['arm']} vs {r['baseline_arm']}, {where}")] += 1
    out["speedup"] = dict(per)
    router: dict[str, int] = {}
    for name, (kind, n) in ROUTER_RUNS.items():
        for panel, _, _ in figures.ROUTER_PANELS:
            # The droptail router never marks: its mode panel has no points.
            router[figures.slug(f"{panel} {name} ({kind})")] = (
                0 if panel == "kickass_mode" and kind == "droptail" else n
            )
    out["router"] = router
    outcomes: dict[str, set[str]] = defaultdict(set)
    for item, _, outcome, _ in ITEM_RUNS:
        outcomes[outcome].add(item)
    out["item-runs"] = {k: len(v) for k, v in outcomes.items()}
    out["atlas-status"] = {"ongoing": 1, "stopped": 1}
    for run in view(database_url, "SELECT run_id FROM v_experiment_runs"):
        flows = view(
            database_url,
            "SELECT protocol, count(DISTINCT flow) AS n FROM v_experiment_rates "
            f"WHERE run_id = {run['run_id']} GROUP BY protocol",
        )
        out[f"experiment-{run['run_id']}"] = {
            **{f["protocol"]: f["n"] for f in flows},
            "total-kickass": 1,
            "total-tcp": 1,
            "kickass-mode": 1,
            "flows-tcp-mode": 1,  # one TCP epoch
        }
    return out


def _no_remote_references(page: str) -> None:
    refs = re.findall(
        r"""\b(?:src|href|xlink:href|action|poster|data)\s*=\s*["']?([^"'\s>]+)""", page
    )
    assert refs, "the test should see the page's own links"
    remote = [r for r in refs if re.match(r"(?i)(https?:)?//", r)]
    assert not remote, remote
    assert not re.search(r"(?i)<(script|iframe|img|link\s+rel=.?stylesheet)\b", page)
    assert not re.search(r"(?i)url\(\s*['\"]?(https?:)?//", page)  # nothing from CSS either


# -- the tests --------------------------------------------------------------------------


def test_report_renders_every_figure_from_the_seed(
    database_url: str, seeded: dict[str, Any], tmp_path: Path
) -> None:
    table = tmp_path / "networks.tsv"
    table.write_text(NETWORK_TABLE)
    out = tmp_path / "report.html"
    result = write_report(database_url, out, network_table=table)
    assert result.path == out.resolve() and result.bytes == out.stat().st_size
    assert result.sections == {
        "study": True,
        "trials": True,
        "router": True,
        "experiments": True,
        "health": True,
    }
    page = out.read_text()
    _no_remote_references(page)
    assert "no data yet" not in page
    shown = chromium.render(out.as_uri(), evaluate={"marks": chromium.COUNT_MARKS})
    assert shown.errors == []
    assert shown.requests == [out.as_uri()]  # nothing fetched but the file itself
    width, height = chromium.png_size(shown.screenshot)
    assert width >= 1000 and height > 3000  # the whole page, every section
    assert chromium.png_colours(shown.screenshot) > 50  # drawn, not blank
    drawn = shown.values["marks"]
    want = expected_marks(database_url)
    assert set(drawn) == set(want)
    for name, series in want.items():
        got = {k: v for k, v in drawn[name].items()}
        want_nonzero = {k: v for k, v in series.items() if v}
        assert {k: v for k, v in got.items() if v} == want_nonzero, name
        assert sum(got.values()) > 0, f"figure {name} is empty"
    # The generator's own count agrees with what the browser drew.
    assert {k: {s: n for s, n in v.items() if n} for k, v in result.figures.items()} == {
        k: {s: n for s, n in v.items() if n} for k, v in drawn.items()
    }


def test_report_numbers_are_the_statistics_of_the_views(
    database_url: str, seeded: dict[str, Any], tmp_path: Path
) -> None:
    result = write_report(database_url, tmp_path / "r.html")
    s = result.summary
    rows = view(
        database_url,
        "SELECT sum(whole_sent) AS ws, sum(whole_acked) AS wa, "
        "sum(split_sent) AS ss, sum(split_acked) AS sa FROM v_verdicts_by_source "
        "WHERE source = 'volunteer'",
    )
    (r,) = rows
    assert s["size_volunteer"]["pooled"] == stats.drop(int(r["ws"]), int(r["wa"])).to_json()
    assert s["split_volunteer"]["pooled"] == stats.drop(int(r["ss"]), int(r["sa"])).to_json()
    latest = view(
        database_url,
        "SELECT latest_verdict FROM v_client_verdicts WHERE latest_verdict IS NOT NULL",
    )
    want = stats.intolerant_share([x["latest_verdict"] for x in latest], "volunteers")
    assert s["intolerant_volunteer"] == want.to_json()
    # Atlas: probe 1002 loses every split (intolerant), the others none.
    assert (s["intolerant_atlas"]["clients"], s["intolerant_atlas"]["intolerant"]) == (3, 1)
    paired = [x for x in s["speedups"] if x["destination"] == "far-3" and x["size_bucket"] == "all"]
    assert len(paired) == 1 and paired[0]["matched"] == 60
    assert 1.5 < paired[0]["speedup"] < 2.5
    assert s["item_runs"] == dict(Counter(o for _, _, o, _ in ITEM_RUNS))
    # Fallbacks per capacity and arm, counted here from the flows: the paired
    # trial's seeded ones (2 pairs x FALLBACKS of 60), none among the unpaired
    # trials' 100 Kick-Ass flows (stored without a negotiated protocol).
    fell = view(
        database_url,
        "SELECT access_capacity_bps, coalesce(arm, protocol) AS arm, count(*) AS n, "
        "count(*) FILTER (WHERE negotiated_protocol = 'tcp') AS k FROM v_flow_results "
        "WHERE protocol = 'kickass' GROUP BY 1, 2 ORDER BY 1, 2",
    )
    assert [(r["access_capacity_bps"], r["arm"], r["n"], r["k"]) for r in fell] == [
        (10e6, "kickass", 100, 0),
        (100e6, "kickass", 60, 2 * FALLBACKS),
    ]
    assert s["fallbacks"] == [
        {
            "access_capacity_bps": r["access_capacity_bps"],
            "arm": r["arm"],
            "flows": r["n"],
            "fell_back": r["k"],
            "share": stats.share(r["k"], r["n"]).to_json(),
        }
        for r in fell
    ]
    page = (tmp_path / "r.html").read_text()
    assert "Kick-Ass flows that fell back to TCP" in page
    assert f"<td>{2 * FALLBACKS}</td><td>10.0% (" in page
    # The workload's floor is stated where the trials are shown.
    assert "no flow is shorter than 46 packets" in page and "--literal-range" in page
    assert s["smallest_size_bin"] == 1  # the seeded trials' sizes start at 1 packet


def test_report_shows_sooner_beside_the_matched_speedup(database_url: str, tmp_path: Path) -> None:
    """Kick-Ass finishes every flow it finishes about 2x sooner, but 12 of
    each pair's 30 were cut at the deadline; 3 CUBIC flows of the second pair
    were never run. The matched speedup (33 of 60 pairs) reads about 2x; the
    flows finished sooner, failures kept, are 33 of the 57 run: 57.9%. The
    report shows both with completion per arm, from the rollup and, for a
    filtered report, computed from the flows alike."""
    seed_paired_trial(database_url, destination="far-5", failed=12, not_run=3)
    with RollupStore(database_url) as rollups:
        rollups.refresh_speedups()
    rolled = write_report(database_url, tmp_path / "r.html")
    live = write_report(database_url, tmp_path / "l.html", since=NOW - timedelta(days=30))
    for result in (rolled, live):
        (row,) = [x for x in result.summary["speedups"] if x["size_bucket"] == "all"]
        assert (row["pairs"], row["matched"]) == (60, 33)
        assert row["speedup"] > 1.5
        assert (row["completion_arm"], row["completion_baseline"]) == (0.6, 0.95)
        assert row["sooner_pairs"] == 57 and row["sooner"] == pytest.approx(33 / 57)
        assert row["sooner_low"] < 33 / 57 < row["sooner_high"]
    page = (tmp_path / "r.html").read_text()
    assert "<strong>Finished sooner</strong> keeps every matched flow" in page
    assert "finished sooner under the arm (95% CI), failures kept" in page
    assert "<td>60.0% / 95.0%</td><td>57.9% (" in page and ") of 57</td>" in page


def test_report_filters_and_cli(database_url: str, seeded: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "filtered.html"
    since = (NOW - timedelta(hours=12)).isoformat()
    proc = subprocess.run(
        [
            KICKASS,
            "report",
            "--database-url",
            database_url,
            "--campaign",
            "no-such-campaign",
            "--since",
            since,
            "-o",
            str(out),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["path"] == str(out.resolve()) and out.exists()
    # No such Atlas campaign: no Atlas series, no Atlas measurement.
    assert "ripe-atlas-probes" not in got["figures"]["drop-by-size"]
    assert got["summary"]["atlas_measurements"] == 0 and "intolerant_atlas" not in got["summary"]
    # Since 12 hours ago: the drop rates pool the sessions created from that
    # UTC day on (the rollup counts by day), the verdicts those finished since.
    day = (NOW - timedelta(hours=12)).replace(hour=0, minute=0, second=0, microsecond=0)
    recent = view(
        database_url,
        "SELECT sum(whole_sent) AS ws FROM v_session_summary "
        f"WHERE state IN ('complete', 'ended', 'expired', 'incomplete') "
        f"AND created_at >= '{day.isoformat()}'",
    )
    sent = int(recent[0]["ws"] or 0)
    if sent:
        assert got["summary"]["size_volunteer"]["pooled"]["sent"] == sent
    else:
        assert "size_volunteer" not in got["summary"]
    # The seeded trials started days ago; the speedup is computed from nothing.
    assert got["summary"]["speedups"] == [] and got["summary"]["fallbacks"] == []
    assert got["sections"]["router"] is True  # the router ran an hour ago
    plain = subprocess.run(
        [KICKASS, "report", "--database-url", database_url, "-o", str(tmp_path / "p.html")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plain.returncode == 0 and plain.stdout.strip() == str((tmp_path / "p.html").resolve())


def test_an_empty_database_says_no_data_yet(database_url: str, tmp_path: Path) -> None:
    out = tmp_path / "empty.html"
    result = write_report(database_url, out)
    assert result.sections == {
        "study": False,
        "trials": False,
        "router": False,
        "experiments": False,
        "health": False,
    }
    assert result.figures == {}
    page = out.read_text()
    assert page.count("no data yet") == 5 and "<svg" not in page
    _no_remote_references(page)
    shown = chromium.render(out.as_uri(), evaluate={"marks": chromium.COUNT_MARKS})
    assert shown.errors == [] and shown.values["marks"] == {}
    assert chromium.png_colours(shown.screenshot) > 2  # the headings are drawn


def test_a_figure_without_data_is_none() -> None:
    assert figures.drop_rate("x", "x", "x", []) is None
    assert figures.shares("x", "x", {"volunteer": []}) is None
    assert figures.router("x", "x", [figures.RunSeries("r", [], {})]) is None
    assert figures.stacked_counts("x", "x", {"item": {"ok": 0}}) is None
    fig = figures.drop_rate("one", "One", "size", [figures.Series("s", [44, 52], [0.1, math.nan])])
    assert fig is not None and fig.marks == {"s": 1}  # a NaN point is not drawn
    assert fig.svg.startswith("<svg ") and 'data-figure="one"' in fig.svg
    assert "<metadata>" not in fig.svg and "DOCTYPE" not in fig.svg
    ids = re.findall(r'\bid="([^"]+)"', fig.svg)
    assert ids and all(i.startswith("one-") for i in ids)


# -- the rollups give the same report ----------------------------------------------------


def seed_long_router_run(
    database_url: str, name: str, hours: float, every_s: float, offset_s: float = 0.0
) -> None:
    """A run of ``hours`` with a sample every ``every_s`` seconds, started on a
    whole minute (so its minutes and seconds hold its samples at their own
    times), or ``offset_s`` from one."""
    start = (NOW - timedelta(hours=hours + 0.5)).replace(second=0, microsecond=0).timestamp()
    start += offset_s
    n = round(hours * 3600 / every_s)
    lines = [
        json.dumps(
            {
                "type": "metadata",
                "started_unix": start,
                "options": {"router": {"kind": "kickass", "capacity_bps": 10e6}},
            }
        )
    ]
    for i in range(n):
        t = float(i * every_s)
        lines.append(
            json.dumps(
                {
                    "type": "sample", "t": t, "ts": start + t,
                    "advertised_rate_bps": 2e6 + 1e3 * (i % 97),
                    "leading_fragment_len": None if i % 11 == 0 else 600 + (i % 13) * 8,
                    "input_rate_bps": 8e6, "output_rate_bps": 7e6,
                    "queue_bytes": 500 * (i % 41),
                    "marking_mode": "tcp" if i % 7 == 0 else "kickass",
                    "drops": i // 100, "fragmented": i,
                }
            )
        )  # fmt: skip
    ing = TelemetryIngest(database_url, name)
    try:
        ing.feed(line + "\n" for line in lines)
    finally:
        ing.close()


def _read(database_url: str) -> Any:  # noqa: ANN401 - ReportData
    from kickass_analysis.report import Filters, ReportStore

    with ReportStore(database_url) as store:
        return store.read(Filters())


def _truth(database_url: str) -> tuple[dict[Any, stats.FctSummary], dict[Any, Any]]:
    """The trials' numbers computed in Python from v_flow_results (stats)."""
    flows = view(
        database_url,
        "SELECT access_capacity_bps, protocol, congestion_control, arm, size_packets, "
        "completed, fct_ms, ka_mode_fraction FROM v_flow_results",
    )
    bins: dict[Any, list[float | None]] = defaultdict(list)
    ka: dict[Any, tuple[list[float | None], list[float | None]]] = defaultdict(lambda: ([], []))
    for f in flows:
        arm = f["arm"] or f["protocol"] + (
            f":{f['congestion_control']}" if f["congestion_control"] else ""
        )
        key = (f["access_capacity_bps"], arm)
        fct = f["fct_ms"] if f["completed"] else None
        bins[(*key, "bin", stats.size_bin(f["size_packets"]))].append(fct)
        bins[(*key, "bucket", stats.size_bucket(f["size_packets"]))].append(fct)
        if f["protocol"] == "kickass":
            ka[key][0].append(f["ka_mode_fraction"])
            ka[key][1].append(fct)
    return (
        {k: stats.fct_summary(v) for k, v in bins.items()},
        {k: stats.time_in_kickass_mode(fr, ts) for k, (fr, ts) in ka.items()},
    )


def _close(a: float | None, b: float | None) -> bool:
    return (a is None and b is None) or (
        a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    )


def _check_trials(data: Any, database_url: str) -> None:  # noqa: ANN401
    from kickass_analysis.report.trials import _fct_summary

    want_bins, want_ka = _truth(database_url)
    got_bins = {
        (
            r["access_capacity_bps"],
            r["arm"],
            "bin" if r["size_bin"] is not None else "bucket",
            r["size_bin"] if r["size_bin"] is not None else r["size_bucket"],
        ): _fct_summary(r)
        for r in data.fct_bins
    }
    assert set(got_bins) == set(want_bins)
    for k, want in want_bins.items():
        got = got_bins[k]
        assert (got.flows, got.completed) == (want.flows, want.completed), k
        for field in ("completion_rate", "mean_ms", "p50_ms", "p95_ms"):
            assert _close(getattr(got, field), getattr(want, field)), (k, field)
    got_ka = {(r["access_capacity_bps"], r["arm"]): r for r in data.ka_mode}
    assert set(got_ka) == set(want_ka)
    for k, want in want_ka.items():
        r = got_ka[k]
        assert r["flows"] == want.flows, k
        for col, w in (("mean", want.mean), ("median", want.median)):
            assert _close(r[col], w), (k, col)
        assert _close(r["share_of_time"], want.share_of_time), k
        xs, ys = want.cdf
        keep = stats.thin(len(xs), figures.MAX_POINTS)
        assert list(r["cdf_x"] or []) == [xs[i] for i in keep], k
        assert all(_close(a, ys[i]) for a, i in zip(r["cdf_y"] or [], keep, strict=True)), k


def test_the_rollups_give_the_report_the_numbers_of_the_raw_rows(
    database_url: str, seeded: dict[str, Any], tmp_path: Path
) -> None:
    """Before any refresh the report computes the trials' figures from the
    flows and Atlas's drop rates from its outcomes; after `rollups.refresh` it
    reads the rollups (and long router runs from their minutes and seconds):
    the same numbers, those Python's stats compute from the raw rows. A trial
    stored after the refresh is shown at once (computed live again)."""
    seed_long_router_run(database_url, "edge-hours", 12, 60)  # drawn from minutes
    seed_long_router_run(database_url, "edge-2h", 2, 10)  # drawn from seconds
    # 1.5 s of 10 ms samples across a minute's end: drawn from its raw samples,
    # though a minute and two seconds of it are rolled up (CI once caught the
    # first sample's time read from the minute).
    seed_long_router_run(database_url, "edge-straddle", 1.5 / 3600, 0.01, offset_s=-0.7)
    before = _read(database_url)
    assert before.trials_source == "live"
    _check_trials(before, database_url)
    rendered_before = write_report(database_url, tmp_path / "before.html")

    from kickass_analysis import rollups as rollup_module

    rollup_module.refresh(database_url)
    after = _read(database_url)
    assert after.trials_source == "rollup"
    _check_trials(after, database_url)
    assert (after.size, after.split, after.verdicts) == (before.size, before.split, before.verdicts)
    assert set(after.size) == {"volunteer", "atlas"}
    runs = {r["run_name"]: r for r in before.router_runs}
    for r in after.router_runs:
        b = runs[r["run_name"]]
        assert (r["samples"], r["first_at"], r["last_at"]) == (
            b["samples"],
            b["first_at"],
            b["last_at"],
        )
        for col in ("advertised_rate_mean", "queue_mean", "kickass_share"):
            assert _close(r[col], b[col]), (r["run_name"], col)
    series = {s.label: s for s in before.router_series}
    assert len(series) == 5
    for s in after.router_series:
        b = series[s.label]
        assert len(s.t) == len(b.t) and 0 < len(s.t) <= figures.MAX_POINTS, s.label
        assert all(_close(x, y) for x, y in zip(s.t, b.t, strict=True)), s.label
        for panel, values in s.values.items():
            assert all(_close(x, y) for x, y in zip(values, b.values[panel], strict=True)), (
                s.label,
                panel,
            )
    rendered_after = write_report(database_url, tmp_path / "after.html")
    assert rendered_after.figures == rendered_before.figures
    assert rendered_after.summary == rendered_before.summary
    # The rollup read what the tables hold: minutes and seconds were used.
    rolled = view(
        database_url,
        "SELECT (SELECT count(*) FROM router_telemetry_1m) AS m, "
        "(SELECT count(*) FROM router_telemetry_1s) AS s",
    )[0]
    assert rolled["m"] >= 720 and rolled["s"] >= 720

    # A trial after the refresh (700 Kick-Ass flows: the CDF is thinned).
    seed_paired_trial(database_url, flows_per_period=350, destination="far-9")
    newer = _read(database_url)
    assert newer.trials_source == "live"
    _check_trials(newer, database_url)
    big = max(newer.ka_mode, key=lambda r: r["flows"])
    assert big["flows"] == 760 and len(big["cdf_x"]) == figures.MAX_POINTS  # 60 + 700, thinned
    rollup_module.refresh(database_url)
    refreshed = _read(database_url)
    assert refreshed.trials_source == "rollup"
    _check_trials(refreshed, database_url)
