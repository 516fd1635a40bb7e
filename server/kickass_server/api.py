"""HTTP API under /api/v1: start a session, read its results, end it early.

``create_app(engine, store, config)`` builds the Flask app around a running
ProbeEngine (the live runs) and a StudyStore (the truth for results), one
blueprint per resource: ``sessions``, ``health``, ``stats``. Handlers only
ever see a run's frozen ``RunSnapshot``, never the engine's mutable state.

Errors are JSON ``{"error": code, "message": text}``. Bad input of any kind
is a 400 with a one-line log; 503 (with ``Retry-After``) means the database
or the engine is unavailable right now; 500 is a bug, and only a bug logs a
traceback.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import math
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from flask import Blueprint, Flask, Response, current_app, jsonify, request
from kickass_core.errors import KickassError
from kickass_core.plan import PlanError
from kickass_core.states import CREATED, FINAL_STATES, LIVE_STATES
from kickass_db.study_store import SessionRetired

from . import __version__, http, metrics, schedule_api, schemas, trials_api
from .client_report import ReportError, parse_report
from .engine import AdmissionDenied, EngineUnavailable, ProbeEngine
from .http import ApiError, RateLimited, accepts, parse_body
from .schemas import ClientReportBody, PlanRequest, SessionRequest
from .volunteer_page import PageConfig, add_page_path, install_page_state, volunteer_pages

log = logging.getLogger("kickass.api")

API_PREFIX = "/api/v1"
COOKIE_HEADER = "X-Kickass-Cookie"  # the volunteer client sends it (kickass_probe.api)
_SESSION_ID = re.compile(r"[0-9a-f]{16}\Z")


@dataclass(frozen=True)
class ApiConfig:
    """Settings of the HTTP API (``create_app``'s ``config``)."""

    # Host clients send UDP to, if not the API's own host name.
    probe_host: str | None = None
    # Behind a reverse proxy: the client address is the last X-Forwarded-For hop.
    trust_proxy: bool = False
    max_body_bytes: int = 16 * 1024
    # The end-of-session report carries the privileged fragment observation
    # (two compressed arrays of the plan's length): its own, larger limit,
    # within the HTTP front's (front.py, 256 KiB).
    max_report_bytes: int = 256 * 1024
    max_json_depth: int = 8
    # Retry-After on 503 and 429: the one policy (http.RetryAfter).
    retry_after: http.RetryAfter = http.RetryAfter()
    # How long /health trusts its last database check.
    health_cache_s: float = 2.0
    # Who may read GET /metrics (networks); others get a 404.
    metrics_from: tuple[str, ...] = ("127.0.0.0/8", "::1/128")
    # The schedule file runner hosts' claims are judged by (schedule_api.py);
    # None: no runner may claim a scheduled run.
    schedule_file: str | None = None

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None) -> ApiConfig:
        """From field names, in any case (``PROBE_HOST`` as Flask configs spell them)."""
        names = {f.name for f in fields(cls)}
        kwargs = {}
        for key, value in (values or {}).items():
            name = key.lower()
            if name not in names:
                raise KickassError(f"unknown API setting {key!r}", hint=f"one of {sorted(names)}")
            kwargs[name] = value
        return cls(**kwargs)


@dataclass
class _Services:
    engine: ProbeEngine
    store: Any  # kickass_db.study_store.StudyStore (duck-typed for tests)
    trials: Any  # kickass_db.trial_store.TrialStore, or None: uploads refused (503)
    config: ApiConfig
    health: _DatabaseCheck
    # kickass_db.schedule_store.ScheduleStore, or None: scheduled claims refused (503)
    schedule: Any = None


def _services() -> _Services:
    svc: _Services = current_app.extensions["kickass"]
    return svc


# -- sessions -------------------------------------------------------------------------

sessions = Blueprint("sessions", __name__, url_prefix=f"{API_PREFIX}/sessions")


@sessions.post("")
@accepts(SessionRequest, schemas.session_example)
def create_session() -> tuple[Response, int]:
    svc = _services()
    body = parse_body(SessionRequest, max_depth=svc.config.max_json_depth)
    try:
        plan = svc.engine.policy.plan_from_request(body.plan or PlanRequest())
    except PlanError as exc:
        raise ApiError(400, "bad-plan", str(exc)) from None
    address = _client_address(svc.config)
    try:
        new = svc.engine.create_session(
            plan,
            address,
            client_version=body.client_version,
            platform=body.platform,
            install_id=body.install_id,
            reassembly=None if body.reassembly is None else body.reassembly.to_metadata(),
        )
    except AdmissionDenied as exc:
        raise RateLimited(str(exc)) from None
    return (
        jsonify(
            session_id=new.session_id,
            cookie=new.cookie,
            probe_host=svc.config.probe_host,
            probe_port=svc.engine.probe_port,
            plan=new.plan.to_json(),
            total_probes=new.plan.total_probes,
            expires_in_s=new.expires_in_s,
            flow_control=new.flow_control,
        ),
        201,
    )


