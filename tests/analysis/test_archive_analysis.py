"""The archive equals the views (issue 28 part 4, test 8).

The issue's seeded data (tests/support/durable.py: the study over three days
with one session still probing, router runs, an Atlas campaign, paired
trials), its finished sessions on the days before today so that retirement
archives every one of them, is retired to a Parquet archive (every past day)
beside its Atlas campaign. DuckDB and Spark ``local[2]`` then compute from the
files alone what PostgreSQL's views show, and each result is compared with
the database row for row:

- counts exactly; rates, excesses and per-session medians as the same Python
  float (their ``repr``); stored verdicts and times as they are. One more
  session is seeded with counts whose excess C's ``pow`` (PostgreSQL's) and a
  square's ``x * x`` (what Java's, Spark's, gives for a power of 2) round apart
  in the last bit: an engine computing the excess itself would differ there;
- each session's verdict decided again by ``kickass_core.verdict.decide``
  equal to the one stored;
- the pooled median RTT exact (equal to PostgreSQL's ``percentile_cont`` over
  the raw rows, taken before they left) and within the documented 0.4975% of
  the view's, which comes from a histogram;
- the latest verdict per client by ``v_client_verdicts``' rule, a client being
  the archive's hashed client key.

One SparkSession serves the module (its JVM takes most of the time). The
Spark test runs in the main stream, not alone: its ~30 s of JVM work is no
heavier than the Chromium and notebook tests there, and the alone stream is
CI's critical path. ``kickass archive analyze`` is run
as a researcher runs it (no database in its environment), and its errors for
a folder that is no verified archive, an output folder that exists, and a
missing Java or engine library are checked.
"""

from __future__ import annotations

import json
import math
import os
import random
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from kickass_analysis import archive, archive_analysis, rollups
from kickass_core.errors import KickassError
from kickass_core.states import FINAL_STATES
from kickass_core.study_events import ClockAnchor, OutcomeBatch, OutcomeEntry, RunFinished
from kickass_core.verdict import decide
from kickass_db.study_store import StudyStore
from kickass_testbed.pg import create_database, drop_database
from support import seed
from support.durable import MEDIAN_BOUND, connect, seed_issue_28

KICKASS = str(Path(sys.executable).with_name("kickass"))
ALL_DAYS = {"probe_outcomes": 0, "router_telemetry": 0}
RESULTS = tuple(archive_analysis.RESULTS)
# A few thousand rows: the JIT's warm-up is most of Spark's time, and its
# first tier alone warms up in a third of it (measured: 22 s against 59 s).
SPARK_TEST_CONF = {"spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1"}


class _Yesterday(datetime):
    """The seed's clock a second before today (UTC): every finished session
    lands on a day retirement archives, so the views and the archive hold the
    same sessions. The live session is created by the database's clock: today."""

    @classmethod
    def now(cls, tz: Any = None) -> _Yesterday:
        today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
        t = today - timedelta(seconds=1)
        return cls.fromtimestamp(t.timestamp(), tz or UTC)


# A session's (whole sent, whole acked, split sent, split acked) whose
# excess ``1 - (1 - whole drop)^2`` takes a square that C's pow and x * x
# round apart: 1 - 16/82 squared.
POW_APART = (82, 66, 100, 90)


def _pow_apart(whole_sent: int, whole_acked: int, *_: int) -> bool:
    x = 1 - (whole_sent - whole_acked) / whole_sent
    return math.pow(x, 2) != x * x


def _seed_pow_apart(url: str, counts: tuple[int, int, int, int]) -> str:
    """One more finished session, created by the seed's clock, with these
    counts: the first probes of each phase acknowledged, the rest lost."""
    whole_sent, whole_acked, split_sent, split_acked = counts
    plan = seed.default_plan()
    probes = [plan.probe(q) for q in range(plan.total_probes)]
    whole = [p for p in probes if p.phase == "whole"][:whole_sent]
    split = [p for p in probes if p.phase == "split"][:split_sent]
    assert len(whole) == whole_sent and len(split) == split_sent
    acked = {p.seq for p in whole[:whole_acked]} | {p.seq for p in split[:split_acked]}
    rows = tuple(
        OutcomeEntry(p.seq, p.phase, p.ip_len, "acked", 0.002 * i, 0.002 * i + 0.04, 1,
                     p.udp_payload_len, 0)
        if p.seq in acked
        else OutcomeEntry(p.seq, p.phase, p.ip_len, "lost", 0.002 * i, None, 0, None, None)
        for i, p in enumerate(whole + split)
    )  # fmt: skip
    t0 = _Yesterday.now(UTC)
    client = seed._Client("seed-pow-apart", "clean", "Linux-x86_64", "192.0.2.77", 40.0, 0.0)
    store = StudyStore(url)
    try:
        session_id = seed._create(store, client, plan, random.Random(82), t0)
        seed._backdate_start(store, session_id, t0)
        store.apply(OutcomeBatch(session_id, rows, ClockAnchor(t0.timestamp(), 0.0)))
        v = decide(*counts)
        store.apply(RunFinished(session_id, "complete", v.verdict, v.reason, None))
        seed._backdate(store, session_id, t0, t0 + timedelta(seconds=1))
    finally:
        store.close()
    return session_id


