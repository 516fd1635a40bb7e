"""HTTP API under /api/v1: start a session, read its results, end it early.

The Flask app is built by ``create_app`` around a running ProbeEngine (which
owns the live sessions) and a Store (the truth for results). Errors are JSON
``{"error": code, "message": text}`` with a meaningful status.
"""

from __future__ import annotations

import logging
from typing import Any

from flask import Blueprint, Flask, current_app, jsonify, request
from kickass_core.plan import PlanError
from kickass_core.states import FINAL_STATES
from werkzeug.exceptions import HTTPException

from . import __version__
from .engine import AdmissionDenied, ProbeEngine

log = logging.getLogger("kickass.api")
bp = Blueprint("sessions", __name__, url_prefix="/api/v1")
MAX_BODY = 16 * 1024


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def _engine() -> ProbeEngine:
    return current_app.extensions["kickass_engine"]


def _store():  # noqa: ANN202
    return current_app.extensions["kickass_store"]


def _client_address() -> str:
    if current_app.config.get("TRUST_PROXY") and request.headers.get("X-Forwarded-For"):
        return request.headers["X-Forwarded-For"].split(",")[0].strip()
    return request.remote_addr or "0.0.0.0"


def _short(value: Any, limit: int = 64) -> str | None:
    return None if value is None else str(value)[:limit]


@bp.get("/health")
def health():  # noqa: ANN201
    return jsonify(status="ok", server_version=__version__)


@bp.get("/stats")
def stats():  # noqa: ANN201
    return jsonify(_engine().stats())


@bp.post("/sessions")
def create_session():  # noqa: ANN201
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        raise ApiError(400, "bad-request", "expected a JSON object body")
    plan_req = body.get("plan") or {}
    if not isinstance(plan_req, dict):
        raise ApiError(400, "bad-plan", "plan must be an object")
    engine = _engine()
    try:
        plan = engine.policy.plan_from_request(plan_req)
    except (PlanError, TypeError, ValueError) as exc:
        raise ApiError(400, "bad-plan", str(exc)) from None
    try:
        new = engine.create_session(
            plan,
            _client_address(),
            client_version=_short(body.get("client_version")),
            platform=_short(body.get("platform"), 128),
            install_id=_short(body.get("install_id")),
        )
    except AdmissionDenied as exc:
        resp = jsonify(error="rate-limited", message=str(exc))
        resp.status_code = 429
        resp.headers["Retry-After"] = "60"
        return resp
    return (
        jsonify(
            session_id=new.session_id,
            cookie=new.cookie,
            probe_host=current_app.config.get("PROBE_HOST"),
            probe_port=engine.probe_port,
            plan=new.plan.to_json(),
            total_probes=new.plan.total_probes,
            expires_in_s=new.expires_in_s,
        ),
        201,
    )


def _results(session_id: str) -> dict:
    if len(session_id) != 16 or any(c not in "0123456789abcdef" for c in session_id):
        raise ApiError(404, "not-found", "no such session")
    res = _store().session_results(session_id)
    if res is None:
        raise ApiError(404, "not-found", "no such session")
    live = _engine().live(session_id)
    if live is not None and live.state in FINAL_STATES and res["state"] not in FINAL_STATES:
        # Finished in the engine, not yet in the database: wait for the writer
        # so a client never reads a final state without its verdict.
        _engine().writer_sync()
        res = _store().session_results(session_id) or res
    if live is not None and res["state"] in ("created", "probing"):
        # The database lags the engine by one flush; live counters are fresher.
        res["state"] = live.state if live.state != "created" else res["state"]
        res["sent"] = max(res.get("sent") or 0, live.sent)
        res["acked"] = max(res.get("acked") or 0, live.acked)
    return res


@bp.get("/sessions/<session_id>")
def get_session(session_id: str):  # noqa: ANN201
    res = _results(session_id)
    _engine().touch(session_id)
    return jsonify(res)


@bp.post("/sessions/<session_id>/end")
def end_session(session_id: str):  # noqa: ANN201
    cookie = request.headers.get("X-Kickass-Cookie", "")
    outcome = _engine().end_session(session_id, cookie)
    if outcome == "forbidden":
        raise ApiError(403, "forbidden", "wrong or missing X-Kickass-Cookie")
    if outcome == "not-found":
        res = _store().session_results(session_id) if len(session_id) == 16 else None
        if res is None:
            raise ApiError(404, "not-found", "no such session")
        return jsonify(res)  # a session of an earlier server run: already final
    return jsonify(_results(session_id))


def create_app(engine: ProbeEngine, store: object, config: dict[str, Any] | None = None) -> Flask:
    app = Flask("kickass_server")
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY
    app.config.update(config or {})
    app.extensions["kickass_engine"] = engine
    app.extensions["kickass_store"] = store
    app.register_blueprint(bp)

    @app.errorhandler(ApiError)
    def _api_error(exc: ApiError):  # noqa: ANN202
        return jsonify(error=exc.code, message=exc.message), exc.status

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):  # noqa: ANN202
        code = (exc.name or "error").lower().replace(" ", "-")
        return jsonify(error=code, message=exc.description), exc.code

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):  # noqa: ANN202
        log.exception("unhandled error")
        # A database outage is the likely cause; say so without internals.
        return jsonify(error="unavailable", message="the server cannot serve this right now"), 503

    return app