@sessions.get("/<session_id>")
def get_session(session_id: str) -> Response:
    svc = _services()
    sid = _session_id(session_id)
    # Liveness first: it is about the client, not about the database, and a
    # poll during a database outage still says the owner is there.
    svc.engine.touch(sid, request.headers.get(COOKIE_HEADER))
    res = _results(svc, sid)
    add_page_path(res, svc.store, sid, request.headers.get(COOKIE_HEADER))
    return jsonify(res)


@sessions.post("/<session_id>/end")
@accepts(None)
def end_session(session_id: str) -> Response:
    svc = _services()
    sid = _session_id(session_id)
    outcome = svc.engine.end_session(sid, request.headers.get(COOKIE_HEADER, ""))
    if outcome == "forbidden":
        raise ApiError(403, "forbidden", f"wrong or missing {COOKIE_HEADER}")
    if outcome == "not-found":
        # A session of an earlier server run is already final in the database.
        res = svc.store.session_results(sid)
        if res is None:
            raise ApiError(404, "not-found", "no such session")
        add_page_path(res, svc.store, sid, request.headers.get(COOKIE_HEADER))
        return jsonify(res)
    res = _results(svc, sid)
    add_page_path(res, svc.store, sid, request.headers.get(COOKIE_HEADER))
    return jsonify(res)


@sessions.post("/<session_id>/report")
@accepts(ClientReportBody, schemas.report_example)
def report_session(session_id: str) -> Response:
    """The client's end-of-session report (header ``X-Kickass-Cookie``): its
    reassembly memory before, during and after the split phase, the ranges it
    measured while its kernel refused fragments, and, when it observed
    fragments before reassembly (``--observe-fragments``), every probe's
    leading fragment. Only for a finished session; idempotent. Returns the
    results, whose verdict may have changed (invalid probes left out); 409
    ``retired`` (nothing changed) once the session's raw rows are archived."""
    svc = _services()
    sid = _session_id(session_id)
    body = parse_body(
        ClientReportBody, max_bytes=svc.config.max_report_bytes, max_depth=svc.config.max_json_depth
    )
    info = svc.store.report_context(sid)
    if info is None:
        raise ApiError(404, "not-found", "no such session")
    cookie = request.headers.get(COOKIE_HEADER, "")
    try:
        cookie_bytes = bytes.fromhex(cookie)
    except ValueError:
        cookie_bytes = b""
    stored = info["cookie_hash"] or b""
    if not cookie_bytes or not hmac.compare_digest(hashlib.sha256(cookie_bytes).digest(), stored):
        raise ApiError(403, "forbidden", f"wrong or missing {COOKIE_HEADER}")
    snap = svc.engine.snapshot(sid)
    if info["state"] not in FINAL_STATES and (snap is None or snap.state not in FINAL_STATES):
        raise ApiError(409, "not-finished", "the session is still running")
    if snap is not None and info["state"] not in FINAL_STATES:
        svc.engine.writer_sync()  # finished in the engine: its rows first
    try:
        report = parse_report(body, int(info["total_probes"]))
    except ReportError as exc:
        raise ApiError(400, "bad-request", str(exc)) from None
    obs = report.observations
    try:
        svc.store.record_client_report(
            sid,
            metadata=report.metadata,
            invalid_ranges=report.invalid_ranges,
            observations=None if obs is None else (obs.seqs, obs.leading, obs.fragments),
        )
    except SessionRetired as exc:
        # Its raw rows are in the archive (kickass archive retire): the counts
        # stay as they are, and the client hears why its report did nothing.
        raise ApiError(409, "retired", exc.message) from None
    res = _results(svc, sid)
    add_page_path(res, svc.store, sid, cookie)
    return jsonify(res)


def _session_id(value: str) -> str:
    if not _SESSION_ID.match(value):
        raise ApiError(404, "not-found", "no such session")
    return value


def _results(svc: _Services, sid: str) -> dict[str, Any]:
    res: dict[str, Any] | None = svc.store.session_results(sid)
    if res is None:
        raise ApiError(404, "not-found", "no such session")
    snap = svc.engine.snapshot(sid)
    if snap is not None and snap.state in FINAL_STATES and res["state"] not in FINAL_STATES:
        # Finished in the engine, not yet in the database: wait for the writer
        # so a client never reads a final state without its verdict.
        svc.engine.writer_sync()
        res = svc.store.session_results(sid) or res
    if snap is not None and res["state"] in LIVE_STATES:
        # The database lags the engine by one flush; live counters are fresher.
        if snap.state != CREATED:
            res["state"] = snap.state
        res["sent"] = max(res.get("sent") or 0, snap.sent)
        res["acked"] = max(res.get("acked") or 0, snap.acked)
    return res


