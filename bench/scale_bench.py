"""Benchmark of issue 28: durable counts, day partitions, the archive and its engines (not a test).

Figures, each from one run on this machine (JSON on stdout, progress on
stderr; bench/README.md), by the issue's letters (figure a, the dashboards
and the refresh at scale, is dashboards_bench.py's):

  e  durable_counts   bytes per full-plan session (36,600 probes) in
                      ``unit_counts`` (heap, TOAST and index:
                      pg_total_relation_size over the sessions), against the
                      raw rows' bytes, and in ``live_counts`` while it is
                      live; what ``finish_session`` gains at p50 and p95 over
                      the same UPDATE alone, counting from the live counts
                      (the head, 0029: ``write_unit_counts_from_live``) and
                      from the raw rows (0027's ``write_unit_counts``, the
                      finish before 0029), the three kinds of finish taking
                      turns session by session (wall clock, and the
                      backend's CPU time), over the partitions a server
                      keeping 30 raw days has; the refresh's fold of those
                      sessions.
  b  ingest           the store's write path (``record_outcomes``: COPY of a
                      batch, an upsert when it repeats a stored seq; batches
                      of 280 rows as the engine flushes) into the partitioned
                      ``probe_outcomes``, against the same code into an
                      unpartitioned copy of the table (with the same live
                      counts' triggers, 0029) and against one COPY of
                      a session's rows into the partitioned table,
                      interleaved round by round; rows/s, the ratios, and the
                      full-plan sessions a day the store's path sustains.
     pruning          EXPLAIN (ANALYZE) of the API's read of one session over
                      30 daily partitions: partitions executed, never executed.
  c  retire           one past day of full-plan sessions (finished, with
                      their counts) and a router hour at 10 ms retired by
                      ``kickass_analysis.archive.retire`` while a reader
                      (``v_session_rollup``) and a writer (``record_outcomes``
                      into today's partition) each run every 20 ms: rows/s
                      archived (written, then re-read and verified), archive
                      bytes per row, the milliseconds of DETACH ... CONCURRENTLY
                      and of DROP, the reader's and the writer's longest call.
  d  engines          DuckDB (2 threads) and Spark ``local[2]`` (driver 6 GB)
                      over an archive of 10 M and of 100 M probe rows (3 and
                      30 days of 91 full-plan sessions: the issue's 100 M-row
                      window), each day seeded by INSERT ... SELECT into its
                      partition, its durable counts written and the day
                      retired by ``archive.retire``: the engine's start-up
                      seconds, then test 8's query set
                      (``archive_analysis.analyze``: verify, every result,
                      write) at 10 M once cold and at each scale warm, and the
                      10 M -> 100 M growth of the warm times (goal: at most
                      12x); whether both engines' results are equal; the
                      seeding's seconds per day.

An embedded PostgreSQL (or KICKASS_DATABASE_URL: a server where this may
CREATE DATABASE). ``--quick``: fewer sessions for b, c and e, and d at 10 M
rows only. ``--data-dir DIR`` keeps the cluster (DIR/pgdata), figure d's
database and its archive (DIR/archive): a second run seeds only the days
missing (the 100 M run after a ``--quick`` one seeds 27 more) and times.
Not run here: a million sessions of durable counts, a year of daily rollups,
a router-day of telemetry (see bench/README.md).

Usage: nice -n 19 .venv/bin/python bench/scale_bench.py [--quick] [--only LETTER|NAME]...
           [--data-dir DIR] > scale.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, date, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import kickass_db as db
import psycopg
from kickass_core.plan import ProbePlan, expected_max_fragment
from kickass_core.states import LIVE_STATES
from kickass_core.study_events import (
    ClockAnchor,
    OutcomeBatch,
    OutcomeEntry,
    RunFinished,
    RunProbing,
)
from kickass_db import partitions, study_store
from kickass_db.archive_store import SIDECAR
from kickass_db.study_store import StudyStore
from kickass_testbed.pg import create_database, drop_database, embedded_postgres
from sqlalchemy import text, update

BATCH = 280  # outcomes per engine flush (0.5 s at about 560 probes/s)
FULL_PLAN = ProbePlan.build()  # the paper's: 184 whole sizes, 182 splits, 100 repetitions
SECONDS_PER_DAY = 86_400


def outcomes(plan: ProbePlan, rng: random.Random) -> list[OutcomeEntry]:
    """A plausible clean path: 1% loss (splits lose either piece), a Linux
    client's IP_RECVFRAGSIZE, RTTs around its base (times: seconds from the start)."""
    base = rng.uniform(10.0, 200.0)
    out = []
    for seq in range(plan.total_probes):
        probe = plan.probe(seq)
        sent = 0.002 * seq
        loss = 0.01 if probe.phase == "whole" else 1 - 0.99**2
        if rng.random() < loss:
            out.append(
                OutcomeEntry(seq, probe.phase, probe.ip_len, "lost", sent, None, 0, None, None)
            )
            continue
        rtt = round(base * rng.uniform(1.0, 1.25), 3)
        frag = 0 if probe.phase == "whole" else expected_max_fragment(probe.ip_len)
        out.append(
            OutcomeEntry(seq, probe.phase, probe.ip_len, "acked", sent, acked_at=sent + rtt / 1000,
                         ack_count=1, received_len=probe.udp_payload_len, observed_frag_size=frag)
        )  # fmt: skip
    return out


