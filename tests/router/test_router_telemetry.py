"""ka-router telemetry lands in PostgreSQL through `kickass telemetry ingest`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import kickass_db as db
import pytest
from kickass_db.partitions import Partitions, day_of
from kickass_db.telemetry import TelemetryIngest
from kickass_testbed.edge import edge_path, ka_router
from kickass_testbed.topology import build
from sqlalchemy import text

# netns: it builds namespaces, and the namespace stream compares the machine's
# namespaces before and after a test, which a test beside it would upset.
pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces"),
]
KICKASS = Path(sys.executable).parent / "kickass"


def test_router_telemetry_rows_appear_in_postgres(database_url: str) -> None:
    # Telemetry on the router's stdout, piped into `kickass telemetry ingest`.
    router_spec = ka_router("--capacity", "10mbit", stderr="inherit")
    with build(edge_path(processes=(router_spec,))) as net:
        router = net.procs["ka-router"]
        env = {**os.environ, "KICKASS_DATABASE_URL": database_url}
        ingest = subprocess.Popen(
            [str(KICKASS), "telemetry", "ingest", "-", "--run-name", "t1", "--json"],
            stdin=router.stdout,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        assert router.stdout is not None
        router.stdout.close()  # the ingest process owns the pipe now
        time.sleep(1.5)
        os.killpg(router.pid, signal.SIGTERM)
        router.wait(10)
        out, err = ingest.communicate(timeout=30)
        assert ingest.returncode == 0, err.decode()
    summary = json.loads(out)
    assert summary["written"] >= 10 and summary["skipped"] == 0
    engine = db.make_engine(database_url)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT * FROM v_router_telemetry ORDER BY t")).mappings().all()
        run = conn.execute(text("SELECT * FROM router_runs")).mappings().one()
    assert len(rows) == summary["written"]
    assert rows[0]["run_name"] == "t1" and rows[0]["capacity_bps"] == 10e6
    assert all(r["marking_mode"] == "kickass" for r in rows)
    assert run["finished_at"] is not None and run["exit_reason"]


def test_ingest_skips_malformed_lines(database_url: str, tmp_path: Path) -> None:
    lines = [
        json.dumps(
            {
                "type": "metadata",
                "version": 1,
                "options": {"router": {"kind": "droptail", "capacity_bps": 1e8}},
                "started_unix": 1.7e9,
            }
        ),
        "not json",
        json.dumps({"type": "sample", "t": 0.01, "mode": "weird"}),
        json.dumps(
            {
                "type": "sample",
                "t": 0.02,
                "advertised_rate_bps": 5e6,
                "leading_fragment_len": 600,
                "input_rate_bps": 4e6,
                "queue_bytes": 0,
                "mode": "kickass",
                "drops": 0,
                "fragmented": 3,
                "ts": 1.7e9,
            }
        ),
        json.dumps([1, 2]),
    ]
    with Partitions(database_url) as p:  # 2023: an old capture's day (migration 0022)
        day = day_of(datetime.fromtimestamp(1.7e9, UTC))
        p.ensure_days("router_telemetry", day, day)
    ing = TelemetryIngest(database_url, "file")
    summary = ing.feed(line + "\n" for line in lines)
    assert summary["written"] == 1 and summary["skipped"] == 3
    assert [s["line"] for s in summary["skipped_lines"]] == [2, 3, 5]
    with db.make_engine(database_url).connect() as conn:
        mode = conn.execute(text("SELECT router_mode FROM v_router_telemetry")).scalar()
    assert mode == "droptail"
