"""The handshake of flows and trial periods as a CHECK (migration 0024): a
value outside the flow record's handshakes, stored before, is quarantined,
NULLed and reported; no writer gets one in after; the downgrade puts it back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from kickass_core.flow_record import HANDSHAKES
from kickass_db import libpq_url

KICKASS = str(Path(sys.executable).parent / "kickass")
TRIAL_ID = "ef" * 16


def kickass(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KICKASS_CONFIG": ""}
    return subprocess.run(
        [KICKASS, *argv], capture_output=True, text=True, env=env, timeout=120, check=False
    )


def dump(conn: psycopg.Connection) -> list[tuple[object, ...]]:
    return conn.execute("""
        SELECT 'flow', id::text, handshake FROM flows
        UNION ALL SELECT 'period', period_index::text, handshake FROM trial_periods
        ORDER BY 1, 2""").fetchall()


def test_unknown_handshakes_are_quarantined_refused_and_put_back(empty_database_url: str) -> None:
    url = empty_database_url
    assert kickass("db", "upgrade", "0023", "--database-url", url).returncode == 0
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute(f"""INSERT INTO trials (id, trial_id, destination, access_capacity_bps,
                             parameters, versions, started_at)
                         VALUES (1, '{TRIAL_ID}', 'far-1', 1e7, '{{}}', '{{}}', now())""")
        conn.execute("""INSERT INTO trial_periods (trial_pk, period_index, pair, protocol,
                            start_offset_s, duration_s, arm, handshake)
                        VALUES (1, 0, 0, 'kickass', 0, 60, 'kickass', 'padded'),
                               (1, 1, 0, 'kickass', 60, 60, 'kickass', 'syn-cookie')""")
        for i, handshake in enumerate(("paper", None, "<script>")):
            conn.execute(
                f"""INSERT INTO flows (id, flow_id, trial_pk, period_index, protocol, size_bytes,
                        size_packets, started_at, completed, fct_ms, arm, pair, handshake)
                    VALUES ({i + 1}, '{TRIAL_ID}-{i}', 1, 0, 'kickass', 1440, 1, now(), true,
                            12.5, 'kickass', 0, %s)""",
                (handshake,),
            )
        before = dump(conn)

    up = kickass("db", "upgrade", "--database-url", url)
    assert up.returncode == 0, up.stderr
    assert "flows.handshake not one of" in up.stderr and "in 1 rows" in up.stderr, up.stderr
    assert "trial_periods.handshake not one of" in up.stderr, up.stderr
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        assert dump(conn) == [
            ("flow", "1", "paper"),
            ("flow", "2", None),
            ("flow", "3", None),
            ("period", "0", "padded"),
            ("period", "1", None),
        ]
        kept = conn.execute(
            """SELECT table_name, row_key, columns, action, "row" ->> 'handshake'
               FROM quarantine WHERE revision = '0024' ORDER BY table_name"""
        ).fetchall()
        assert kept == [
            ("flows", {"id": 3}, ["handshake"], "nulled", "<script>"),
            (
                "trial_periods",
                {"trial_pk": 1, "period_index": 1},
                ["handshake"],
                "nulled",
                "syn-cookie",
            ),
        ]
        for h in HANDSHAKES:  # every handshake of the record still goes in
            conn.execute("UPDATE flows SET handshake = %s WHERE id = 2", (h,))
        for table, where in (("flows", "id = 1"), ("trial_periods", "period_index = 0")):
            with pytest.raises(psycopg.errors.CheckViolation):
                conn.execute(f"UPDATE {table} SET handshake = 'tcp' WHERE {where}")
        conn.execute("UPDATE flows SET handshake = NULL WHERE id = 2")

    down = kickass("db", "downgrade", "0023", "--database-url", url)
    assert down.returncode == 0, down.stderr
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        assert dump(conn) == before
        assert conn.execute(
            "SELECT count(*) FROM quarantine WHERE revision = '0024'"
        ).fetchone() == (0,)