def new_session(store: StudyStore, rng: random.Random) -> str:
    sid = secrets.token_hex(8)
    store.create_session(
        session_id=sid, cookie_hash=secrets.token_bytes(32), plan=FULL_PLAN.to_json(),
        source_address=f"198.51.{rng.randrange(256)}.{rng.randrange(1, 255)}",
        expires_at=datetime.now(UTC) + timedelta(hours=3), server_version="bench",
    )  # fmt: skip
    return sid


def stamped(sid: str, rows: list[OutcomeEntry], t0: datetime) -> OutcomeBatch:
    return OutcomeBatch(sid, tuple(rows), ClockAnchor(t0.timestamp(), 0.0))  # rows' 0 is t0


def record(store: StudyStore, sid: str, rows: list[OutcomeEntry]) -> None:
    t0 = datetime.now(UTC)
    for start in range(0, len(rows), BATCH):
        store.apply(stamped(sid, rows[start : start + BATCH], t0))


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


# -- e: durable counts --------------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")


def _backend(store: StudyStore) -> int:
    return int(store.run(lambda conn: conn.execute(text("SELECT pg_backend_pid()")).scalar_one()))


def _cpu_s(pid: int) -> float:
    """User and system CPU seconds of a process (the server's backend: same machine)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _scalar(conn: Any, stmt: Any) -> Any:
    return conn.execute(stmt).scalar_one()


MIGRATIONS = Path(__file__).resolve().parents[1] / "db" / "migrations" / "versions"


def _migration(prefix: str) -> Any:
    """A migration module of db/migrations/versions, for its SQL."""
    (path,) = MIGRATIONS.glob(f"{prefix}_*.py")
    spec = importlib.util.spec_from_file_location(f"_scale_bench_migration_{prefix}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextmanager
def _counted_by(function: str) -> Iterator[None]:
    """finish_session storing its counts through ``function`` (same arguments)."""
    saved = study_store._FINISH_COUNTS
    study_store._FINISH_COUNTS = text(f"SELECT * FROM {function}(CAST(:pks AS bigint[]))")
    try:
        yield
    finally:
        study_store._FINISH_COUNTS = saved


# The two ways of counting a finish: from the live counts (the head, 0029) and
# from the raw rows (0027's write_unit_counts, the finish before 0029).
COUNTING = {"now": "write_unit_counts_from_live", "raw_0027": "write_unit_counts"}


_ARMS = (("now", ""), ("raw_0027", "_raw_0027"))
# A session finished other than by the head's finish leaves no live counts either.
_DROP_LIVE = text(
    "WITH d AS (DELETE FROM live_counts WHERE session_pk = :pk), "
    "m AS (DELETE FROM live_count_marks WHERE session_pk = :pk) SELECT 1"
)


def _live_bytes(sid: str) -> Any:
    return text(
        "SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM live_counts t "
        "JOIN sessions s ON s.id = t.session_pk WHERE s.session_id = :sid"
    ).bindparams(sid=sid)


def _pk(store: StudyStore, sid: str) -> int:
    stmt = text("SELECT id FROM sessions WHERE session_id = :sid").bindparams(sid=sid)
    return int(store.run(partial(_scalar, stmt=stmt)))


def _stats(ms: list[float]) -> dict[str, float]:
    return {"p50": pct(ms, 50), "p95": pct(ms, 95), "n": len(ms)}


def durable_counts(url: str, sessions: int, rng: random.Random) -> dict[str, Any]:
    """Sessions in turn: finished with their counts from the live counts
    (head), from their raw rows (0027), or by the UPDATE alone (before 0020)."""
    from kickass_analysis.archive import KEEP_RAW_DAYS
    from kickass_db.study_store import _sessions

    store = StudyStore(url)
    # The raw days a server keeps (keep_raw_days): the finish reads one
    # partition, but is planned over all of them.
    with store.engine.begin() as conn:
        today = partitions.today(conn)
        for back in range(1, KEEP_RAW_DAYS["probe_outcomes"] + 1):
            partitions.ensure(conn, "probe_outcomes", today - timedelta(days=back))
        days = len(partitions.days(conn, "probe_outcomes"))
    arms = ("now", "raw_0027", "update_only")
    wall: dict[str, list[float]] = {arm: [] for arm in arms}
    cpu: dict[str, list[float]] = {arm: [] for arm in arms[:2]}
    counted: list[str] = []
    live_bytes: list[int] = []
    try:
        for i in range(sessions):
            arm = arms[i % 3]
            sid = new_session(store, rng)
            record(store, sid, outcomes(FULL_PLAN, rng))
            live_bytes.append(store.run(partial(_scalar, stmt=_live_bytes(sid))))
            pid = _backend(store)
            if arm == "update_only":
                # finish_session's UPDATE alone: what it cost before 0020.
                stmt = (
                    update(_sessions)
                    .where(_sessions.c.session_id == sid, _sessions.c.state.in_(LIVE_STATES))
                    .values(state="complete", verdict="fragments-ok", verdict_reason="bench",
                            finished_at=datetime.now(UTC))
                    .returning(_sessions.c.id)
                )  # fmt: skip
                t0 = time.perf_counter()
                pk = store.run(partial(_scalar, stmt=stmt))
                wall[arm].append((time.perf_counter() - t0) * 1000)
                store.run(partial(_scalar, stmt=_DROP_LIVE.bindparams(pk=pk)))
                continue
            with _counted_by(COUNTING[arm]):
                c0, t0 = _cpu_s(pid), time.perf_counter()
                assert store.apply(RunFinished(sid, "complete", "fragments-ok", "bench", None))
                wall[arm].append((time.perf_counter() - t0) * 1000)
            if _backend(store) == pid:  # the pool's one connection: its CPU time
                cpu[arm].append((_cpu_s(pid) - c0) * 1000)
            if arm == "raw_0027":  # as the finish of the head leaves them: none
                store.run(partial(_scalar, stmt=_DROP_LIVE.bindparams(pk=_pk(store, sid))))
            counted.append(sid)
        with store.engine.connect() as conn:
            sizes = conn.execute(
                text(
                    "SELECT pg_total_relation_size('unit_counts') AS counts, "
                    "pg_relation_size('unit_counts') AS heap, "
                    "pg_indexes_size('unit_counts') AS idx, "
                    "(SELECT count(*) FROM unit_counts) AS rows, "
                    "(SELECT sum(pg_total_relation_size(inhrelid)) FROM pg_inherits "
                    " WHERE inhparent = 'probe_outcomes'::regclass) AS raw, "
                    "(SELECT count(*) FROM probe_outcomes) AS raw_rows"
                )
            ).one()
        t0 = time.perf_counter()
        with store.engine.begin() as conn:
            folded = conn.execute(text("SELECT fold_unit_count_changes()")).scalar_one()
        fold_s = time.perf_counter() - t0
    finally:
        store.close()
    base = wall["update_only"]
    return {
        "sessions_counted": len(counted),
        "probe_outcomes_partitions": days,
        "bytes_per_session": sizes.counts / len(counted),
        "heap_bytes_per_session": sizes.heap / len(counted),
        "index_bytes_per_session": sizes.idx / len(counted),
        "raw_bytes_per_session": sizes.raw / sessions,
        "unit_counts_rows": sizes.rows,
        # A live full-plan session's live_counts rows (pg_column_size summed).
        "live_counts_bytes_per_session": statistics.median(live_bytes),
        "update_only_ms": _stats(base),
        # Wall clock of the finish with its counts, and what that gains over
        # the UPDATE alone, counting from the live counts (head) and from the raw rows (0027).
        **{f"finish{suffix}_ms": _stats(wall[arm]) for arm, suffix in _ARMS},
        **{
            f"finish{suffix}_gains_ms": {
                "p50": pct(wall[arm], 50) - pct(base, 50),
                "p95": pct(wall[arm], 95) - pct(base, 95),
            }
            for arm, suffix in _ARMS
        },
        # The backend's CPU time of a finish with its counts: what it costs on
        # an idle core (the wall times above include waiting for one).
        **{f"finish{suffix}_backend_cpu_ms": _stats(cpu[arm]) for arm, suffix in _ARMS},
        "fold": {
            "changes": folded,
            "seconds": fold_s,
            "ms_per_session": fold_s * 1000 / len(counted),
        },
    }


# -- b: ingest ----------------------------------------------------------------------------

_FLAT = """
CREATE TABLE bench_flat (LIKE probe_outcomes INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
ALTER TABLE bench_flat ADD PRIMARY KEY (session_pk, seq, session_created_at);
CREATE INDEX ON bench_flat (session_pk, phase, ip_len);
""" + "".join(  # the same live counts (0029) kept for it: only the partitioning differs
    f"CREATE TRIGGER bench_flat_{event} AFTER {event.upper()} ON bench_flat REFERENCING "
    f"{tables} FOR EACH STATEMENT EXECUTE FUNCTION count_live_outcomes();\n"
    for event, tables in _migration("0029").TRIGGERS.items()
)
_COLUMNS = ("session_pk", "session_created_at", "seq", "phase", "ip_len", "sent_at", "outcome",
            "acked_at", "rtt_ms", "ack_count", "received_len", "observed_frag_size",
            "reassembly_invalid")  # fmt: skip


@contextmanager
def unpartitioned() -> Iterator[None]:
    """StudyStore.record_outcomes, unchanged, writing to ``bench_flat``."""
    saved = study_store._COPY_OUTCOMES, study_store._UPSERT_OUTCOMES
    study_store._COPY_OUTCOMES = saved[0].replace("probe_outcomes", "bench_flat")
    study_store._UPSERT_OUTCOMES = text(
        str(saved[1])
        .replace("INSERT INTO probe_outcomes", "INSERT INTO bench_flat")
        .replace("probe_outcomes.reassembly_invalid", "bench_flat.reassembly_invalid")
    )
    try:
        yield
    finally:
        study_store._COPY_OUTCOMES, study_store._UPSERT_OUTCOMES = saved


def ingest(url: str, rounds: int, rng: random.Random) -> dict[str, Any]:
    store = StudyStore(url)
    times: dict[str, list[float]] = {"store": [], "unpartitioned": [], "copy": []}
    rows_done: dict[str, int] = dict.fromkeys(times, 0)
    try:
        with store.engine.begin() as conn:
            conn.exec_driver_sql(_FLAT)
        conninfo = db.libpq_url(url)
        for _ in range(rounds):
            order = list(times)
            rng.shuffle(order)
            for how in order:
                sid = new_session(store, rng)
                rows = outcomes(FULL_PLAN, rng)
                t0 = time.perf_counter()
                if how == "store":
                    record(store, sid, rows)
                elif how == "unpartitioned":
                    with unpartitioned():
                        record(store, sid, rows)
                else:
                    _copy(conninfo, sid, rows, datetime.now(UTC))
                times[how].append(time.perf_counter() - t0)
                rows_done[how] += len(rows)
    finally:
        store.close()
    # Per round the three ran one after the other: the ratios of each round
    # (the machine's load moves between rounds more than within one), and
    # their median.
    per_round = [{k: FULL_PLAN.total_probes / times[k][r] for k in times} for r in range(rounds)]
    rate = {k: rows_done[k] / sum(v) for k, v in times.items()}
    return {
        "rounds": rounds,
        "rows_per_s": rate,
        "rows_per_s_per_round": per_round,
        "store_vs_unpartitioned": statistics.median(
            r["store"] / r["unpartitioned"] for r in per_round
        ),
        "store_vs_copy": statistics.median(r["store"] / r["copy"] for r in per_round),
        "full_plan_sessions_per_day": rate["store"] * SECONDS_PER_DAY / FULL_PLAN.total_probes,
    }


def _copy(conninfo: str, sid: str, rows: list[OutcomeEntry], t0: datetime) -> None:
    with psycopg.connect(conninfo) as conn:
        pk, created = conn.execute(
            "SELECT id, created_at FROM sessions WHERE session_id = %s", (sid,)
        ).fetchone() or (None, None)
        with conn.cursor().copy(f"COPY probe_outcomes ({', '.join(_COLUMNS)}) FROM STDIN") as cp:
            for row in study_store._outcome_rows(stamped(sid, rows, t0)):  # the store's own rows
                cp.write_row((pk, created, *row))


# -- c: retire one day ------------------------------------------------------------------------


def retire(url: str, sessions: int, rng: random.Random) -> dict[str, Any]:
    import threading

    import pyarrow.parquet as pq
    from kickass_analysis import archive, rollups

    day = datetime.now(UTC).date() - timedelta(days=3)
    t0 = datetime(day.year, day.month, day.day, 12, tzinfo=UTC)
    conninfo = db.libpq_url(url)
    with partitions.Partitions(url) as p:
        for table in partitions.PARTITIONED:
            p.ensure_days(table, day, day)
    store = StudyStore(url)
    started = time.monotonic()
    try:
        for _ in range(sessions):
            sid = new_session(store, rng)
            with psycopg.connect(conninfo, autocommit=True) as conn:
                conn.execute("UPDATE sessions SET created_at = %s WHERE session_id = %s", (t0, sid))
            _copy(conninfo, sid, outcomes(FULL_PLAN, rng), t0)
            store.apply(RunFinished(sid, "complete", None, None, None))
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(
                """INSERT INTO router_runs (run_name, router_kind, capacity_bps, options,
                       started_at, finished_at)
                   VALUES ('bench-retire', 'kickass', 1e8, '{}'::jsonb, %s, %s)""",
                (t0, t0 + timedelta(hours=1)),
            )
            conn.execute(
                """INSERT INTO router_telemetry (run_id, t, recorded_at, advertised_rate_bps,
                       leading_fragment_len, input_rate_bps, output_rate_bps, queue_bytes,
                       marking_mode, rtt_ms, drops, fragmented, extra)
                   SELECT r.id, g / 100.0, r.started_at + make_interval(secs => g / 100.0),
                          9.5e7 + g % 1000, 1000, 9e7, 9e7, 1500 + g % 7000,
                          CASE WHEN g % 30000 < 15000 THEN 'kickass' ELSE 'tcp' END, 100,
                          g / 1000, g, jsonb_build_object('flows', g % 17, 'cpu', 0.25)
                   FROM router_runs r CROSS JOIN generate_series(0, 359999) g
                   WHERE r.run_name = 'bench-retire'"""
            )
        rollups.refresh(url)
        # Today's live session, which the writer fills while the day retires.
        live = new_session(store, rng)
        store.apply(RunProbing(live, "198.51.100.2", 40000, 20.0))
    finally:
        store.close()
    seeded_s = time.monotonic() - started
    waits: dict[str, list[float]] = {"reader": [], "writer": []}
    stop = threading.Event()

    def reader() -> None:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            while not stop.is_set():
                t = time.monotonic()
                conn.execute("SELECT count(*) FROM v_session_rollup").fetchone()
                waits["reader"].append(time.monotonic() - t)
                stop.wait(0.02)

    def writer() -> None:
        w = StudyStore(url)
        rows = outcomes(FULL_PLAN, rng)
        try:
            n = 0
            while not stop.is_set():
                t = time.monotonic()
                w.apply(stamped(live, rows[n : n + BATCH], datetime.now(UTC)))
                waits["writer"].append(time.monotonic() - t)
                n = (n + BATCH) % len(rows)
                stop.wait(0.02)
        finally:
            w.close()

    threads = [threading.Thread(target=f, daemon=True) for f in (reader, writer)]
    for t in threads:
        t.start()
    with tempfile.TemporaryDirectory(prefix="kickass-archive-bench-") as root:
        result = archive.retire(url, root, {"probe_outcomes": 2, "router_telemetry": 2})
        stop.set()
        for t in threads:
            t.join()
        verified = archive.verify_archive(root)
        groups = {}
        for table in partitions.PARTITIONED:
            part = archive.day_dir(Path(root), table, day) / archive.part_name(0)
            meta = pq.ParquetFile(part).metadata
            groups[table] = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    days = {d.table: d for d in result.days if d.day == day}
    out: dict[str, Any] = {
        "day": day.isoformat(),
        "sessions": sessions,
        "seeding_s": seeded_s,
        "retire_s": result.seconds,
        "verify_offline_ok": verified.ok,
        "reader_max_ms": max(waits["reader"]) * 1000.0,
        "writer_max_ms": max(waits["writer"]) * 1000.0,
        "reader_calls": len(waits["reader"]),
        "writer_calls": len(waits["writer"]),
    }
    for table, d in days.items():
        out[table] = {
            **d.to_json(),
            "write_rows_per_s": d.rows / d.write_s if d.write_s else None,
            "verify_rows_per_s": d.rows / d.verify_s if d.verify_s else None,
            "bytes_per_row": d.bytes / d.rows if d.rows else None,
            "row_groups": groups[table],
        }
    return out


# -- pruning --------------------------------------------------------------------------------


def pruning(url: str, rng: random.Random) -> dict[str, Any]:
    from kickass_db.study_store import _WHOLE_ROWS

    store = StudyStore(url)
    try:
        today = datetime.now(UTC).date()
        with partitions.Partitions(url) as p:
            p.ensure_days("probe_outcomes", today - timedelta(days=22), today)
        sid = new_session(store, rng)
        store.apply(RunProbing(sid, "198.51.100.1", 40000, 20.0))
        record(store, sid, outcomes(FULL_PLAN, rng)[:5000])
    finally:
        store.close()
    with psycopg.connect(db.libpq_url(url)) as conn:
        n = conn.execute(
            "SELECT count(*) FROM pg_inherits WHERE inhparent = 'probe_outcomes'::regclass"
        ).fetchone()
        sql = str(_WHOLE_ROWS).replace(":session_id", "%s")
        (plan,) = conn.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", (sid,)).fetchone() or ()
    executed, never = 0, 0

    def walk(node: dict[str, Any]) -> None:
        nonlocal executed, never
        if node.get("Relation Name", "").startswith("probe_outcomes_p"):
            if node.get("Actual Loops", 0):
                executed += 1
            else:
                never += 1
        for child in node.get("Plans", []):
            walk(child)

    walk(plan[0]["Plan"])
    return {"partitions": n[0] if n else None, "executed": executed, "never_executed": never,
            "execution_ms": plan[0]["Execution Time"]}  # fmt: skip


# -- d: Spark and DuckDB over the archive ------------------------------------------------------

# One day of the raw window: 2,732 full-plan sessions over 30 days is
# about 91 a day (3.33 M probe rows), so 3 days are 10 M rows and 30 are 100 M.
ENGINE_SESSIONS_PER_DAY = 91
ENGINE_SCALES = {"10M": 3, "100M": 30}  # rows (label) -> days of the archive
SPARK_DRIVER_MEMORY = "6g"  # local[2] runs in the driver: its heap is all Spark has
DUCKDB_THREADS = 2


def log(msg: str) -> None:
    print(f"[scale_bench {datetime.now(UTC):%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


_PLAN_TABLE = """
CREATE TABLE IF NOT EXISTS bench_plan (
    seq integer PRIMARY KEY, phase text NOT NULL, ip_len smallint NOT NULL,
    received_len integer NOT NULL, frag integer NOT NULL)
"""

# A day's sessions, finished: as in ``outcomes`` (1% loss, splits lose either
# piece, RTTs around a base per session), but one in twelve refuses every
# split (fragment-intolerant) and one in ten loses 5%, so the verdicts and
# the pooled views see every kind. Straight into the table, as
# dashboards_bench.py seeds.
_DAY_SESSIONS = """
INSERT INTO sessions (session_id, state, plan, server_version, client_version, source_address,
                      cookie_hash, created_at, started_at, finished_at, verdict, verdict_reason)
SELECT %(prefix)s || lpad(to_hex(i), 8, '0'), 'complete', %(plan)s::jsonb, 'bench', '0.1.0',
       ('198.51.' || (n / 250 %% 256) || '.' || (n %% 250 + 1))::inet,
       sha256(convert_to(%(prefix)s || i, 'UTF8')), c, c, c + interval '20 minutes',
       'fragments-ok', 'bench'
FROM (SELECT i, %(n0)s + i AS n,
             %(low)s::timestamptz + make_interval(secs => i * 86000.0 / %(sessions)s) AS c
      FROM generate_series(0, %(sessions)s - 1) i) x
"""
_DAY_PROBES = """
INSERT INTO probe_outcomes (session_pk, session_created_at, seq, phase, ip_len, sent_at, outcome,
                            acked_at, rtt_ms, ack_count, received_len, observed_frag_size)
SELECT id, created_at, seq, phase, ip_len, sent_at, outcome,
       CASE WHEN outcome = 'acked' THEN sent_at + make_interval(secs => rtt / 1000.0) END,
       CASE WHEN outcome = 'acked' THEN rtt END,
       CASE WHEN outcome = 'acked' THEN 1 ELSE 0 END,
       CASE WHEN outcome = 'acked' THEN received_len END,
       CASE WHEN outcome = 'acked' THEN frag END
FROM (
    SELECT s.id, s.created_at, p.seq, p.phase, p.ip_len, p.received_len, p.frag,
           s.created_at + p.seq * interval '2 ms' AS sent_at,
           CASE WHEN (p.phase = 'split' AND s.intolerant)
                     OR random() < CASE WHEN p.phase = 'whole' THEN s.loss
                                        ELSE 1 - (1 - s.loss) ^ 2 END
                THEN 'lost' ELSE 'acked' END AS outcome,
           CAST(round(s.base * (1 + 0.25 * random()) * 1000) / 1000 AS real) AS rtt
    FROM (SELECT id, created_at, id %% 12 = 0 AS intolerant,
                 CASE WHEN id %% 10 = 1 THEN 0.05 ELSE 0.01 END AS loss,
                 10 + 190 * random() AS base
          FROM sessions WHERE created_at >= %(low)s AND created_at < %(high)s
          OFFSET 0) s
    CROSS JOIN bench_plan p
) o
"""
_DAY_VERDICTS = """
UPDATE sessions SET verdict = 'fragment-intolerant'
WHERE created_at >= %(low)s AND created_at < %(high)s AND id %% 12 = 0
"""
_DAY_SEEDED = "SELECT count(*) FROM sessions WHERE created_at >= %(low)s AND created_at < %(high)s"
_DAY_COUNTS = """
SELECT count(*) FROM write_unit_counts(ARRAY(
    SELECT id FROM sessions WHERE created_at >= %(low)s AND created_at < %(high)s))
"""


def archived_days(root: Path) -> list[date]:
    """The probe_outcomes days published under ``root`` (by their folders)."""
    folder = root / "probe_outcomes"
    if not folder.is_dir():
        return []
    return sorted(
        date.fromisoformat(p.name.removeprefix("day="))
        for p in folder.iterdir()
        if p.name.startswith("day=") and (p / "_manifest.json").exists()
    )


def seed_archive(url: str, root: Path, days: int) -> dict[str, Any]:
    """``root`` holding at least ``days`` days of ``ENGINE_SESSIONS_PER_DAY``
    full-plan sessions: each missing day seeded into its partition, its
    sessions' durable counts written (write_unit_counts, as finish_session
    does), then retired by ``kickass_analysis.archive.retire`` (written,
    verified, detached, dropped: the database never holds more than a day)."""
    from kickass_analysis import archive

    have = archived_days(root)
    out: dict[str, Any] = {"days_found": len(have), "days_seeded": 0, "per_day": []}
    if len(have) >= days:
        return out
    conninfo = db.libpq_url(url)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(_PLAN_TABLE)
        (planned,) = conn.execute("SELECT count(*) FROM bench_plan").fetchone() or (0,)
        if planned != FULL_PLAN.total_probes:
            conn.execute("TRUNCATE bench_plan")
            with conn.cursor().copy("COPY bench_plan FROM STDIN") as cp:
                for seq in range(FULL_PLAN.total_probes):
                    probe = FULL_PLAN.probe(seq)
                    frag = 0 if probe.phase == "whole" else expected_max_fragment(probe.ip_len)
                    cp.write_row((seq, probe.phase, probe.ip_len, probe.udp_payload_len, frag))
        today = conn.execute("SELECT (now() AT TIME ZONE 'UTC')::date").fetchone()
    assert today is not None
    # A year and more back: before any day the other figures fill, and a
    # later run's days continue after those of the kept archive.
    day = max(have) + timedelta(days=1) if have else today[0] - timedelta(days=400)
    plan_json = json.dumps(FULL_PLAN.to_json())
    while len(have) < days:
        if day >= today[0] - timedelta(days=1):
            raise RuntimeError(f"no past day left to seed (reached {day}); use a new --data-dir")
        low = datetime(day.year, day.month, day.day, tzinfo=UTC)
        args = {"low": low, "high": low + timedelta(days=1), "prefix": f"{day:%Y%m%d}",
                "plan": plan_json, "sessions": ENGINE_SESSIONS_PER_DAY,
                "n0": len(have) * ENGINE_SESSIONS_PER_DAY}  # fmt: skip
        t0 = time.monotonic()
        with partitions.Partitions(url) as parts:
            parts.ensure_days("probe_outcomes", day, day)
        # One transaction: a run stopped while seeding leaves no part of the
        # day; one stopped while retiring left it whole, and the retire below
        # finishes it (its claim, or the day still attached).
        with psycopg.connect(conninfo) as conn:
            seeded = conn.execute(_DAY_SEEDED, args).fetchone()
            if not (seeded and seeded[0]):
                conn.execute(_DAY_SESSIONS, args)
                conn.execute(_DAY_VERDICTS, args)
                conn.execute(_DAY_PROBES, args)
            t1 = time.monotonic()
            if not (seeded and seeded[0]):
                conn.execute(_DAY_COUNTS, args)
            t2 = time.monotonic()
        keep = (today[0] - day).days - 1  # this day, and none after it
        result = archive.retire(url, root, {"probe_outcomes": keep}, tables=["probe_outcomes"])
        retired = [d for d in result.days if d.day == day and d.dropped]
        if not retired:
            raise RuntimeError(f"retiring {day} failed: {result.to_json()}")
        t3 = time.monotonic()
        step = {"day": day.isoformat(), "rows": retired[0].rows, "insert_s": round(t1 - t0, 1),
                "counts_s": round(t2 - t1, 1), "retire_s": round(t3 - t2, 1),
                "load": _load()}  # fmt: skip
        out["per_day"].append(step)
        out["days_seeded"] += 1
        have.append(day)
        log(f"archive day {len(have)}/{days}: {step}")
        day += timedelta(days=1)
    return out


def archive_view(root: Path, days: list[date], view: Path) -> Path:
    """An archive root of ``days`` only: their probe_outcomes and sidecar
    folders hard-linked from ``root`` (the files are the same bytes)."""
    from kickass_analysis.archive import day_dir

    if view.exists():
        shutil.rmtree(view)
    for day in days:
        for folder in ("probe_outcomes", SIDECAR):
            src = day_dir(root, folder, day)
            dst = day_dir(view, folder, day)
            dst.mkdir(parents=True)
            for f in src.iterdir():
                os.link(f, dst / f.name)
    return view


def _same_results(a: Path, b: Path) -> dict[str, bool]:
    """Per result: the two engines' rows equal (sorted; floats as they came)."""
    import pyarrow.parquet as pq

    same = {}
    for f in sorted(a.glob("*.parquet")):
        ta, tb = pq.read_table(f), pq.read_table(b / f.name)
        keys = [(n, "ascending") for n in ta.column_names]
        same[f.stem] = ta.sort_by(keys).equals(tb.sort_by(keys))
    return same