@dataclass
class Archived:
    url: str
    root: Path
    sessions: list[str]  # the archived sessions' ids
    exact_medians: dict[int, float]  # PostgreSQL's exact pooled median per IP length


@pytest.fixture(scope="module")
def archived(
    pg_server_url: str, _migrated_template: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Archived]:
    name = f"archive_analysis_{secrets.token_hex(4)}"
    url = create_database(pg_server_url, name, template=_migrated_template)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(seed, "datetime", _Yesterday)
            seed_issue_28(url)
            _seed_pow_apart(url, POW_APART)
        rollups.refresh(url)
        exact = _exact_pooled_medians(url)
        root = tmp_path_factory.mktemp("analysis") / "archive"
        result = archive.retire(url, root, ALL_DAYS)
        assert not result.failed and not result.blocked, result.to_json()
        assert archive.write_campaign(url, root, "seed-atlas").rows > 0
        with connect(url) as conn:
            live = conn.execute(
                "SELECT count(*) AS n FROM sessions WHERE state <> ALL(%s)", (list(FINAL_STATES),)
            ).fetchone()
            ids = [
                r["session_id"]
                for r in conn.execute(
                    "SELECT session_id FROM sessions WHERE created_at < %s ORDER BY session_id",
                    (_today(),),
                )
            ]
        assert live is not None and live["n"] >= 1  # the live session stays in the database
        yield Archived(url, root, ids, exact)
    finally:
        drop_database(pg_server_url, name)


def _today() -> datetime:
    return datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)


def _exact_pooled_medians(url: str) -> dict[int, float]:
    with connect(url) as conn:
        return {
            r["ip_len"]: r["m"]
            for r in conn.execute(
                "SELECT o.ip_len, percentile_cont(0.5) WITHIN GROUP "
                "(ORDER BY o.rtt_ms::double precision) AS m "
                "FROM probe_outcomes o JOIN sessions s ON s.id = o.session_pk "
                "WHERE s.state = ANY(%s) AND o.phase = 'whole' AND o.outcome = 'acked' "
                "GROUP BY o.ip_len",
                (list(FINAL_STATES),),
            )
        }


# -- PostgreSQL's side ----------------------------------------------------------------------

_KEYS = {
    "v_whole_drop": ("session_id", "ip_len"),
    "v_split_drop": ("session_id", "leading_ip_len"),
    "v_session_summary": ("session_id",),
    "session_verdicts": ("session_id",),
    "v_size_drop_all": ("ip_len",),
    "v_split_drop_all": ("leading_ip_len",),
    "v_size_drop_by_source": ("source", "ip_len"),
    "v_split_drop_by_source": ("source", "leading_ip_len"),
    "client_verdicts": ("client_key_hash",),
}
# Per client key (hashed as the archive's sidecar hashes it), v_client_verdicts' rule.
_CLIENT_VERDICTS = """
WITH s AS (
    SELECT s.id, s.session_id, s.state, s.verdict, s.finished_at,
           encode(sha256(k.secret || convert_to(client_key(s.source_address), 'UTF8')), 'hex')
               AS client_key_hash
    FROM sessions s CROSS JOIN archive_secrets k
    WHERE k.name = 'client_key' AND s.created_at < %(today)s
)
SELECT c.client_key_hash, n.sessions, l.session_id AS latest_session_id,
       l.verdict AS latest_verdict, l.finished_at AS latest_finished_at
FROM (SELECT DISTINCT client_key_hash FROM s WHERE client_key_hash IS NOT NULL) c
CROSS JOIN LATERAL (SELECT count(*) AS sessions FROM s
                    WHERE s.client_key_hash = c.client_key_hash) n
LEFT JOIN LATERAL (SELECT s.session_id, s.verdict, s.finished_at FROM s
                   WHERE s.client_key_hash = c.client_key_hash AND s.state = ANY(%(final)s)
                   ORDER BY s.finished_at DESC NULLS LAST, s.id DESC LIMIT 1) l ON true
"""


