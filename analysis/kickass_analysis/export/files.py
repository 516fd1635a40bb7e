"""The export's files: their names, the result they describe, a window published before.

``<view>[-<source>][-campaign-<c>][-since<T>][-until<T>]-<exported>.<ext>``, or
named by its window alone (``window_name``); ``ExportResult`` is one export
(the data file and its ``.schema.json``); ``_published`` reads back an
export of a window already published, as its schema describes it. The files
are published through ``kickass_analysis.publish`` (view.py: the schema
first).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

from kickass_core.errors import KickassError

from .filters import Filters, _utc

SCHEMA_VERSION = 1
STAMP = "%Y%m%dT%H%M%SZ"


@dataclass(frozen=True)
class ExportResult:
    """One export: the data file and its schema beside it."""

    view: str
    format: str
    data_path: Path
    schema_path: Path
    rows: int
    bytes: int  # size of the data file
    seconds: float
    sha256: str
    exported_at: datetime
    alembic_revision: str | None
    filters: dict[str, str | None] = field(default_factory=dict)
    # Published before this call (by an earlier attempt at the same window).
    already_published: bool = False

    @property
    def paths(self) -> tuple[Path, Path]:
        """The data file and its ``.schema.json``."""
        return (self.data_path, self.schema_path)

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "view": self.view,
            "format": self.format,
            "path": str(self.data_path),
            "schema_path": str(self.schema_path),
            "rows": self.rows,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 3),
            "rows_per_s": round(self.rows_per_s, 1),
            "sha256": self.sha256,
            "exported_at": self.exported_at.isoformat(),
            "alembic_revision": self.alembic_revision,
            "filters": self.filters,
        }


def window_name(
    view: str,
    fmt: str,
    since: datetime | None = None,
    until: datetime | None = None,
    *,
    source: str | None = None,
    campaign: str | None = None,
    at: datetime | None = None,
) -> str:
    """The data file's name of an export of one window: the view, its
    filters and its bounds, and no export time, so every attempt at the
    window names the same file. ``at`` labels an export of a view that pools
    all time (it has no window) with the time it stands for (the scheduled
    run's due time)."""
    name = _file_name(view, fmt, Filters(_utc(since), _utc(until), source, campaign), None)
    if at is None:
        return name
    return name.removesuffix("." + fmt) + "-at" + _stamp(at) + "." + fmt


def _file_name(view: str, fmt: str, filters: Filters, exported_at: datetime | None) -> str:
    parts = [view]
    if filters.source:
        parts.append(filters.source)
    if filters.campaign is not None:
        parts.append("campaign-" + (re.sub(r"[^A-Za-z0-9._]+", "_", filters.campaign)[:60] or "_"))
    if filters.since:
        parts.append("since" + _stamp(filters.since))
    if filters.until:
        parts.append("until" + _stamp(filters.until))
    if exported_at is not None:
        parts.append(_stamp(exported_at))
    return "-".join(parts) + "." + fmt


def _stamp(t: datetime) -> str:
    return t.astimezone(UTC).strftime(STAMP)


# -- files ---------------------------------------------------------------------------------


def _exists(final: Path) -> NoReturn:
    raise KickassError(
        f"{final} already exists",
        hint="an export of the same view and filters in the same second: run it again",
    )


def _published(view: str, fmt: str, data_path: Path, schema_path: Path) -> ExportResult:
    """The export already published under ``data_path``, as its schema describes it."""
    try:
        schema = json.loads(schema_path.read_text(encoding="utf-8"))
        size = data_path.stat().st_size
        ok = (
            schema.get("view") == view and schema.get("format") == fmt
            and schema.get("data_file") == data_path.name and schema.get("bytes") == size
        )  # fmt: skip
    except (OSError, ValueError, AttributeError):
        ok = False
    if not ok:
        raise KickassError(
            f"{data_path} is published, but {schema_path.name} does not describe it",
            hint="move both aside (or restore the schema) and run the export again",
        )
    return ExportResult(
        view=view,
        format=fmt,
        data_path=data_path,
        schema_path=schema_path,
        rows=int(schema["rows"]),
        bytes=size,
        seconds=0.0,
        sha256=str(schema["sha256"]),
        exported_at=datetime.fromisoformat(schema["exported_at"]),
        alembic_revision=schema.get("alembic_revision"),
        filters={k: schema["filters"].get(k) for k in ("since", "until", "source", "campaign")},
        already_published=True,
    )
