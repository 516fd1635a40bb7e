"""A readable copy of an Atlas result wins over an unreadable one, and Atlas
verdicts count late replies as delivered.

A garbled line (an archive dump cut short, a proxy's mangling) names its
measurement, probe and time: it is stored ``invalid`` with a reason a person
can read, without outcomes. A readable line with the same key, imported
later or found later in the same file, takes its place with its outcomes,
and the probe's verdict and its rollup are decided again; a readable result
is never replaced. The lines are the real probe firmware's
(tests/atlas/data, evping_records.py), with the reply log our responder
would have written for them.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import evping_records
import kickass_db as db
import pytest
from atlas_standin import api_result
from kickass_analysis.rollups import Rollups
from kickass_atlas.campaign import Campaign, PlannedMeasurement
from kickass_atlas.ingest import FetchReport, MeasurementSpec, ingest_window
from kickass_atlas.responder_core import ReplyRecord
from kickass_atlas.service import AtlasSettings, import_results
from kickass_atlas.store import AtlasStore
from sqlalchemy import text

WHOLE, SPLIT = evping_records.TARGET, "10.77.0.9"
PRB, ADDRESS = 3001, "198.51.100.31"
MSM_WHOLE, MSM_SPLIT = 91_000_001, 91_000_002
BASE = 1_790_000_000
SLOT_S = 120  # one run per slot: the runs never overlap
LEADING = 548  # the split every split reply had
RUNS = {r["run"]: r for r in evping_records.records()}
# 4 packets 200 ms apart each: every reply 300 ms late but the last, which
# the run's end cut off (x, dup, x, dup, x, dup, x) ...
ALL_LATE = RUNS[65]
# ... and every reply back in 120 ms.
CLEAN = RUNS[69]
RUNS_PER_PHASE = 5  # 20 requests a phase: the verdict rule's minimum


def campaign() -> Campaign:
    return Campaign.from_dict(
        {
            "name": "readable-copy",
            "target": {"whole": WHOLE, "split": SPLIT},
            "probes": {"ids": [PRB]},
            "whole": {"sizes": [60]},
            "split": {"leading": [LEADING]},
            "packets": 4,
            "packet_interval": 200,
            "duration": 86400,
            "credit_budget": 10**9,
        }
    )


def _end(phase: str, i: int) -> int:
    return BASE + 600 + (i * 2 + (phase == "split")) * SLOT_S


@pytest.fixture
def lines(database_url: str) -> Iterator[dict[str, list[dict[str, Any]]]]:
    """The campaign, its two measurements and the reply log of five runs of
    each; yields each phase's API lines."""
    with AtlasStore(database_url) as store:
        campaign_id = store.upsert_campaign(campaign())
        lines: dict[str, list[dict[str, Any]]] = {"whole": [], "split": []}
        log: list[ReplyRecord] = []
        for phase, msm_id, target, rec, ip_len, request_len in (
            ("whole", MSM_WHOLE, WHOLE, ALL_LATE, 60, 60),
            ("split", MSM_SPLIT, SPLIT, CLEAN, 1500, 1500),
        ):
            planned = PlannedMeasurement(
                f"{phase}-{ip_len}", phase, target, ip_len, 4, 240, 200, 1, 1
            )
            store.record_measurement(campaign_id, msm_id, planned, {}, None)
            probe_line = evping_records.probe_line(rec)
            for i in range(RUNS_PER_PHASE):
                end = _end(phase, i)
                shift = end - int(probe_line["time"])
                for row in evping_records.reply_log(rec, address=ADDRESS, shift=shift):
                    log.append(
                        ReplyRecord(
                            len(log), target, row.dst_address, row.icmp_id, row.icmp_seq,
                            request_len, phase, ip_len if phase == "whole" else LEADING,
                            row.sent_at, row.attempt, row.duplicate,
                        )
                    )  # fmt: skip
                line = api_result(
                    probe_line, msm_id=msm_id, prb_id=PRB, public=ADDRESS, packets=4,
                    timestamp=end,
                )  # fmt: skip
                if phase == "split":
                    line["size"] = 1472  # the probe's ICMP data for a 1500-byte request
                lines[phase].append(line)
        store.write_reply_log(campaign_id, uuid.uuid4(), log)
    yield lines


def garbled(line: dict[str, Any]) -> dict[str, Any]:
    """The line with every entry turned into text, as a mangled dump has it."""
    bad = copy.deepcopy(line)
    bad["result"] = [json.dumps(e) for e in bad["result"]]
    return bad


