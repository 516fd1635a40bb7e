"""Benchmark of `kickass export` (not a test): constant memory, and rows/s against COPY.

    .venv/bin/python bench/export_bench.py [--rows N] [--quick] > bench/export_bench.json

Seeds probe rows into a real (embedded) PostgreSQL through the tables
``v_whole_drop`` reads (``seed_probe_rows``: INSERT ... SELECT
generate_series, one probe per session and packet size, so the view has
exactly one row per probe row), then runs ``kickass export v_whole_drop``
as a child process, as an operator or the scheduler runs it, and prints one
JSON object:

* memory: the exporter's peak RSS (the child's ru_maxrss, from wait4) for
  CSV and Parquet at ``--small`` (100 thousand) and ``--rows`` (10 million)
  probe rows, and the difference (goal: within ``RSS_GOAL_MIB``);
* throughput: rows/s of the CSV and Parquet exports (the export's own
  clock, from ``--json``: connection to published files) against
  PostgreSQL's own ``COPY (SELECT * FROM v_whole_drop) TO STDOUT`` of the
  same view written to a file in the same directory (read with psycopg's
  ``Copy``, a row at a time, as a Python client would), measured in the same
  run, best of ``--repeats``. The CSV path *is* COPY (``FORMAT csv, HEADER,
  FORCE_QUOTE *``, plus the file's sha256 and fsync), so the figure that
  says something about the exporter is Parquet's (the same COPY's CSV
  parsed by Arrow and written as row groups) against COPY. ``v_whole_drop``
  costs PostgreSQL a sort and an aggregate per row; ``v_router_telemetry``
  (``--telemetry-rows`` samples, a month at one second) is a plain join,
  where the client's work shows more.

The same seeding runs in CI at 100 thousand rows
(tests/analysis/test_export.py imports ``seed_probe_rows`` from here).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import kickass_db as db
import psycopg
from kickass_db import partitions

VERSION = 1
VIEW = "v_whole_drop"
TELEMETRY_VIEW = "v_router_telemetry"
SIZES_PER_SESSION = 1000  # probes per seeded session: ip_len 500..1499, one probe each
RSS_GOAL_MIB = 8.0
KICKASS = str(Path(sys.executable).with_name("kickass"))
T0 = "2026-01-01T00:00:00Z"

_SESSIONS = """
INSERT INTO sessions (session_id, state, plan, server_version, client_version, verdict,
                      verdict_reason, source_address, created_at, started_at, finished_at)
SELECT lpad(to_hex(i), 16, '0'), 'complete', '{"seeded": "export bench"}', 'export-bench',
       '0.1.0', 'fragments-ok', 'seeded', '192.0.2.1'::inet + (i %% 250),
       %(t0)s::timestamptz + i * interval '1 minute',
       %(t0)s::timestamptz + i * interval '1 minute',
       %(t0)s::timestamptz + i * interval '1 minute' + interval '30 s'
FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS i
"""

# One probe per (session, ip_len); every 50th lost (NULL acked_at, rtt, received_len),
# a quarter of the sessions without IP_RECVFRAGSIZE (NULL observed_frag_size).
_PROBES = """
INSERT INTO probe_outcomes (session_pk, session_created_at, seq, phase, ip_len, sent_at, outcome,
                            acked_at, rtt_ms, ack_count, received_len, observed_frag_size)
SELECT s.id, s.created_at, k, 'whole', 500 + k, s.started_at + k * interval '2 ms',
       CASE WHEN s.lost THEN 'lost' ELSE 'acked' END,
       CASE WHEN s.lost THEN NULL ELSE s.started_at + k * interval '2 ms' + interval '40 ms' END,
       CASE WHEN s.lost THEN NULL ELSE 20 + ((s.i * 31 + k * 17) %% 1000) / 8.0 END,
       CASE WHEN s.lost THEN 0 ELSE 1 END,
       CASE WHEN s.lost THEN NULL ELSE 472 + k END,
       CASE WHEN s.i %% 4 = 0 THEN NULL ELSE 0 END
FROM (
    SELECT x.id, x.created_at, x.started_at, x.i, k, (x.i * 7919 + k * 104729) %% 50 = 0 AS lost
    FROM (
        SELECT id, created_at, started_at, ('x' || session_id)::bit(64)::bigint AS i
        FROM sessions
        WHERE server_version = 'export-bench'
          AND session_id BETWEEN lpad(to_hex(%(first)s::bigint), 16, '0')
                             AND lpad(to_hex(%(last)s::bigint), 16, '0')
    ) AS x
    CROSS JOIN LATERAL generate_series(
        0, least(%(sizes)s::bigint, %(end)s::bigint - x.i * %(sizes)s::bigint) - 1) AS k
) AS s
"""

# Finished sessions are read from their durable counts (migration 0020): stored
# as StudyStore stores them when it applies a RunFinished.
_COUNTS = """
SELECT count(*) FROM write_unit_counts(ARRAY(
    SELECT id FROM sessions
    WHERE server_version = 'export-bench'
      AND session_id BETWEEN lpad(to_hex(%(first)s::bigint), 16, '0')
                         AND lpad(to_hex(%(last)s::bigint), 16, '0')))
