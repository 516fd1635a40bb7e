"""`/api/v1/schedule`: scheduled runs claimed by runner hosts, by the server's schedule.

A trial runner host holds a runner token, not database credentials; its
``kickass schedule run`` claims its items here
(``kickass_operations.claims.ApiClaims``). The server claims in the same
``item_runs`` table as every other host (``kickass_db.schedule_store``), so
the guarantee is the same: one run per item and due time. Every call is
signed with the runner's token (``kickass_core.signing``), and a run can
only be heartbeated or finished by the runner that holds it.

    POST /api/v1/schedule/claims              ClaimBody -> 201 {run_id, attempt, took_over}
                                              403 the schedule does not allow it (nothing stored)
                                              409 taken (alive, or over)
    POST /api/v1/schedule/runs/<id>/heartbeat 200, or 409 (no longer this runner's)
    PUT  /api/v1/schedule/runs/<id>           FinishBody -> 200, or 409

What a runner may claim is the server's to say, from its own copy of the
schedule file (the ``schedule_file`` setting: the file every host runs, read
again when it changes), never from the claim: the item must be in it, of a
kind a runner host runs, enabled, and name this runner among its ``host``
owners (or name none); the due time must be on the item's cron and have
started (its slip included; ``signing.WINDOW_S`` of clock skew allowed).
Anything else is a 403 that stores no run, counted per runner, item and
reason (``claim_refusals``: ``kickass schedule status``, ``/metrics``). The
claimed kind is the schedule's, not the body's.

A runner's run has no advisory lock (its process is not the server's): it
is dead when its heartbeat is older than the schedule's stale limit
(``Settings.stale_after_s``: at least four of its heartbeats). The
``stale_s`` a claim carries (runner hosts before this rule sent their own)
is ignored: nobody judges another's run by a limit of their choosing.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from flask import Blueprint, Response, current_app, jsonify, request
from flask.blueprints import BlueprintSetupState
from kickass_core import signing
from kickass_core.errors import KickassError
from kickass_db.schedule_store import ScheduleStore
from kickass_db.trial_store import TrialStore
from kickass_operations.schedule_file import Item, Schedule, database_kinds, load

from .http import ApiError, Unavailable, accepts, parse_body, signed_runner
from .schemas import ClaimBody, FinishBody, claim_example, finish_example

log = logging.getLogger("kickass.schedule")

bp = Blueprint("schedule", __name__, url_prefix="/api/v1/schedule")

# The runner names that may be a host in item_runs: "runner:NAME", so a
# runner cannot pass for a database host (or another runner).
HOST_PREFIX = "runner:"
# A due time whose start is this far in the server's future is not due yet:
# the clock skew a signed request is allowed anyway.
AHEAD_S = float(signing.WINDOW_S)


class ServerSchedule:
    """The schedule file the server judges claims by: loaded at start (a bad
    file stops the server), read again when it changes on disk; a change
    that does not load keeps the last good schedule, and says so in the log."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._stamp = self._stat()
        self._schedule, _ = load(self.path)

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def current(self) -> Schedule:
        stamp = self._stat()
        with self._lock:
            if stamp is not None and stamp != self._stamp:
                self._stamp = stamp
                try:
                    self._schedule, _ = load(self.path)
                    log.info("schedule file %s read again", self.path)
                except KickassError as exc:
                    log.error("schedule file %s not taken (kept the last good one): %s",
                              self.path, exc.message)  # fmt: skip
            return self._schedule


@bp.record_once
def _load_schedule(state: BlueprintSetupState) -> None:
    path = state.app.extensions["kickass"].config.schedule_file
    if path:
        state.app.extensions["kickass.schedule_file"] = ServerSchedule(path)


def server_schedule() -> Schedule | None:
    """The server's schedule (None: no ``schedule_file`` set)."""
    holder: ServerSchedule | None = current_app.extensions.get("kickass.schedule_file")
    return None if holder is None else holder.current()


