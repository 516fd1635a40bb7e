"""`kickass export`: the files equal the views, the filters equal a WHERE, memory
stays flat, and the command behaves (help, errors, --json, files that appear
whole or not at all under SIGINT, SIGTERM and SIGKILL).

The seeded database holds the study (tests/support/seed.py), trials, router
telemetry, Atlas campaigns and scheduled item runs, with NULLs, empty
strings, timestamps, jsonb, inet, numeric, real, and unicode, commas, quotes
and newlines in text. "Equal" is a sha256 over the sorted rows read back
(pyarrow for Parquet, pyarrow's CSV reader typed by the .schema.json for
CSV) against the same over the sorted rows of ``SELECT * FROM view`` read
directly with psycopg.
"""

from __future__ import annotations

import decimal
import hashlib
import importlib.util
import ipaddress
import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import kickass_db as db
import psycopg
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from kickass_analysis import export, export_cli, publish
from kickass_analysis.export import export_view
from kickass_core.errors import KickassError
from kickass_db.study_store import StudyStore
from kickass_testbed.pg import create_database, drop_database
from psycopg import sql
from sqlalchemy import make_url
from support.seed import seed_study, seed_trials

ROOT = Path(__file__).resolve().parents[2]
KICKASS = str(Path(sys.executable).with_name("kickass"))
NOW = datetime.now(UTC)
CAMPAIGN = "Zürich “test”, 2"


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The benchmark's seeding (INSERT ... SELECT generate_series through the real
# tables): CI runs the memory check on the same rows the benchmark uses.
bench = _load("export_bench", ROOT / "bench" / "export_bench.py")


# -- the seeded database ---------------------------------------------------------------


@pytest.fixture(scope="module")
def seeded(pg_server_url: str, _migrated_template: str) -> Iterator[str]:
    """One database for the module's read-only tests, seeded once."""
    name = f"test_export_{secrets.token_hex(4)}"
    try:
        url = create_database(pg_server_url, name, template=_migrated_template)
        with StudyStore(url) as store:
            seed_study(store, n_clients=14, rng=3, spread=timedelta(days=10), live=True)
        seed_trials(url, flows_per_period=12)
        bench.seed_telemetry_rows(url, 3000)
        with psycopg.connect(db.libpq_url(url)) as conn:
            _seed_oddities(conn)
            _seed_atlas(conn)
            _seed_item_runs(conn)
        yield url
    finally:
        drop_database(pg_server_url, name)


def _seed_oddities(conn: psycopg.Connection) -> None:
    """Text that CSV must quote and NULL that must stay apart from ''."""
    ids = [r[0] for r in conn.execute("SELECT id FROM sessions ORDER BY id LIMIT 4")]
    odd = ["β-0.1 “ü”, with a comma", "", 'line one\nline "two"', None]
    for pk, version in zip(ids, odd, strict=True):
        conn.execute("UPDATE sessions SET client_version = %s WHERE id = %s", (version, pk))
    trial = conn.execute("SELECT min(id) FROM trials").fetchone()
    assert trial is not None
    conn.execute("UPDATE trials SET destination = %s WHERE id = %s", ('fär-✓, "east"\n2', trial[0]))
    conn.execute(
        "UPDATE flows SET error = CASE WHEN id %% 3 = 0 THEN '' WHEN id %% 3 = 1 THEN %s END",
        ('timeout: ünacked, "gave up"',),
    )


def _seed_atlas(conn: psycopg.Connection) -> None:
    """Two Atlas campaigns (one with a unicode, comma and quote name), three probes
    (one with no ASN or country), whole and split outcomes, verdicts, spread over days."""
    campaigns = {1: "eu-1", 2: CAMPAIGN}
    for cid, name in campaigns.items():
        conn.execute(
            "INSERT INTO atlas_campaigns (id, name, definition, credit_budget) "
            "VALUES (%s, %s, %s, 100000)",
            (cid, name, json.dumps({"name": name, "note": 'ünï "q"'})),
        )
    for prb, asn, cc in ((101, 64500, "DE"), (102, None, None), (103, 64501, "CH")):
        conn.execute(
            "INSERT INTO atlas_probes (prb_id, asn_v4, country_code, meta) VALUES (%s, %s, %s, %s)",
            (prb, asn, cc, json.dumps({"tags": ["ü"]})),
        )
    msm = 5000
    for cid in campaigns:
        for phase, ip_len in (("whole", 576), ("whole", 1500), ("split", 1500)):
            msm += 1
            created = NOW - timedelta(days=3 * cid + (ip_len == 576))
            conn.execute(
                "INSERT INTO atlas_measurements (msm_id, campaign_id, key, phase, target, ip_len,"
                " size, packets, interval_s, packet_interval_ms, probes_requested, definition,"
                " estimated_credits, created_at, status_name)"
                " VALUES (%s, %s, %s, %s, '192.0.2.80', %s, %s, 16, 240, 1000, 3, %s, 96, %s, %s)",
                (msm, cid, f"{phase}-{ip_len}", phase, ip_len, ip_len - 28,
                 json.dumps({"af": 4, "ü": True}), created, None if cid == 2 else "Ongoing"),
            )  # fmt: skip
            for prb in (101, 102, 103):
                for r in range(2):
                    at = created + timedelta(minutes=4 * r + prb % 7)
                    conn.execute(
                        "INSERT INTO atlas_results (msm_id, prb_id, result_at, campaign_id,"
                        " join_status, raw) VALUES (%s, %s, %s, %s, 'exact', %s)",
                        (msm, prb, at, cid, json.dumps({"prb_id": prb})),
                    )
                    for k in range(16):
                        outcome = ("acked", "lost", "late", "unanswered")[(prb + k + r) % 7 % 4]
                        conn.execute(
                            "INSERT INTO atlas_outcomes (msm_id, prb_id, result_at, packet_index,"
                            " campaign_id, phase, ip_len, outcome, rtt_ms)"
                            " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)",
                            (msm, prb, at, k, cid, phase, ip_len, outcome,
                             12.345 + k if outcome == "acked" else None),
                        )  # fmt: skip
    for cid in campaigns:
        for prb in (101, 102, 103):
            conn.execute(
                "INSERT INTO atlas_verdicts (campaign_id, prb_id, whole_sent, whole_acked,"
                " split_sent, split_acked, verdict, verdict_reason, updated_at)"
                " VALUES (%s, %s, 64, %s, 32, %s, %s, 'seeded', %s)",
                (cid, prb, 60 - prb % 3, 0 if prb == 102 else 30,
                 "fragment-intolerant" if prb == 102 else "fragments-ok",
                 NOW - timedelta(days=cid + 2 * (prb - 100), hours=prb % 5)),
            )  # fmt: skip