# -- health -----------------------------------------------------------------------------

health = Blueprint("health", __name__, url_prefix=f"{API_PREFIX}/health")


# All that anyone may learn from /health about a database that is down: where
# it is (user, socket directory, database name) and the driver's error go to
# the server's log only.
DATABASE_DOWN = "database unavailable"


class _DatabaseCheck:
    """A cheap ``SELECT 1``, at most once per ``ttl`` whatever the request rate.
    The reason it failed is logged when it changes (once per outage), never
    answered."""

    def __init__(self, store: Any, ttl: float) -> None:
        self.store = store
        self.ttl = ttl
        self._lock = threading.Lock()
        self._at = -math.inf
        self._problem: str | None = None

    def problem(self) -> str | None:
        with self._lock:
            now = time.monotonic()
            if now - self._at >= self.ttl:
                problem = self._check()
                if problem != self._problem:
                    if problem is not None:
                        log.warning("health: %s", problem)
                    else:
                        log.info("health: the database is back")
                self._problem = problem
                self._at = time.monotonic()
            return None if self._problem is None else DATABASE_DOWN

    def _check(self) -> str | None:
        from kickass_db.engine import check_connection

        try:
            check_connection(self.store.engine)
        except KickassError as exc:
            return exc.message
        return None


@health.get("")
def get_health() -> Response:
    """200 either way: ``degraded`` names the parts that are down. Running
    sessions go on measuring (their outcomes wait in the writer), so the
    server is alive even when it cannot take new sessions."""
    svc = _services()
    parts: dict[str, dict[str, Any]] = {}
    db_problem = svc.health.problem()
    parts["database"] = (
        {"status": "ok"} if db_problem is None else {"status": "down", "detail": db_problem}
    )
    loop = svc.engine.loop_state
    parts["probe_engine"] = {"status": "down" if loop in ("stopped", "died") else "ok"}
    degraded = [name for name, p in parts.items() if p["status"] != "ok"]
    writer = svc.engine.writer
    # Informational: outcomes measured but not yet written (they wait, in
    # order, while the database is away).
    parts["db_writer"] = {
        "backlog": writer.q.qsize(),
        "failures": writer.failures,
        "dropped": writer.dropped,
    }
    return jsonify(
        status="degraded" if degraded else "ok",
        degraded=degraded,
        components=parts,
        server_version=__version__,
    )


# -- stats ------------------------------------------------------------------------------

stats = Blueprint("stats", __name__, url_prefix=f"{API_PREFIX}/stats")


@stats.get("")
def get_stats() -> Response:
    return jsonify(_services().engine.stats())


# -- input ------------------------------------------------------------------------------


def _client_address(config: ApiConfig) -> str:
    """The address admission limits are keyed on."""
    candidate = request.remote_addr or ""
    if config.trust_proxy:
        forwarded = request.headers.get("X-Forwarded-For", "")
        if forwarded.strip():
            # The last hop is the one our proxy appended; anything left of it
            # came from the client and would let it pick its own quota.
            candidate = forwarded.split(",")[-1].strip()
    try:
        ip = ipaddress.ip_address(candidate)
    except ValueError:
        raise ApiError(400, "bad-request", "cannot tell the client's address") from None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


# -- the app ------------------------------------------------------------------------------


def create_app(
    engine: ProbeEngine,
    store: Any,
    config: ApiConfig | Mapping[str, Any] | None = None,
    *,
    trials: Any = None,
    schedule: Any = None,
    page: PageConfig | None = None,
) -> Flask:
    """The Flask app around ``engine``, ``store`` and ``trials`` (a TrialStore;
    None: the trials endpoints answer 503); ``config`` is an ApiConfig or a
    mapping of its fields (any case: ``{"PROBE_HOST": ...}``)."""
    cfg = config if isinstance(config, ApiConfig) else ApiConfig.from_mapping(config)
    app = Flask("kickass_server")
    app.config["MAX_CONTENT_LENGTH"] = cfg.max_body_bytes
    app.extensions["kickass"] = _Services(
        engine, store, trials, cfg, _DatabaseCheck(store, cfg.health_cache_s), schedule
    )
    for bp in (sessions, health, stats, trials_api.bp, schedule_api.bp, metrics.bp):
        app.register_blueprint(bp)
    # The volunteer-facing pages: /, the one-file client, each session's page.
    app.register_blueprint(volunteer_pages)
    install_page_state(app, page)
    http.install(
        app,
        cfg.retry_after,
        unavailable=(EngineUnavailable,),
    )
    return app
