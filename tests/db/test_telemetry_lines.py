"""`kickass telemetry ingest` line by line: a bad line is skipped and named, the rest stored.

The real command in its own process on a real PostgreSQL: a 10,000-line
router capture with 100 hostile lines at seeded random positions stores
exactly the good lines, names exactly the injected line numbers, exits 1
and prints no traceback. Each hostile kind below broke the ingest before
(a traceback, and its whole batch of up to 200 samples lost) or was stored
and broke every reader after it (``t = 1e300``).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from kickass_db import libpq_url
from kickass_db.partitions import Partitions, day_of
from kickass_db.telemetry import MAX_LINE_BYTES, TelemetryIngest

KICKASS = str(Path(sys.executable).parent / "kickass")
LINES = 10_000
HOSTILE = 100
START = 1.7e9


@pytest.fixture(autouse=True)
def _capture_days(database_url: str) -> None:
    """The capture's days (2023) have partitions (migration 0022), made as an
    operator ingesting an old capture makes them."""
    with Partitions(database_url) as p:
        day = day_of(datetime.fromtimestamp(START, UTC))
        p.ensure_days("router_telemetry", day, day + timedelta(days=1))


def sample(t: float, **over: Any) -> dict[str, Any]:
    """A sample line as ka-router prints it."""
    return {
        "type": "sample", "t": t, "advertised_rate_bps": 9.5e6, "leading_fragment_len": 604,
        "input_rate_bps": 8e6, "output_rate_bps": 7.9e6, "queue_bytes": 3000,
        "queue_packets": 2, "marking_mode": "kickass", "rtt_ms": 101.5, "interval_ms": 10.0,
        "mode_switches": 0, "drops": 0, "fragmented": 12, "forwarded_bytes": 10**6,
        "ts": START + t, **over,
    }  # fmt: skip


def text(t: float, **over: Any) -> str:
    return json.dumps(sample(t, **over))


# Each: what a broken router, a garbled pipe or an attacker's file may hold.
HOSTILE_KINDS: list[tuple[str, Any]] = [
    ("a string in a number column", lambda t: text(t, queue_bytes="3000")),
    ("a bool in a number column", lambda t: text(t, drops=True)),
    ("NaN in an extra field", lambda t: text(t).replace('"interval_ms": 10.0', '"x": NaN')),
    ("Infinity in a column", lambda t: text(t).replace('"rtt_ms": 101.5', '"rtt_ms": Infinity')),
    ("a number past a double", lambda t: text(t).replace('"rtt_ms": 101.5', '"rtt_ms": 1e999')),
    ("past bigint", lambda t: text(t, queue_bytes=2**63)),
    ("past smallint", lambda t: text(t, leading_fragment_len=40_000)),
    ("past real", lambda t: text(t, rtt_ms=1e39)),
    ("below real", lambda t: text(t, rtt_ms=1e-40)),
    ("t = 1e300", lambda t: text(1e300)),
    ("t = NaN", lambda t: text(t).replace(f'"t": {t}', '"t": NaN', 1)),
    ("t before the run", lambda t: text(-1.0)),
    ("a rate of 1e308", lambda t: text(t, advertised_rate_bps=1e308)),
    ("a wall clock past Python's", lambda t: text(t, ts=1e20)),
    ("an extra integer past 64 bits", lambda t: text(t, forwarded_bytes=2**70)),
    ("an extra NUL character", lambda t: text(t, note="a\u0000b")),
    ("a missing column", lambda t: json.dumps({**sample(t), "drops": None})),
    ("an unknown marking mode", lambda t: text(t, marking_mode="turbo")),
    ("an unknown line type", lambda t: text(t, type="bogus")),
    ("not JSON", lambda t: "ka-router: warning: cannot read GRO on w0"),
    ("a cut line", lambda t: text(t)[:57]),
    ("a JSON list", lambda t: json.dumps([sample(t)])),
    ("deep nesting", lambda t: text(t, extra="x").replace('"x"', "[" * 100 + "]" * 100)),
    ("an endless line", lambda t: text(t, pad="x" * (MAX_LINE_BYTES + 10))),
    ("not UTF-8", lambda t: text(t).replace('"kickass"', '"kick\udcffass"')),
]  # fmt: skip


def capture(path: Path, seed: int) -> list[int]:
    """The file; returns the hostile lines' numbers (1-based)."""
    r = random.Random(seed)
    # Never the first (metadata) or the last (exit) line.
    hostile = sorted(r.sample(range(2, LINES), HOSTILE))
    bad = set(hostile)
    meta = {"type": "metadata", "version": 1, "program": "ka-router", "program_version": "t",
            "started_unix": START, "options": {"router": {"kind": "kickass",
                                                          "capacity_bps": 1e7}}}  # fmt: skip
    with path.open("wb") as fp:
        fp.write(json.dumps(meta).encode() + b"\n")
        for n in range(2, LINES):
            t = round(n * 0.01, 2)
            line = r.choice(HOSTILE_KINDS)[1](t) if n in bad else text(t)
            fp.write(line.encode("utf-8", "surrogateescape") + b"\n")
        fp.write(json.dumps({"type": "exit", "ts": START + LINES, "reason": "signal"}).encode())
    return hostile


def test_hostile_lines_are_skipped_by_number_and_the_rest_stored(
    database_url: str, tmp_path: Path
) -> None:
    path = tmp_path / "capture.ndjson"
    hostile = capture(path, seed=27)
    env = {**os.environ, "KICKASS_DATABASE_URL": database_url, "KICKASS_CONFIG": ""}
    run = subprocess.run(
        [KICKASS, "telemetry", "ingest", str(path), "--run-name", "hostile", "--json"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr
    summary = json.loads(run.stdout)
    assert [s["line"] for s in summary["skipped_lines"]] == hostile
    assert summary["skipped"] == HOSTILE and summary["lines"] == LINES
    good = LINES - 2 - HOSTILE  # the metadata and exit lines are the run's row
    assert summary["written"] == summary["samples"] == good
    with psycopg.connect(libpq_url(database_url)) as conn:
        stored = [t for (t,) in conn.execute("SELECT t FROM router_telemetry ORDER BY t")]
        run_row = conn.execute(
            "SELECT run_name, capacity_bps, finished_at IS NOT NULL, exit_reason FROM router_runs"
        ).fetchall()
    bad = set(hostile)
    assert stored == [round(n * 0.01, 2) for n in range(2, LINES) if n not in bad]
    assert run_row == [("hostile", 1e7, True, "signal")]
    # The text summary names them too, on stderr, and exits the same.
    run = subprocess.run(
        [KICKASS, "telemetry", "ingest", str(path)],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert f"{HOSTILE} lines skipped" in run.stderr
    assert f"  line {hostile[0]}: " in run.stderr and "--json lists every one" in run.stderr


@pytest.mark.parametrize(("kind", "make"), HOSTILE_KINDS, ids=[k for k, _ in HOSTILE_KINDS])
def test_each_hostile_kind_costs_its_line_only(database_url: str, kind: str, make: Any) -> None:
    """One hostile line in a batch of good ones: the batch is stored, the line
    named (before: a traceback, or all 200 samples of its batch lost)."""
    lines = [text(0.01), make(0.02).encode("utf-8", "surrogateescape"), text(0.03)]
    ingest = TelemetryIngest(database_url, kind)
    try:
        summary = ingest.feed(lines)
    finally:
        ingest.close()
    assert [s["line"] for s in summary["skipped_lines"]] == [2], summary
    assert summary["written"] == 2