def engines(url: str, data: Path, scales: dict[str, int]) -> dict[str, Any]:
    """Test 8's query set (``archive_analysis.analyze``: verify, every result,
    write) by DuckDB (2 threads) and Spark ``local[2]`` (driver 6 GB) over
    archives of each scale; start-up once per engine."""
    from kickass_analysis import archive, archive_analysis

    root = data / "archive"
    t0 = time.monotonic()
    seeding = seed_archive(url, root, max(scales.values()))
    seeding["seconds"] = round(time.monotonic() - t0, 1)
    all_days = archived_days(root)
    views: dict[str, Path] = {}
    out: dict[str, Any] = {"seeding": seeding, "scales": {}}
    for label, days in scales.items():
        view = archive_view(root, all_days[:days], data / f"view-{label}")
        views[label] = view
        t = time.monotonic()
        report = archive.verify_archive(view)
        out["scales"][label] = {
            "days": days,
            "sessions": sum(d.rows for d in report.datasets if d.folder == SIDECAR),
            "rows": sum(d.rows for d in report.datasets if d.folder == "probe_outcomes"),
            "archive_bytes": sum(d.bytes for d in report.datasets),
            "verify_s": round(time.monotonic() - t, 2),
            "verified": report.ok,
        }
    results = data / "results"
    if results.exists():
        shutil.rmtree(results)
    for name in archive_analysis.ENGINES:
        log(f"starting {name}")
        load = _load()
        t = time.monotonic()
        eng: archive_analysis.Engine
        if name == "duckdb":
            duck = archive_analysis.DuckDBEngine()
            duck._con.execute(f"SET threads = {DUCKDB_THREADS}")  # every core it finds, else
            eng = duck
        else:
            eng = archive_analysis.SparkEngine(
                archive_analysis.LOCAL_MASTER, {"spark.driver.memory": SPARK_DRIVER_MEMORY}
            )
        start_s = time.monotonic() - t
        setting = "threads" if name == "duckdb" else "spark.driver.memory"
        row = (
            eng.fetch(f"SELECT current_setting('{setting}') AS v")
            if name == "duckdb"
            else eng.fetch(f"SET {setting}")
        ).to_pylist()[0]
        timings: dict[str, Any] = {
            "version": eng.version, "master": eng.master,
            setting: str(row.get("v", row.get("value"))),
            "start_s": round(start_s, 2), "load_at_start": load,
        }  # fmt: skip
        try:
            # The first analysis after the start is cold (the JVM's JIT, Spark's
            # planner, DuckDB's first reads): timed on its own, then every scale
            # warm, so the growth compares like with like.
            first = next(iter(views))
            runs = [(first, "cold"), *((label, label) for label in views)]
            for label, key in runs:
                log(f"{name}: analyze {label} ({'cold' if key == 'cold' else 'warm'})")
                load = _load()
                t = time.monotonic()
                analysis = archive_analysis.analyze(views[label], eng, results / f"{name}-{key}")
                seconds = time.monotonic() - t
                timings[key] = {
                    "scale": label,
                    "analyze_s": round(seconds, 2),
                    # analyze verifies the archive first: what the queries and the writing took
                    "queries_s": round(seconds - out["scales"][label]["verify_s"], 2),
                    "result_rows": {k: v["rows"] for k, v in analysis.results.items()},
                    "load_before": load, "load_after": _load(),
                }  # fmt: skip
        finally:
            eng.close()
        if all(label in timings for label in ("10M", "100M")):
            timings["growth_10M_to_100M"] = round(
                timings["100M"]["analyze_s"] / timings["10M"]["analyze_s"], 2
            )
        out[name] = timings
    out["engines_agree"] = {
        label: _same_results(results / f"duckdb-{label}", results / f"spark-{label}")
        for label in views
    }
    return out


