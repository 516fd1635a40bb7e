"""Atlas lands its counts in the durable counts (migration 0028): one unit per
probe result, written with its outcomes, once.

The results and outcomes are made here and stored through the real
``AtlasStore.store_window``; what ``unit_counts`` holds is checked against
the outcomes' own tallies (0006's rules, computed in Python, not by the SQL
under test): re-fetches and re-imports add nothing, a late result is one more
unit, an unreadable copy counts only once a readable one replaces it, the
rollups outlive ``atlas_outcomes``, and the migration's backfill writes what
the store wrote.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import astuple
from datetime import UTC, datetime
from typing import Any

import kickass_db as db
import pytest
from alembic import command
from kickass_atlas.campaign import Campaign, PlannedMeasurement
from kickass_atlas.store import (
    OUTCOME_COLUMNS,
    AtlasStore,
    OutcomeRow,
    ResultRow,
    _copy_insert,
    _store_results,
    _write_counts,
)
from sqlalchemy import Engine, text

MSM = {"whole": 93_000_001, "split": 93_000_002}
IP_LEN = {"whole": 1400, "split": 548}
PROBES = {4001: "198.51.100.41", 4002: "198.51.100.42", 4003: "203.0.113.43"}
BASE = 1_790_000_000
# Per packet: (outcome, rtt_ms, ip_len known). unanswered and error, and an
# outcome without an IP length, stay out of the counts.
PATTERNS: list[list[tuple[str, float | None, bool]]] = [
    [("acked", 11.5, True), ("acked", 12.25, True), ("lost", None, True), ("late", None, True)],
    [("acked", 40.0, True), ("unanswered", None, True), ("error", None, True)],
    [("lost", None, True), ("acked", 7.0, False), ("acked", 9.5, True), ("acked", 8.0, True)],
]
COUNTED = ("acked", "lost", "late")
NAME = "durable-atlas"


def campaign() -> Campaign:
    return Campaign.from_dict(
        {
            "name": NAME,
            "target": {"whole": "192.0.2.1", "split": "192.0.2.2"},
            "probes": {"ids": list(PROBES)},
            "whole": {"sizes": [IP_LEN["whole"]]},
            "split": {"leading": [IP_LEN["split"]]},
            "packets": 4,
            "duration": 3600,
            "credit_budget": 10**9,
        }
    )


def result(campaign_id: int, phase: str, prb_id: int, at: int, status: str = "exact") -> ResultRow:
    return ResultRow(
        MSM[phase], prb_id, datetime.fromtimestamp(at, UTC), campaign_id, 5080,
        PROBES[prb_id], "192.0.2.1", 100, 4, 2, 0, status, {"prb_id": prb_id, "at": at},
    )  # fmt: skip


def outcomes(r: ResultRow, phase: str, pattern: int) -> list[OutcomeRow]:
    return [
        OutcomeRow(
            r.msm_id,
            r.prb_id,
            r.result_at,
            i,
            r.campaign_id,
            phase,
            IP_LEN[phase] if known else None,
            outcome,
            rtt,
            int(outcome == "acked"),
            i,
            None,
            "sendto failed" if outcome == "error" else None,
        )  # fmt: skip
        for i, (outcome, rtt, known) in enumerate(PATTERNS[pattern])
    ]


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    e = db.make_engine(database_url)
    try:
        yield e
    finally:
        e.dispose()


def stored_counts(engine: Engine) -> dict[tuple[str, str], dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT unit, phase, day, client_key, sent, acked, late, reassembly_invalid, "
                "frag_observed, rtt_ms_sum, rtt_ms_n, ip_lens, sent_by_size, acked_by_size, "
                "late_by_size, frag_observed_by_size, rtt_ms_n_by_size, rtt_ms_median_by_size "
                "FROM unit_counts WHERE source = 'atlas'"
            )
        ).mappings()
        return {(r["unit"], r["phase"]): dict(r) for r in rows}


def expected_counts(
    stored: list[tuple[ResultRow, str, int]],
) -> dict[tuple[str, str], dict[str, Any]]:
    """Each probe's counts from its results' outcomes, by 0006's rules."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for r, phase, pattern in sorted(stored, key=lambda x: x[0].result_at):
        rows = [(o, rtt) for o, rtt, known in PATTERNS[pattern] if known and o in COUNTED]
        rtts = [rtt for o, rtt in rows if o == "acked" and rtt is not None]
        unit = out.setdefault(
            (f"atlas:{NAME}:{r.prb_id}", phase),
            {"sent": 0, "acked": 0, "late": 0, "rtt_ms_sum": 0.0, "rtt_ms_n": 0},
        )
        unit["day"] = r.result_at.date()  # the last result's
        unit["sent"] += len(rows)
        unit["acked"] += sum(o == "acked" for o, _ in rows)
        unit["late"] += sum(o == "late" for o, _ in rows)
        unit["rtt_ms_sum"] += sum(rtts)
        unit["rtt_ms_n"] += len(rtts)
        unit["ip_lens"] = [IP_LEN[phase]]
    return out


