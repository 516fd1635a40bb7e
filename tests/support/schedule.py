"""Helpers for tests of scheduled work (``kickass schedule``): write a schedule
file, run the real command as a process, read ``item_runs``, follow a
runner's child processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import kickass_db as db
from sqlalchemy import text

KICKASS = str(Path(sys.executable).with_name("kickass"))


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(type(v))


def write_schedule(path: Path, items: list[dict[str, Any]], **settings: Any) -> Path:
    lines = ["[schedule]"] + [f"{k} = {toml_value(v)}" for k, v in settings.items()]
    for item in items:
        lines += ["", "[[item]]"]
        lines += [f"{k} = {toml_value(v)}" for k, v in item.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def stable_cron(minutes_ago: int = 2, now: datetime | None = None) -> tuple[str, datetime]:
    """A daily cron expression whose latest due time was ``minutes_ago``
    minutes ago: the same due time for the whole test, whatever minute
    boundaries pass meanwhile."""
    t = (now or datetime.now(UTC)) - timedelta(minutes=minutes_ago)
    due = t.replace(second=0, microsecond=0)
    return f"{due.minute} {due.hour} * * *", due


def schedule_env(database_url: str | None, host: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KICKASS_")}
    env["KICKASS_HOST_ID"] = host
    if database_url is not None:
        env["KICKASS_DATABASE_URL"] = database_url
    env.update(extra)
    return env


def run_schedule(
    schedule: Path, env: dict[str, str], *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [KICKASS, "schedule", "run", str(schedule), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def events(stdout: str) -> list[dict[str, Any]]:
    """The JSON log lines (and the --json summary, last) of a run."""
    out = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def item_runs(database_url: str) -> list[dict[str, Any]]:
    e = db.make_engine(database_url)
    try:
        with e.connect() as conn:
            return [
                dict(r)
                for r in conn.execute(text("SELECT * FROM item_runs ORDER BY id")).mappings()
            ]
    finally:
        e.dispose()


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(check: Any, timeout: float, what: str, step: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
