"""A local-disk outbox: results are kept until the server has confirmed them.

Every record has a stable id (a flow's ``flow_id``, a trial's ``trial_id``),
is written atomically as its own file before anything is sent, and is removed
only after the server acknowledged that id. Uploads are idempotent on the
server (a repeated id is a no-op), so a crash between "stored there" and
"removed here" re-sends, and nothing is lost or counted twice.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


class Spool:
    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def put(self, kind: str, record_id: str, record: dict[str, Any]) -> None:
        """Keep ``record`` on disk (durably) until ``done`` is called for its id."""
        if not _ID.match(kind) or not _ID.match(record_id):
            raise ValueError(f"bad spool key {kind}/{record_id}")
        final = self.dir / f"{kind}.{record_id}.json"
        tmp = final.with_suffix(".tmp")
        with tmp.open("w") as f:
            json.dump({"kind": kind, "id": record_id, "record": record}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        self._sync_dir()

    def pending(self, kind: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        """Records not yet confirmed, oldest first (trials before their flows)."""
        files = sorted(self.dir.glob("*.json"), key=lambda p: (p.stat().st_mtime_ns, p.name))
        out = []
        for p in files:
            if kind is not None and not p.name.startswith(kind + "."):
                continue
            try:
                out.append(json.loads(p.read_text()))
            except (OSError, ValueError):
                # A torn file cannot exist (atomic rename); anything else is
                # not ours to delete: leave it and say so through count().
                continue
            if limit is not None and len(out) >= limit:
                break
        return out

    def done(self, kind: str, ids: Iterable[str]) -> None:
        for record_id in ids:
            if _ID.match(record_id):
                (self.dir / f"{kind}.{record_id}.json").unlink(missing_ok=True)
        self._sync_dir()

    def reject(self, kind: str, ids: Iterable[str], reason: str) -> None:
        """Move records the server refused for good to ``rejected/``, noting why."""
        aside = self.dir / "rejected"
        aside.mkdir(exist_ok=True)
        for record_id in ids:
            src = self.dir / f"{kind}.{record_id}.json"
            if _ID.match(record_id) and src.exists():
                data = json.loads(src.read_text())
                data["rejected_because"] = reason
                (aside / src.name).write_text(json.dumps(data))
                src.unlink()
        self._sync_dir()

    def rejected(self) -> int:
        aside = self.dir / "rejected"
        return sum(1 for _ in aside.glob("*.json")) if aside.exists() else 0

    def count(self) -> int:
        return sum(1 for _ in self.dir.glob("*.json"))

    def _sync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
