"""JSON over HTTP as every server of the platform speaks it: the measurement
server's Flask app (``kickass_server.http``) and a wan agent's control API
(``kickass_wan.agent``, on ``http.server``).

One convention, whatever serves it:

* an error is JSON ``{"error": code, "message": text}`` (``ApiError``,
  ``error_body``): bad input of any kind a 4xx, 503 (with ``Retry-After``)
  something unavailable right now, 429 (with ``Retry-After``) a rate limit,
  500 a bug (``INTERNAL``, nothing more said);
* a body is read once, capped (``MAX_BODY_BYTES``, ``TOO_LARGE``), decoded
  as UTF-8, parsed strictly (``strictjson``: no NaN or infinity, nesting at
  most ``MAX_JSON_DEPTH``), must be an object, and only then meets a
  declared model (``parse_json``); the first problems of a model's refusal
  are one line naming the fields (``errors_text``);
* ``RetryAfter`` is the one policy for ``Retry-After``.

Here rather than in either server: the server may not import the agent's
package and the agent's host has no server, and like ``signing`` (how these
requests are signed) this belongs to both ends. Standard library only, as
all of core: the model is any class with pydantic's interface
(``model_validate``, refusing with a ``ValueError`` that lists ``errors()``),
which both servers declare their bodies with; nothing here imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from . import strictjson

# A body's cap where an endpoint sets none of its own, and how deep its JSON nests.
MAX_BODY_BYTES = 16 * 1024
MAX_JSON_DEPTH = 8
# Codes and messages both servers answer with.
BAD_REQUEST = "bad-request"
NOT_FOUND = "not-found"
TOO_LARGE = "request-entity-too-large"
UNAVAILABLE = "unavailable"
RATE_LIMITED = "rate-limited"
INTERNAL = ("internal-error", "the server failed on this request")

D = TypeVar("D", bound="DeclaredModel")


class DeclaredModel(Protocol):
    """A body's declared model (a pydantic model)."""

    @classmethod
    def model_validate(cls: type[D], obj: Any) -> D: ...


@dataclass(frozen=True)
class RetryAfter:
    """Seconds a client should wait: the only source of ``Retry-After``."""

    unavailable_s: int = 10  # 503: the database or engine should be back by then
    rate_limited_s: int = 60  # 429

    def header(self, retry: str | None) -> str | None:
        """The ``Retry-After`` value of an answer whose ``ApiError.retry`` is
        ``retry`` (None: the answer has none)."""
        if retry == UNAVAILABLE:
            return str(self.unavailable_s)
        if retry == RATE_LIMITED:
            return str(self.rate_limited_s)
        return None


class ApiError(Exception):
    """A request answered with ``status`` (4xx, or a 503 with ``retry`` set);
    ``code`` is the machine-readable ``error`` field."""

    def __init__(self, status: int, code: str, message: str, *, retry: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.retry = status, code, message, retry


class Unavailable(ApiError):
    def __init__(self, message: str) -> None:
        super().__init__(503, UNAVAILABLE, message, retry=UNAVAILABLE)


class RateLimited(ApiError):
    def __init__(self, message: str) -> None:
        super().__init__(429, RATE_LIMITED, message, retry=RATE_LIMITED)


def error_body(code: str, message: str) -> dict[str, str]:
    """An error's JSON body."""
    return {"error": code, "message": message}


def one_line(exc: BaseException | str) -> str:
    """The first line of an error, at most 200 characters (what a log and a
    client are told)."""
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


def errors_text(exc: Any, limit: int = 3) -> str:
    """A model's refusal (a pydantic ValidationError) as one short line:
    'field.path: problem; ...'."""
    parts = []
    for err in exc.errors(include_url=False, include_input=False)[:limit]:
        where = ".".join(str(p) for p in err.get("loc", ())) or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid')}"[:160])
    more = exc.error_count() - len(parts)
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def too_large(max_bytes: int) -> ApiError:
    """The answer to a body over its cap."""
    return ApiError(413, TOO_LARGE, f"the body is larger than {max_bytes} bytes")


def body_length(header: str | None, max_bytes: int = MAX_BODY_BYTES) -> int:
    """A request's body length from its ``Content-Length`` (none: 0), for a
    server that reads the body itself; ApiError 400 if it is not a length,
    413 beyond ``max_bytes``."""
    try:
        length = int(header or 0)
    except ValueError:
        raise ApiError(400, BAD_REQUEST, "Content-Length is not a number") from None
    if length < 0:
        raise ApiError(400, BAD_REQUEST, "Content-Length is not a number")
    if length > max_bytes:
        raise too_large(max_bytes)
    return length


def validate(model: type[D], value: Any, code: str = BAD_REQUEST) -> D:
    """``value`` as ``model``, or ApiError 400 naming the fields at fault."""
    try:
        return model.model_validate(value)
    except ValueError as exc:
        if not hasattr(exc, "errors"):
            raise  # not a refusal of the value: a bug, answered as one
        raise ApiError(400, code, errors_text(exc)) from None


def parse_json(raw: bytes, model: type[D], max_depth: int = MAX_JSON_DEPTH) -> D:
    """A request's body (already within its cap) as ``model``, or ApiError 400."""
    try:
        value = strictjson.loads(raw, max_depth)
    except ValueError as exc:
        raise ApiError(400, BAD_REQUEST, f"the body is not valid JSON: {one_line(exc)}") from None
    if not isinstance(value, dict):
        raise ApiError(400, BAD_REQUEST, "expected a JSON object body")
    return validate(model, value)
