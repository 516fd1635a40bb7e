"""The rollups on a real database: the speedup on matched flows, per bucket and
pooled; the dashboards' rollups of migration 0012 equal the exact views they
stand for, the router's are incremental, and a refresh never blocks a reader."""

from __future__ import annotations

import secrets
import threading
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import kickass_db as db
import psycopg
import pytest
from kickass_analysis.rollups import RollupStore, refresh
from kickass_core.flow_record import flow_id
from kickass_db.partitions import Partitions, day_of
from kickass_db.study_store import StudyStore
from kickass_db.trial_store import TrialStore
from psycopg.rows import dict_row
from support.seed import seed_atlas, seed_paired_trials, seed_study

T0 = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)


def _trial(tid: str, arms: list[tuple[str, str]], pairs: int) -> dict:
    periods: list[dict[str, Any]] = []
    for pair in range(pairs):
        for arm, proto in arms:
            periods.append({"index": len(periods), "pair": pair, "protocol": proto, "arm": arm,
                            "start_s": 130.0 * len(periods), "duration_s": 120.0})  # fmt: skip
    return {
        "trial_id": tid,
        "destination": "far-1",
        "access_capacity_bps": 10e6,
        "parameters": {
            "workload": {"mean_packets": 100.0, "seed": 1},
            "arms": [{"name": a, "protocol": p} for a, p in arms],
            "period_s": 120.0,
        },
        "started_at": T0.isoformat(),
        "periods": periods,
    }


def _flows(tid: str, trial: dict, fct: dict[str, float], fail: set[tuple[int, str]]) -> list:
    """Per period, the same 6 flows (sizes 5, 50, 500 packets, twice): the
    paired design; FCT = size x fct[arm]; (index, arm) in ``fail`` did not complete."""
    out = []
    for p in trial["periods"]:
        for i, size in enumerate((5, 50, 500, 5, 50, 500)):
            done = (i, p["arm"]) not in fail
            out.append({
                "flow_id": flow_id(tid, p["index"], i), "period_index": p["index"],
                "pair": p["pair"], "arm": p["arm"], "protocol": p["protocol"],
                "size_bytes": size * 1440, "size_packets": size,
                "started_at": (T0 + timedelta(seconds=p["start_s"] + i)).isoformat(),
                "completed": done, "fct_ms": size * fct[p["arm"]] if done else None,
                "negotiated_protocol": p["protocol"],
            })  # fmt: skip
    return out


@pytest.fixture
def store(database_url: str):  # noqa: ANN201
    trials = TrialStore(database_url)
    runner = trials.authenticate(trials.add_runner("roll"))
    yield trials, runner, RollupStore(database_url)
    trials.close()


def test_speedup_per_bucket_on_matched_flows(store) -> None:  # noqa: ANN001
    trials, runner, rollups = store
    tid = secrets.token_hex(16)
    trial = _trial(tid, [("kickass", "kickass"), ("tcp:cubic", "tcp")], pairs=2)
    trials.put_trial(runner, trial)
    # TCP takes 3x as long; flow 1 (50 packets) failed under TCP in both pairs.
    flows = _flows(tid, trial, {"kickass": 2.0, "tcp:cubic": 6.0}, {(1, "tcp:cubic")})
    assert not trials.put_flows(runner, tid, flows).conflicts
    assert rollups.refresh_speedups() > 0
    rows = {(r["scope"], r["size_bucket"]): r for r in rollups.speedups()}
    every = rows[("trial", "all")]
    assert (every["arm"], every["baseline_arm"]) == ("kickass", "tcp:cubic")
    assert every["pairs"] == 12 and every["matched"] == 10
    assert every["speedup"] == pytest.approx(3.0)
    assert every["completion_arm"] == 1.0 and every["completion_baseline"] == pytest.approx(10 / 12)
    mid = rows[("trial", "11-100")]
    assert (mid["pairs"], mid["matched"]) == (4, 2)  # the failed twins leave the ratio
    assert rows[("pooled", "all")]["speedup"] == pytest.approx(3.0)
    # Refreshed again: the same rows, not twice as many.
    before = len(rollups.speedups())
    rollups.refresh_speedups()
    assert len(rollups.speedups()) == before


