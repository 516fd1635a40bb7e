"""Ingest of the real probe firmware's result lines: idempotent, whatever the
order, the batching and the upload delays, and it never stops.

Hypothesis draws from the lines the real ``evping`` printed (tests/atlas/data,
evping_records.py: drop patterns of every kind, 10% loss, fragments, duplicated
and delayed replies), places them as runs of a few probes, and perturbs what
the API and the log show: results uploaded late (after the first read of
their window), served twice, corrupted; log rows missing (the responder was
down). Then they are fetched through the HTTPS stand-in in two rounds (before
and after the late uploads arrive, the second with the late re-read) and,
separately, imported from files in another order. Properties:

- every fetch and import finishes, and every line of ours is stored once,
  unreadable ones as ``invalid``;
- fetch and import store the same rows, and running either again adds none;
- every joined result has one outcome per packet, one ``acked`` per rtt
  entry; with the log the responder would really have written (an
  unperturbed faithful recording), the counts are the truth's.
"""

from __future__ import annotations

import json
import random
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import evping_records
import kickass_db as db
import pytest
from atlas_standin import StandIn, api_result, running
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kickass_atlas.campaign import Campaign, PlannedMeasurement
from kickass_atlas.client import AtlasClient
from kickass_atlas.ingest import fetch_campaign
from kickass_atlas.responder_core import ReplyRecord
from kickass_atlas.result_files import import_campaign, read_result_lines
from kickass_atlas.store import AtlasStore
from sqlalchemy import text

TARGET = evping_records.TARGET
PROBES = {2001: "198.51.100.21", 2002: "198.51.100.22", 2003: "198.51.100.23"}
BASE = 1_790_000_000  # the campaign's start, long past
SLOT_S = 120  # one run per probe per slot: the runs never overlap
RECORDS = [r for r in evping_records.records() if r["truth"]["requests"]]


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandIn]:
    with running(tmp_path_factory.mktemp("standin")) as s:
        for prb_id, address in PROBES.items():
            s.add_probe(prb_id, address, 64500, "NL")
        yield s


def campaign() -> Campaign:
    return Campaign.from_dict(
        {
            "name": "recorded-lines",
            "target": {"whole": TARGET, "split": "10.77.0.9"},
            "probes": {"ids": sorted(PROBES)},
            "duration": 86400,
            "credit_budget": 10**9,
        }
    )


