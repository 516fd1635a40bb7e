"""The HTTP conventions every blueprint shares: one error type, one body parser,
one place that decides ``Retry-After``.

Errors are JSON ``{"error": code, "message": text}``. Bad input of any kind
is a 4xx with a one-line log; 503 (with ``Retry-After``) means the database
or the engine is unavailable right now; 429 (with ``Retry-After``) is a rate
limit; 500 is a bug, and only a bug logs a traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from flask import Flask, Response, jsonify, request
from kickass_core import signing, strictjson
from kickass_db.retry import DatabaseUnavailable
from pydantic import BaseModel, ValidationError
from werkzeug.exceptions import HTTPException

from .schemas import errors_text

if TYPE_CHECKING:
    from kickass_db.trial_store import TrialStore

log = logging.getLogger("kickass.api")

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class RetryAfter:
    """Seconds a client should wait: the only source of ``Retry-After``."""

    unavailable_s: int = 10  # 503: the database or engine should be back by then
    rate_limited_s: int = 60  # 429


class ApiError(Exception):
    """A request the server answers with ``status`` (4xx, or a 503 with
    ``retry`` set); ``code`` is the machine-readable ``error`` field."""

    def __init__(self, status: int, code: str, message: str, *, retry: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.retry = status, code, message, retry


class Unavailable(ApiError):
    def __init__(self, message: str) -> None:
        super().__init__(503, "unavailable", message, retry="unavailable")


class RateLimited(ApiError):
    def __init__(self, message: str) -> None:
        super().__init__(429, "rate-limited", message, retry="rate-limited")


def one_line(exc: BaseException | str) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


V = TypeVar("V", bound=Callable[..., Any])


def accepts(
    model: type[BaseModel] | None,
    example: Callable[[dict[str, str]], dict[str, Any]] | None = None,
) -> Callable[[V], V]:
    """Declares what a view takes as its body: ``model`` (None: no body) and a
    valid ``example`` for given path arguments. The property test over every
    endpoint reads these, so a new endpoint is fuzzed without editing it."""

    def mark(view: V) -> V:
        view.body_model = model  # type: ignore[attr-defined]
        view.body_example = example  # type: ignore[attr-defined]
        return view

    return mark


def parse_body(model: type[M], *, max_bytes: int | None = None, max_depth: int = 8) -> M:
    """The request body as ``model``, or ApiError 400 (413 when too large).

    ``max_bytes`` raises the app's cap for this request (a batch of flow
    records, a report); the HTTP front caps every body anyway.
    """
    if max_bytes is not None:
        request.max_content_length = max_bytes
    if not request.is_json:
        raise ApiError(400, "bad-request", "expected a JSON body (Content-Type: application/json)")
    raw = request.get_data(cache=False)  # MAX_CONTENT_LENGTH: 413 beyond it
    try:
        value = strictjson.loads(raw, max_depth)
    except ValueError as exc:
        raise ApiError(400, "bad-request", f"the body is not valid JSON: {one_line(exc)}") from None
    if not isinstance(value, dict):
        raise ApiError(400, "bad-request", "expected a JSON object body")
    return validate(model, value)


def validate(model: type[M], value: Any, code: str = "bad-request") -> M:
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise ApiError(400, code, errors_text(exc)) from None


def signed_path() -> str:
    """The path a client signed: the path and, when there is one, its query."""
    query = request.query_string.decode("latin-1")
    return request.path + (f"?{query}" if query else "")


def signed_runner(store: TrialStore) -> int:
    """The id of the runner that signed this request (``store``: a TrialStore),
    or ApiError 401 with the reason (unsigned, unknown, bad, stale, replayed)."""
    ids: dict[str, int] = {}

    def key_for(name: str) -> bytes | None:
        found = store.runner_key(name)
        if found is None:
            return None
        ids[name] = found[0]
        return found[1]

    try:
        signed = signing.check(
            request.headers, request.method, signed_path(), request.get_data(cache=True), key_for
        )
    except signing.SignatureError as exc:
        raise ApiError(401, "unauthorized", str(exc)) from None
    runner = ids[signed.key_id]
    if store.seen_nonce(runner, signed.nonce, signing.WINDOW_S):
        raise ApiError(401, "unauthorized", "replayed request (its nonce was seen before)")
    return runner


def install(app: Flask, retry_after: RetryAfter, unavailable: tuple[type[Exception], ...]) -> None:
    """The error handlers of every blueprint; ``unavailable`` are the
    exception types that mean "try again shortly" (503)."""

    def respond(status: int, code: str, message: str, retry: str | None) -> tuple[Response, int]:
        resp = jsonify(error=code, message=message)
        if retry == "unavailable":
            resp.headers["Retry-After"] = str(retry_after.unavailable_s)
        elif retry == "rate-limited":
            resp.headers["Retry-After"] = str(retry_after.rate_limited_s)
        return resp, status

    @app.errorhandler(ApiError)
    def _api_error(exc: ApiError) -> tuple[Response, int]:
        log.info("%d %s %s %r: %s", exc.status, exc.code, request.method, request.path[:80],
                 one_line(exc.message))  # fmt: skip
        return respond(exc.status, exc.code, exc.message, exc.retry)

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> Any:
        if exc.code is None or exc.code < 400:
            return exc  # a redirect and the like: werkzeug's own response
        code = (exc.name or "error").lower().replace(" ", "-")
        log.info("%d %s %s %r", exc.code, code, request.method, request.path[:80])
        return respond(exc.code, code, exc.description or code, None)

    def _down(exc: Exception) -> tuple[Response, int]:
        message = getattr(exc, "message", None) or one_line(exc)
        log.warning("503 %s %r: %s", request.method, request.path[:80], message)
        if isinstance(exc, DatabaseUnavailable):
            message = "the database is unavailable right now; try again shortly"
        return respond(503, "unavailable", message, "unavailable")

    kinds: tuple[type[Exception], ...] = (DatabaseUnavailable, *unavailable)
    for kind in kinds:
        app.register_error_handler(kind, _down)

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception) -> tuple[Response, int]:
        # Not bad input (4xx) and not an outage (503): a bug.
        log.exception("500 %s %r", request.method, request.path[:80])
        return jsonify(error="internal-error", message="the server failed on this request"), 500