def _stores() -> tuple[ScheduleStore, TrialStore]:
    svc = current_app.extensions["kickass"]
    if svc.schedule is None or svc.trials is None:
        raise Unavailable("this server takes no scheduled claims")
    return svc.schedule, svc.trials


def _runner() -> str:
    """The runner's name (401 unless signed by a known runner, fresh, not replayed)."""
    _schedule, trials = _stores()
    signed_runner(trials)
    return request.headers["X-Kickass-Key-Id"]


@dataclass(frozen=True)
class Refusal:
    reason: str  # one of kickass_db.models.operations.CLAIM_REFUSALS
    message: str


def may_claim(item: Item | None, name: str, runner: str, due: datetime,
              now: datetime) -> Refusal | None:  # fmt: skip
    """Why the runner ``runner`` may not claim ``name`` at ``due`` (None: it may)."""
    if item is None:
        return Refusal("not-in-schedule", f"the server's schedule has no item {name!r}")
    if item.kind in database_kinds():
        return Refusal("database-kind", f"{name} is a {item.kind} item: database hosts run it")
    if not item.enabled:
        return Refusal("disabled", f"{name} is disabled in the server's schedule")
    if not item.may_run(runner):
        owners = ", ".join(item.owners or ())
        return Refusal("not-owner", f"{name} is run by {owners}, not by runner {runner}")
    if not item.on_cron(due):
        return Refusal("not-due", f"{due.isoformat()} is not a due time of {name} ({item.cron})")
    start = due + item.slip(due)
    if start > now + timedelta(seconds=AHEAD_S):
        return Refusal("not-due", f"{name} due {due.isoformat()} starts at {start.isoformat()}")
    return None


@bp.post("/claims")
@accepts(ClaimBody, claim_example)
def claim() -> tuple[Response, int]:
    store, _ = _stores()
    runner = _runner()
    host = HOST_PREFIX + runner
    body = parse_body(ClaimBody)
    schedule = server_schedule()
    if schedule is None:
        raise ApiError(
            403, "no-schedule",
            "this server has no schedule file (schedule_file): it lets no runner claim a run",
        )  # fmt: skip
    item = schedule.find(body.item)
    refused = may_claim(item, body.item, runner, body.due_at, datetime.now(UTC))
    if refused is not None:
        # Counted under the item's name only if the schedule has it: made-up
        # names must not grow the table (or the metrics read from it).
        store.count_refusal(host, item.name if item else "", refused.reason, refused.message)
        raise ApiError(403, refused.reason, refused.message)
    assert item is not None
    stale_s = schedule.schedule.stale_after_s
    store.reap({item.name: body.due_at}, stale_s=stale_s)
    c = store.claim(
        item.name,
        item.kind,
        body.due_at,
        host,
        body.definition_hash,
        stale_s=stale_s,
        lock=False,
        owners=None if item.owners is None else [HOST_PREFIX + o for o in item.owners],
    )
    if c is None:
        raise ApiError(409, "taken", f"{body.item} due {body.due_at.isoformat()} is taken or over")
    return jsonify(run_id=c.run_id, attempt=c.attempt, took_over=c.took_over, host=host), 201


def _run_id(value: int) -> int:
    if not 0 < value < 2**63:
        raise ApiError(404, "not-found", "no such run")
    return value


@bp.post("/runs/<int:run_id>/heartbeat")
@accepts(None)
def heartbeat(run_id: int) -> Response:
    store, _ = _stores()
    host = HOST_PREFIX + _runner()
    if not store.heartbeat(_run_id(run_id), host):
        raise ApiError(409, "not-yours", "this run is not held by this runner (over or taken over)")
    return jsonify(run_id=run_id)


@bp.put("/runs/<int:run_id>")
@accepts(FinishBody, finish_example)
def finish(run_id: int) -> Response:
    store, _ = _stores()
    host = HOST_PREFIX + _runner()
    body = parse_body(FinishBody)
    done = store.finish(_run_id(run_id), host, body.outcome, body.reason, body.counts)
    if not done:
        raise ApiError(409, "not-yours", "this run is not held by this runner (over or taken over)")
    return jsonify(run_id=run_id, outcome=body.outcome)