@st.composite
def plans(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Runs: a recorded line, its probe and slot, and what befalls it."""
    n = draw(st.integers(1, 10))
    runs = []
    for i in range(n):
        rec = draw(st.sampled_from(RECORDS))
        runs.append(
            {
                "rec": rec,
                "prb_id": draw(st.sampled_from(sorted(PROBES))),
                "slot": i,
                # Uploaded seconds after the run: at once, after the first read, much later.
                "upload": draw(st.sampled_from([3, 3, 3, 900, 20_000])),
                "served_twice": draw(st.booleans()),
                "corrupt": draw(st.sampled_from([None, None, None, None, "result", "rtt"])),
                # Log rows the responder lost (it was down): none, some, all.
                "log_loss": draw(st.sampled_from([0.0, 0.0, 0.0, 0.3, 1.0])),
                "seed": draw(st.integers(0, 2**16)),
            }
        )
    return runs


def _spec_key(rec: dict[str, Any]) -> tuple[int, int, int]:
    return (
        evping_records.packets(rec),
        evping_records.interval_ms(rec),
        evping_records.request_len(rec),
    )


def _setup(
    store: AtlasStore, standin: StandIn, runs: list[dict[str, Any]]
) -> tuple[int, list[dict[str, Any]], dict[int, int]]:
    """The measurements (one per packets/interval/size the drawn lines had),
    the reply log and the API lines; returns the campaign id, the lines and
    each line's packets."""
    c = campaign()
    campaign_id = store.upsert_campaign(c)
    msm_of: dict[tuple[int, int, int], int] = {}
    for run in runs:
        key = _spec_key(run["rec"])
        if key in msm_of:
            continue
        msm_id = msm_of[key] = 80_000_000 + len(msm_of)
        packets, interval, ip_len = key
        planned = PlannedMeasurement(
            f"whole-{ip_len}-{packets}-{interval}", "whole", TARGET, ip_len, packets, 240,
            interval, len(PROBES), 1,
        )  # fmt: skip
        store.record_measurement(campaign_id, msm_id, planned, {}, None)
        standin.measurements[msm_id] = {
            "id": msm_id, "type": "ping", "af": 4, "target": TARGET, "description": planned.key,
            "status": {"id": 2, "name": "Ongoing"}, "start_time": BASE, "stop_time": None,
            "credits_per_result": packets, "interval": 240, "is_oneoff": False,
        }  # fmt: skip
    lines: list[dict[str, Any]] = []
    log: list[ReplyRecord] = []
    packets_of: dict[int, int] = {}
    for run in runs:
        rec, prb_id = run["rec"], run["prb_id"]
        msm_id = msm_of[_spec_key(rec)]
        probe_line = evping_records.probe_line(rec)
        end = BASE + 600 + run["slot"] * SLOT_S
        recorded_end = int(probe_line.get("time", rec["wall_end"]))
        rng = random.Random(run["seed"])
        for row in evping_records.reply_log(rec, address=PROBES[prb_id], shift=end - recorded_end):
            if rng.random() < run["log_loss"]:
                continue
            log.append(
                ReplyRecord(
                    len(log), TARGET, row.dst_address, row.icmp_id, row.icmp_seq, row.ip_len,
                    "whole", row.ip_len, row.sent_at, row.attempt, row.duplicate,
                )
            )  # fmt: skip
        line = api_result(
            probe_line,
            msm_id=msm_id,
            prb_id=prb_id,
            public=PROBES[prb_id],
            packets=evping_records.packets(rec),
            timestamp=end,
            stored_delay=run["upload"],
        )
        if run["corrupt"] == "rtt" and not line["result"]:
            run["corrupt"] = None  # nothing to corrupt
        if run["corrupt"] == "result":
            line["result"] = "truncated"
        elif run["corrupt"] == "rtt":
            line["result"] = [{"rtt": "NaN?"}, *line["result"][1:]]
        lines += [line, line] if run["served_twice"] else [line]
        packets_of[id(line)] = evping_records.packets(rec)
    store.write_reply_log(campaign_id, uuid.uuid4(), log)
    for line in lines:
        standin.results.setdefault(line["msm_id"], []).append(line)
    return campaign_id, lines, packets_of


RESULT_COLS = "msm_id, prb_id, result_at, join_status, join_error, sent, stored_at, raw"
OUTCOME_COLS = (
    "msm_id, prb_id, result_at, packet_index, phase, ip_len, outcome, rtt_ms, ack_count, "
    "icmp_seq, replied_at, error, attempt"
)


def snapshot(url: str) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    e = db.make_engine(url)
    try:
        with e.connect() as conn:
            results = [
                tuple(r)
                for r in conn.execute(
                    text(f"SELECT {RESULT_COLS} FROM atlas_results ORDER BY 1, 2, 3")
                )
            ]
            outcomes = [
                tuple(r)
                for r in conn.execute(
                    text(f"SELECT {OUTCOME_COLS} FROM atlas_outcomes ORDER BY 1, 2, 3, 4")
                )
            ]
    finally:
        e.dispose()
    return results, outcomes


def _clear(url: str, results_only: bool) -> None:
    tables = ["atlas_outcomes", "atlas_results", "atlas_verdicts"]
    if not results_only:
        tables += ["atlas_reply_log", "atlas_measurements", "atlas_probes"]
    e = db.make_engine(url)
    try:
        with e.begin() as conn:
            for t in tables:
                conn.execute(text(f"DELETE FROM {t}"))
            conn.execute(
                text(
                    "UPDATE atlas_measurements SET fetched_until = NULL, rechecked_until = NULL, "
                    "results_fetched = 0, results_late = 0"
                )
            )
    finally:
        e.dispose()


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(runs=plans(), order_seed=st.integers(0, 2**16))
def test_ingest_is_idempotent_and_never_stops(
    runs: list[dict[str, Any]],
    order_seed: int,
    standin: StandIn,
    database_url: str,
    tmp_path: Path,
) -> None:
    _clear(database_url, results_only=False)
    standin.results.clear()
    standin.measurements.clear()
    c = campaign()
    client = AtlasClient(server=standin.server, verify=str(standin.ca_bundle))
    with AtlasStore(database_url) as store:
        _, lines, _ = _setup(store, standin, runs)
        last_end = BASE + 600 + len(runs) * SLOT_S
        # Round one: the late uploads are not in Atlas's store yet.
        standin.clock = lambda: last_end + 600
        fetch_campaign(
            store, client, c, settle_s=0, late_horizon_s=3600, now=lambda: last_end + 600
        )
        # Round two, a day later: everything uploaded, the late re-read runs.
        standin.clock = lambda: last_end + 90_000
        report = fetch_campaign(
            store, client, c, settle_s=0, late_horizon_s=3600, now=lambda: last_end + 90_000
        )
        # Found by the re-read: the results uploaded after the first read.
        assert report.results_late == sum(
            1 for run in runs if BASE + 600 + run["slot"] * SLOT_S + run["upload"] > last_end + 600
        )
        fetched = snapshot(database_url)
        # Again: nothing new.
        again = fetch_campaign(
            store, client, c, settle_s=0, late_horizon_s=0, now=lambda: last_end + 90_000
        )
        assert again.results_new == 0 and snapshot(database_url) == fetched

        # The same lines from files, in another order, into a fresh start.
        _clear(database_url, results_only=True)
        order = list(lines)
        random.Random(order_seed).shuffle(order)
        half = len(order) // 2
        files = [tmp_path / "a.json", tmp_path / "b.ndjson"]
        files[0].write_text(json.dumps(order[:half]))
        files[1].write_text("".join(json.dumps(x) + "\n" for x in order[half:]))
        import_campaign(store, c, (x for f in files for x in read_result_lines(f)))
        imported = snapshot(database_url)
        assert imported == fetched
        import_campaign(store, c, (x for f in files for x in read_result_lines(f)))
        assert snapshot(database_url) == imported
    check_rows(imported, runs)


def check_rows(
    snap: tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]], runs: list[dict[str, Any]]
) -> None:
    results, outcomes = snap
    assert len(results) == len(runs)  # every line once, a line served twice too
    per_result: dict[tuple[Any, ...], Counter[str]] = {}
    for o in outcomes:
        per_result.setdefault(o[:3], Counter())[o[6]] += 1
    by_time = {r[2]: r for r in results}
    for run in runs:
        rec = run["rec"]
        end = datetime.fromtimestamp(BASE + 600 + run["slot"] * SLOT_S, UTC)
        row = by_time[end]
        kinds = per_result.get(row[:3], Counter())
        if run["corrupt"] is not None:
            assert row[3] == "invalid" and row[4] and not kinds
            continue
        entries = evping_records.probe_line(rec)["result"]
        rtts = sum(1 for e in entries if "rtt" in e and "dup" not in e)
        assert sum(kinds.values()) == evping_records.packets(rec)
        assert kinds["acked"] == rtts
        assert row[3] in ("exact", "ambiguous", "inconsistent", "no-log")
        if run["log_loss"] == 0.0 and evping_records.faithful(rec):
            requests = sum(1 for r in evping_records.reply_log(rec) if not r.duplicate)
            assert row[3] == "exact", (rec["run"], rec["scenario"])
            assert kinds["lost"] + kinds["late"] == requests - rtts
            assert kinds["unanswered"] == evping_records.packets(rec) - requests
        if run["log_loss"] == 1.0:
            assert row[3] == "no-log"
