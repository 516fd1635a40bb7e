"""The Parquet archive and retirement of the raw days (issue 28 part 3; tests 2, 6, 7, 9, 10).

On the issue's seeded data (tests/support/durable.py: the study over three
days with one session still probing, router runs, an Atlas campaign, paired
trials), rolled up by the refresh:

- retire writes, verifies, records, detaches and drops every past day, and
  keeps every row and count: every view but the raw router window, every
  session's durable counts, the report's router runs; the archive verifies
  without a database, its schemas hold no address and no cookie hash, and
  restore puts each day back row for row (its counts written again from it);
- verify names a flipped byte, a missing file, an extra file and a
  manifest's row count off by one; a day whose files are damaged after it
  was detached is attached again, not dropped;
- a live session keeps its day, and is named;
- a late client report for a retired session is a 409 with the reason and
  changes nothing; a replayed batch is refused; the day is never made again;
- a retirement stopped between any two steps leaves no day missing from the
  database without a verified row and verifying files, counts no row twice,
  and the next run finishes it; a full archive disk drops nothing and gives
  the claim up;
- the report reads a retired router run from its rollups;
- `write` archives a day without retiring it, and a later retire keeps its files;
- the housekeeping item retires with its counts in item_runs;
- a settled Atlas campaign's outcomes are archived whole, kept while the
  database holds the same and written again when a late result changes them.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import redirect_stdout
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pyarrow.parquet as pq
import pytest
from kickass_analysis import archive, export, rollups
from kickass_analysis.report import Filters, ReportStore
from kickass_core import cli
from kickass_core.errors import KickassError
from kickass_core.study_events import (
    ClockAnchor,
    OutcomeBatch,
    OutcomeEntry,
    RunFinished,
    RunProbing,
)
from kickass_db.study_store import SessionRetired, StudyStore
from kickass_server.api import ApiConfig, create_app
from kickass_server.engine import ProbeEngine
from kickass_server.policy import Policy
from kickass_testbed.pg import create_database, drop_database
from support.durable import assert_views_equal, connect, durable_counts, seed_issue_28, views
from support.schedule import events, run_schedule, schedule_env, stable_cron, write_schedule
from support.seed import default_plan

KICKASS = str(Path(sys.executable).with_name("kickass"))
ALL_DAYS = {"probe_outcomes": 0, "router_telemetry": 0}  # every day before today
RAW = ("probe_outcomes", "router_telemetry")


@pytest.fixture(scope="module")
def seeded_template(pg_server_url: str, _migrated_template: str) -> Iterator[str]:
    name = f"archive_template_{secrets.token_hex(4)}"
    url = create_database(pg_server_url, name, template=_migrated_template)
    try:
        seed_issue_28(url)
        rollups.refresh(url)  # the router's seconds: a router day goes once rolled up
        yield name
    finally:
        drop_database(pg_server_url, name)


@pytest.fixture
def seeded(pg_server_url: str, seeded_template: str) -> Iterator[str]:
    name = f"archive_{secrets.token_hex(4)}"
    url = create_database(pg_server_url, name, template=seeded_template)
    try:
        yield url
    finally:
        drop_database(pg_server_url, name)


def today(url: str) -> date:
    with connect(url) as conn:
        row = conn.execute("SELECT (now() AT TIME ZONE 'UTC')::date AS d").fetchone()
    assert row is not None
    return row["d"]


def raw_rows(url: str, table: str) -> dict[date, list[tuple[Any, ...]]]:
    """Every row of a raw table, by its day, in key order (as psycopg reads them)."""
    key = "session_created_at" if table == "probe_outcomes" else "recorded_at"
    order = "session_pk, seq" if table == "probe_outcomes" else "run_id, t"
    out: dict[date, list[tuple[Any, ...]]] = {}
    with psycopg.connect(connect(url).info.dsn) as conn:
        cur = conn.execute(f"SELECT * FROM {table} ORDER BY {order}")
        names = [c.name for c in cur.description or ()]
        for r in cur.fetchall():
            day = r[names.index(key)].astimezone(UTC).date()
            out.setdefault(day, []).append(tuple(r))
    return out


def partitions_of(url: str, table: str) -> set[str]:
    with connect(url) as conn:
        return {
            r["relname"]
            for r in conn.execute(
                "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                "WHERE i.inhparent = %s::regclass",
                (table,),
            )
        }


def archive_rows(url: str) -> list[dict[str, Any]]:
    with connect(url) as conn:
        return conn.execute("SELECT * FROM archive_partitions ORDER BY table_name, day").fetchall()


def session_on(url: str, day: date, *, live: bool, cookie: bytes = b"c" * 16) -> str:
    """A session created at noon of ``day`` with a few outcomes; finished
    (with its durable counts) unless ``live``."""
    store = StudyStore(url)
    sid = secrets.token_hex(8)
    t0 = datetime(day.year, day.month, day.day, 12, tzinfo=UTC)
    try:
        store.create_session(
            session_id=sid, cookie_hash=hashlib.sha256(cookie).digest(),
            plan=default_plan().to_json(), source_address="192.0.2.77",
            expires_at=t0 + timedelta(hours=3), server_version="test", client_version="0.1.0",
        )  # fmt: skip
        with store.engine.begin() as conn:
            conn.exec_driver_sql(
                "UPDATE sessions SET created_at = %(t)s WHERE session_id = %(s)s",
                {"t": t0, "s": sid},
            )
        store.apply(RunProbing(sid, "192.0.2.77", 40000, 20.0))
        entries = tuple(
            OutcomeEntry(seq=n, phase="split", ip_len=44 + 8 * n,
                         outcome="lost" if n % 2 else "acked", sent_at=0.0,
                         acked_at=None if n % 2 else 0.020, ack_count=0 if n % 2 else 1,
                         received_len=None, observed_frag_size=None)
            for n in range(6)
        )  # fmt: skip
        store.apply(OutcomeBatch(sid, entries, ClockAnchor(t0.timestamp(), 0.0)))
        if not live:
            assert store.apply(RunFinished(sid, "complete", "fragments-ok", "seeded", None))
    finally:
        store.close()
    return sid


# -- the round trip --------------------------------------------------------------------------


def test_retire_and_restore_keep_every_row_and_count(
    seeded: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, root = seeded, tmp_path / "archive"
    # Row groups of at least this many rows (128 Ki in use; the seed is small),
    # set where they are read: the writer's and the verifier's (not the package's copy).
    monkeypatch.setattr(archive.writing, "ROW_GROUP_ROWS", 256)
    monkeypatch.setattr(archive.verifying, "ROW_GROUP_ROWS", 256)
    now = today(url)
    before_views = views(url)
    before_rows = {t: raw_rows(url, t) for t in RAW}
    before_counts = durable_counts(url)
    past = {t: sorted(d for d in before_rows[t] if d < now) for t in RAW}
    assert len(past["probe_outcomes"]) >= 2 and len(past["router_telemetry"]) >= 2

    result = archive.retire(url, root, ALL_DAYS)
    assert not result.failed and not result.blocked, result.to_json()
    c = result.counts()
    retired = {(d.table, d.day) for d in result.days if d.dropped}
    assert {(t, d) for t in RAW for d in past[t]} <= retired
    assert c["partitions_dropped"] == len(retired) == c["partitions_verified"]
    assert c["rows"] == sum(len(before_rows[t].get(d, [])) for t, d in retired)
    assert c["bytes"] > 0 and c["lock_ms"]["drop"] >= 0
    # The days are gone from the database, recorded as verified and dropped.
    for t in RAW:
        left = partitions_of(url, t)
        assert not any(f"{t}_p{d:%Y%m%d}" in left for d in past[t])
        assert f"{t}_p{now:%Y%m%d}" in left  # today stays
    recorded = {(r["table_name"], r["day"]): r for r in archive_rows(url)}
    for key in retired:
        r = recorded[key]
        assert r["verified_at"] and r["detached_at"] and r["dropped_at"] and r["claimed_at"]
        assert (
            r["manifest_sha256"]
            == hashlib.sha256(
                (archive.day_dir(root, key[0], key[1]) / archive.MANIFEST).read_bytes()
            ).hexdigest()
        )

    # Every view but the raw router window is as it was; the window holds the kept days.
    after_views = views(url)
    window = after_views.pop("v_router_telemetry")
    before_window = before_views.pop("v_router_telemetry")
    assert_views_equal(before_views, after_views)
    assert len(before_window) > 0 and len(window) < len(before_window)
    assert durable_counts(url) == before_counts

    # The archive verifies with no database, and holds no address, no cookie hash.
    proc = subprocess.run(
        [KICKASS, "archive", "verify", str(root), "--json"],
        capture_output=True, text=True, timeout=120, env=_no_database(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    verified = json.loads(proc.stdout)
    assert verified["ok"] and verified["problems"] == []
    for manifest in root.glob("*/day=*/_manifest.json"):
        m = json.loads(manifest.read_text())
        for col in m["columns"]:
            assert col["postgresql_type"] != "inet", (manifest, col)
            assert "address" not in col["name"] and "cookie" not in col["name"], (manifest, col)
        assert all(f["path"].startswith("part-") for f in m["files"])
        assert m["parquet"]["row_group_rows"] == 256
        for f in m["files"]:
            meta = pq.ParquetFile(manifest.parent / f["path"]).metadata
            groups = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
            assert all(n >= 256 for n in groups[:-1]) and sum(groups) == f["rows"], groups
    sidecars = list((root / "sessions").glob("day=*"))
    assert len(sidecars) == len(past["probe_outcomes"])

    # Restored, every day is back row for row, and its counts are written again from it.
    with connect(url) as conn:
        conn.execute("DELETE FROM unit_counts WHERE source = 'volunteer'")
        conn.commit()
    for t, d in sorted(retired):
        out = archive.restore(url, root, t, d, recount=True)
        assert out["rows"] == len(before_rows[t].get(d, []))
    assert {t: raw_rows(url, t) for t in RAW} == before_rows
    restored_counts = durable_counts(url)
    assert {k: v for k, v in before_counts.items() if k in restored_counts} == restored_counts
    assert all(r["restored_at"] and r["claimed_at"] is None for r in archive_rows(url))


def _no_database() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KICKASS_")}


def test_write_archives_a_day_and_retire_keeps_its_files(seeded: str, tmp_path: Path) -> None:
    url, root = seeded, tmp_path / "archive"
    day = today(url) - timedelta(days=1)
    before = raw_rows(url, "probe_outcomes")[day]
    first = archive.write(url, root, "probe_outcomes", day)
    assert first.files_written and first.verified and first.rows == len(before)
    [row] = [r for r in archive_rows(url) if r["day"] == day]
    assert row["written_at"] and row["verified_at"] and row["claimed_at"] is None
    assert f"probe_outcomes_p{day:%Y%m%d}" in partitions_of(url, "probe_outcomes")
    again = archive.write(url, root, "probe_outcomes", day)
    assert not again.files_written and again.verified  # the same rows: kept
    with pytest.raises(KickassError, match="is still being filled"):
        archive.write(url, root, "probe_outcomes", today(url))
    result = archive.retire(url, root, ALL_DAYS, tables=["probe_outcomes"])
    [retired] = [d for d in result.days if d.day == day]
    assert retired.dropped and not retired.files_written  # the files written before
    assert archive.verify_archive(root).ok


# -- damage -----------------------------------------------------------------------------------


def test_verify_names_damage_and_retire_keeps_a_damaged_day(seeded: str, tmp_path: Path) -> None:
    url, root = seeded, tmp_path / "archive"
    now = today(url)
    # Stopped after the detach: the day is verified, detached, not dropped.
    os.environ[archive.INJECT_ENV] = "after-detach"
    try:
        with pytest.raises(archive.InjectedFault):
            archive.retire(url, root, ALL_DAYS, tables=["probe_outcomes"])
    finally:
        del os.environ[archive.INJECT_ENV]
    [day] = [r["day"] for r in archive_rows(url) if r["detached_at"] and not r["dropped_at"]]
    folder = archive.day_dir(root, "probe_outcomes", day)
    assert archive.verify_archive(root).ok

    def damaged(how: str) -> str:
        copy = tmp_path / how
        shutil.copytree(root, copy)
        target = archive.day_dir(copy, "probe_outcomes", day)
        part = target / archive.part_name(0)
        if how.startswith("flipped"):
            # One bit, in a data page's header (byte 8), a page's values or
            # the footer: each is the sha256's to report, never pyarrow's
            # error on a page (a clean-clone run had the middle byte land in
            # a page that file_checks then read: a traceback).
            data = bytearray(part.read_bytes())
            at = {"flipped": len(data) // 2, "flipped-8": 8, "flipped-third": len(data) // 3}[how]
            data[at] ^= 0x01
            part.write_bytes(bytes(data))
        elif how == "missing":
            part.unlink()
        elif how == "extra":
            (target / "part-00001.parquet").write_bytes(part.read_bytes())
        elif how == "rows":
            m = json.loads((target / archive.MANIFEST).read_text())
            m["rows"] += 1
            (target / archive.MANIFEST).write_text(json.dumps(m))
        proc = subprocess.run(
            [KICKASS, "archive", "verify", str(copy)],
            capture_output=True, text=True, timeout=120, env=_no_database(),
        )  # fmt: skip
        assert proc.returncode == 1, (how, proc.stdout, proc.stderr)
        return proc.stderr

    for how in ("flipped", "flipped-8", "flipped-third"):
        stderr = damaged(how)
        assert "part-00000.parquet: its sha256 is not the manifest's" in stderr, (how, stderr)
        assert "Traceback" not in stderr, (how, stderr)
    assert "missing file part-00000.parquet" in damaged("missing")
    assert "extra file part-00001.parquet (in no manifest)" in damaged("extra")
    assert "rows, its files list" in damaged("rows")

    # Damaged before its drop: the next retire re-verifies, attaches the day
    # again and drops nothing.
    rows_before = raw_rows_count(url, "probe_outcomes", day)
    part = folder / archive.part_name(0)
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0x01
    part.write_bytes(bytes(data))
    result = archive.retire(url, root, ALL_DAYS, tables=["probe_outcomes"])
    [failed] = [d for d in result.days if d.day == day]
    assert failed.outcome == "failed" and not failed.dropped
    assert "does not verify" in failed.reasons[0]
    assert f"probe_outcomes_p{day:%Y%m%d}" in partitions_of(url, "probe_outcomes")
    assert raw_rows_count(url, "probe_outcomes", day) == rows_before
    row = {r["day"]: r for r in archive_rows(url)}[day]
    assert row["dropped_at"] is None and row["verified_at"] is None
    assert row["claimed_at"] is None  # its late writes are taken again
    assert day < now


def raw_rows_count(url: str, table: str, day: date) -> int:
    with connect(url) as conn:
        row = conn.execute(f"SELECT count(*) AS n FROM {table}_p{day:%Y%m%d}").fetchone()
    assert row is not None
    return int(row["n"])


# -- a live session, a late report -------------------------------------------------------------


def test_a_live_session_keeps_its_day(seeded: str, tmp_path: Path) -> None:
    url = seeded
    yesterday = today(url) - timedelta(days=1)
    live = session_on(url, yesterday, live=True)
    result = archive.retire(url, tmp_path / "archive", ALL_DAYS, tables=["probe_outcomes"])
    [kept] = [d for d in result.days if d.day == yesterday]
    assert kept.outcome == "blocked" and not kept.dropped
    assert f"session {live} is still probing" in kept.reasons
    assert {"table": "probe_outcomes", "day": str(yesterday), "reasons": kept.reasons} in (
        result.counts()["blocked"]
    )
    assert f"probe_outcomes_p{yesterday:%Y%m%d}" in partitions_of(url, "probe_outcomes")
    assert any(d.dropped for d in result.days)  # the other days went
    assert yesterday not in {r["day"] for r in archive_rows(url)}  # never claimed


def test_a_late_report_for_a_retired_session_is_refused(seeded: str, tmp_path: Path) -> None:
    url = seeded
    cookie = secrets.token_bytes(16)
    day = today(url) - timedelta(days=1)
    sid = session_on(url, day, live=False, cookie=cookie)
    # Before retirement a report counts (it marks the lost probes invalid).
    other = session_on(url, day, live=False, cookie=cookie)
    store = StudyStore(url)
    engine = ProbeEngine(store, Policy(), probe_port=9000, server_version="test")
    try:
        http = create_app(engine, store, ApiConfig(probe_host="probe.example")).test_client()
        report = {"invalid_ranges": [[0, 6]], "reassembly": {"after": {"fails": 3}}}
        headers = {"X-Kickass-Cookie": cookie.hex()}
        r = http.post(f"/api/v1/sessions/{other}/report", json=report, headers=headers)
        assert r.status_code == 200, r.get_json()
        assert r.get_json()["reassembly_invalid"]["split"] == 3

        result = archive.retire(url, tmp_path / "archive", ALL_DAYS, tables=["probe_outcomes"])
        assert any(d.day == day and d.dropped for d in result.days), result.to_json()
        counts = durable_counts(url)
        with connect(url) as conn:
            before = conn.execute(
                "SELECT verdict, client_metadata FROM sessions WHERE session_id = %s", (sid,)
            ).fetchone()
        r = http.post(f"/api/v1/sessions/{sid}/report", json=report, headers=headers)
        assert r.status_code == 409
        body = r.get_json()
        assert body["error"] == "retired"
        assert f"session {sid} is archived" in body["message"] and str(day) in body["message"]
        assert durable_counts(url) == counts
        with connect(url) as conn:
            after = conn.execute(
                "SELECT verdict, client_metadata FROM sessions WHERE session_id = %s", (sid,)
            ).fetchone()
        assert after == before
        # The session still reads as it did, from its durable counts.
        assert http.get(f"/api/v1/sessions/{sid}").status_code == 200
    finally:
        engine.stop()
    # A replayed batch is refused (the writer sets it aside), never written.
    try:
        t0 = datetime(day.year, day.month, day.day, 12, tzinfo=UTC)
        with pytest.raises(SessionRetired):
            lost = OutcomeEntry(0, "whole", 44, "lost", 0.0, None, 0, None, None)
            store.apply(OutcomeBatch(sid, (lost,), ClockAnchor(t0.timestamp(), 0.0)))
    finally:
        store.close()
    # The day is never made again.
    proc = subprocess.run(
        [KICKASS, "db", "partitions", "add", "probe_outcomes", str(day), "--database-url", url],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0
    assert f"the {day} partition of probe_outcomes is archived and retired" in proc.stderr
    assert "kickass archive restore probe_outcomes" in proc.stderr
    assert "Traceback" not in proc.stderr


# -- a retirement stopped between its steps ----------------------------------------------------


@pytest.mark.parametrize("point", archive.INJECTION_POINTS)
def test_a_stopped_retirement_drops_nothing_unverified(
    seeded: str, tmp_path: Path, point: str
) -> None:
    url, root = seeded, tmp_path / "archive"
    before = raw_rows(url, "probe_outcomes")
    total = sum(len(v) for v in before.values())
    os.environ[archive.INJECT_ENV] = point
    try:
        with pytest.raises(archive.InjectedFault):
            archive.retire(url, root, ALL_DAYS, tables=["probe_outcomes"])
    finally:
        del os.environ[archive.INJECT_ENV]
    attached = partitions_of(url, "probe_outcomes")
    recorded = {r["day"]: r for r in archive_rows(url)}
    report = archive.verify_archive(root)
    assert report.problems == []  # every file under a final name is in a manifest
    published = {d.day: d for d in report.datasets if d.folder == "probe_outcomes"}
    assert all(d.ok for d in report.datasets)
    in_database = only_archived = 0
    with connect(url) as conn:
        for day, rows in before.items():
            name = f"probe_outcomes_p{day:%Y%m%d}"
            if name in attached:
                continue
            # Missing from the database: a verified row, files that verify and hold its rows.
            row = recorded[day]
            assert row["verified_at"] is not None and row["detached_at"] is not None, (point, day)
            assert published[day].rows == len(rows)
            assert published[day].manifest_sha256 == row["manifest_sha256"]
            if row["dropped_at"] is None:  # detached, not dropped: its rows still here
                n = conn.execute(f"SELECT count(*) AS n FROM {name}").fetchone()
                assert n is not None
                in_database += n["n"]
            else:
                only_archived += len(rows)
        n = conn.execute("SELECT count(*) AS n FROM probe_outcomes").fetchone()
        assert n is not None
        in_database += n["n"]
    # The database's rows plus those only archived are the rows before, none twice.
    assert in_database + only_archived == total
    # The next run finishes the retirement.
    result = archive.retire(url, root, ALL_DAYS, tables=["probe_outcomes"])
    assert not result.failed, result.to_json()
    now = today(url)
    assert {d for d, r in {r["day"]: r for r in archive_rows(url)}.items() if r["dropped_at"]} == {
        d for d in before if d < now
    }
    assert archive.verify_archive(root).ok


def test_a_full_archive_disk_drops_nothing(
    seeded: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, root = seeded, tmp_path / "archive"
    before = raw_rows(url, "probe_outcomes")

    def full(*_args: Any, **_kwargs: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(export, "write_parquet", full)
    result = archive.retire(url, root, ALL_DAYS, tables=["probe_outcomes"])
    assert result.days and all(d.outcome == "failed" and not d.dropped for d in result.days)
    assert "No space left on device" in result.days[0].reasons[0]
    assert raw_rows(url, "probe_outcomes") == before
    # Nothing verified, and the days not claimed: late writes are taken again.
    assert all(r["verified_at"] is None and r["claimed_at"] is None for r in archive_rows(url))
    assert [p for p in root.rglob("*") if p.is_file()] == []  # no partial file left


# -- a settled Atlas campaign -----------------------------------------------------------------


def test_a_campaign_is_archived_whole_and_kept_current(seeded: str, tmp_path: Path) -> None:
    url, root = seeded, tmp_path / "archive"
    count = (
        "SELECT count(*) AS n FROM atlas_outcomes o JOIN atlas_campaigns c "
        "ON c.id = o.campaign_id WHERE c.name = 'seed-atlas'"
    )
    with connect(url) as conn:
        n = conn.execute(count).fetchone()
    assert n is not None and n["n"] > 0
    first = archive.write_campaign(url, root, "seed-atlas")
    assert first.wrote and first.rows == n["n"]
    assert archive.campaign_dir(root, "seed-atlas").name == "campaign=seed-atlas"
    report = archive.verify_archive(root)
    assert report.ok and [d.key for d in report.datasets] == [("campaign", "seed-atlas")]
    columns = first.manifest["columns"]
    assert all(c["postgresql_type"] != "inet" for c in columns)
    # Written once: the snapshot stands while the database holds the same...
    again = archive.write_campaign(url, root, "seed-atlas")
    assert not again.wrote and again.manifest_sha256 == first.manifest_sha256
    # ...and is written again when a late result changed it.
    with connect(url) as conn:
        conn.execute(
            "UPDATE atlas_outcomes SET error = 'late' WHERE ctid = "
            "(SELECT ctid FROM atlas_outcomes WHERE error IS NULL LIMIT 1)"
        )
        conn.commit()
    third = archive.write_campaign(url, root, "seed-atlas")
    assert third.wrote and third.manifest_sha256 != first.manifest_sha256
    assert third.manifest["checks"]["rows_error"] == first.manifest["checks"]["rows_error"] + 1
    assert archive.verify_archive(root).ok
    with connect(url) as conn:
        assert conn.execute(count).fetchone() == n  # never dropped
    with pytest.raises(KickassError, match="no Atlas campaign 'nope'"):
        archive.write_campaign(url, root, "nope")


# -- what readers see after retirement -------------------------------------------------------


def test_the_report_reads_retired_router_days_from_the_rollups(seeded: str, tmp_path: Path) -> None:
    url = seeded

    def router(data: Any) -> list[dict[str, Any]]:
        return [
            {k: r[k] for k in ("run_id", "samples", "advertised_rate_mean", "queue_mean",
                               "kickass_share", "first_at", "last_at")}
            for r in data.router_runs
        ]  # fmt: skip

    def report_json(tag: str) -> dict[str, Any]:
        buf = io.StringIO()
        out = tmp_path / f"report-{tag}.html"
        with redirect_stdout(buf):
            assert cli.main(["report", "--database-url", url, "-o", str(out), "--json"]) == 0
        return json.loads(buf.getvalue())["sections"]

    with ReportStore(url) as store:
        before = router(store.read(Filters()))
    sections_before = report_json("before")
    assert len(before) >= 2
    result = archive.retire(url, tmp_path / "archive", ALL_DAYS, tables=["router_telemetry"])
    assert sum(d.dropped for d in result.days) >= 2 and not result.failed
    with connect(url) as conn:
        left = conn.execute("SELECT count(*) AS n FROM v_router_telemetry").fetchone()
    assert left is not None and left["n"] == 0  # every run's days retired
    with ReportStore(url) as store:
        after = router(store.read(Filters()))
    # Every run still there, its samples and means as before (from its
    # seconds and minutes); its first sample's second, its last second.
    assert [r["run_id"] for r in after] == [r["run_id"] for r in before]
    for a, b in zip(after, before, strict=True):
        assert a["samples"] == b["samples"]
        for k in ("advertised_rate_mean", "queue_mean", "kickass_share"):
            assert a[k] == pytest.approx(b[k], rel=1e-9)
        assert a["first_at"] == b["first_at"].replace(microsecond=0)
        assert b["last_at"] - timedelta(seconds=1) < a["last_at"] <= b["last_at"]
    assert report_json("after") == sections_before


# -- the housekeeping item -----------------------------------------------------------------------


def test_housekeeping_retires_and_counts_it(seeded: str, tmp_path: Path) -> None:
    url = seeded
    cron, _ = stable_cron(minutes_ago=4)
    schedule = write_schedule(
        tmp_path / "schedule.toml",
        [{"name": "house", "kind": "housekeeping", "cron": cron, "archive": "archive",
          "keep_raw_days": {"probe_outcomes": 1, "router_telemetry": 1}}],
        name="archive",
    )  # fmt: skip
    proc = run_schedule(schedule, schedule_env(url, "ops-host"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [done] = [e for e in events(proc.stdout) if e["event"] == "finished"]
    assert done["outcome"] == "ok", done
    counts = done["counts"]["archive"]
    dropped = [r for r in archive_rows(url) if r["dropped_at"] is not None]
    assert counts["partitions_dropped"] == len(dropped) >= 3
    assert counts["partitions_written"] == counts["partitions_verified"] == len(dropped)
    assert counts["rows"] == sum(r["rows"] for r in dropped) > 0
    assert counts["bytes"] == sum(r["bytes"] for r in dropped) > 0
    assert counts["seconds"] > 0 and set(counts["lock_ms"]) == {"detach", "drop", "drop_max"}
    assert counts["blocked"] == [] and counts["failed"] == []
    now = today(url)
    assert all(r["day"] < now - timedelta(days=1) for r in dropped)
    assert archive.verify_archive(tmp_path / "archive").ok
