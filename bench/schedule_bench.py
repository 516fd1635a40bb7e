"""Benchmark of scheduled work (not a test): `kickass schedule run` at scale.

Figures, from one run on this machine, into a real (embedded) PostgreSQL:
  nothing_due   wall time of `kickass schedule run` (a fresh process, as cron
                starts it) with 1,000 items whose current due times are all
                done and 100,000 past runs stored: median and max of several
                runs (goal: under 1 s), and the same with 10 items, as the ratio
                of what the thousand items cost over the fixed start-up.
  contention    50 `kickass schedule run` processes started at the same
                instant against 100 due items: claims per process, runs per
                item (goal: exactly one each; no "claimed" logged twice).

Usage: .venv/bin/python bench/schedule_bench.py [--quick] > bench/schedule_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import kickass_db as db
from kickass_testbed.pg import create_database, embedded_postgres
from sqlalchemy import text

VERSION = 1
KICKASS = str(Path(sys.executable).with_name("kickass"))
BARRIER = """
import sys, time
at = float(sys.argv[1])
from kickass_core.cli import main
time.sleep(max(0.0, at - time.time()))
sys.exit(main(sys.argv[2:]))
"""
CRONS = ["*/5 * * * *", "17 * * * *", "0 3 * * *", "40 */3 * * 1-5", "*/15 * * * *"]


def write_schedule(path: Path, items: list[dict[str, Any]]) -> None:
    lines = ["[schedule]", 'name = "bench"']
    for it in items:
        lines += ["", "[[item]]"] + [f"{k} = {json.dumps(v)}" for k, v in it.items()]
    path.write_text("\n".join(lines) + "\n")


def env_for(url: str, host: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KICKASS_")}
    return env | {"KICKASS_DATABASE_URL": url, "KICKASS_HOST_ID": host}


def nothing_due(url: str, work: Path, n_items: int, n_past: int, repeats: int) -> dict[str, Any]:
    from kickass_operations.schedule_file import load

    items = [
        {
            "name": f"item-{i:04d}",
            "kind": "refresh",
            "cron": CRONS[i % len(CRONS)],
            "slip_s": 60.0 if i % 2 else 0.0,
        }  # fmt: skip
        for i in range(n_items)
    ]
    path = work / f"schedule-{n_items}.toml"
    write_schedule(path, items)
    schedule, _ = load(path)
    # Seeded from a little ahead, so the due times that come while the bench
    # runs are done too (a minute boundary must not make an item due).
    now = datetime.now(UTC) + timedelta(minutes=10)
    per_item = max(4, n_past // n_items)
    rows = []
    for it in schedule.item:
        due = it.due_now(now)
        assert due is not None
        # The due times up to then, all done.
        for d in [due, *it.previous_dues(due, per_item - 1)]:
            rows.append({"item": it.name, "kind": it.kind, "due": d})
    engine = db.make_engine(url)
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE item_runs"))
        conn.execute(
            text(
                "INSERT INTO item_runs (item, kind, due_at, host, outcome, finished_at) "
                "VALUES (:item, :kind, :due, 'bench', 'ok', :due)"
            ),
            rows,
        )
        conn.execute(text("ANALYZE item_runs"))
    engine.dispose()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        proc = subprocess.run(
            [KICKASS, "schedule", "run", str(path), "--json"], env=env_for(url, "bench"),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        times.append(time.perf_counter() - t0)
        summary = json.loads(proc.stdout.splitlines()[-1])
        assert proc.returncode == 0 and summary["due"] == 0, (proc.stdout, proc.stderr)
    return {
        "items": n_items,
        "past_runs": len(rows),
        "wall_s_median": round(statistics.median(times), 3),
        "wall_s_max": round(max(times), 3),
        "repeats": repeats,
    }


def contention(url: str, work: Path, n_procs: int, n_items: int) -> dict[str, Any]:
    now = datetime.now(UTC) - timedelta(minutes=2)
    cron = f"{now.minute} {now.hour} * * *"
    items = [{"name": f"due-{i:03d}", "kind": "housekeeping", "cron": cron} for i in range(n_items)]
    path = work / "contention.toml"
    write_schedule(path, items)
    engine = db.make_engine(url)
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE item_runs"))
    at = time.time() + 8.0 + n_procs * 0.1  # every process imported and waiting
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BARRIER, str(at), "schedule", "run", str(path)],
            env=env_for(url, f"host-{i:02d}"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i in range(n_procs)
    ]
    claimed: list[str] = []
    per_proc = []
    failures: list[str] = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        if p.returncode != 0:
            failures.append(f"exit {p.returncode}: " + (err.strip().splitlines() or ["?"])[-1])
            failures += [
                json.loads(line).get("reason", "")
                for line in out.splitlines()
                if line.startswith("{") and json.loads(line).get("outcome") in ("failed", "timeout")
            ]
        mine = [
            json.loads(line)["item"]
            for line in out.splitlines()
            if line.startswith("{") and json.loads(line)["event"] == "claimed"
        ]
        claimed += mine
        per_proc.append(len(mine))
    wall = time.time() - at
    with engine.connect() as conn:
        runs = conn.execute(
            text("SELECT item, count(*) AS n, max(attempt) AS a FROM item_runs GROUP BY item")
        ).all()
    engine.dispose()
    return {
        "processes": n_procs,
        "due_items": n_items,
        "items_run": len(runs),
        "runs_per_item_max": max(r.n for r in runs),
        "attempts_max": max(r.a for r in runs),
        "claims_logged": len(claimed),
        "claimed_twice": len(claimed) - len(set(claimed)),
        "processes_that_claimed": sum(1 for n in per_proc if n),
        "claims_per_process_max": max(per_proc),
        "failed_processes": failures,  # why, when any
        "wall_s": round(wall, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller, for a smoke run")
    ap.add_argument("--only", choices=["nothing-due", "contention"], help="one part only")
    args = ap.parse_args()
    n_items, n_past, procs, due = (100, 5_000, 8, 16) if args.quick else (1000, 100_000, 50, 100)
    with (
        tempfile.TemporaryDirectory(prefix="kickass-schedule-bench-") as tmp,
        embedded_postgres(Path(tmp) / "pg") as server,
    ):
        url = create_database(server, "bench")
        db.upgrade(url)
        work = Path(tmp)
        small = big = race = None
        if args.only in (None, "nothing-due"):
            small = nothing_due(url, work, 10, 1_000, 5)
            big = nothing_due(url, work, n_items, n_past, 5)
        if args.only in (None, "contention"):
            race = contention(url, work, procs, due)
    out = {
        "version": VERSION,
        "metadata": {
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "cpus": os.cpu_count(),
            "git": subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
            ).stdout.strip(),  # fmt: skip
            "quick": args.quick,
        },
        "nothing_due": None
        if small is None or big is None
        else {
            "small": small,
            "large": big,
            "large_over_small": round(big["wall_s_median"] / small["wall_s_median"], 2),
            "goal_s": 1.0,
        },
        "contention": race,
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
