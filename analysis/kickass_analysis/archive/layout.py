"""The archive's layout and what its parts share: folders, names, the manifest's conventions.

``ROOT/<table>/day=D/`` (a day of ``probe_outcomes``, its sessions'
sidecar ``sessions``, ``router_telemetry``) or
``ROOT/atlas_outcomes/campaign=NAME/``, the value escaped as Hive
partitions are; ``part-NNNNN.parquet`` files in row groups of at least
``ROW_GROUP_ROWS`` rows and ``_manifest.json`` (``SCHEMA_VERSION``) beside
them. ``INJECT_ENV`` stops a retirement at one of ``INJECTION_POINTS`` (the
crash-safety tests). ``Progress`` is the callback the writing and the
retirement report through.
"""

from __future__ import annotations

import os
import signal
import urllib.parse
from collections.abc import Callable
from datetime import date, datetime
from pathlib import Path
from typing import Any

from kickass_core.errors import KickassError
from kickass_db.archive_store import SIDECAR
from kickass_db.models.archive import ARCHIVED_TABLES

SCHEMA_VERSION = 1
MANIFEST = "_manifest.json"
ROW_GROUP_ROWS = 128 * 1024
ATLAS = "atlas_outcomes"  # a settled campaign's snapshot, never dropped from the database
FOLDERS = (*ARCHIVED_TABLES, SIDECAR, ATLAS)
INJECT_ENV = "KICKASS_ARCHIVE_INJECT"
INJECTION_POINTS = (
    "after-first-file", "before-manifest", "after-manifest", "after-verify", "after-detach",
)  # fmt: skip
# What one folder of a table holds: a day, or (atlas_outcomes) a campaign.
Key = tuple[str, str]
Progress = Callable[[str, dict[str, Any]], None]


class InjectedFault(Exception):
    """A retirement stopped at an injection point (``INJECT_ENV``)."""


def _inject(point: str) -> None:
    want = os.environ.get(INJECT_ENV)
    if not want:
        return
    name, _, how = want.partition(":")
    if name != point:
        return
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise InjectedFault(point)


def day_dir(root: Path, folder: str, day: date) -> Path:
    return dataset_dir(root, folder, ("day", day.isoformat()))


def campaign_dir(root: Path, campaign: str) -> Path:
    return dataset_dir(root, ATLAS, ("campaign", campaign))


def dataset_dir(root: Path, folder: str, key: Key) -> Path:
    """``ROOT/<folder>/<name>=<value>``, the value escaped as Hive partitions are
    (DuckDB, Spark and Arrow read it back unescaped)."""
    return root / folder / f"{key[0]}={urllib.parse.quote(key[1], safe='')}"


def part_name(n: int) -> str:
    return f"part-{n:05d}.parquet"


def _check_table(table: str) -> None:
    if table not in ARCHIVED_TABLES:
        raise KickassError(
            f"{table!r} is not archived by day", hint=f"one of: {', '.join(ARCHIVED_TABLES)}"
        )


def _date(value: str) -> date:
    return datetime.strptime(value, "%Y-%m-%d").date()


def _sha256(blob: bytes) -> str:
    import hashlib

    return hashlib.sha256(blob).hexdigest()