def postgres(url: str, sessions: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Each result's rows as PostgreSQL's views give them (the archived sessions'
    rows of the per-session views)."""
    out: dict[str, list[dict[str, Any]]] = {}
    with connect(url) as conn:
        for name, result in archive_analysis.RESULTS.items():
            columns = ", ".join(c for c, _ in result.columns)
            if name == "client_verdicts":
                query = _CLIENT_VERDICTS
            elif name == "session_verdicts":
                query = f"SELECT {columns} FROM v_session_summary WHERE session_id = ANY(%(ids)s)"
            elif result.view in ("v_whole_drop", "v_split_drop", "v_session_summary"):
                query = f"SELECT {columns} FROM {result.view} WHERE session_id = ANY(%(ids)s)"
            else:
                query = f"SELECT {columns} FROM {result.view}"
            out[name] = conn.execute(
                query, {"ids": sessions, "today": _today(), "final": list(FINAL_STATES)}
            ).fetchall()
    return out


# -- the comparison ----------------------------------------------------------------------------


def _pooled_median(name: str, column: str) -> bool:
    return column == "rtt_ms_median" and name in ("v_size_drop_all", "v_size_drop_by_source")


def assert_equal_to_postgres(
    archived: Archived, tables: dict[str, Any], expected: dict[str, list[dict[str, Any]]]
) -> None:
    assert set(tables) == set(RESULTS)
    for name, table in tables.items():
        keys = _KEYS[name]
        got = {tuple(r[k] for k in keys): r for r in table.to_pylist()}
        want = {tuple(r[k] for k in keys): r for r in expected[name]}
        assert len(got) == table.num_rows, (name, "a key twice")
        assert sorted(got, key=repr) == sorted(want, key=repr), name
        assert table.column_names == [c for c, _ in archive_analysis.RESULTS[name].columns]
        for key, w in want.items():
            g = got[key]
            for column, value in w.items():
                if _pooled_median(name, column) and value is not None:
                    # PostgreSQL's pooled median is the histogram's (every
                    # source's since 0028); the archive's is exact.
                    exact = g[column]
                    if w.get("source", "volunteer") == "volunteer":
                        assert repr(exact) == repr(archived.exact_medians[w["ip_len"]]), key
                    assert math.isclose(value, exact, rel_tol=MEDIAN_BOUND), (name, key)
                elif isinstance(value, float) or isinstance(g[column], float):
                    assert repr(g[column]) == repr(value), (name, key, column, g[column], value)
                else:
                    assert g[column] == value, (name, key, column, g[column], value)


@pytest.fixture(scope="module")
def expected(archived: Archived) -> dict[str, list[dict[str, Any]]]:
    out = postgres(archived.url, archived.sessions)
    # What makes the comparison worth something: the archive holds every
    # finished session, several verdicts, and both sources.
    assert len(out["v_session_summary"]) == len(archived.sessions) >= 10
    assert len({r["verdict"] for r in out["session_verdicts"]}) >= 2
    assert {r["source"] for r in out["v_size_drop_by_source"]} == {"volunteer", "atlas"}
    assert any(r["sessions"] > 1 for r in out["client_verdicts"])
    assert any(r["split_to_whole_ratio"] is not None for r in out["v_session_summary"])
    counts = ("whole_sent", "whole_acked", "split_sent", "split_acked")
    apart = [r for r in out["v_session_summary"] if _pow_apart(*(r[c] for c in counts))]
    assert [tuple(r[c] for c in counts) for r in apart] == [POW_APART]
    return out


def _read(out: Path) -> dict[str, Any]:
    return {name: pq.read_table(out / f"{name}.parquet") for name in RESULTS}


def _check_schemas(out: Path, archived: Archived, engine: str) -> None:
    for name, result in archive_analysis.RESULTS.items():
        data = out / f"{name}.parquet"
        schema = json.loads((out / f"{name}.parquet.schema.json").read_text())
        assert schema["result"] == name and schema["view"] == result.view
        assert schema["engine"]["name"] == engine
        assert schema["rows"] == pq.ParquetFile(data).metadata.num_rows
        assert schema["bytes"] == data.stat().st_size
        assert schema["sha256"] == archive.export.sha256_file(data)
        assert [c["name"] for c in schema["columns"]] == [c for c, _ in result.columns]
        assert {d["table"] for d in schema["archive"]["datasets"]} >= {
            "probe_outcomes", "sessions", "atlas_outcomes",
        }  # fmt: skip
        assert schema["archive"]["root"] == str(archived.root)


# -- the engines -------------------------------------------------------------------------------


def test_duckdb_equals_the_views(
    archived: Archived, expected: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    out = tmp_path / "duckdb"
    analysis = archive_analysis.analyze(archived.root, "duckdb", out)
    assert analysis.engine == "duckdb" and set(analysis.results) == set(RESULTS)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        f for n in RESULTS for f in (f"{n}.parquet", f"{n}.parquet.schema.json")
    )
    _check_schemas(out, archived, "duckdb")
    assert_equal_to_postgres(archived, _read(out), expected)


@pytest.fixture(scope="module")
def spark() -> Iterator[archive_analysis.SparkEngine]:
    engine = archive_analysis.SparkEngine("local[2]", conf=SPARK_TEST_CONF)
    try:
        yield engine
    finally:
        engine.close()


def test_spark_equals_the_views(
    archived: Archived,
    expected: dict[str, list[dict[str, Any]]],
    spark: archive_analysis.SparkEngine,
    tmp_path: Path,
) -> None:
    assert spark.master == "local[2]"
    out = tmp_path / "spark"
    analysis = archive_analysis.analyze(archived.root, spark, out)
    assert analysis.engine == "spark" and analysis.master == "local[2]"
    _check_schemas(out, archived, "spark")
    assert_equal_to_postgres(archived, _read(out), expected)


# -- the command, as a researcher runs it ----------------------------------------------------


def _no_database() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KICKASS_")}


def _analyze(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [KICKASS, "archive", "analyze", *args],
        capture_output=True, text=True, timeout=300, env=env or _no_database(),
    )  # fmt: skip


def test_the_command_on_a_copy_equals_the_views(
    archived: Archived, expected: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(archived.root, copy)
    out = tmp_path / "results"
    proc = _analyze(str(copy), "--engine", "duckdb", "-o", str(out), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["engine"] == "duckdb" and summary["out"] == str(out)
    assert {n: r["rows"] for n, r in summary["results"].items()} == {
        n: len(expected[n]) for n in RESULTS
    }
    assert_equal_to_postgres(Archived(archived.url, copy, archived.sessions,
                                      archived.exact_medians), _read(out), expected)  # fmt: skip
    # An existing output folder is never written into.
    again = _analyze(str(copy), "--engine", "duckdb", "-o", str(out))
    assert again.returncode == 2 and f"ERROR: {out} already exists" in again.stderr


def test_what_is_not_a_verified_archive_is_refused(
    archived: Archived, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(root: Path, engine: str = "duckdb") -> str:
        out = tmp_path / f"out-{secrets.token_hex(3)}"
        with pytest.raises(KickassError) as exc:
            archive_analysis.analyze(root, engine, out)
        assert not out.exists()
        return exc.value.render()

    assert f"ERROR: no archive at {tmp_path / 'nowhere'}" in refused(tmp_path / "nowhere")
    # A folder that is not an archive (the archive's parent, say).
    stray = tmp_path / "stray"
    (stray / "notes").mkdir(parents=True)
    assert f"ERROR: {stray} is not a verified archive" in refused(stray)
    # An archive without a probe day or a campaign has nothing to analyze.
    router_only = tmp_path / "router-only"
    shutil.copytree(archived.root / "router_telemetry", router_only / "router_telemetry")
    assert "holds no probe_outcomes day and no Atlas campaign" in refused(router_only)
    # No Java for Spark, or no engine library: said before anything starts.
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "no-java"))
    err = refused(archived.root, "spark")
    assert "ERROR: Spark needs Java" in err and "openjdk-17-jre-headless" in err
    monkeypatch.setitem(sys.modules, "duckdb", None)
    err = refused(archived.root)
    assert "ERROR: DuckDB is not installed" in err and "kickass-analysis[engines]" in err

    # The command says it as one error, no traceback: a damaged copy (one flipped byte).
    copy = tmp_path / "damaged"
    shutil.copytree(archived.root, copy)
    part = next((copy / "probe_outcomes").glob("day=*")) / archive.part_name(0)
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0x01
    part.write_bytes(bytes(data))
    out = tmp_path / "out"
    proc = _analyze(str(copy), "--engine", "duckdb", "-o", str(out))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()
    assert f"ERROR: {copy} is not a verified archive" in proc.stderr
    assert "its sha256 is not the manifest's" in proc.stderr
    assert f"hint: kickass archive verify {copy} names them all" in proc.stderr