def test_sooner_keeps_the_flows_an_arm_failed_to_finish(store) -> None:  # noqa: ANN001
    """Kick-Ass 1.2x faster on every flow it finished, but 4 of each
    period's 6 flows did not finish under it: the matched speedup reads
    1.2x over the 2 flows left of each pair; ``sooner`` keeps the 4 and
    reads 1/3. A third pair's Kick-Ass period was skipped (no flow tokens):
    its flows were never run, and leave ``sooner``, not its completion."""
    trials, runner, rollups = store
    tid = secrets.token_hex(16)
    trial = _trial(tid, [("kickass", "kickass"), ("tcp:cubic", "tcp")], pairs=3)
    trials.put_trial(runner, trial)
    failed = {(i, "kickass") for i in range(4)}
    flows = _flows(tid, trial, {"kickass": 2.0, "tcp:cubic": 2.4}, failed)
    for f in flows:
        if f["pair"] == 2 and f["arm"] == "kickass":
            f.update(completed=False, fct_ms=None,
                     error="not run: no flow tokens from agent far-1: unreachable")  # fmt: skip
        elif not f["completed"]:
            f["error"] = "not completed by the end of its period (cut at the deadline)"
    assert not trials.put_flows(runner, tid, flows).conflicts
    rollups.refresh_speedups()
    rows = {(r["scope"], r["size_bucket"]): r for r in rollups.speedups()}
    every = rows[("trial", "all")]
    assert (every["pairs"], every["matched"]) == (18, 4)
    assert every["speedup"] == pytest.approx(1.2)
    assert every["completion_arm"] == pytest.approx(4 / 18) and every["completion_baseline"] == 1.0
    assert (every["sooner_pairs"], every["sooner_clusters"]) == (12, 2)
    assert every["sooner"] == pytest.approx(1 / 3)
    # Both pairs read 1/3: an interval of width 0 (t with 1 degree of freedom).
    assert every["sooner_low"] == pytest.approx(1 / 3) == every["sooner_high"]
    assert rows[("pooled", "all")]["sooner"] == pytest.approx(1 / 3)
    # Per bucket: the 500-packet flows (indices 2 and 5) split one each way.
    assert rows[("trial", "101-1000")]["sooner"] == pytest.approx(0.5)


def test_the_runner_s_words_for_a_flow_never_given_its_time() -> None:
    """``rollups.NOT_GIVEN_ITS_TIME`` is how kickass_wan.trials.runner begins the
    error of a flow it never gave its time (a skipped period's flows are
    "not run: no flow tokens ...": tests/wan/test_trials_loopback.py), and
    not how it begins that of a flow that reached its limit."""
    from kickass_analysis.rollups import NOT_GIVEN_ITS_TIME, given_its_time
    from kickass_wan import tcpflow
    from kickass_wan.trials import runner

    error: str | None
    for error in (runner.NOT_RUN_STOPPED, runner.CUT_BY_STOP):
        assert not given_its_time({"completed": False, "error": error}), error
    for error in (runner.CUT_AT_DEADLINE, tcpflow.TIMED_OUT, "no result from the sender", None):
        assert given_its_time({"completed": False, "error": error}), error
    assert all(isinstance(w, str) for w in NOT_GIVEN_ITS_TIME)


def test_an_a_a_trial_compares_its_arms_with_the_first(store) -> None:  # noqa: ANN001
    trials, runner, rollups = store
    tid = secrets.token_hex(16)
    trial = _trial(tid, [("tcp:cubic", "tcp"), ("tcp:cubic#2", "tcp")], pairs=3)
    trials.put_trial(runner, trial)
    trials.put_flows(runner, tid, _flows(tid, trial, {"tcp:cubic": 5.0, "tcp:cubic#2": 5.0}, set()))
    rollups.refresh_speedups()
    (row,) = [r for r in rollups.speedups([tid]) if r["size_bucket"] == "all"]
    assert (row["arm"], row["baseline_arm"]) == ("tcp:cubic#2", "tcp:cubic")
    assert row["speedup"] == pytest.approx(1.0) and row["speedup_low"] == pytest.approx(1.0)
    assert row["sooner"] == row["sooner_low"] == row["sooner_high"] == 0.5  # every flow a tie


# -- the rollups of migration 0012 (issue 20) -------------------------------------------------


def _rows(database_url: str, query: str, **params: object) -> list[dict]:
    with psycopg.connect(db.libpq_url(database_url), row_factory=dict_row) as conn:
        return conn.execute(query, params).fetchall()


def _multiset(rows: list[dict]) -> Counter:
    return Counter(tuple(sorted((k, _norm(v)) for k, v in r.items())) for r in rows)


def _norm(v: object) -> object:
    return round(v, 9) if isinstance(v, float) else v


@pytest.fixture
def seeded_study(database_url: str) -> str:
    """Sessions rolled up by a refresh, and more that finished after it."""
    study = StudyStore(database_url)
    try:
        seed_study(study, n_clients=25, rng=21, spread=timedelta(days=10), live=True)
        seed_atlas(database_url)
        refresh(database_url)
        seed_study(study, n_clients=8, rng=22, spread=timedelta(days=2), live=True)
    finally:
        study.close()
    return database_url


