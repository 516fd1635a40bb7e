"""`/api/v1/schedule`: scheduled trial rounds claimed by runner hosts.

A trial runner host holds a runner token, not database credentials; its
``kickass schedule run`` claims its ``trials`` items here
(``kickass_operations.claims.ApiClaims``). The server claims in the same
``item_runs`` table as every other host (``kickass_db.schedule_store``), so
the guarantee is the same: one run per item and due time. Every call is
signed with the runner's token (``kickass_core.signing``), and a run can
only be heartbeated or finished by the runner that holds it.

    POST /api/v1/schedule/claims              ClaimBody -> 201 {run_id, attempt, took_over}
                                              409 taken (alive, or over)
    POST /api/v1/schedule/runs/<id>/heartbeat 200, or 409 (no longer this runner's)
    PUT  /api/v1/schedule/runs/<id>           FinishBody -> 200, or 409

A runner's run has no advisory lock (its process is not the server's): it
is dead when its heartbeat is older than the ``stale_s`` it claimed with.
"""

from __future__ import annotations

from flask import Blueprint, Response, current_app, jsonify, request
from kickass_db.schedule_store import ScheduleStore
from kickass_db.trial_store import TrialStore

from .http import ApiError, Unavailable, accepts, parse_body, signed_runner
from .schemas import ClaimBody, FinishBody, claim_example, finish_example

bp = Blueprint("schedule", __name__, url_prefix="/api/v1/schedule")

# The runner names that may be a host in item_runs: "runner:NAME", so a
# runner cannot pass for a database host (or another runner).
HOST_PREFIX = "runner:"


def _stores() -> tuple[ScheduleStore, TrialStore]:
    svc = current_app.extensions["kickass"]
    if svc.schedule is None or svc.trials is None:
        raise Unavailable("this server takes no scheduled claims")
    return svc.schedule, svc.trials


def _host() -> str:
    _schedule, trials = _stores()
    signed_runner(trials)  # 401 unless signed by a known runner, fresh, not replayed
    return HOST_PREFIX + request.headers["X-Kickass-Key-Id"]


@bp.post("/claims")
@accepts(ClaimBody, claim_example)
def claim() -> tuple[Response, int]:
    store, _ = _stores()
    host = _host()
    body = parse_body(ClaimBody)
    store.reap({body.item: body.due_at}, stale_s=body.stale_s)
    c = store.claim(
        body.item,
        body.kind,
        body.due_at,
        host,
        body.definition_hash,
        stale_s=body.stale_s,
        lock=False,
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
    host = _host()
    if not store.heartbeat(_run_id(run_id), host):
        raise ApiError(409, "not-yours", "this run is not held by this runner (over or taken over)")
    return jsonify(run_id=run_id)


@bp.put("/runs/<int:run_id>")
@accepts(FinishBody, finish_example)
def finish(run_id: int) -> Response:
    store, _ = _stores()
    host = _host()
    body = parse_body(FinishBody)
    done = store.finish(_run_id(run_id), host, body.outcome, body.reason, body.counts)
    if not done:
        raise ApiError(409, "not-yours", "this run is not held by this runner (over or taken over)")
    return jsonify(run_id=run_id, outcome=body.outcome)