def _seed_item_runs(conn: psycopg.Connection) -> None:
    """Scheduled runs: jsonb counts (nested, unicode) and a numeric duration."""
    for i in range(6):
        due = NOW - timedelta(hours=6 * i)
        finished = None if i == 0 else due + timedelta(seconds=3.25 * i)
        conn.execute(
            "INSERT INTO item_runs (item, kind, due_at, host, claimed_at, heartbeat_at,"
            " finished_at, outcome, reason, counts)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            (f"export-{i % 2}", "export", due, "höst-1", due, due, finished,
             "running" if i == 0 else ("failed" if i == 3 else "ok"),
             "disk full, \"retry\"" if i == 3 else None,
             json.dumps({"rows": {"v_flow_results": i * 10}, "note": "ü", "list": [1, None]})),
        )  # fmt: skip


# -- reading back and comparing ------------------------------------------------------------


def _schema(result: export.ExportResult) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(result.schema_path.read_text(encoding="utf-8"))
    return loaded


def _read_back(result: export.ExportResult) -> tuple[list[str], list[dict[str, Any]]]:
    """The exported file as rows of Python values, and its columns' PostgreSQL types."""
    columns = _schema(result)["columns"]
    pg_types = [c["postgresql_type"] for c in columns]
    if result.format == "parquet":
        table = pq.read_table(result.data_path)
    else:
        types = {c["name"]: _arrow_type(c["arrow_type"]) for c in columns}
        table = pacsv.read_csv(
            result.data_path,
            read_options=pacsv.ReadOptions(block_size=64 << 20),  # rows of a few MiB
            parse_options=pacsv.ParseOptions(newlines_in_values=True),
            convert_options=pacsv.ConvertOptions(
                column_types=types,
                strings_can_be_null=True,
                quoted_strings_can_be_null=False,
                null_values=[""],
                true_values=["t"],
                false_values=["f"],
            ),
        )
    assert table.column_names == [c["name"] for c in columns]
    return pg_types, table.to_pylist()


def _arrow_type(name: str) -> pa.DataType:
    return {
        "int64": pa.int64(),
        "double": pa.float64(),
        "bool": pa.bool_(),
        "timestamp[us, tz=UTC]": pa.timestamp("us", tz="UTC"),
        "timestamp[us]": pa.timestamp("us"),
        "date32[day]": pa.date32(),
        "string": pa.string(),
    }[name]


def _canon(value: Any, pg_type: str) -> Any:
    """One value, as a comparable plain value, whichever way it was read."""
    if value is None:
        return None
    if pg_type in ("json", "jsonb"):
        parsed = json.loads(value) if isinstance(value, str) else value
        return json.dumps(parsed, sort_keys=True, ensure_ascii=False)
    if isinstance(value, bool):
        return value
    if isinstance(value, float | decimal.Decimal):
        return repr(float(value))
    if isinstance(value, datetime):
        assert value.tzinfo is not None, "timestamps must be tz-aware"
        return value.astimezone(UTC).isoformat()
    if isinstance(value, ipaddress.IPv4Address | ipaddress.IPv6Address):
        return str(value)
    if isinstance(value, ipaddress.IPv4Interface | ipaddress.IPv6Interface):
        return str(value)
    return value


def _digest(pg_types: list[str], rows: list[tuple[Any, ...]]) -> tuple[str, list[str]]:
    lines = sorted(
        repr(tuple(_canon(v, t) for v, t in zip(row, pg_types, strict=True))) for row in rows
    )
    return hashlib.sha256("\n".join(lines).encode()).hexdigest(), lines