def test_study_rollups_equal_the_exact_views(seeded_study: str) -> None:
    url = seeded_study
    # Some sessions' counts are folded into the rollups, others' wait (0020).
    assert _rows(url, "SELECT count(*) AS n FROM unit_counts_daily")[0]["n"] > 0
    assert _rows(url, "SELECT count(*) AS n FROM unit_count_changes")[0]["n"] > 0
    every = _rows(url, "SELECT * FROM v_session_summary")
    assert _multiset(_rows(url, "SELECT * FROM v_session_rollup")) == _multiset(every)
    assert _multiset(_rows(url, "SELECT * FROM v_verdicts_rollup")) == _multiset(
        _rows(url, "SELECT * FROM v_verdicts_by_source")
    )
    # Per size, summed over days, the rollup is the pooled view, count for count.
    for phase, exact, size, as_sent in (
        ("whole", "v_size_drop_all", "ip_len", "fragmented_on_arrival"),
        ("split", "v_split_drop_all", "leading_ip_len", "largest_fragment_as_sent"),
    ):
        rolled_up = _rows(
            url,
            f"""SELECT ip_len, sum(sessions) AS sessions, sum(sent) AS sent,
                       sum(acked) AS acked, sum(late) AS late,
                       sum(reassembly_invalid) AS reassembly_invalid,
                       sum({"frag_observed" if phase == "whole" else as_sent}) AS observed
                FROM v_drop_rollup WHERE source = 'volunteer' AND phase = %(p)s
                GROUP BY ip_len ORDER BY ip_len""",
            p=phase,
        )
        direct = _rows(
            url,
            f"""SELECT {size} AS ip_len, sessions, sent, acked, late, reassembly_invalid,
                       {as_sent} AS observed
                FROM {exact} ORDER BY 1""",
        )
        assert rolled_up == direct, phase
    # Atlas: per size and source, as v_*_drop_by_source pools it.
    for phase, exact, size in (
        ("whole", "v_size_drop_by_source", "ip_len"),
        ("split", "v_split_drop_by_source", "leading_ip_len"),
    ):
        rolled_up = _rows(
            url,
            """SELECT ip_len, sum(sessions) AS sessions, sum(sent) AS sent, sum(acked) AS acked
               FROM v_drop_rollup WHERE source = 'atlas' AND phase = %(p)s
               GROUP BY ip_len ORDER BY ip_len""",
            p=phase,
        )
        direct = _rows(
            url,
            f"""SELECT {size} AS ip_len, sessions, sent, acked FROM {exact}
                WHERE source = 'atlas' ORDER BY 1""",
        )
        assert rolled_up and rolled_up == direct, phase


def test_trial_rollups_equal_the_exact_views(database_url: str) -> None:
    seed_paired_trials(database_url, flows_per_period=15)
    counts = refresh(database_url)
    assert counts["mv_flow_summary"] > 0 and counts["mv_flow_hourly"] > 0
    assert _multiset(_rows(database_url, "SELECT * FROM v_flow_summary_rollup")) == _multiset(
        _rows(database_url, "SELECT * FROM v_flow_summary")
    )
    hourly = _rows(
        database_url,
        """SELECT destination, arm, size_bucket, sum(flows) AS flows,
                  sum(completed) AS completed, round(sum(fct_ms_sum)::numeric, 6) AS fct
           FROM v_flow_hourly GROUP BY 1, 2, 3 ORDER BY 1, 2, 3""",
    )
    direct = _rows(
        database_url,
        """SELECT destination, arm, size_bucket, count(*) AS flows, count(fct_ms) AS completed,
                  round(sum(fct_ms)::numeric, 6) AS fct
           FROM v_flow_results GROUP BY 1, 2, 3 ORDER BY 1, 2, 3""",
    )
    assert hourly == direct