def assert_counts(engine: Engine, stored: list[tuple[ResultRow, str, int]]) -> None:
    got = stored_counts(engine)
    want = expected_counts(stored)
    assert set(got) == set(want)
    for key, w in want.items():
        g = got[key]
        assert g["day"] == w["day"]
        assert (g["sent"], g["acked"], g["late"], g["rtt_ms_n"]) == (
            w["sent"], w["acked"], w["late"], w["rtt_ms_n"],
        )  # fmt: skip
        assert g["rtt_ms_sum"] == (pytest.approx(w["rtt_ms_sum"]) if w["rtt_ms_n"] else None)
        assert g["ip_lens"] == w["ip_lens"] and g["sent_by_size"] == [w["sent"]]
        assert g["acked_by_size"] == ([w["acked"]] if w["acked"] else None)
        assert g["late_by_size"] == ([w["late"]] if w["late"] else None)
        assert g["rtt_ms_n_by_size"] == ([w["rtt_ms_n"]] if w["rtt_ms_n"] else None)
        # Atlas observes no fragments and no reassembly; no exact per-probe median is kept.
        assert (g["reassembly_invalid"], g["frag_observed"], g["frag_observed_by_size"]) == (
            0, 0, None,
        )  # fmt: skip
        assert g["rtt_ms_median_by_size"] is None
        assert g["client_key"] is not None


def changes(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                text("SELECT count(*) FROM unit_count_changes WHERE source = 'atlas'")
            ).scalar_one()
        )


