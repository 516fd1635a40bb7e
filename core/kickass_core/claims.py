"""A claimed run of a scheduled item: the one record of a claim.

The database's schedule store makes it (``kickass_db.schedule_store``), the
server's schedule API sends its fields to a runner host, and the scheduler
carries it while the run lasts (``kickass_operations.claims``, ``runner``):
a record that crosses those boundaries is defined once, here, where both the
database package and the scheduler (which a runner host has without the
database package) may import it. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class Claim:
    """A run this host holds: carry it out, heartbeat it, finish it."""

    run_id: int
    item: str
    due_at: datetime
    attempt: int
    # Set when a dead run was taken over: what its previous attempt was.
    took_over: dict[str, Any] | None = None