def _direct(url: str, query: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(db.libpq_url(url)) as conn:
        conn.execute("SET TIME ZONE 'UTC'")
        return conn.execute(query, params).fetchall()


def _assert_equal(result: export.ExportResult, expected: list[tuple[Any, ...]]) -> int:
    pg_types, back = _read_back(result)
    got_hash, got = _digest(pg_types, [tuple(r.values()) for r in back])
    want_hash, want = _digest(pg_types, expected)
    if got_hash != want_hash:
        diff = sorted(set(got) ^ set(want))[:5]
        raise AssertionError(f"{result.data_path.name}: rows differ, e.g. {diff}")
    assert result.rows == len(expected) == _schema(result)["rows"]
    return len(expected)


# -- the files equal the views --------------------------------------------------------------

VIEWS = [
    "v_session_summary",  # study outcomes: per session, inet, live sessions with NULLs
    "v_whole_drop",  # per session and size
    "v_flow_results",  # trials' flows: unicode destination, '' and NULL errors
    "v_router_telemetry",  # router: real, NULL leading fragment, unicode run name
    "v_atlas_whole_drop",  # Atlas: a probe with no ASN
    "v_verdicts_by_source",  # both sources, campaign with quotes and a comma
    "v_atlas_measurements",  # inet target, NULL status
    "v_item_runs",  # jsonb counts, numeric duration
]


@pytest.mark.parametrize("fmt", export.FORMATS)
@pytest.mark.parametrize("view", VIEWS)
def test_the_file_equals_the_view(seeded: str, tmp_path: Path, view: str, fmt: str) -> None:
    before = datetime.now(UTC)
    result = export_view(seeded, view, fmt, tmp_path)
    n = _assert_equal(result, _direct(seeded, f"SELECT * FROM {view}"))
    assert n > 0, f"{view} is empty in the seeded database: the test would prove nothing"

    schema = _schema(result)
    assert schema["view"] == view and schema["format"] == fmt
    assert schema["data_file"] == result.data_path.name
    assert result.schema_path.name == result.data_path.name + ".schema.json"
    assert schema["sha256"] == hashlib.sha256(result.data_path.read_bytes()).hexdigest()
    assert schema["bytes"] == result.data_path.stat().st_size == result.bytes
    revision = _direct(seeded, "SELECT version_num FROM alembic_version")[0][0]
    assert schema["alembic_revision"] == revision
    exported = datetime.fromisoformat(schema["exported_at"])
    assert before - timedelta(seconds=5) <= exported <= datetime.now(UTC)
    assert result.data_path.name == f"{view}-{exported.strftime('%Y%m%dT%H%M%SZ')}.{fmt}"
    assert schema["filters"] == {
        "since": None, "until": None, "source": None, "campaign": None, "time": None,
    }  # fmt: skip
    assert schema["query"].startswith("SELECT ") and f'"{view}"' in schema["query"]
    # Column names and PostgreSQL types as the catalogue has them.
    catalogue = _direct(
        seeded,
        "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
        "WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
        (view,),
    )
    assert [(c["name"], c["postgresql_type"]) for c in schema["columns"]] == catalogue
    if fmt == "parquet":
        file_schema = pq.read_schema(result.data_path)
        for c in schema["columns"]:
            assert str(file_schema.field(c["name"]).type) == c["arrow_type"]
    else:
        assert schema["csv"]["null"].startswith("an unquoted empty field")
    assert tmp_path.joinpath(result.data_path.name).exists()
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_types_nulls_and_text_survive(seeded: str, tmp_path: Path) -> None:
    """Not only equal as a whole: the awkward values are there, typed."""
    result = export_view(seeded, "v_session_summary", "parquet", tmp_path)
    table = pq.read_table(result.data_path)
    assert table.schema.field("created_at").type == pa.timestamp("us", tz="UTC")
    assert table.schema.field("whole_sent").type == pa.int64()
    assert table.schema.field("whole_drop_rate").type == pa.float64()
    assert table.schema.field("source_address").type == pa.string()
    versions = table.column("client_version").to_pylist()
    assert None in versions and "" in versions
    assert "β-0.1 “ü”, with a comma" in versions and 'line one\nline "two"' in versions
    assert table.column("finished_at").null_count > 0  # the live session

    csv_result = export_view(seeded, "v_session_summary", "csv", tmp_path)
    text = csv_result.data_path.read_text(encoding="utf-8")
    assert ',"",' in text  # the empty string, quoted
    assert '"line one\nline ""two"""' in text
    assert ",," in text  # NULLs: unquoted empty fields

    runs = pq.read_table(export_view(seeded, "v_item_runs", "parquet", tmp_path).data_path)
    assert runs.schema.field("counts").type == pa.string()  # jsonb as its JSON text
    assert runs.schema.field("duration_s").type == pa.float64()  # numeric
    counts = [json.loads(c) for c in runs.column("counts").to_pylist()]
    assert {"note": "ü", "list": [1, None]}.items() <= counts[0].items()

    telemetry = export_view(seeded, "v_router_telemetry", "parquet", tmp_path)
    assert pq.read_table(telemetry.data_path).column("leading_fragment_len").null_count == 1000

    # A real reads back as the number PostgreSQL prints (0.93456787, not 0.934567868...).
    flows = pq.read_table(export_view(seeded, "v_flow_results", "parquet", tmp_path).data_path)
    ids, fractions = flows.column("flow_id"), flows.column("ka_mode_fraction")
    got = dict(zip(ids.to_pylist(), fractions.to_pylist(), strict=True))
    printed = _direct(seeded, "SELECT flow_id, ka_mode_fraction::text FROM v_flow_results")
    assert {f: None if t is None else float(t) for f, t in printed} == got
    assert any(t and len(t) > 6 for _, t in printed)


@pytest.mark.parametrize("fmt", export.FORMATS)
def test_rows_over_many_blocks_and_rows_larger_than_a_block(
    seeded: str, database_url: str, tmp_path: Path, monkeypatch: Any, fmt: str
) -> None:
    """COPY's output goes to the file and to Arrow's parser in blocks of whole rows:
    with blocks of 100 bytes nearly every row (quotes, commas and newlines in its
    text included) is larger than a block, some 3 MiB, and the file still equals the
    view (Arrow's parser refuses a row spread over more than two of its reads)."""
    monkeypatch.setattr(export.readers, "COPY_BLOCK_BYTES", 100)
    for view in ("v_session_summary", "v_flow_results", "v_router_telemetry"):
        result = export_view(seeded, view, fmt, tmp_path)
        _assert_equal(result, _direct(seeded, f"SELECT * FROM {view}"))
    with psycopg.connect(db.libpq_url(database_url), autocommit=True) as conn:
        conn.execute(
            "CREATE VIEW v_export_wide AS SELECT g AS n, repeat(E'a,\\n\"', 1000 * g * g) AS t "
            "FROM generate_series(1, 30) AS g"
        )  # rows of 4 kB to 3.6 MB
    monkeypatch.setattr(export.readers, "COPY_BLOCK_BYTES", 1024 * 1024)
    result = export_view(database_url, "v_export_wide", fmt, tmp_path)
    _assert_equal(result, _direct(database_url, "SELECT * FROM v_export_wide"))


def test_server_settings_do_not_change_the_values(database_url: str, tmp_path: Path) -> None:
    """A database whose DateStyle, TimeZone and extra_float_digits differ from the
    defaults exports the same values: the export sets what its text depends on."""
    with psycopg.connect(db.libpq_url(database_url), autocommit=True) as conn:
        name = conn.execute("SELECT current_database()").fetchone()
        assert name is not None
        for setting, value in (("DateStyle", "SQL, DMY"), ("TimeZone", "Asia/Kathmandu"),
                               ("extra_float_digits", "-2")):  # fmt: skip
            conn.execute(
                sql.SQL("ALTER DATABASE {} SET {} = {}").format(
                    sql.Identifier(name[0]), sql.Identifier(setting), sql.Literal(value)
                )
            )
        conn.execute(
            "CREATE VIEW v_export_settings AS SELECT g AS n, "
            "timestamptz '2026-11-25 03:12:05.123456+00' + g * interval '1 day 1 ms' AS at, "
            "date '2026-02-03' + g AS day, 0.1::float8 * g + 1e-17 AS x, (g / 3.0)::real AS r "
            "FROM generate_series(1, 50) AS g"
        )
    at = datetime(2026, 11, 25, 3, 12, 5, 123456, UTC)
    day = datetime(2026, 2, 3).date()
    exact = [
        (n, at + n * timedelta(days=1, milliseconds=1), day + timedelta(days=n), 0.1 * n + 1e-17)
        for n in range(1, 51)
    ]
    for fmt in export.FORMATS:
        result = export_view(database_url, "v_export_settings", fmt, tmp_path)
        _, rows = _read_back(result)
        assert [(r["n"], r["at"], r["day"], r["x"]) for r in rows] == exact, fmt
        assert rows[2]["x"] == 0.30000000000000004  # all 17 digits, not extra_float_digits -2
        assert rows[0]["r"] == 0.33333334  # a real as PostgreSQL prints it by default


def test_a_value_parquet_cannot_hold_is_an_error_that_names_it(
    database_url: str, tmp_path: Path
) -> None:
    """An infinite timestamp has no place in timestamp[us]: the Parquet export stops
    with an error and a hint (CSV carries it), and leaves no file."""
    with psycopg.connect(db.libpq_url(database_url), autocommit=True) as conn:
        conn.execute(
            "CREATE VIEW v_export_infinite AS SELECT g AS n, CASE WHEN g = 40000 "
            "THEN 'infinity'::timestamptz ELSE now() END AS at FROM generate_series(1, 50000) AS g"
        )
    with pytest.raises(KickassError) as err:
        export_view(database_url, "v_export_infinite", "parquet", tmp_path)
    assert "does not fit its Parquet column" in err.value.message
    assert "infinity" in err.value.message
    assert err.value.hint and "--format csv" in err.value.hint
    assert list(tmp_path.iterdir()) == []
    result = export_view(database_url, "v_export_infinite", "csv", tmp_path)
    assert result.rows == 50_000 and b',"infinity"' in result.data_path.read_bytes()


@pytest.mark.parametrize("fmt", export.FORMATS)
def test_an_error_in_the_middle_of_a_view_is_an_error_and_no_file(
    database_url: str, tmp_path: Path, fmt: str
) -> None:
    """PostgreSQL fails after streaming rows (a division by zero at row 60,000): the
    export says so, leaves nothing, and the database takes the next export."""
    with psycopg.connect(db.libpq_url(database_url), autocommit=True) as conn:
        conn.execute(
            "CREATE VIEW v_export_fails AS SELECT g AS n, 1 / (g - 60000) AS x "
            "FROM generate_series(1, 100000) AS g"
        )
    with pytest.raises(KickassError) as err:
        export_view(database_url, "v_export_fails", fmt, tmp_path)
    assert err.value.message == "export of v_export_fails failed: division by zero"
    assert err.value.hint and "nothing was written" in err.value.hint
    assert list(tmp_path.iterdir()) == []
    assert export_view(database_url, "v_flow_summary", fmt, tmp_path).rows == 0


def test_an_empty_selection_is_a_valid_empty_file(seeded: str, tmp_path: Path) -> None:
    future = NOW + timedelta(days=400)
    for fmt in export.FORMATS:
        result = export_view(seeded, "v_flow_results", fmt, tmp_path, since=future)
        assert result.rows == 0
        pg_types, rows = _read_back(result)
        assert rows == [] and len(pg_types) > 10


# -- filters select exactly what a WHERE selects --------------------------------------------


def _window(url: str, query: str) -> tuple[datetime, datetime]:
    """Two times inside the span of a column, a third and two thirds of the way."""
    lo, hi = _direct(url, query)[0]
    return lo + (hi - lo) / 3, lo + 2 * (hi - lo) / 3


FILTER_CASES = [
    # (view, filters, the WHERE that must select the same rows; %(name)s are the filters)
    ("v_session_summary", {"since": "s", "until": "u"},
     "created_at >= %(since)s AND created_at < %(until)s"),
    ("v_session_summary", {"source": "volunteer"}, "true"),
    ("v_whole_drop", {"since": "s"},
     "session_id IN (SELECT session_id FROM sessions WHERE created_at >= %(since)s)"),
    ("v_split_drop", {"since": "s", "until": "u"},
     "session_id IN (SELECT session_id FROM sessions"
     " WHERE created_at >= %(since)s AND created_at < %(until)s)"),
    ("v_flow_results", {"until": "u"}, "started_at < %(until)s"),
    ("v_router_telemetry", {"since": "s", "until": "u"},
     "recorded_at >= %(since)s AND recorded_at < %(until)s"),
    ("v_verdicts_by_source", {"source": "atlas"}, "source = 'atlas'"),
    ("v_verdicts_by_source", {"source": "volunteer", "since": "s"},
     "source = 'volunteer' AND finished_at >= %(since)s"),
    ("v_verdicts_by_source", {"campaign": CAMPAIGN}, "campaign = %(campaign)s"),
    ("v_verdicts_by_source", {"source": "atlas", "campaign": "eu-1", "until": "u"},
     "source = 'atlas' AND campaign = %(campaign)s AND finished_at < %(until)s"),
    ("v_atlas_whole_drop", {"campaign": CAMPAIGN, "source": "atlas"}, "campaign = %(campaign)s"),
    ("v_atlas_measurements", {"since": "s"}, "created_at >= %(since)s"),
    ("v_split_drop_by_source", {"source": "volunteer"}, "source = 'volunteer'"),
    ("v_item_runs", {"since": "s", "until": "u"}, "due_at >= %(since)s AND due_at < %(until)s"),
    ("v_session_rollup", {"since": "s", "source": "volunteer"}, "created_at >= %(since)s"),
    ("v_verdicts_rollup", {"source": "atlas", "campaign": CAMPAIGN},
     "source = 'atlas' AND campaign = %(campaign)s"),
]  # fmt: skip

TIME_SPANS = {
    "v_session_summary": "SELECT min(created_at), max(created_at) FROM v_session_summary",
    "v_whole_drop": "SELECT min(created_at), max(created_at) FROM sessions",
    "v_split_drop": "SELECT min(created_at), max(created_at) FROM sessions",
    "v_flow_results": "SELECT min(started_at), max(started_at) FROM v_flow_results",
    "v_router_telemetry": "SELECT min(recorded_at), max(recorded_at) FROM v_router_telemetry",
    "v_verdicts_by_source": "SELECT min(finished_at), max(finished_at) FROM v_verdicts_by_source",
    "v_atlas_measurements": "SELECT min(created_at), max(created_at) FROM v_atlas_measurements",
    "v_item_runs": "SELECT min(due_at), max(due_at) FROM v_item_runs",
    "v_session_rollup": "SELECT min(created_at), max(created_at) FROM v_session_rollup",
}


@pytest.mark.parametrize(("view", "filters", "where"), FILTER_CASES)
def test_filters_select_what_a_where_selects(
    seeded: str, tmp_path: Path, view: str, filters: dict[str, str], where: str
) -> None:
    values: dict[str, Any] = dict(filters)
    if "since" in filters or "until" in filters:
        since, until = _window(seeded, TIME_SPANS[view])
        values["since"], values["until"] = since, until
    kwargs = {k: values[k] for k in filters}
    expected = _direct(seeded, f"SELECT * FROM {view} WHERE {where}", values)
    everything = _direct(seeded, f"SELECT count(*) FROM {view}")[0][0]
    assert expected, f"{view} {filters}: the filter selects nothing here, proving nothing"
    if "since" in filters or "until" in filters or "campaign" in filters:
        assert len(expected) < everything, "the filter must leave something out"
    for fmt in export.FORMATS:
        result = export_view(seeded, view, fmt, tmp_path, **kwargs)
        _assert_equal(result, expected)
        name = result.data_path.name
        for key in ("since", "until"):
            if key in kwargs:
                assert f"-{key}{kwargs[key].strftime('%Y%m%dT%H%M%SZ')}-" in name
        if "source" in kwargs:
            assert f"{view}-{kwargs['source']}-" in name
        if "campaign" in kwargs:
            assert "-campaign-" in name and "/" not in name and " " not in name
        recorded = _schema(result)["filters"]
        for key, value in kwargs.items():
            expect = value.isoformat() if isinstance(value, datetime) else value
            assert recorded[key] == expect


def test_consecutive_windows_neither_overlap_nor_leave_gaps(seeded: str, tmp_path: Path) -> None:
    """What the scheduled export does: [a, b) then [b, c) is [a, c)."""
    a, b = _window(seeded, TIME_SPANS["v_router_telemetry"])
    # A sample exactly on the boundary belongs to the second window only.
    b = _direct(seeded, "SELECT min(recorded_at) FROM v_router_telemetry WHERE recorded_at >= %s",
                (b,))[0][0]  # fmt: skip
    first = export_view(seeded, "v_router_telemetry", "parquet", tmp_path, since=a, until=b)
    second = export_view(seeded, "v_router_telemetry", "parquet", tmp_path, since=b)
    rows = pq.read_table(first.data_path).to_pylist() + pq.read_table(second.data_path).to_pylist()
    times = [r["recorded_at"] for r in rows]
    assert len(times) == len(set(times)) and b in times
    want = _direct(seeded, "SELECT count(*) FROM v_router_telemetry WHERE recorded_at >= %s", (a,))
    assert len(times) == want[0][0]


def test_naive_times_are_utc(seeded: str, tmp_path: Path) -> None:
    since, _ = _window(seeded, TIME_SPANS["v_router_telemetry"])
    naive = since.astimezone(UTC).replace(tzinfo=None)
    as_utc = export_view(seeded, "v_router_telemetry", "csv", tmp_path, since=since)
    as_naive = export_view(seeded, "v_router_telemetry", "parquet", tmp_path, since=naive)
    assert as_utc.rows == as_naive.rows > 0


@pytest.mark.parametrize(
    ("view", "kwargs", "message", "hint"),
    [
        ("v_nope", {}, "no exportable view 'v_nope'", "v_session_summary"),
        ("sessions", {}, "no exportable view 'sessions'", "v_flow_results"),
        ("v_whole_drop; DROP TABLE flows", {}, "no exportable view", "v_whole_drop"),
        ("v_size_drop_all", {"since": NOW}, "no time column", "v_flow_results"),
        ("v_session_summary", {"source": "atlas"}, "only volunteer rows", "_by_source"),
        ("v_flow_results", {"source": "volunteer"}, "no study source's rows", "_by_source"),
        ("v_flow_results", {"campaign": "eu-1"}, "no campaign column", "v_atlas_whole_drop"),
        ("v_flow_results", {"since": NOW, "until": NOW}, "is not before", "since <= time"),
        ("v_flow_results", {"source": "mars"}, "unknown source", "volunteer"),
    ],
)
def test_refusals_are_errors_with_a_hint(
    seeded: str, tmp_path: Path, view: str, kwargs: dict[str, Any], message: str, hint: str
) -> None:
    with pytest.raises(KickassError) as err:
        export_view(seeded, view, "csv", tmp_path, **kwargs)
    assert message in err.value.message
    assert err.value.hint and hint in err.value.hint
    assert list(tmp_path.iterdir()) == []
    assert _direct(seeded, "SELECT count(*) FROM flows")[0][0] > 0


def test_unknown_format_and_unreachable_database(tmp_path: Path) -> None:
    with pytest.raises(KickassError, match="unknown export format"):
        export_view("postgresql://x@/y?host=/nonexistent", "v_flow_results", "xlsx", tmp_path)
    with pytest.raises(KickassError, match="cannot reach the database"):
        export_view("postgresql://x@/y?host=/nonexistent", "v_flow_results", "csv", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_directory_is_an_error(seeded: str, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(KickassError, match="cannot write the export of v_flow_results"):
        export_view(seeded, "v_flow_results", "parquet", blocker / "exports")
    assert list(tmp_path.iterdir()) == [blocker]


def test_every_view_the_module_knows_exists_and_every_view_exports(
    seeded: str, tmp_path: Path
) -> None:
    views = export.exportable_views(seeded)
    known = export.views()
    assert set(known) <= set(views), "a view in export.views() was renamed or dropped"
    for view in views:
        spec = known.get(view)
        columns = {r[0] for r in _direct(
            seeded, "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass "
            "AND attnum > 0", (view,))}  # fmt: skip
        if spec and spec.time:
            assert spec.time in columns, f"{view}: no column {spec.time}"
        if spec and spec.session_time:
            assert "session_id" in columns
        result = export_view(seeded, view, "parquet", tmp_path)
        assert result.rows == _direct(seeded, f"SELECT count(*) FROM {view}")[0][0]
    assert export_cli.FORMATS == export.FORMATS


def test_the_views_only_reader_role_can_export(seeded: str, tmp_path: Path) -> None:
    """Filters read views, never tables: the role dashboards and notebooks use can export."""
    grant_reader = _load("grant_reader", ROOT / "docker" / "grant_reader.py").grant_reader
    role = f"kickass_reader_{secrets.token_hex(4)}"
    url = db.libpq_url(seeded)
    with psycopg.connect(url, autocommit=True) as admin:
        grant_reader(admin, role)
        try:
            reader = make_url(url).set(username=role, password=None)
            reader_url = reader.render_as_string(hide_password=False)
            since, _ = _window(seeded, TIME_SPANS["v_whole_drop"])
            result = export_view(reader_url, "v_whole_drop", "parquet", tmp_path, since=since)
            where = "session_id IN (SELECT session_id FROM sessions WHERE created_at >= %s)"
            _assert_equal(result, _direct(seeded, f"SELECT * FROM v_whole_drop WHERE {where}",
                                          (since,)))  # fmt: skip
            assert _schema(result)["alembic_revision"] is None  # it may not read alembic_version
        finally:
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_an_existing_file_is_never_replaced(seeded: str, tmp_path: Path, monkeypatch: Any) -> None:
    first = export_view(seeded, "v_flow_summary", "csv", tmp_path)
    before = first.data_path.read_bytes()
    # The same name again (the same view and filters in the same second).
    monkeypatch.setattr(export.files, "_stamp", lambda t: first.data_path.stem.rsplit("-", 1)[1])
    with pytest.raises(KickassError, match="already exists"):
        export_view(seeded, "v_flow_summary", "csv", tmp_path)
    assert first.data_path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [first.data_path.name, first.schema_path.name]
    )


def test_a_window_is_published_once_whatever_the_attempts(seeded: str, tmp_path: Path) -> None:
    """Named by its window (not the clock), an export of a window already
    published is not done again: the publication is returned, and the folder
    holds one data file and its schema, whatever the number of attempts."""
    a, b = _window(seeded, TIME_SPANS["v_router_telemetry"])
    name = export.window_name("v_router_telemetry", "csv", a, b)
    assert name == (
        f"v_router_telemetry-since{a.astimezone(UTC):%Y%m%dT%H%M%SZ}"
        f"-until{b.astimezone(UTC):%Y%m%dT%H%M%SZ}.csv"
    )
    first = export_view(seeded, "v_router_telemetry", "csv", tmp_path, since=a, until=b,
                        name=name, tag="r1a1")  # fmt: skip
    before = first.data_path.read_bytes()
    again = export_view(seeded, "v_router_telemetry", "csv", tmp_path, since=a, until=b,
                        name=name, tag="r1a2")  # fmt: skip
    assert (first.already_published, again.already_published) == (False, True)
    assert (again.data_path, again.rows, again.sha256) == (
        first.data_path, first.rows, first.sha256
    )  # fmt: skip
    assert first.data_path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [name, name + ".schema.json"]
    whole = export.window_name("v_flow_summary", "parquet", at=b)
    assert whole == f"v_flow_summary-at{b.astimezone(UTC):%Y%m%dT%H%M%SZ}.parquet"


def test_a_schema_left_alone_by_a_dead_attempt_is_replaced(seeded: str, tmp_path: Path) -> None:
    """An attempt killed between its two links left the schema without its
    data file: the next attempt's schema replaces it and its data follows."""
    name = export.window_name("v_flow_summary", "csv", at=datetime(2026, 11, 25, tzinfo=UTC))
    orphan = tmp_path / (name + ".schema.json")
    orphan.write_text('{"view": "v_flow_summary", "rows": -1}\n')
    result = export_view(seeded, "v_flow_summary", "csv", tmp_path, name=name)
    assert not result.already_published and result.data_path.exists()
    schema = json.loads(orphan.read_text())
    assert schema["rows"] == result.rows and schema["sha256"] == result.sha256
    # A data file its schema does not describe is not taken for an export.
    orphan.write_text('{"view": "v_flow_summary", "rows": -1}\n')
    with pytest.raises(KickassError, match="does not describe it"):
        export_view(seeded, "v_flow_summary", "csv", tmp_path, name=name)


def test_sweep_removes_the_partial_files_of_dead_writers_only(tmp_path: Path) -> None:
    final = tmp_path / "v_x-until20261125T000000Z.csv"
    dead = publish.partial_path(final, "r7a1")
    live = publish.partial_path(final, "r7a2")
    manual = publish.partial_path(final, "31337")
    for p, size in ((dead, 10), (live, 20), (manual, 30)):
        p.write_bytes(b"x" * size)
    (tmp_path / "v_x.csv").write_bytes(b"published")
    (tmp_path / ".hidden-but-not-partial").write_bytes(b"keep")
    swept = publish.sweep(tmp_path, lambda tag: tag == "r7a1")
    assert swept.files == [dead.name] and swept.bytes == 10
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [live.name, manual.name, "v_x.csv", ".hidden-but-not-partial"]
    )
    assert publish.partial_of(dead) == (final.name, "r7a1")
    assert publish.partial_of(final) is None
    with pytest.raises(ValueError):
        publish.partial_path(final, "../x")
    # Publishing never replaces: a second publisher is told, its file stays its own.
    first, second = publish.partial_path(final, "a"), publish.partial_path(final, "b")
    first.write_bytes(b"one")
    second.write_bytes(b"two")
    assert publish.publish(first, final) and not publish.publish(second, final)
    assert final.read_bytes() == b"one"


def test_progress_is_reported_for_long_exports(
    seeded: str, tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setattr(export.readers, "PROGRESS_EVERY_S", 0.0)
    for fmt in export.FORMATS:
        seen: list[tuple[int, float]] = []

        def progress(rows: int, seconds: float, seen: list[tuple[int, float]] = seen) -> None:
            seen.append((rows, seconds))

        result = export_view(seeded, "v_router_telemetry", fmt, tmp_path, progress=progress)
        assert len(seen) >= 2 and seen[-1][0] == result.rows
        assert [r for r, _ in seen] == sorted(r for r, _ in seen)


# -- constant memory -------------------------------------------------------------------------

RSS_SLACK_MIB = bench.RSS_GOAL_MIB


def _peak_rss_mib(url: str, fmt: str, directory: Path) -> tuple[int, float]:
    run = bench.run_export(url, "v_whole_drop", fmt, directory)
    return run["rows"], run["peak_rss_mib"]


def test_memory_stays_flat_from_10k_to_100k_probe_rows(database_url: str, tmp_path: Path) -> None:
    """The exporter (`kickass export` in a child, its peak RSS from wait4) needs no more
    memory for 100 thousand probe rows than for 10 thousand, give or take one Parquet
    row group being filled (ROW_GROUP_BYTES)."""
    bench.seed_probe_rows(database_url, 10_000)
    small = {fmt: _peak_rss_mib(database_url, fmt, tmp_path) for fmt in export.FORMATS}
    bench.seed_probe_rows(database_url, 90_000, start=10_000)
    large = {fmt: _peak_rss_mib(database_url, fmt, tmp_path) for fmt in export.FORMATS}
    for fmt in export.FORMATS:
        assert small[fmt][0] == 10_000 and large[fmt][0] == 100_000
        growth = large[fmt][1] - small[fmt][1]
        assert growth <= RSS_SLACK_MIB, f"{fmt}: {small[fmt][1]} -> {large[fmt][1]} MiB"
    assert list(tmp_path.iterdir()) == []


# -- the command ----------------------------------------------------------------------------


def _kickass(*args: str, url: str | None = None, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("KICKASS_DATABASE_URL", "KICKASS_CONFIG")
    }
    if url:
        env["KICKASS_DATABASE_URL"] = url
    return subprocess.run(
        [KICKASS, *args], capture_output=True, text=True, env=env, timeout=120, **kwargs
    )


def test_help_lists_the_command_and_its_options() -> None:
    top = _kickass("--help")
    assert top.returncode == 0 and "export" in top.stdout
    out = _kickass("export", "--help")
    assert out.returncode == 0
    for word in (
        "VIEW",
        "--format",
        "{csv,parquet}",
        "--since",
        "--until",
        "--source",
        "--campaign",
        "--json",
        "--database-url",
        "-o DIR",
        "since <= time < until",
    ):
        assert word in out.stdout, word  # fmt: skip


def test_the_command_refuses_with_an_error_and_a_hint(seeded: str, tmp_path: Path) -> None:
    out = _kickass("export", "v_nope", "--format", "csv", "-o", str(tmp_path), url=seeded)
    assert out.returncode == 2
    assert out.stderr.startswith("ERROR: no exportable view 'v_nope'\nhint: exportable views: ")
    assert "v_session_summary" in out.stderr and "Traceback" not in out.stderr
    out = _kickass("export", "v_flow_results", "--format", "csv", "-o", str(tmp_path))
    assert out.returncode == 2 and out.stderr.startswith("ERROR: no database URL given")
    out = _kickass("export", "v_flow_results", "--format", "csv", "--since", "yesterday")
    assert out.returncode == 2 and "not an ISO 8601 time" in out.stderr
    out = _kickass("export", "v_flow_results", "--format", "xls")
    assert out.returncode == 2 and "invalid choice" in out.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_command_prints_a_json_summary(seeded: str, tmp_path: Path) -> None:
    since, _ = _window(seeded, TIME_SPANS["v_flow_results"])
    until = (NOW + timedelta(days=1)).replace(microsecond=0)
    out = _kickass(
        "export", "v_flow_results", "--format", "parquet", "--json", "-o", str(tmp_path / "new"),
        "--since", since.isoformat(), "--until", until.strftime("%Y-%m-%dT%H:%M:%S.%f"),
        url=seeded,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert set(summary) == {
        "view", "format", "path", "schema_path", "rows", "bytes", "seconds", "rows_per_s",
        "sha256", "exported_at", "alembic_revision", "filters",
    }  # fmt: skip
    assert summary["view"] == "v_flow_results" and summary["format"] == "parquet"
    assert summary["filters"] == {
        "since": since.isoformat(), "until": until.isoformat(), "source": None, "campaign": None,
    }  # fmt: skip
    path = Path(summary["path"])
    assert path.parent == tmp_path / "new" and Path(summary["schema_path"]).exists()
    assert pq.read_metadata(path).num_rows == summary["rows"] > 0
    assert summary["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert isinstance(summary["seconds"], float) and summary["bytes"] == path.stat().st_size
    want = _direct(seeded, "SELECT count(*) FROM v_flow_results "
                   "WHERE started_at >= %s AND started_at < %s", (since, until))  # fmt: skip
    assert summary["rows"] == want[0][0]
    plain = _kickass("export", "v_flow_summary", "--format", "csv", "-o", str(tmp_path), url=seeded)
    assert plain.returncode == 0 and plain.stdout.startswith("exported ")
    assert "rows of v_flow_summary to " in plain.stdout


SLOW_VIEW = """
CREATE VIEW v_export_slow AS
SELECT g AS n, now() AS at, repeat('x', 200) AS pad, pg_sleep(0.001) IS NULL AS slept
FROM generate_series(1, 60000) AS g
"""


@pytest.mark.parametrize("fmt", export.FORMATS)
@pytest.mark.parametrize(
    "sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["SIGINT", "SIGTERM", "SIGKILL"]
)
def test_a_killed_export_leaves_no_file_under_a_final_name(
    database_url: str, tmp_path: Path, monkeypatch: Any, fmt: str, sig: signal.Signals
) -> None:
    """Stopped in the middle (rows already streamed: its progress said so), the export
    leaves no data or schema file; Ctrl-C and SIGTERM also remove the partial file."""
    with psycopg.connect(db.libpq_url(database_url), autocommit=True) as conn:
        conn.execute(SLOW_VIEW)  # a v_* view is exportable: ~1000 rows/s for a minute
    env = {**os.environ, "KICKASS_DATABASE_URL": database_url}
    child = subprocess.Popen(
        [KICKASS, "export", "v_export_slow", "--format", fmt, "-o", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        # Ctrl-C's default, whatever this process inherited (a job started in the
        # background of a shell ignores SIGINT, and so would the export).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        assert child.stderr is not None
        line = child.stderr.readline()  # the first progress line, after ~2 s
        assert line.startswith("export v_export_slow: ") and " rows/s)" in line, line
        partial = [p.name for p in tmp_path.iterdir()]
        assert len(partial) == 1 and partial[0].startswith(".v_export_slow-")
        assert ".partial-" in partial[0]
        child.send_signal(sig)
        rc = child.wait(timeout=30)
        rest = child.stderr.read()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    names = [p.name for p in tmp_path.iterdir()]
    assert not [n for n in names if not n.startswith(".")], names  # no final name, ever
    if sig == signal.SIGKILL:
        assert rc == -signal.SIGKILL
    else:
        assert rc == 130 and "interrupted" in rest and "Traceback" not in rest, rest
        assert names == []  # the partial file removed too
    # The database is still usable, and an export completes when left alone.
    with psycopg.connect(db.libpq_url(database_url), autocommit=True) as conn:
        conn.execute(SLOW_VIEW.replace("v_export_slow", "v_export_quick").replace("60000", "300"))
    result = export_view(database_url, "v_export_quick", fmt, tmp_path)
    assert result.rows == 300 and result.data_path.exists()
