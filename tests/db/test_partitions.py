"""Raw rows partitioned by UTC day (issue 28 part 2; tests 3, 4 and 7's part-2 cases).

- The migration carries the data: on the seeded database, the previous head
  -> the new head -> the previous head, every table's and view's rows as
  they were after each step.
- Pruning, by EXPLAIN: the API's read of a live session executes one
  probe_outcomes partition of 30 (the rest "never executed"); a range on the
  partition key lists only its partitions (the archiver's read of a day,
  v_router_telemetry for a time range); with no live session no study view
  or rollup view executes a probe_outcomes partition at all.
- A write for a day without a partition is never dropped: an outcome batch
  goes to the journal's failed-* with PostgreSQL's error, the telemetry
  ingest counts the line as refused, and ``kickass schedule status`` warns
  when fewer than 2 days are ahead (the housekeeping item makes them again).
- create_session and the telemetry ingest make their own day's partition;
  a line without "ts" is recorded at its run's start + t.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import kickass_db as db
import psycopg
import pytest
from alembic import command
from kickass_core import study_events
from kickass_core.plan import ProbePlan
from kickass_core.study_events import ClockAnchor, OutcomeBatch, OutcomeEntry
from kickass_db.journal import Journal, pending
from kickass_db.partitions import Partitions, day_of, partition_name
from kickass_db.study_store import StudyStore
from kickass_db.telemetry import TelemetryIngest
from kickass_db.writer import OrderedWriter
from kickass_testbed.pg import create_database, drop_database
from support.durable import assert_views_equal, connect, seed_issue_28, view_columns, views
from support.schedule import events, run_schedule, schedule_env, stable_cron, write_schedule

KICKASS = str(Path(sys.executable).with_name("kickass"))
PREVIOUS = "0019"  # the head before issue 28's migrations
STUDY_VIEWS = (
    "v_whole_drop", "v_split_drop", "v_session_summary", "v_size_drop_all", "v_split_drop_all",
    "v_size_drop_by_source", "v_split_drop_by_source", "v_verdicts_by_source",
    "v_session_rollup", "v_verdicts_rollup", "v_drop_rollup", "v_client_verdicts",
)  # fmt: skip


@pytest.fixture(scope="module")
def seeded_template(pg_server_url: str, _migrated_template: str) -> Iterator[str]:
    name = f"partitions_template_{secrets.token_hex(4)}"
    url = create_database(pg_server_url, name, template=_migrated_template)
    try:
        seed_issue_28(url)
        with Partitions(url) as p:  # 30 days of partitions, as the issue measured
            today = datetime.now(UTC).date()
            p.ensure_days("probe_outcomes", today - timedelta(days=22), today)
        yield name
    finally:
        drop_database(pg_server_url, name)


@pytest.fixture
def seeded(pg_server_url: str, seeded_template: str) -> Iterator[str]:
    name = f"partitions_{secrets.token_hex(4)}"
    url = create_database(pg_server_url, name, template=seeded_template)
    try:
        yield url
    finally:
        drop_database(pg_server_url, name)


def one(conn: psycopg.Connection[Any], sql: str) -> Any:
    """The one value ``sql`` reads."""
    row = conn.execute(sql).fetchone()
    assert row is not None
    (value,) = row.values() if isinstance(row, dict) else row
    return value


# -- test 3: the migration carries the data ------------------------------------------------


Columns = dict[str, list[str]]


def table_columns(url: str) -> Columns:
    """Every table's columns (a partitioned table once)."""
    with psycopg.connect(db.libpq_url(url)) as conn:
        out: Columns = {}
        for table, column in conn.execute(
            """SELECT c.relname, a.attname FROM pg_class c
               JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
               WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition
                 AND c.relnamespace = 'public'::regnamespace AND c.relname <> 'alembic_version'
               ORDER BY c.relname, a.attnum"""
        ):
            out.setdefault(table, []).append(column)
        return out


