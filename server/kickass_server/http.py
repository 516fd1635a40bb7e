"""The HTTP conventions every blueprint shares, on Flask: one error type, one
body parser, one place that decides ``Retry-After``.

The convention itself is ``kickass_core.httpjson``, which the wan agent's
control API answers by too: errors are JSON ``{"error": code, "message":
text}``; bad input of any kind is a 4xx with a one-line log; 503 (with
``Retry-After``) means the database or the engine is unavailable right now;
429 (with ``Retry-After``) is a rate limit; 500 is a bug, and only a bug logs
a traceback. Here: Flask's side of it (the app's handlers, the request's body
cap, a signed runner).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from flask import Flask, Response, jsonify, request
from kickass_core import httpjson, signing
from kickass_core.httpjson import ApiError, RateLimited, RetryAfter, Unavailable, one_line
from kickass_db.retry import DatabaseUnavailable
from pydantic import BaseModel
from werkzeug.exceptions import HTTPException

if TYPE_CHECKING:
    from kickass_db.trial_store import TrialStore

log = logging.getLogger("kickass.api")

# The convention's names, as the blueprints import them from here.
__all__ = [
    "ApiError", "RateLimited", "RetryAfter", "Unavailable", "accepts", "install", "one_line",
    "parse_body", "signed_path", "signed_runner", "validate",
]  # fmt: skip

M = TypeVar("M", bound=BaseModel)

V = TypeVar("V", bound=Callable[..., Any])


def accepts(
    model: type[BaseModel] | None,
    example: Callable[[dict[str, str]], dict[str, Any]] | None = None,
) -> Callable[[V], V]:
    """Declares what a view takes as its body: ``model`` (None: no body) and a
    valid ``example`` for given path arguments. The property test over every
    endpoint reads these, so a new endpoint is fuzzed without editing it."""

    def mark(view: V) -> V:
        view.body_model = model  # type: ignore[attr-defined]  # a function's type declares no marks; the fuzz test reads them
        view.body_example = example  # type: ignore[attr-defined]  # a function's type declares no marks; the fuzz test reads them
        return view

    return mark


def parse_body(
    model: type[M], *, max_bytes: int | None = None, max_depth: int = httpjson.MAX_JSON_DEPTH
) -> M:
    """The request body as ``model`` (``httpjson.parse_json``), or ApiError 400
    (413 when too large).

    ``max_bytes`` raises the app's cap for this request (a batch of flow
    records, a report); the HTTP front caps every body anyway. A body must say
    it is JSON (the agent's control API, whose runners' requests are signed
    whatever their head says, does not ask).
    """
    if max_bytes is not None:
        request.max_content_length = max_bytes
    if not request.is_json:
        raise ApiError(400, "bad-request", "expected a JSON body (Content-Type: application/json)")
    raw = request.get_data(cache=False)  # MAX_CONTENT_LENGTH: 413 beyond it
    return httpjson.parse_json(raw, model, max_depth)


def validate(model: type[M], value: Any, code: str = httpjson.BAD_REQUEST) -> M:
    return httpjson.validate(model, value, code)


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
        resp = jsonify(httpjson.error_body(code, message))
        header = retry_after.header(retry)
        if header is not None:
            resp.headers["Retry-After"] = header
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
        return respond(503, httpjson.UNAVAILABLE, message, httpjson.UNAVAILABLE)

    kinds: tuple[type[Exception], ...] = (DatabaseUnavailable, *unavailable)
    for kind in kinds:
        app.register_error_handler(kind, _down)

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception) -> tuple[Response, int]:
        # Not bad input (4xx) and not an outage (503): a bug.
        log.exception("500 %s %r", request.method, request.path[:80])
        return jsonify(httpjson.error_body(*httpjson.INTERNAL)), 500