def totals(engine: Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [
            tuple(r)
            for r in conn.execute(
                text(
                    "SELECT phase, ip_len, units, sent, acked, late, rtt_ms_n, clients, "
                    "rtt_bin_counts FROM unit_counts_total WHERE source = 'atlas' "
                    "ORDER BY phase, ip_len"
                )
            )
        ]


def test_each_result_is_counted_once_and_the_counts_outlive_the_outcomes(
    database_url: str, engine: Engine
) -> None:
    stored: list[tuple[ResultRow, str, int]] = []
    with AtlasStore(database_url) as store:
        campaign_id = store.upsert_campaign(campaign())
        for phase in MSM:
            planned = PlannedMeasurement(
                f"{phase}-{IP_LEN[phase]}", phase, "192.0.2.1", IP_LEN[phase], 4, 240, 1000, 2, 15
            )
            store.record_measurement(campaign_id, MSM[phase], planned, {"size": 100}, None)
        batch: dict[str, tuple[list[ResultRow], list[OutcomeRow]]] = {}
        for phase in MSM:
            rows, outs = [], []
            for i, prb_id in enumerate(PROBES):
                r = result(campaign_id, phase, prb_id, BASE + i * 60)
                rows.append(r)
                outs += outcomes(r, phase, i)
                stored.append((r, phase, i))
            batch[phase] = (rows, outs)
            until = datetime.fromtimestamp(BASE + 3600, UTC)
            assert store.store_chunk(MSM[phase], rows, outs, until) == len(PROBES)
        assert_counts(engine, stored)
        queued = changes(engine)
        assert queued == len(stored)

        # A re-fetched window and a re-import add nothing.
        for phase, (rows, outs) in batch.items():
            assert store.store_chunk(MSM[phase], rows, outs, None) == 0
            assert store.store_window(MSM[phase], rows, outs, None, recheck=True).fresh == set()
        assert changes(engine) == queued
        assert_counts(engine, stored)

        # A late result (found by the re-read, a day later) is one more unit.
        late = result(campaign_id, "whole", 4001, BASE + 86_400)
        store.store_window(MSM["whole"], [late], outcomes(late, "whole", 0), None, recheck=True)
        stored.append((late, "whole", 0))
        # An unreadable copy counts nothing; the readable one that replaces it counts once.
        garbled = result(campaign_id, "split", 4003, BASE + 7200, status="invalid")
        store.store_chunk(MSM["split"], [garbled], [], None)
        assert_counts(engine, stored)
        readable = result(campaign_id, "split", 4003, BASE + 7200)
        assert store.store_chunk(MSM["split"], [readable], outcomes(readable, "split", 2), None)
        stored.append((readable, "split", 2))
        assert_counts(engine, stored)
        assert changes(engine) == len(stored)
        # The benchmark's baseline, given the stored results again, adds nothing.
        store.store_chunk_row_by_row(MSM["whole"], *batch["whole"], until)
        assert changes(engine) == len(stored)

    # The by-source views' Atlas rows are the outcomes' own, pooled per size.
    pooled = atlas_rows(engine)
    assert_outcomes_pooled(engine, pooled)
    with engine.begin() as conn:
        conn.execute(text("SELECT fold_unit_count_changes()"))
    folded = totals(engine)
    assert atlas_rows(engine) == pooled
    # A unit is a probe of the campaign (its late and replacing results add to
    # it); the probes come from two client blocks (client_key: /24).
    assert [(p, units, clients) for p, _, units, *_, clients, _ in folded] == [
        ("split", 3, 2),
        ("whole", 3, 2),
    ]
    # Durable: the raw outcomes go, the counts and the views' rows stay.
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM atlas_outcomes"))
    assert totals(engine) == folded
    assert atlas_rows(engine) == pooled
    assert_counts(engine, stored)


def atlas_rows(engine: Engine) -> dict[str, list[dict[str, Any]]]:
    with engine.connect() as conn:
        return {
            view: [
                dict(r)
                for r in conn.execute(
                    text(f"SELECT * FROM {view} WHERE source = 'atlas' ORDER BY 2")
                ).mappings()
            ]
            for view in ("v_size_drop_by_source", "v_split_drop_by_source")
        }


def assert_outcomes_pooled(engine: Engine, rows: dict[str, list[dict[str, Any]]]) -> None:
    """Per size: the probes with a reply counted, sent, acked, late and the
    acked replies' median RTT, as the outcomes give them (the median within
    the histogram's bound, 0020), and what Atlas cannot observe NULL."""
    with engine.connect() as conn:
        for view, phase, size, unseen in (
            ("v_size_drop_by_source", "whole", "ip_len", ("fragmented_on_arrival",)),
            ("v_split_drop_by_source", "split", "leading_ip_len",
             ("frag_observed", "arrived_as_sent", "largest_fragment_as_sent",
              "reassembly_invalid")),
        ):  # fmt: skip
            truth = conn.execute(
                text(
                    "SELECT ip_len, count(DISTINCT prb_id), count(*), "
                    "count(*) FILTER (WHERE outcome = 'acked'), "
                    "count(*) FILTER (WHERE outcome = 'late'), "
                    "percentile_cont(0.5) WITHIN GROUP (ORDER BY rtt_ms) "
                    "FILTER (WHERE outcome = 'acked') "
                    "FROM atlas_outcomes WHERE phase = :p AND ip_len IS NOT NULL "
                    "AND outcome IN ('acked', 'lost', 'late') GROUP BY ip_len ORDER BY ip_len"
                ),
                {"p": phase},
            ).all()
            got = rows[view]
            assert [(r[size], r["sessions"], r["sent"], r["acked"], r["late"]) for r in got] == [
                tuple(t[:5]) for t in truth
            ]
            for r, t in zip(got, truth, strict=True):
                assert r["drop_rate"] == pytest.approx((t[2] - t[3]) / t[2])
                assert all(r[c] is None for c in unseen)
                if phase == "whole":
                    assert r["rtt_ms_median"] == pytest.approx(t[5], rel=0.01 / 2.01)


def test_the_backfill_writes_what_the_store_wrote(database_url: str, engine: Engine) -> None:
    stored: list[tuple[ResultRow, str, int]] = []
    with AtlasStore(database_url) as store:
        campaign_id = store.upsert_campaign(campaign())
        planned = PlannedMeasurement("whole-1400", "whole", "192.0.2.1", 1400, 4, 240, 1000, 2, 15)
        store.record_measurement(campaign_id, MSM["whole"], planned, {"size": 100}, None)
        rows, outs = [], []
        for i, prb_id in enumerate(PROBES):
            r = result(campaign_id, "whole", prb_id, BASE + i * 60)
            rows.append(r)
            outs += outcomes(r, "whole", i)
            stored.append((r, "whole", i))
        store.store_chunk(MSM["whole"], rows, outs, None)
    with engine.begin() as conn:
        conn.execute(text("SELECT fold_unit_count_changes()"))
    before = (stored_counts(engine), totals(engine))
    config = db.alembic_config(database_url)
    command.downgrade(config, "0027")
    with engine.connect() as conn:
        left = conn.execute(
            text("SELECT count(*) FROM unit_counts_total WHERE source = 'atlas'")
        ).scalar_one()
    assert left == 0
    command.upgrade(config, "head")
    after = stored_counts(engine), totals(engine)
    assert after == before
    assert_counts(engine, stored)


def test_two_stores_adding_to_one_probe_at_once_lose_neither(
    database_url: str, engine: Engine
) -> None:
    """A fetch and an import (or two runs) storing results of one probe at
    once: the second waits for the first's unit and adds to it."""
    with AtlasStore(database_url) as store:
        campaign_id = store.upsert_campaign(campaign())
        planned = PlannedMeasurement("whole-1400", "whole", "192.0.2.1", 1400, 4, 240, 1000, 2, 15)
        store.record_measurement(campaign_id, MSM["whole"], planned, {"size": 100}, None)
    first = result(campaign_id, "whole", 4001, BASE)
    second = result(campaign_id, "whole", 4001, BASE + 3600)
    # The first result's store, held open: its rows and its unit not committed yet.
    with engine.connect() as held:
        tx = held.begin()
        stored = _store_results(held, [first])
        _copy_insert(
            held, "atlas_outcomes", OUTCOME_COLUMNS, map(astuple, outcomes(first, "whole", 0))
        )
        _write_counts(held, stored.fresh)
        with AtlasStore(database_url) as other:
            racing = threading.Thread(
                target=other.store_window,
                args=(MSM["whole"], [second], outcomes(second, "whole", 1), None),
            )
            racing.start()
            racing.join(timeout=1.0)
            assert racing.is_alive()  # waiting for the first's unit
            tx.commit()
            racing.join(timeout=30)
            assert not racing.is_alive()
    assert_counts(engine, [(first, "whole", 0), (second, "whole", 1)])