def ndjson(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def imported(url: str, *files: Path) -> FetchReport:
    """``kickass atlas import CAMPAIGN FILE...``, as the command runs it."""
    return import_results(AtlasSettings(database_url=url), campaign(), [str(f) for f in files])


def q(url: str, sql: str) -> list[dict[str, Any]]:
    e = db.make_engine(url)
    try:
        with e.connect() as conn:
            return [dict(r) for r in conn.execute(text(sql)).mappings()]
    finally:
        e.dispose()


def outcomes(url: str) -> list[tuple[Any, ...]]:
    return [
        tuple(r.values())
        for r in q(
            url,
            "SELECT msm_id, prb_id, result_at, packet_index, ip_len, outcome, rtt_ms, ack_count, "
            "icmp_seq, attempt FROM atlas_outcomes ORDER BY 1, 2, 3, 4",
        )
    ]


def forget_results(url: str) -> None:
    e = db.make_engine(url)
    try:
        with e.begin() as conn:
            conn.execute(text("DELETE FROM atlas_results"))  # and their outcomes
            conn.execute(text("DELETE FROM atlas_verdicts"))
            conn.execute(text("UPDATE atlas_measurements SET results_fetched = 0"))
    finally:
        e.dispose()


def verdict(url: str, view: str = "v_verdicts_by_source") -> dict[str, Any]:
    rows = q(url, f"SELECT * FROM {view} WHERE source = 'atlas'")
    assert len(rows) == 1, rows
    return rows[0]


def test_a_readable_copy_replaces_the_garbled_one_and_the_verdict_follows(
    lines: dict[str, list[dict[str, Any]]],
    database_url: str,
    tmp_path: Path,
) -> None:
    good = ndjson(tmp_path / "good.ndjson", lines["whole"] + lines["split"])
    # What the good lines store when nothing came before them.
    imported(database_url, good)
    truth = outcomes(database_url)
    assert Counter(o[5] for o in truth) == Counter(late=15, lost=5, acked=20)
    forget_results(database_url)

    # The whole phase's lines garbled, the split phase's as they were:
    # the garbled ones stored invalid with a reason a person can read, no
    # outcomes; too few whole probes for a verdict.
    bad = ndjson(tmp_path / "bad.ndjson", [garbled(x) for x in lines["whole"]])
    first = imported(database_url, bad, ndjson(tmp_path / "split.ndjson", lines["split"]))
    assert first.results_new == 2 * RUNS_PER_PHASE
    assert first.join == {"invalid": RUNS_PER_PHASE, "exact": RUNS_PER_PHASE}
    invalid = q(
        database_url,
        "SELECT DISTINCT join_error FROM atlas_results WHERE join_status = 'invalid'",
    )
    assert [r["join_error"] for r in invalid] == [
        'unreadable result: entry 1 of "result" is the text "{\\"x\\": \\"*\\"}", not an object'
    ]
    assert {o[0] for o in outcomes(database_url)} == {MSM_SPLIT}
    v = verdict(database_url)
    assert v["verdict"] == "inconclusive" and v["verdict_reason"].startswith(
        "too few probes (whole 0, split 20"
    )

    # Then every good line: the garbled copies give way.
    report = imported(database_url, good)
    assert (report.results_new, report.results_replaced) == (RUNS_PER_PHASE, RUNS_PER_PHASE)
    assert outcomes(database_url) == truth
    results = q(database_url, "SELECT join_status, join_error, raw FROM atlas_results")
    assert {(r["join_status"], r["join_error"]) for r in results} == {("exact", None)}
    assert sorted(json.dumps(r["raw"], sort_keys=True) for r in results) == sorted(
        json.dumps(x, sort_keys=True) for x in lines["whole"] + lines["split"]
    )
    # Each result counted once, when it was first stored.
    fetched = q(database_url, "SELECT results_fetched, results_invalid FROM v_atlas_measurements")
    assert fetched == [{"results_fetched": RUNS_PER_PHASE, "results_invalid": 0}] * 2

    # The verdict of the probe, decided again: its whole phase came in now.
    v = verdict(database_url)
    assert (v["whole_sent"], v["whole_acked"], v["split_sent"], v["split_acked"]) == (20, 0, 20, 20)
    assert v["verdict"] == "fragments-ok", v["verdict_reason"]
    assert verdict(database_url, "v_verdicts_rollup")["verdict"] == "fragments-ok"
    # The rollup of the drop rates holds the replaced results at its next refresh.
    with Rollups(database_url) as rollups:
        rollups.refresh_matviews(("mv_atlas_probe_drop",))
    drop = q(
        database_url,
        "SELECT phase, sent, acked, late FROM v_drop_rollup WHERE source = 'atlas' ORDER BY phase",
    )
    assert drop == [
        {"phase": "split", "sent": 20, "acked": 20, "late": 0},
        {"phase": "whole", "sent": 20, "acked": 0, "late": 15},
    ]

    # A readable result is never replaced: importing everything again, the
    # garbled copies, or other readable lines with the same keys (their
    # entries differ) changes nothing.
    before = q(database_url, "SELECT * FROM atlas_results ORDER BY msm_id, result_at")
    other = []
    for line in lines["whole"]:
        x = copy.deepcopy(line)
        x["result"] = [{"rtt": 1.0}] * 4
        other.append(x)
    again = imported(
        database_url, good, tmp_path / "bad.ndjson", ndjson(tmp_path / "other.ndjson", other)
    )
    assert (again.results_new, again.results_replaced) == (0, 0)
    assert q(database_url, "SELECT * FROM atlas_results ORDER BY msm_id, result_at") == before
    assert outcomes(database_url) == truth


def test_a_garbled_copy_before_the_good_line_in_one_file(
    lines: dict[str, list[dict[str, Any]]],
    database_url: str,
    tmp_path: Path,
) -> None:
    mixed = [x for line in lines["whole"] for x in (garbled(line), line)]
    report = imported(database_url, ndjson(tmp_path / "mixed.ndjson", mixed))
    assert (report.results_new, report.join) == (RUNS_PER_PHASE, {"exact": RUNS_PER_PHASE})
    statuses = q(database_url, "SELECT join_status, count(*) AS n FROM atlas_results GROUP BY 1")
    assert statuses == [{"join_status": "exact", "n": RUNS_PER_PHASE}]
    assert Counter(o[5] for o in outcomes(database_url)) == Counter(late=15, lost=5)


def test_atlas_verdicts_count_late_replies_as_delivered(
    lines: dict[str, list[dict[str, Any]]],
    database_url: str,
    tmp_path: Path,
) -> None:
    """kickass_core.verdict.decide's contract (the volunteers' rule): acked
    counts every reply that came back, in time or late. Every whole reply
    here came back 300 ms late but the ones the run's end cut off: a path
    that delivers 75% of whole packets, not one too lossy to judge. The drop
    rates keep the paper's late-as-lost rule, as the volunteers' do."""
    imported(database_url, ndjson(tmp_path / "all.ndjson", lines["whole"] + lines["split"]))
    v = verdict(database_url)
    assert v["verdict"] == "fragments-ok", v["verdict_reason"]
    assert "15 probes acknowledged after their timeout, counted as delivered" in v["verdict_reason"]
    assert (v["whole_drop_rate"], v["split_drop_rate"]) == (1.0, 0.0)


def test_a_late_reread_replaces_a_garbled_copy_fetched_before(
    lines: dict[str, list[dict[str, Any]]], database_url: str
) -> None:
    """fetch: a window read with a garbled copy, read again at the late
    horizon with the readable one. The readable one takes its place; it is
    not a result uploaded late, nor fetched twice."""
    c = campaign()
    with AtlasStore(database_url) as store:
        spec = MeasurementSpec.from_row(
            next(
                m
                for m in store.measurements(store.campaign_id(c.name) or 0)
                if m["phase"] == "whole"
            )
        )
        line = lines["whole"][0]
        start, stop = line["timestamp"] - 60, line["timestamp"] + 60
        for recheck, served in ((False, garbled(line)), (True, line)):
            report = FetchReport()
            ingest_window(
                store, spec, [served], start, stop, report, store.known_probes,
                watermark=datetime.fromtimestamp(stop, UTC), recheck=recheck,
            )  # fmt: skip
            assert report.results_new == 1
        assert (report.results_replaced, report.results_late) == (1, 0)
    m = q(
        database_url,
        f"SELECT results_fetched, results_late, results_invalid, rechecked_until "
        f"FROM v_atlas_measurements WHERE msm_id = {MSM_WHOLE}",
    )[0]
    assert (m["results_fetched"], m["results_late"], m["results_invalid"]) == (1, 0, 0)
    assert m["rechecked_until"] == datetime.fromtimestamp(stop, UTC)
    assert Counter(o[5] for o in outcomes(database_url)) == Counter(late=3, lost=1)