@contextmanager
def server(data_dir: Path | None) -> Iterator[str]:
    """KICKASS_DATABASE_URL's server, or an embedded one (kept in DATA/pgdata)."""
    given = os.environ.get("KICKASS_DATABASE_URL")
    if given:
        yield given
        return
    with embedded_postgres(data_dir / "pgdata" if data_dir else None) as url:
        yield url


@contextmanager
def scratch_database(server_url: str) -> Iterator[str]:
    """A new database at the head, dropped afterwards (figures b, c, e, pruning)."""
    name = f"scale_bench_{secrets.token_hex(4)}"
    target = create_database(server_url, name)
    try:
        db.upgrade(target)
        yield target
    finally:
        drop_database(server_url, name)


@contextmanager
def engines_database(server_url: str, data: Path, keep: bool) -> Iterator[str]:
    """Figure d's database: the one that seeded ``DATA/archive`` (its sessions'
    ids, its client-key secret), kept with ``--data-dir``; made anew when the
    archive holds no day yet."""
    name = "scale_bench_engines"
    with psycopg.connect(db.libpq_url(server_url), autocommit=True) as admin:
        exists = admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
    if exists and not archived_days(data / "archive"):
        drop_database(server_url, name)
        exists = None
    target = db.libpq_url(server_url, name) if exists else create_database(server_url, name)
    try:
        db.upgrade(target)
        yield target
    finally:
        if not keep:
            drop_database(server_url, name)