def table_rows(url: str, columns: Columns) -> dict[str, list[str]]:
    """The rows of these tables' columns, sorted (a column a later revision
    adds, such as probe_outcomes.session_created_at, is not among them)."""
    from support.durable import norm

    out = {}
    with psycopg.connect(db.libpq_url(url)) as conn:
        for table, cols in columns.items():
            rows = conn.execute(f"SELECT {', '.join(cols)} FROM {table}").fetchall()
            out[table] = sorted(json.dumps([norm(v) for v in r]) for r in rows)
    return out


def migrate(url: str, step: Any, revision: str) -> None:
    engine = db.make_engine(url)
    try:
        with engine.begin() as conn:
            step(db.alembic_config(url, connection=conn), revision)
    finally:
        engine.dispose()


def test_the_migration_carries_the_data_both_ways(seeded: str) -> None:
    url = seeded
    migrate(url, command.downgrade, PREVIOUS)
    columns, shown = table_columns(url), view_columns(url)
    tables, seen = table_rows(url, columns), views(url)
    with connect(url) as conn:
        assert one(conn, "SELECT count(*) AS n FROM probe_outcomes") > 1000
        assert one(conn, "SELECT count(*) AS n FROM router_telemetry") > 500
        # The UTC days the seeded sessions fall on: three days back from now
        # cover three or four calendar days, by the time of day the test runs.
        seeded_days = {
            r["d"]
            for r in conn.execute(
                "SELECT DISTINCT (created_at AT TIME ZONE 'UTC')::date AS d FROM sessions"
            )
        }
    today = datetime.now(UTC).date()
    days = seeded_days | {today + timedelta(days=k) for k in range(8)}
    migrate(url, command.upgrade, "head")
    # Every table holds what it held (the tables and columns the new head adds are new).
    assert table_rows(url, columns) == tables
    assert {
        "unit_counts", "unit_count_changes", "unit_counts_daily", "unit_counts_total",
        "client_sizes",
    } <= set(table_columns(url)) - set(columns)  # fmt: skip
    # Every view as it was (the pooled medians within the histogram's bound).
    assert_views_equal(seen, views(url, seen, shown))
    with connect(url) as conn:
        parts = one(
            conn,
            "SELECT count(*) AS n FROM pg_inherits WHERE inhparent = 'probe_outcomes'::regclass",
        )
    assert parts >= len(days), (parts, sorted(days))  # the seeded days, today and 7 ahead
    migrate(url, command.downgrade, PREVIOUS)
    assert table_columns(url) == columns
    assert table_rows(url, columns) == tables
    assert_views_equal(seen, views(url, seen, shown))


# -- test 4: pruning, proven by EXPLAIN ---------------------------------------------------


def plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from plan_nodes(child)


def _plan(conn: psycopg.Connection[Any], explain: str, params: dict[str, Any]) -> dict[str, Any]:
    (row,) = conn.execute(explain, params).fetchall()
    (value,) = row.values() if isinstance(row, dict) else row
    plan: dict[str, Any] = value[0]["Plan"]
    return plan