def _router_lines(start: float, first: int, last: int, rate: float) -> list[str]:
    import json

    return [
        json.dumps({"type": "sample", "t": i / 100, "ts": start + i / 100,
                    "advertised_rate_bps": rate + i, "leading_fragment_len": 600 + 8 * (i % 3),
                    "input_rate_bps": 9e6, "output_rate_bps": 8e6, "queue_bytes": 1000 + i,
                    "marking_mode": "tcp" if i % 4 == 0 else "kickass", "rtt_ms": 100.0,
                    "drops": i // 10, "fragmented": i, "mode_switches": i // 50})
        for i in range(first, last)
    ]  # fmt: skip


ROUTER_FROM_RAW = """
SELECT date_trunc('second', r.started_at) + make_interval(secs => floor(s.t)) AS at,
       count(*) AS samples, sum(advertised_rate_bps) AS rate_sum,
       max(queue_bytes) AS queue_max,
       count(*) FILTER (WHERE marking_mode = 'kickass') AS kickass,
       max(drops) AS drops
FROM router_telemetry s JOIN router_runs r ON r.id = s.run_id
WHERE s.run_id = %(run)s GROUP BY 1 ORDER BY 1
"""
ROUTER_ROLLED = """
SELECT at, samples, advertised_rate_bps * samples AS rate_sum, queue_bytes_max AS queue_max,
       kickass_samples AS kickass, drops
FROM v_router_telemetry_1s WHERE run_id = %(run)s ORDER BY at
"""


def test_router_rollups_are_incremental_and_exact(database_url: str) -> None:
    import json

    from kickass_db.telemetry import TelemetryIngest

    start = 1_764_000_000.5  # a run starting half-way through a second
    with Partitions(database_url) as p:  # an old run's day (migration 0022)
        day = day_of(datetime.fromtimestamp(start, UTC))
        p.ensure_days("router_telemetry", day, day)
    ingest = TelemetryIngest(database_url, "incremental")
    try:
        ingest.feed_line(json.dumps({"type": "metadata", "started_unix": start,
                                     "options": {"router": {"capacity_bps": 10e6}}}))  # fmt: skip
        for line in _router_lines(start, 0, 1250, 5e6):  # 12.5 s: the last second partial
            ingest.feed_line(line)
        ingest.flush()
        first = refresh(database_url)
        run = ingest.run_id
        for line in _router_lines(start, 1250, 13000, 5e6):  # then the rest of 130 s
            ingest.feed_line(line)
        ingest.flush()
    finally:
        ingest.close()
    assert first["router_telemetry_1s"] == 13
    second = refresh(database_url)
    # Only what was new was rolled up: the partial second again, and the rest.
    assert second["router_telemetry_1s"] == 130 - 12
    raw = _rows(database_url, ROUTER_FROM_RAW, run=run)
    rolled = _rows(database_url, ROUTER_ROLLED, run=run)
    assert len(rolled) == 130 and [_multiset([r]) for r in rolled] == [_multiset([r]) for r in raw]
    # Minutes: the seconds re-aggregated, exactly.
    minutes = _rows(
        database_url,
        """SELECT at, samples, advertised_rate_bps * samples AS rate_sum,
                  kickass_samples AS kickass
           FROM v_router_telemetry_1m WHERE run_id = %(run)s ORDER BY at""",
        run=run,
    )
    assert sum(m["samples"] for m in minutes) == 13000
    assert sum(m["kickass"] for m in minutes) == sum(r["kickass"] for r in raw)
    assert sum(m["rate_sum"] for m in minutes) == pytest.approx(sum(r["rate_sum"] for r in raw))
    # Raw samples pruned (retention): the rollups keep what they hold.
    with psycopg.connect(db.libpq_url(database_url), autocommit=True) as conn:
        conn.execute("DELETE FROM router_telemetry WHERE run_id = %s", (run,))
    third = refresh(database_url)
    assert third["router_telemetry_1s"] == third["router_telemetry_1m"] == 0
    assert len(_rows(database_url, ROUTER_ROLLED, run=run)) == 130


def test_refresh_lets_readers_keep_reading(seeded_study: str) -> None:
    """REFRESH ... CONCURRENTLY: a dashboard's open read does not block the
    refresh, and the refresh does not block the read."""
    url = db.libpq_url(seeded_study)
    with psycopg.connect(url) as reader:
        reader.execute("SELECT count(*) FROM v_session_rollup").fetchone()
        reader.execute("SELECT count(*) FROM v_drop_rollup").fetchone()
        done: dict[str, object] = {}

        def work() -> None:
            done["counts"] = refresh(seeded_study)

        thread = threading.Thread(target=work)
        thread.start()
        thread.join(timeout=60)
        assert not thread.is_alive(), "refresh waited for a reader"
        assert reader.execute("SELECT count(*) FROM v_session_rollup").fetchone()
        reader.rollback()
    counts = done["counts"]
    assert isinstance(counts, dict)
    names = {r["name"] for r in _rows(seeded_study, "SELECT name FROM v_rollup_status")}
    assert names == set(counts) and set(counts) >= {
        "trial_speedups", "unit_counts", "mv_atlas_probe_drop",
        "mv_flow_summary", "mv_flow_hourly", "router_telemetry_1s", "router_telemetry_1m",
    }  # fmt: skip
    # Every finished session's counts are folded in now: none waits.
    assert _rows(seeded_study, "SELECT count(*) AS n FROM unit_count_changes") == [{"n": 0}]