# Figures by the letters (a is dashboards_bench.py's) and by name.
FIGURES = {"b": "ingest", "c": "retire", "d": "engines", "e": "durable_counts"}
NAMES = ("durable_counts", "ingest", "pruning", "retire", "engines")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true",
        help="fewer sessions for b, c and e; figure d at 10 M rows only (default: 10 M and 100 M)",
    )  # fmt: skip
    parser.add_argument(
        "--only", choices=(*FIGURES, *NAMES), action="append",
        help="only these figures, by letter or name (repeat; default: all)",
    )  # fmt: skip
    parser.add_argument(
        "--data-dir", type=Path, metavar="DIR",
        help="keep the PostgreSQL cluster (DIR/pgdata), figure d's database and its "
        "archive (DIR/archive) here: a second run seeds only the days missing and times",
    )  # fmt: skip
    args = parser.parse_args()
    rng = random.Random(28)
    # Figure e takes three kinds of finish in turn: 40 sessions of each in a full run.
    sessions, rounds = (21, 2) if args.quick else (120, 9)
    # One day of the 100 M rows is about 90 full-plan sessions (3.3 M rows).
    retire_sessions = 10 if args.quick else 90
    only = {FIGURES.get(f, f) for f in args.only or NAMES}
    scales = {"10M": ENGINE_SCALES["10M"]} if args.quick else ENGINE_SCALES
    out: dict[str, Any] = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "quick": args.quick,
        "load": os.getloadavg(),
    }
    if args.data_dir:
        args.data_dir.mkdir(parents=True, exist_ok=True)
    data = args.data_dir or Path(tempfile.mkdtemp(prefix="kickass-scale-bench-"))
    try:
        with server(args.data_dir) as server_url:
            if only - {"engines"}:
                with scratch_database(server_url) as url:
                    if "durable_counts" in only:
                        out["durable_counts"] = durable_counts(url, sessions, rng)
                    if "ingest" in only:
                        out["ingest"] = ingest(url, rounds, rng)
                    if "pruning" in only:
                        out["pruning"] = pruning(url, rng)
                    if "retire" in only:
                        out["retire"] = retire(url, retire_sessions, rng)
            if "engines" in only:
                with engines_database(server_url, data, keep=args.data_dir is not None) as url:
                    out["engines"] = engines(url, data, scales)
    finally:
        if args.data_dir is None:
            shutil.rmtree(data, ignore_errors=True)
    out["load_after"] = os.getloadavg()
    json.dump(out, sys.stdout, indent=2, default=str)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
