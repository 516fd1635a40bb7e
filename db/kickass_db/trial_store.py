"""Storage of wide-area trial results: runners' tokens, trials, periods, flows.

Uploads are idempotent: a trial is keyed by its ``trial_id`` and a flow by its
``flow_id`` (both chosen by the runner), so a runner re-sending its spool after
a lost answer stores nothing twice. Only a hash of a runner's token is kept.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from kickass_core import flow_record
from kickass_core.errors import KickassError
from sqlalchemy import Connection, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert

from .models.trials import PROTOCOLS, TRIAL_ID_PATTERN, FlowRow, RunnerRow, TrialPeriodRow, TrialRow
from .tx import StoreBase

_TRIAL_ID = re.compile(TRIAL_ID_PATTERN.replace("$", r"\Z"))
class BadRecord(KickassError):
    """An upload that can never be stored (wrong shape): a client error, not an outage."""


def token_hash(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class TrialStore(StoreBase):
    # -- runners ----------------------------------------------------------

    def add_runner(self, name: str) -> str:
        """Register a runner; returns its token (shown once, stored only hashed)."""
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise KickassError(f"bad runner name {name!r}", hint="letters, digits, _ . - only")
        token = secrets.token_urlsafe(32)

        def work(conn: Connection) -> None:
            stmt = pg_insert(RunnerRow).values(name=name, token_hash=token_hash(token))
            stmt = stmt.on_conflict_do_update(
                index_elements=[RunnerRow.name],
                set_={"token_hash": stmt.excluded.token_hash, "revoked_at": None},
            )
            conn.execute(stmt)

        self.run(work)
        return token

    def authenticate(self, token: str) -> int | None:
        """The runner id for ``token``, or None (unknown or revoked)."""
        if not token or len(token) > 256:
            return None
        digest = token_hash(token)

        def work(conn: Connection) -> int | None:
            rows = conn.execute(
                select(RunnerRow.id, RunnerRow.token_hash).where(RunnerRow.revoked_at.is_(None))
            ).all()
            for rid, h in rows:
                if hmac.compare_digest(h, digest):
                    return int(rid)
            return None

        return self.run(work)

    # -- results ----------------------------------------------------------

    def put_trial(self, runner_id: int | None, trial: dict[str, Any]) -> None:
        """Store a trial and its schedule; a repeat (same trial_id) updates finished_at only."""
        t = _check_trial(trial)

        def work(conn: Connection) -> None:
            stmt = pg_insert(TrialRow).values(runner_id=runner_id, **t["row"])
            stmt = stmt.on_conflict_do_update(
                index_elements=[TrialRow.trial_id],
                set_={"finished_at": stmt.excluded.finished_at},
                where=TrialRow.runner_id.is_not_distinct_from(runner_id),
            ).returning(TrialRow.id)
            pk = conn.execute(stmt).scalar()
            if pk is None:
                raise BadRecord(f"trial {t['row']['trial_id']} belongs to another runner")
            if t["periods"]:
                conn.execute(
                    pg_insert(TrialPeriodRow).on_conflict_do_nothing(),
                    [{"trial_pk": pk, **p} for p in t["periods"]],
                )

        self.run(work)

    def put_flows(
        self, runner_id: int | None, trial_id: str, flows: Sequence[dict[str, Any]]
    ) -> list[str]:
        """Store flows of a trial; returns every flow id now stored (new or repeated)."""
        rows = [_check_flow(trial_id, f) for f in flows]

        def work(conn: Connection) -> list[str]:
            pk = conn.execute(
                select(TrialRow.id).where(
                    TrialRow.trial_id == trial_id,
                    TrialRow.runner_id.is_not_distinct_from(runner_id),
                )
            ).scalar()
            if pk is None:
                raise BadRecord(
                    f"no trial {trial_id} of this runner", hint="upload the trial first"
                )
            if rows:
                conn.execute(
                    pg_insert(FlowRow).on_conflict_do_nothing(index_elements=[FlowRow.flow_id]),
                    [{"trial_pk": pk, **r} for r in rows],
                )
            return [r["flow_id"] for r in rows]

        return self.run(work)

    def finish_trial(self, trial_id: str, finished_at: datetime) -> None:
        self.run(
            lambda conn: conn.execute(
                update(TrialRow)
                .where(TrialRow.trial_id == trial_id)
                .values(finished_at=finished_at)
            )
        )


def _aware(name: str, value: Any) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError as exc:
            raise BadRecord(f"{name}: not an ISO 8601 time: {value!r}") from exc
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise BadRecord(f"{name} must be a time with a UTC offset")
    return value


def _check_trial(trial: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(trial, dict):
        raise BadRecord("a trial must be an object")
    tid = trial.get("trial_id")
    if not isinstance(tid, str) or not _TRIAL_ID.match(tid):
        raise BadRecord("trial_id must be 32 lowercase hex digits")
    dest = trial.get("destination")
    if not isinstance(dest, str) or not 0 < len(dest) <= 255:
        raise BadRecord("destination must be a non-empty string")
    cap = trial.get("access_capacity_bps")
    if cap is not None and (not isinstance(cap, int | float) or not 0 < cap < 1e13):
        raise BadRecord("access_capacity_bps must be a positive number")
    for key in ("parameters", "versions"):
        if not isinstance(trial.get(key, {}), dict):
            raise BadRecord(f"{key} must be an object")
    periods = []
    for p in trial.get("periods") or []:
        try:
            periods.append(
                {
                    "period_index": int(p["index"]),
                    "pair": int(p["pair"]),
                    "protocol": _protocol(p["protocol"]),
                    "congestion_control": p.get("congestion_control"),
                    "start_offset_s": float(p["start_s"]),
                    "duration_s": float(p["duration_s"]),
                }
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise BadRecord(f"bad period {p!r}: {exc}") from None
    return {
        "row": {
            "trial_id": tid,
            "destination": dest,
            "access_capacity_bps": cap,
            "router_run_name": trial.get("router_run_name"),
            "parameters": trial.get("parameters") or {},
            "versions": trial.get("versions") or {},
            "started_at": _aware("started_at", trial.get("started_at")),
            "finished_at": _aware("finished_at", trial.get("finished_at")),
        },
        "periods": periods,
    }


def _protocol(value: Any) -> str:
    if value not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}")
    return value


def _check_flow(trial_id: str, f: dict[str, Any]) -> dict[str, Any]:
    """A flow record (kickass_core.flow_record) as a ``flows`` row."""
    if not isinstance(f, dict):
        raise BadRecord("a flow must be an object")
    try:
        flow_record.check(f)
        owner, _, _ = flow_record.parse_flow_id(f["flow_id"])
    except ValueError as exc:
        raise BadRecord(f"bad flow {str(f.get('flow_id'))[:80]}: {exc}") from None
    if owner != trial_id:
        raise BadRecord(f"flow {f['flow_id']} is not of trial {trial_id}")
    row = {k: f.get(k) for k in flow_record.FIELD_NAMES}
    row["started_at"] = _aware("started_at", row["started_at"])
    return row
