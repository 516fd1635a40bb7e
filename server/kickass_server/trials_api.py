"""`/api/v1/trials`: trial runners upload their results here.

Every call is signed by a runner (``kickass_core.signing``: an HMAC over the
method, path, time, a nonce and the body's digest, with the key derived from
the runner's token); the token itself never travels, and a replayed request
is refused (its nonce is kept in ``request_nonces``). Uploads are idempotent,
so a runner re-sending its spool after a lost answer is safe, and they answer
per record, so one bad record never takes its neighbours with it:

    PUT  /api/v1/trials/<trial_id>          the trial and its schedule (TrialBody)
    POST /api/v1/trials/<trial_id>/flows    {"flows": [...]} ->
         {"stored": [flow ids], "refused": [{"index", "flow_id", "error", "message"}]}

A refused record's ``error`` is ``bad-flow`` (it can never be stored as
sent) or ``conflict`` (its id is stored with other content: nothing was
replaced). One id twice in a batch: the first copy is stored, an identical
later copy is answered stored too, a different one is a conflict. A batch
of flows of a trial not uploaded yet is a 404 ``unknown-trial``: keep the
flows and send the trial first.
"""

from __future__ import annotations

import logging
from typing import Any

from flask import Blueprint, Response, current_app, jsonify, request
from kickass_core import flow_record
from kickass_db.trial_store import BadRecord, Conflict, TrialStore, UnknownTrial
from pydantic import ValidationError

from . import schemas
from .http import ApiError, M, Unavailable, accepts, parse_body, signed_runner
from .schemas import FlowRecord, FlowsBody, TrialBody, errors_text

log = logging.getLogger("kickass.trials")

bp = Blueprint("trials", __name__, url_prefix="/api/v1/trials")
# A batch of flow records is larger than the study's requests (the app's
# MAX_CONTENT_LENGTH); the HTTP front caps every body at 256 KiB.
MAX_BODY_BYTES = 256 * 1024


def _store() -> TrialStore:
    store: TrialStore | None = current_app.extensions["kickass"].trials
    if store is None:
        raise Unavailable("this server takes no trial uploads")
    return store


@bp.before_request
def _allow_batches() -> None:
    # Before the signature check reads the body: a batch of flow records is
    # larger than the study's requests (the app's cap).
    request.max_content_length = MAX_BODY_BYTES


def _upload(trial_id: str, model: type[M]) -> tuple[TrialStore, int, str, M]:
    """An upload's store, the signing runner's id (else ApiError 401: unsigned,
    bad, stale, replayed), the trial id and the body, checked in that order."""
    store = _store()
    return store, signed_runner(store), _trial_id(trial_id), parse_body(model)


def _trial_id(value: str) -> str:
    if not flow_record.TRIAL_ID_RE.fullmatch(value):
        raise ApiError(404, "not-found", "a trial id is 32 lowercase hex digits")
    return value


@bp.put("/<trial_id>")
@accepts(TrialBody, schemas.trial_example)
def put_trial(trial_id: str) -> Response:
    store, runner, tid, body = _upload(trial_id, TrialBody)
    if body.trial_id not in (None, tid):
        raise ApiError(400, "bad-request", "trial_id in the body differs from the URL")
    try:
        store.put_trial(runner, {**body.model_dump(), "trial_id": tid})
    except Conflict as exc:
        raise ApiError(409, "conflict", exc.message) from None
    except BadRecord as exc:
        raise ApiError(403, "forbidden", exc.message) from None
    return jsonify(trial_id=tid)


@bp.post("/<trial_id>/flows")
@accepts(FlowsBody, schemas.flows_example)
def put_flows(trial_id: str) -> Response:
    store, runner, tid, body = _upload(trial_id, FlowsBody)
    valid: list[dict[str, Any]] = []
    refused: list[dict[str, Any]] = []
    for index, item in enumerate(body.flows):
        fid = item.get("flow_id") if isinstance(item, dict) else None
        fid = fid[:80] if isinstance(fid, str) else None
        try:
            rec = FlowRecord.model_validate(item)
        except ValidationError as exc:
            refused.append(_refusal(index, fid, "bad-flow", errors_text(exc)))
            continue
        # FlowRecord's fields are made at run time (create_model): read them from the dump.
        record = rec.model_dump()
        if flow_record.parse_flow_id(record["flow_id"])[0] != tid:
            refused.append(_refusal(index, fid, "bad-flow", f"not a flow of trial {tid}"))
            continue
        valid.append({"_index": index, **record})
    try:
        result = store.put_flows(
            runner, tid, [{k: v for k, v in f.items() if k != "_index"} for f in valid]
        )
    except UnknownTrial as exc:
        raise ApiError(404, "unknown-trial", exc.message) from None
    for position, fid, why in result.conflicts:
        refused.append(_refusal(valid[position]["_index"], fid, "conflict", why))
    if refused:
        log.info("trial %s: %d of %d flows refused (first: %s)", tid, len(refused),
                 len(body.flows), refused[0]["message"][:120])  # fmt: skip
    refused.sort(key=lambda r: r["index"])
    return jsonify(stored=result.stored, refused=refused)


def _refusal(index: int, flow_id: str | None, error: str, message: str) -> dict[str, Any]:
    return {"index": index, "flow_id": flow_id, "error": error, "message": message}