"""

_RUN = """
INSERT INTO router_runs (id, run_name, router_kind, capacity_bps, program_version, options,
                         started_at)
VALUES (%(run)s, 'export-bench ü', 'kickass', 1e8, 'bench', '{"seeded": true}', %(t0)s)
"""

_TELEMETRY = """
INSERT INTO router_telemetry (run_id, t, recorded_at, advertised_rate_bps, leading_fragment_len,
                              input_rate_bps, output_rate_bps, queue_bytes, queue_packets,
                              marking_mode, rtt_ms, drops, fragmented, mode_switches, extra)
SELECT %(run)s, g, %(t0)s::timestamptz + g * interval '1 s', 1e7 + (g %% 1000) * 1e4,
       CASE WHEN g %% 3 = 0 THEN NULL ELSE 576 + g %% 900 END, 9e7, 8.5e7, (g * 37) %% 150000,
       (g * 37) %% 100, CASE WHEN g %% 10 = 0 THEN 'tcp' ELSE 'kickass' END,
       20 + (g %% 100) / 8.0, g / 100, g / 7, g / 1000,
       CASE WHEN g %% 1000 = 0 THEN jsonb_build_object('note', 'sample ' || g) END
FROM generate_series(0::bigint, %(n)s::bigint - 1) AS g
"""


def seed_probe_rows(database_url: str, n: int, start: int = 0) -> None:
    """Probe rows ``start`` .. ``start + n - 1`` of the benchmark's study: one
    whole-phase probe per session and packet size (SIZES_PER_SESSION sizes a
    session), through the real tables, so ``v_whole_drop`` gains exactly n
    rows. ``start`` is a multiple of SIZES_PER_SESSION."""
    if start % SIZES_PER_SESSION:
        raise ValueError(f"start must be a multiple of {SIZES_PER_SESSION}")
    first = start // SIZES_PER_SESSION
    last = (start + n - 1) // SIZES_PER_SESSION
    params = {"t0": T0, "first": first, "last": last, "sizes": SIZES_PER_SESSION, "end": start + n}
    t0 = datetime.fromisoformat(T0)
    _days(database_url, "probe_outcomes", t0 + first * MINUTE, t0 + last * MINUTE)
    with psycopg.connect(db.libpq_url(database_url)) as conn:
        conn.execute(_SESSIONS, params)
        conn.execute(_PROBES, params)
        conn.execute(_COUNTS, params)
    _vacuum(database_url, "sessions", "probe_outcomes", "unit_counts")


def seed_telemetry_rows(database_url: str, n: int, run: int = 1) -> None:
    """``n`` one-second samples of one router run (``v_router_telemetry`` gains n rows)."""
    t0 = datetime.fromisoformat(T0)
    _days(database_url, "router_telemetry", t0, t0 + n * SECOND)
    with psycopg.connect(db.libpq_url(database_url)) as conn:
        conn.execute(_RUN, {"run": run, "t0": T0})
        conn.execute(_TELEMETRY, {"run": run, "t0": T0, "n": n})
    _vacuum(database_url, "router_runs", "router_telemetry")


MINUTE, SECOND = timedelta(minutes=1), timedelta(seconds=1)


def _days(database_url: str, table: str, first: datetime, last: datetime) -> None:
    """The partitions (migration 0022) of the days the seeded rows fall on."""
    with partitions.Partitions(database_url) as p:
        p.ensure_days(table, partitions.day_of(first), partitions.day_of(last))


def _vacuum(database_url: str, *tables: str) -> None:
    # Hint bits and statistics set now, so no measured run pays for them.
    with psycopg.connect(db.libpq_url(database_url), autocommit=True) as conn:
        conn.execute(f"VACUUM (ANALYZE) {', '.join(tables)}")


def run_export(database_url: str, view: str, fmt: str, directory: Path) -> dict[str, Any]:
    """`kickass export` in a child process: its --json summary, wall time and peak RSS.
    The files are removed afterwards (a 10-million-row CSV is most of a gigabyte)."""
    cmd = [KICKASS, "export", view, "--format", fmt, "--json", "-o", str(directory)]
    env = {**os.environ, "KICKASS_DATABASE_URL": database_url}
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as err:
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env)
        assert child.stdout is not None
        out = child.stdout.read()
        child.stdout.close()
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - t0
        if child.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"{' '.join(cmd)} failed: {err.read().decode()[-2000:]}")
    summary = json.loads(out)
    for key in ("path", "schema_path"):
        Path(summary[key]).unlink()
    return {
        "rows": summary["rows"],
        "bytes": summary["bytes"],
        "seconds": summary["seconds"],
        "rows_per_s": round(summary["rows"] / summary["seconds"]),
        "wall_seconds": round(wall, 3),
        "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),  # Linux: KiB
    }


def copy_baseline(database_url: str, view: str, directory: Path) -> dict[str, Any]:
    """PostgreSQL's own COPY of the view (text format) to a file, timed from the
    connection to the last byte written."""
    path = directory / f"copy-{uuid.uuid4().hex[:8]}.txt"
    t0 = time.monotonic()
    try:
        with (
            psycopg.connect(db.libpq_url(database_url)) as conn,
            conn.cursor() as cur,
            open(path, "wb") as out,
        ):
            with cur.copy(f"COPY (SELECT * FROM {view}) TO STDOUT") as copy:
                for chunk in copy:
                    out.write(chunk)
            rows = cur.rowcount
        seconds = time.monotonic() - t0
        size = path.stat().st_size
    finally:
        path.unlink(missing_ok=True)
    return {
        "rows": rows,
        "bytes": size,
        "seconds": round(seconds, 3),
        "rows_per_s": round(rows / seconds),
    }


def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return max(runs, key=lambda r: float(r["rows_per_s"]))


def throughput(database_url: str, view: str, directory: Path, repeats: int) -> dict[str, Any]:
    copy_baseline(database_url, view, directory)  # warm-up: the view's pages in memory
    runs: dict[str, list[dict[str, Any]]] = {"copy": [], "csv": [], "parquet": []}
    for _ in range(repeats):  # interleaved, so a slow spell of the machine hits all three
        runs["copy"].append(copy_baseline(database_url, view, directory))
        runs["csv"].append(run_export(database_url, view, "csv", directory))
        runs["parquet"].append(run_export(database_url, view, "parquet", directory))
    copy = best(runs["copy"])["rows_per_s"]
    return {
        "view": view,
        "rows": runs["copy"][0]["rows"],
        "rows_per_s": {k: best(v)["rows_per_s"] for k, v in runs.items()},
        "csv_over_copy": round(best(runs["csv"])["rows_per_s"] / copy, 2),
        "parquet_over_copy": round(best(runs["parquet"])["rows_per_s"] / copy, 2),
        "runs": runs,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000, help="probe rows, large run")
    parser.add_argument("--small", type=int, default=100_000, help="probe rows, small run")
    parser.add_argument(
        "--telemetry-rows", type=int, default=30 * 86_400, help="router samples (0: skip)"
    )
    parser.add_argument("--repeats", type=int, default=2, help="throughput runs per method")
    parser.add_argument("--quick", action="store_true", help="1 million rows, one repeat")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.telemetry_rows, args.repeats = 1_000_000, 100_000, 1
    result: dict[str, Any] = {
        "version": VERSION,
        "metadata": {
            "benchmark": "export",
            "when": datetime.now(UTC).isoformat(timespec="seconds"),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "view": VIEW,
            "rows": args.rows,
            "small_rows": args.small,
            "telemetry_rows": args.telemetry_rows,
            "repeats": args.repeats,
        },
    }
    from kickass_testbed.pg import create_database, embedded_postgres

    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kickass-export-bench-")))
        server = stack.enter_context(embedded_postgres(tmp / "pgdata"))
        urls = {}
        seeding: dict[str, float] = {}
        for label, n in (("small", args.small), ("large", args.rows)):
            urls[label] = create_database(server, f"export_bench_{label}")
            db.upgrade(urls[label])
            t0 = time.monotonic()
            seed_probe_rows(urls[label], n)
            seeding[f"{label}_probe_rows_s"] = round(time.monotonic() - t0, 1)
        out = tmp / "out"
        out.mkdir()
        memory: dict[str, Any] = {}
        for fmt in ("csv", "parquet"):
            small = run_export(urls["small"], VIEW, fmt, out)
            large = run_export(urls["large"], VIEW, fmt, out)
            memory[fmt] = {
                "small": small,
                "large": large,
                "peak_rss_growth_mib": round(large["peak_rss_mib"] - small["peak_rss_mib"], 1),
            }
        result["memory"] = {
            "goal_mib": RSS_GOAL_MIB,
            **memory,
            "within_goal": all(m["peak_rss_growth_mib"] <= RSS_GOAL_MIB for m in memory.values()),
        }
        result["throughput"] = [throughput(urls["large"], VIEW, out, args.repeats)]
        if args.telemetry_rows:
            t0 = time.monotonic()
            seed_telemetry_rows(urls["large"], args.telemetry_rows)
            seeding["telemetry_rows_s"] = round(time.monotonic() - t0, 1)
            result["throughput"].append(
                throughput(urls["large"], TELEMETRY_VIEW, out, args.repeats)
            )
        result["metadata"]["seeding_seconds"] = seeding
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
