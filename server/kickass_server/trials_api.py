"""`/api/v1/trials`: trial runners upload their results here (issue: wide-area trials).

Every call carries ``Authorization: Bearer <runner token>`` (tokens come from
`kickass trials runners add NAME`; only their hashes are stored). Uploads are
idempotent, so a runner re-sending its spool after a lost answer is safe:

    PUT  /api/v1/trials/<trial_id>          the trial and its schedule
    POST /api/v1/trials/<trial_id>/flows    {"flows": [...]} -> {"stored": [flow ids]}
"""

from __future__ import annotations

import logging
from typing import Any

from flask import Blueprint, current_app, jsonify, request
from kickass_core import strictjson
from kickass_db.retry import DatabaseUnavailable
from kickass_db.trial_store import BadRecord, TrialStore

log = logging.getLogger("kickass.trials")

bp = Blueprint("trials", __name__, url_prefix="/api/v1/trials")
MAX_FLOWS_PER_CALL = 500
# A batch of flow records is larger than the study's requests (the app's
# MAX_CONTENT_LENGTH); the HTTP front caps every body at 256 KiB.
MAX_BODY_BYTES = 256 * 1024


@bp.before_request
def _allow_batches() -> None:
    request.max_content_length = MAX_BODY_BYTES


def _store() -> TrialStore:
    return current_app.extensions["kickass.trials"]


def _error(status: int, code: str, message: str) -> Any:
    resp = jsonify(error=code, message=message)
    resp.status_code = status
    if status == 503:
        resp.headers["Retry-After"] = "30"
    return resp


def _runner() -> int | None:
    auth = request.headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return None
    return _store().authenticate(token.strip())


def _body() -> dict[str, Any] | None:
    try:
        body = strictjson.loads(request.get_data(cache=False))
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


@bp.put("/<trial_id>")
def put_trial(trial_id: str) -> Any:
    try:
        runner = _runner()
        if runner is None:
            return _error(401, "unauthorized", "a valid runner token is required")
        body = _body()
        if body is None:
            return _error(400, "bad-request", "expected a JSON object body")
        if body.get("trial_id", trial_id) != trial_id:
            return _error(400, "bad-request", "trial_id in the body differs from the URL")
        _store().put_trial(runner, {**body, "trial_id": trial_id})
    except BadRecord as exc:
        log.info("refused trial %s: %s", trial_id[:40], exc.message)
        return _error(400, "bad-trial", exc.message)
    except DatabaseUnavailable:
        return _error(503, "unavailable", "the database is unavailable; retry later")
    return jsonify(trial_id=trial_id), 200


@bp.post("/<trial_id>/flows")
def put_flows(trial_id: str) -> Any:
    try:
        runner = _runner()
        if runner is None:
            return _error(401, "unauthorized", "a valid runner token is required")
        body = _body()
        flows = body.get("flows") if body else None
        if not isinstance(flows, list) or len(flows) > MAX_FLOWS_PER_CALL:
            return _error(
                400, "bad-request", f'expected {{"flows": [...]}} with at most {MAX_FLOWS_PER_CALL}'
            )
        stored = _store().put_flows(runner, trial_id, flows)
    except BadRecord as exc:
        log.info("refused flows of trial %s: %s", trial_id[:40], exc.message)
        return _error(400, "bad-flows", exc.message)
    except DatabaseUnavailable:
        return _error(503, "unavailable", "the database is unavailable; retry later")
    return jsonify(stored=stored), 200


def register(app: Any, trials: TrialStore) -> None:
    app.extensions["kickass.trials"] = trials
    app.register_blueprint(bp)