def partition_scans(
    conn: psycopg.Connection[Any], sql: str, table: str, **params: Any
) -> list[Any]:
    """The scans of ``table``'s partitions in ``EXPLAIN (ANALYZE)`` of ``sql``:
    (partition, loops executed)."""
    out = []
    for node in plan_nodes(_plan(conn, f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", params)):
        name = node.get("Relation Name", "")
        if name.startswith(f"{table}_p"):
            out.append((name, node.get("Actual Loops", 0)))
    return out


def explained_partitions(conn: psycopg.Connection[Any], sql: str, table: str) -> set[str]:
    """The partitions of ``table`` that plain ``EXPLAIN`` lists for ``sql``."""
    return {
        n["Relation Name"]
        for n in plan_nodes(_plan(conn, f"EXPLAIN (FORMAT JSON) {sql}", {}))
        if n.get("Relation Name", "").startswith(f"{table}_p")
    }


def test_a_live_session_s_read_executes_one_partition(seeded: str) -> None:
    from kickass_db.study_store import _SPLIT_ROWS, _WHOLE_ROWS

    with connect(seeded) as conn:
        live = conn.execute(
            "SELECT session_id, created_at FROM sessions WHERE state = 'probing'"
        ).fetchone()
        total = one(
            conn,
            "SELECT count(*) AS n FROM pg_inherits WHERE inhparent = 'probe_outcomes'::regclass",
        )
        assert live is not None and total >= 30
        for query in (_WHOLE_ROWS, _SPLIT_ROWS):
            scans = partition_scans(
                conn, str(query).replace(":session_id", "%(sid)s"), "probe_outcomes",
                sid=live["session_id"],
            )  # fmt: skip
            executed = [name for name, loops in scans if loops > 0]
            assert executed == [partition_name("probe_outcomes", day_of(live["created_at"]))]
            # Every other partition is in the plan and never executed (run-time pruning).
            assert len(scans) >= total - 1, scans


def test_a_range_on_the_partition_key_lists_only_its_partitions(seeded: str) -> None:
    today = datetime.now(UTC).date()
    day = today - timedelta(days=1)
    with connect(seeded) as conn:
        # The archiver's read of one day.
        read = (
            f"SELECT * FROM probe_outcomes WHERE session_created_at >= '{day}T00:00Z' "
            f"AND session_created_at < '{day + timedelta(days=1)}T00:00Z'"
        )
        assert explained_partitions(conn, read, "probe_outcomes") == {
            partition_name("probe_outcomes", day)
        }
        # v_router_telemetry for a time range: the two days it spans (the seeded
        # runs are on two days one after the other, of the 30 partitions).
        first = one(conn, "SELECT min(recorded_at) AS t FROM router_telemetry")
        start = first.astimezone(UTC).replace(hour=23, minute=0)
        window = (
            f"SELECT * FROM v_router_telemetry WHERE recorded_at >= '{start.isoformat()}' "
            f"AND recorded_at < '{(start + timedelta(hours=2)).isoformat()}'"
        )
        assert explained_partitions(conn, window, "router_telemetry") == {
            partition_name("router_telemetry", day_of(start)),
            partition_name("router_telemetry", day_of(start) + timedelta(days=1)),
        }


def test_with_no_live_session_no_view_executes_a_partition(seeded: str) -> None:
    store = StudyStore(seeded)
    try:
        assert len(store.mark_orphans_incomplete()) == 1  # the session left probing
    finally:
        store.close()
    with connect(seeded) as conn:
        assert conn.execute(
            "SELECT count(*) AS n FROM sessions WHERE state IN ('created', 'probing')"
        ).fetchone() == {"n": 0}
        rollup_views = [
            r["viewname"]
            for r in conn.execute(
                "SELECT viewname FROM pg_views WHERE viewname LIKE 'v\\_%%rollup'"
            )
        ]
        assert {"v_session_rollup", "v_drop_rollup", "v_verdicts_rollup"} <= set(rollup_views)
        for view in sorted({*STUDY_VIEWS, *rollup_views}):
            scans = partition_scans(conn, f"SELECT * FROM {view}", "probe_outcomes")
            assert [s for s in scans if s[1] > 0] == [], view


# -- test 7: a write for a day without a partition is never dropped -------------------------


def _old_session(store: StudyStore, days_ago: int) -> tuple[str, datetime]:
    """A session of a day whose partition is gone (retired, say)."""
    sid = secrets.token_hex(8)
    store.create_session(
        session_id=sid, cookie_hash=secrets.token_bytes(32), plan=ProbePlan.quick().to_json(),
        source_address="198.51.100.9", expires_at=datetime.now(UTC) + timedelta(hours=1),
        server_version="t",
    )  # fmt: skip
    created = datetime.now(UTC) - timedelta(days=days_ago)
    with store.engine.begin() as conn:
        conn.exec_driver_sql(
            "UPDATE sessions SET created_at = %(c)s WHERE session_id = %(s)s",
            {"c": created, "s": sid},
        )
    return sid, created


def _batch(session_id: str, seqs: range) -> OutcomeBatch:
    anchor = ClockAnchor(unix=datetime.now(UTC).timestamp(), mono=0.0)
    entries = tuple(
        OutcomeEntry(seq=i, phase="whole", ip_len=1500, outcome="acked", sent_at=0.01 * i,
                     acked_at=0.01 * i + 0.02, ack_count=1, received_len=1472,
                     observed_frag_size=None)
        for i in seqs
    )  # fmt: skip
    return OutcomeBatch(session_id=session_id, entries=entries, anchor=anchor)


def test_an_outcome_batch_for_a_day_without_a_partition_is_set_aside(
    database_url: str, tmp_path: Path
) -> None:
    store = StudyStore(database_url)
    journal = Journal(tmp_path / "journal", study_events.to_json)
    writer = OrderedWriter(store.apply, journal=journal)
    try:
        old, created = _old_session(store, days_ago=40)
        now_sid = secrets.token_hex(8)
        store.create_session(
            session_id=now_sid, cookie_hash=secrets.token_bytes(32),
            plan=ProbePlan.quick().to_json(), source_address="198.51.100.10",
            expires_at=datetime.now(UTC) + timedelta(hours=1), server_version="t",
        )  # fmt: skip
        writer.submit(_batch(old, range(5)))
        writer.submit(_batch(now_sid, range(5)))  # the next batch is not held up
        assert writer.sync(30)
    finally:
        writer.close()
        store.close()
    (failed,) = (tmp_path / "journal").glob("failed-*")
    [record] = [json.loads(line) for line in failed.read_text().splitlines()]
    assert record["record"]["session_id"] == old and len(record["record"]["entries"]) == 5
    assert 'no partition of relation "probe_outcomes" found for row' in record["reason"]
    assert pending(tmp_path / "journal")["failed_records"] == 1
    with connect(database_url) as conn:
        stored = conn.execute(
            "SELECT s.session_id, count(*) AS n FROM probe_outcomes o "
            "JOIN sessions s ON s.id = o.session_pk GROUP BY 1"
        ).fetchall()
    assert stored == [{"session_id": now_sid, "n": 5}]
    assert partition_name("probe_outcomes", day_of(created)) not in _partitions(database_url)


def _partitions(url: str) -> set[str]:
    with connect(url) as conn:
        return {
            r["relname"]
            for r in conn.execute(
                "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
            )
        }


def _sample(t: float, ts: float | None = None) -> str:
    line: dict[str, Any] = {
        "type": "sample", "t": t, "advertised_rate_bps": 1e6, "input_rate_bps": 1e6,
        "queue_bytes": 0, "marking_mode": "kickass", "drops": 0, "fragmented": 0,
    }  # fmt: skip
    if ts is not None:
        line["ts"] = ts
    return json.dumps(line)


def test_the_ingest_refuses_a_line_for_a_day_without_a_partition(
    database_url: str, tmp_path: Path
) -> None:
    start = datetime.now(UTC).timestamp() - 60
    old = start - 10 * 86400  # a router clock ten days off: no partition for that day
    capture = tmp_path / "run.ndjson"
    lines = [json.dumps({"type": "metadata", "started_unix": start,
                         "options": {"router": {"capacity_bps": 1e7}}})]  # fmt: skip
    lines += [_sample(i * 0.01, start + i * 0.01) for i in range(300)]
    lines[101] = _sample(1.0, old)
    lines[250] = _sample(2.49, old + 2.49)
    capture.write_text("\n".join(lines) + "\n")
    env = {**os.environ, "KICKASS_DATABASE_URL": database_url}
    proc = subprocess.run(
        [KICKASS, "telemetry", "ingest", str(capture), "--json"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["written"] == 298 and summary["skipped"] == 2
    old_day = day_of(datetime.fromtimestamp(old, UTC))
    assert [s["line"] for s in summary["skipped_lines"]] == [102, 251]
    for s in summary["skipped_lines"]:
        assert s["reason"].startswith("refused: router_telemetry has no partition for ")
        assert str(old_day) in s["reason"]
    assert partition_name("router_telemetry", old_day) not in _partitions(database_url)
    # The operator makes that day, and the capture (which still holds the
    # lines) goes in whole.
    made = subprocess.run(
        [KICKASS, "db", "partitions", "add", "router_telemetry", str(old_day)],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert f"router_telemetry: 1 partition made {old_day}" in made.stdout
    again = subprocess.run(
        [KICKASS, "telemetry", "ingest", str(capture), "--json"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["written"] == 300


def test_status_warns_when_fewer_than_two_days_are_ahead(database_url: str, tmp_path: Path) -> None:
    today = datetime.now(UTC).date()
    with connect(database_url) as conn:
        conn.autocommit = True
        for table in ("probe_outcomes", "router_telemetry"):
            for n in range(2, 8):
                name = partition_name(table, today + timedelta(days=n))
                conn.execute(f"ALTER TABLE {table} DETACH PARTITION {name}")
                conn.execute(f"DROP TABLE {name}")
    cron, _ = stable_cron(minutes_ago=4)
    schedule = write_schedule(
        tmp_path / "schedule.toml",
        [{"name": "house", "kind": "housekeeping", "cron": cron, "partitions_ahead": 7}],
        name="partitions",
    )
    env = schedule_env(database_url, "ops-host")

    def status() -> tuple[dict[str, Any], str]:
        out = []
        for argv in (["--json"], []):
            proc = subprocess.run(
                [KICKASS, "schedule", "status", str(schedule), *argv],
                env=env, capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert proc.returncode == 0, proc.stderr
            out.append(proc.stdout)
        return json.loads(out[0]), out[1]

    st, text = status()
    assert st["partitions_ahead"] == {"probe_outcomes": 1, "router_telemetry": 1}
    assert len(st["warnings"]) == 2 and all("fewer than 2" in w for w in st["warnings"])
    assert "WARNING: probe_outcomes has partitions for 1 day ahead of today" in text
    # The housekeeping item makes them again.
    proc = run_schedule(schedule, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [done] = [e for e in events(proc.stdout) if e["event"] == "finished"]
    assert done["outcome"] == "ok"
    made = [str(today + timedelta(days=n)) for n in range(2, 8)]
    assert done["counts"]["partitions"] == {
        "probe_outcomes": {"made": made, "days_ahead": 7},
        "router_telemetry": {"made": made, "days_ahead": 7},
    }
    st, text = status()
    assert st["warnings"] == [] and "WARNING" not in text


# -- their own day, and a line without ts ----------------------------------------------------


def test_the_server_and_the_ingest_make_their_own_day(database_url: str) -> None:
    today = datetime.now(UTC).date()
    with connect(database_url) as conn:
        conn.autocommit = True
        for table in ("probe_outcomes", "router_telemetry"):
            for d in (today, today + timedelta(days=1)):
                conn.execute(f"ALTER TABLE {table} DETACH PARTITION {partition_name(table, d)}")
                conn.execute(f"DROP TABLE {partition_name(table, d)}")
    store = StudyStore(database_url)
    try:
        sid = secrets.token_hex(8)
        store.create_session(
            session_id=sid, cookie_hash=secrets.token_bytes(32),
            plan=ProbePlan.quick().to_json(), source_address="198.51.100.11",
            expires_at=datetime.now(UTC) + timedelta(hours=1), server_version="t",
        )  # fmt: skip
        store.apply(_batch(sid, range(3)))
    finally:
        store.close()
    assert {partition_name("probe_outcomes", d) for d in (today, today + timedelta(days=1))} <= (
        _partitions(database_url)
    )
    # A live router's lines, without "ts": recorded at the run's start + t.
    start = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=30)
    meta = json.dumps({"type": "metadata", "started_unix": start.timestamp(),
                       "options": {"router": {"capacity_bps": 1e7}}})  # fmt: skip
    samples = [_sample(i * 0.5) for i in range(20)]
    ingest = TelemetryIngest(database_url, "live")
    try:
        summary = ingest.feed([meta, *samples, *samples])  # every line twice
    finally:
        ingest.close()
    assert summary["written"] == 20 and summary["skipped"] == 0
    assert partition_name("router_telemetry", today) in _partitions(database_url)
    with connect(database_url) as conn:
        rows = conn.execute(
            "SELECT t, recorded_at FROM router_telemetry WHERE run_id = %s ORDER BY t",
            (summary["run_id"],),
        ).fetchall()
    assert [r["recorded_at"] for r in rows] == [
        start + timedelta(seconds=0.5 * i) for i in range(20)
    ]
