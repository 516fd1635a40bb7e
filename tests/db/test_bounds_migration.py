"""The bounds of every number a reader computes with, as CHECK constraints
(kickass_core.bounds, the migration named *_bounds.py): what the database
holds is what the table says, a row already out of bounds is quarantined
and reported rather than failing the upgrade, every reader reads what is
left, and a downgrade puts every quarantined row back as it was."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
from kickass_core import bounds, cli
from kickass_db import libpq_url
from kickass_db.base import check_bounds

REPO = Path(__file__).resolve().parents[2]
MIGRATION = next((REPO / "db/migrations/versions").glob("*_bounds.py"))
REVISION = MIGRATION.name.split("_", 1)[0]
_DOWN = re.search(r'^down_revision: str \| None = "(\d+)"', MIGRATION.read_text(), re.M)
assert _DOWN is not None
BEFORE = _DOWN.group(1)
KICKASS = str(Path(sys.executable).parent / "kickass")

TRIAL_ID, OTHER_TRIAL_ID = "ab" * 16, "cd" * 16
# What the migration must find in the rows ``seed`` writes: (table, columns
# out of bounds, action) -> rows. A removed row takes the rows that belong
# to it along (no columns of their own, or nulled ones: removed whole).
EXPECTED = {
    ("router_telemetry", ("t",), "removed"): 2,  # t = 1e300, t = NaN
    ("router_telemetry", ("output_rate_bps",), "nulled"): 1,  # Infinity
    ("router_telemetry", ("rtt_ms",), "nulled"): 1,  # -1
    ("router_runs", ("capacity_bps",), "nulled"): 1,  # NaN
    ("router_runs", ("started_at",), "removed"): 1,  # 'infinity'
    ("router_telemetry", (), "removed"): 1,  # that run's sample
    ("flows", ("fct_ms",), "nulled"): 1,  # 1e308
    ("flows", ("size_bytes",), "removed"): 1,  # 2^50
    ("trial_periods", ("duration_s",), "removed"): 1,  # Infinity
    ("trials", ("started_at",), "removed"): 1,  # year 9999
    ("trial_periods", (), "removed"): 1,  # that trial's period
    ("flows", ("fct_ms",), "removed"): 1,  # that trial's flow, 1e308 of its own
    ("probe_outcomes", ("rtt_ms",), "nulled"): 1,  # -Infinity
    ("atlas_outcomes", ("rtt_ms",), "nulled"): 1,  # NaN
}
TABLES = sorted({t for t, _, _ in EXPECTED} | {"sessions", "atlas_results"})


def seed(conn: psycopg.Connection) -> None:
    """A little of everything at the revision before, good rows and bad ones."""
    ex = conn.execute
    ex("""INSERT INTO router_runs (id, run_name, router_kind, capacity_bps, options, started_at)
          VALUES (1, 'edge', 'kickass', 'NaN', '{}', now() - interval '1 hour'),
                 (2, 'edge', 'kickass', 1e7, '{}', 'infinity')""")
    for i, (run, t, out, rtt) in enumerate(
        [(1, "0.01", "1e6", "10"), (1, "0.02", "1e6", "11"), (1, "1e300", "1e6", "12"),
         (1, "'NaN'", "1e6", "13"), (1, "0.05", "'Infinity'", "14"), (1, "0.06", "1e6", "-1"),
         (2, "0.01", "1e6", "10")]
    ):  # fmt: skip
        ex(f"""INSERT INTO router_telemetry (run_id, t, recorded_at, advertised_rate_bps,
                   input_rate_bps, output_rate_bps, queue_bytes, marking_mode, rtt_ms, drops,
                   fragmented)
               VALUES ({run}, {t}, now(), 5e6, 4e6, {out}, {i}, 'kickass', {rtt}, 0, 0)""")
    ex(f"""INSERT INTO trials (id, trial_id, destination, access_capacity_bps, parameters,
               versions, started_at)
           VALUES (1, '{TRIAL_ID}', 'far-1', 1e7, '{{}}', '{{}}', now() - interval '1 hour'),
                  (2, '{OTHER_TRIAL_ID}', 'far-1', 1e7, '{{}}', '{{}}', '9999-12-31')""")
    ex("""INSERT INTO trial_periods (trial_pk, period_index, pair, protocol, start_offset_s,
               duration_s, arm)
           VALUES (1, 0, 0, 'tcp', 0, 60, 'tcp:cubic'), (1, 1, 0, 'kickass', 60, 'Infinity',
                   'kickass'), (2, 0, 0, 'tcp', 0, 60, 'tcp:cubic')""")
    for i, (trial, size, fct) in enumerate(
        [(1, 1440, "12.5"), (1, 1440, "1e308"), (1, 2**50, "20"), (2, 1440, "1e308")]
    ):
        tid = TRIAL_ID if trial == 1 else OTHER_TRIAL_ID
        ex(f"""INSERT INTO flows (id, flow_id, trial_pk, period_index, protocol, size_bytes,
                   size_packets, started_at, completed, fct_ms, arm, pair)
               VALUES ({i + 1}, '{tid}-{i}', {trial}, 0, 'tcp', {size}, 1, now(), true, {fct},
                       'tcp:cubic', 0)""")
    ex("""INSERT INTO sessions (id, session_id, state, plan, server_version)
          VALUES (1, '0123456789abcdef', 'complete', '{}', 't')""")
    ex("""INSERT INTO probe_outcomes (session_pk, seq, phase, ip_len, sent_at, outcome, rtt_ms)
          VALUES (1, 0, 'whole', 1500, now(), 'acked', 20), (1, 1, 'whole', 1500, now(),
                  'acked', '-Infinity')""")
    ex("""INSERT INTO atlas_campaigns (id, name, definition, credit_budget)
          VALUES (1, 'c', '{}', 1000)""")
    ex("""INSERT INTO atlas_measurements (msm_id, campaign_id, key, phase, target, ip_len, size,
              packets, interval_s, packet_interval_ms, probes_requested, definition,
              estimated_credits)
          VALUES (7, 1, 'whole-1500', 'whole', '192.0.2.1', 1500, 1472, 2, 60, 100, 1, '{}', 2)""")
    ex("""INSERT INTO atlas_results (msm_id, prb_id, result_at, campaign_id, join_status, raw)
          VALUES (7, 9, now(), 1, 'exact', '{}')""")
    ex("""INSERT INTO atlas_outcomes (msm_id, prb_id, result_at, packet_index, campaign_id,
              phase, ip_len, outcome, rtt_ms)
          SELECT 7, 9, result_at, i, 1, 'whole', 1500, 'acked', r
          FROM atlas_results, (VALUES (0, 30::real), (1, 'NaN'::real)) v(i, r)""")


def dump(conn: psycopg.Connection) -> dict[str, list[str]]:
    """Every row of the tables above, as JSON text (NaN kept as "NaN")."""
    return {
        t: sorted(r[0] for r in conn.execute(f"SELECT to_jsonb(x)::text FROM {t} x").fetchall())
        for t in TABLES
    }


def kickass(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KICKASS_CONFIG": ""}
    return subprocess.run(
        [KICKASS, *argv], capture_output=True, text=True, env=env, timeout=120, check=False
    )


def report(url: str, tmp_path: Path) -> int:
    return cli.main(["report", "--database-url", url, "-o", str(tmp_path / "report.html")])


def test_rows_out_of_bounds_are_quarantined_reported_and_put_back(
    empty_database_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = empty_database_url
    assert kickass("db", "upgrade", BEFORE, "--database-url", url).returncode == 0
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        seed(conn)
        before = dump(conn)
    # What the database accepted, the report could not read.
    with pytest.raises(Exception, match="out of range"):
        report(url, tmp_path)

    up = kickass("db", "upgrade", "--database-url", url)
    assert up.returncode == 0, up.stderr
    assert "Traceback" not in up.stderr
    for (table, columns, action), n in EXPECTED.items():
        if not columns:
            assert f"{n} rows of {table} removed with the row they belong to" in up.stderr
            continue
        what = "row removed" if action == "removed" else "value set to NULL"
        assert f"{table}.{columns[0]} out of bounds in {n} rows: {what}" in up.stderr, up.stderr

    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        kept = conn.execute(
            'SELECT table_name, columns, action, "row", revision FROM quarantine ORDER BY id'
        ).fetchall()
        found: dict[tuple[str, tuple[str, ...], str], int] = {}
        for table, columns, action, _, _ in kept:
            key = (table, tuple(columns), action)
            found[key] = found.get(key, 0) + 1
        assert found == EXPECTED
        assert {r for *_, r in kept} == {REVISION}
        # Each row as it was: the bad value too.
        assert {repr(float(row["t"])) for _, cols, _, row, _ in kept if cols == ["t"]} == {
            "1e+300",
            "nan",
        }
        assert conn.execute("SELECT count(*) FROM router_telemetry").fetchone() == (4,)
        assert conn.execute(
            "SELECT count(*) FROM router_telemetry WHERE output_rate_bps IS NULL"
        ).fetchone() == (1,)
        assert conn.execute("SELECT fct_ms FROM flows ORDER BY id").fetchall() == [(12.5,), (None,)]
        assert conn.execute("SELECT id, capacity_bps FROM router_runs").fetchall() == [(1, None)]
        assert conn.execute("SELECT id FROM trials").fetchall() == [(1,)]
        # No writer gets past the table any more.
        for bad in ("'NaN'", "'Infinity'", "1e308", "-1"):
            with pytest.raises(psycopg.errors.CheckViolation):
                conn.execute(f"UPDATE flows SET fct_ms = {bad} WHERE id = 1")
        for bad in ("'infinity'", "'9999-12-31'", "'1969-12-31'"):
            with pytest.raises(psycopg.errors.CheckViolation):
                conn.execute(f"UPDATE trials SET started_at = {bad} WHERE id = 1")
    capsys.readouterr()
    assert report(url, tmp_path) == 0

    down = kickass("db", "downgrade", BEFORE, "--database-url", url)
    assert down.returncode == 0, down.stderr
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        assert dump(conn) == before


def test_the_checks_are_the_bounds_table(database_url: str) -> None:
    """What the database holds at head is what ``kickass_core.bounds`` says
    today (the migration wrote its constraints out; a bound moved later
    needs a migration of its own, and fails here until it has one)."""
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        held: dict[str, str] = dict(
            conn.execute(
                "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
                "WHERE contype = 'c' AND conname LIKE 'ck_%_bounds'"
            ).fetchall()
        )
        wanted: dict[str, Any] = {}
        for table in bounds.TABLES:
            for f in bounds.checked(table):
                name = f"ck_{table}_{f.name}_bounds"
                # PostgreSQL's own rendering of the table's SQL, on a copy of the table.
                conn.execute(f"CREATE TEMP TABLE IF NOT EXISTS c_{table} (LIKE {table})")
                conn.execute(
                    f"ALTER TABLE c_{table} ADD CONSTRAINT {name} CHECK ({check_bounds(f)})"
                )
                (wanted[name],) = conn.execute(
                    "SELECT pg_get_constraintdef(oid) FROM pg_constraint "
                    "WHERE conname = %s AND conrelid = %s::regclass",
                    (name, f"c_{table}"),
                ).fetchone() or (None,)
    assert held == wanted
