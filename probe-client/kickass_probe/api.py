"""HTTP client of the measurement server's API (stdlib urllib only).

The volunteer client must stay a tiny install, so no requests: urllib with
bounded retries and backoff, and every failure turned into a ProbeError whose
message says what happened and whose hint says what to do.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kickass_core import strictjson
from kickass_core.plan import PlanError, PlanTooLarge, ProbePlan, UnsupportedPlan

from . import __version__
from .errors import EXIT_USAGE, ProbeError
from .session import MAX_PLAN_PROBES

if TYPE_CHECKING:
    # Python 3.10+; used in annotations only, which are never evaluated at run
    # time (the one-file client runs on 3.9).
    from typing import TypeGuard

API_PREFIX = "/api/v1"
DEFAULT_TRIES = 3
DEFAULT_BACKOFF_S = 0.5
# A Retry-After longer than this is reported instead of waited for: a
# volunteer should not stare at a silent terminal for minutes.
MAX_RETRY_AFTER_S = 60.0
# Gateway errors are usually a proxy in front of a restarting server.
RETRYABLE_STATUS = frozenset({502, 504})
MAX_REPLY_BYTES = 8 << 20
USER_AGENT = f"kickass-probe/{__version__}"
# The session's secret cookie (32 hex digits, from POST /sessions) travels in
# this header on every request about the session: /end needs it, and the
# server counts a GET as a sign of life only when it carries it.
COOKIE_HEADER = "X-Kickass-Cookie"
# Server text shown on the terminal (error messages, reasons) is cut to this.
MAX_TEXT_CHARS = 300
# A host name is at most 253 characters; the probe host is one, or an address.
_HOST = re.compile(r"^[A-Za-z0-9._-]{1,253}$")


_HEX16 = re.compile(r"^[0-9a-f]{16}$")
# The path of the session's page on the server (its results next to other
# volunteers'), as the server sends it once the session is final.
_PAGE_PATH = re.compile(r"^(/[A-Za-z0-9._~-]+){1,8}$")
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_UPGRADE_HINT = "upgrade kickass-probe: pip install -U kickass-probe"

_SERVER_HINT = "check --server (or KICKASS_SERVER) and that the measurement server is running"
# A timed-out socket raises socket.timeout, an alias of TimeoutError only since
# Python 3.10 (on 3.9 it is a plain OSError).
_TIMEOUTS = (TimeoutError, socket.timeout)


def normalize_server_url(url: str) -> str:
    """Validate ``--server`` and drop a trailing slash."""
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ProbeError(
            f"--server must be an http:// or https:// URL, got {url!r}",
            hint="for example: kickass-probe --server https://measure.example.org",
            exit_code=EXIT_USAGE,
        )
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise ProbeError(f"bad port in --server {url!r}", exit_code=EXIT_USAGE) from None
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))


def server_host(url: str) -> str:
    return urllib.parse.urlsplit(url).hostname or ""


class ApiError(ProbeError):
    """The server answered with an error status."""

    def __init__(
        self,
        status: int,
        code: str | None,
        message: str,
        hint: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message, hint)
        self.status = status
        self.code = code
        self.retry_after = retry_after


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header; the HTTP-date form is ignored."""
    if not value:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return seconds if seconds >= 0 else None


class ApiClient:
    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 10.0,
        tries: int = DEFAULT_TRIES,
        backoff: float = DEFAULT_BACKOFF_S,
        log: Callable[[str], None] | None = None,
        notify: Callable[[str], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.base_url = normalize_server_url(base_url)
        self.timeout = timeout
        self.tries = tries
        self.backoff = backoff
        self._log = log or (lambda _msg: None)
        # What the user must see even without --verbose (a long wait).
        self._notify = notify or self._log
        self._sleep = sleep

    # -- the contract -----------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return self._request("GET", "/health")

    def create_session(
        self,
        plan_request: dict[str, Any],
        *,
        platform: str,
        client_version: str = __version__,
        reassembly: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "plan": plan_request,
            "client_version": client_version,
            "platform": platform,
            # No persistent identifier: the consent notice promises nothing else.
            "install_id": None,
        }
        if reassembly is not None:
            # This system's reassembly limits and counters, and the split
            # credit: the server bounds the split phase by what we report.
            body["reassembly"] = reassembly
        reply = self._request("POST", "/sessions", body, honour_retry_after=True)
        try:
            return validate_created(reply)
        except ProbeError:
            # The server did create a session we cannot use: release it now
            # rather than leave it to the server's expiry.
            sid, cookie = reply.get("session_id"), reply.get("cookie")
            if (
                isinstance(sid, str)
                and _HEX16.match(sid)
                and isinstance(cookie, str)
                and _HEX32.match(cookie)
            ):
                with contextlib.suppress(ProbeError):
                    self.end_session(sid, cookie, tries=1, timeout=min(self.timeout, 5.0))
            raise

    def get_session(
        self,
        session_id: str,
        *,
        cookie: str | None = None,
        tries: int | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """The session's state and results; ``cookie`` marks the poll as ours.

        The server treats a GET as the client's liveness only when it carries
        the session cookie (anyone may read a session by its id), so the
        runner's polls pass it, in the same header as ``end_session``.
        """
        headers = {COOKIE_HEADER: cookie} if cookie else None
        reply = self._request(
            "GET", f"/sessions/{session_id}", headers=headers, tries=tries, timeout=timeout
        )
        return validate_result(reply)

    def end_session(
        self,
        session_id: str,
        cookie: str,
        *,
        tries: int | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        reply = self._request(
            "POST",
            f"/sessions/{session_id}/end",
            {},
            headers={COOKIE_HEADER: cookie},
            tries=tries,
            timeout=timeout,
        )
        return validate_result(reply)

    def report_session(
        self,
        session_id: str,
        cookie: str,
        report: dict[str, Any],
        *,
        tries: int | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """The end-of-session report (reassembly memory, refused-fragment
        ranges, fragment observations); the reply is the session's results."""
        reply = self._request(
            "POST",
            f"/sessions/{session_id}/report",
            report,
            headers={COOKIE_HEADER: cookie},
            tries=tries,
            timeout=timeout,
        )
        return validate_result(reply)

    def session_url(self, session_id: str) -> str:
        return f"{self.base_url}{API_PREFIX}/sessions/{session_id}"

    def page_url(self, page_path: object) -> str | None:
        """The session's page (HTML) from the ``page_path`` the server sent,
        on the server this client talks to; None if none or not a plain path."""
        if not isinstance(page_path, str) or not _PAGE_PATH.match(page_path):
            return None
        if any(part in (".", "..") for part in page_path.split("/")):
            return None
        return f"{self.base_url}{page_path}"

    # -- transport ----------------------------------------------------------------

    def _request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        headers: dict[str, str] | None = None,
        tries: int | None = None,
        timeout: float | None = None,
        honour_retry_after: bool = False,
    ) -> dict[str, Any]:
        url = f"{self.base_url}{API_PREFIX}{path}"
        tries = tries or self.tries
        timeout = timeout or self.timeout
        waited_for_server = False
        attempt = 0
        while True:
            attempt += 1
            try:
                return self._once(method, url, body, headers or {}, timeout)
            except ApiError as exc:
                if (
                    honour_retry_after
                    and not waited_for_server
                    and exc.status in (429, 503)
                    and exc.retry_after is not None
                    and exc.retry_after <= MAX_RETRY_AFTER_S
                ):
                    # One bounded wait, as the server asked; a second refusal
                    # is reported rather than waited for again.
                    waited_for_server = True
                    self._notify(f"{exc.message}; retrying in {exc.retry_after:g} s as asked")
                    self._sleep(exc.retry_after)
                    attempt -= 1
                    continue
                if exc.status not in RETRYABLE_STATUS or attempt >= tries:
                    raise
                self._log(f"{method} {path}: HTTP {exc.status}, retrying")
            except _Transient as exc:
                if attempt >= tries:
                    raise exc.final(self.base_url, timeout, attempt) from None
                self._log(f"{method} {path}: {exc.what}, retrying")
            self._sleep(self.backoff * 2 ** (attempt - 1))

    def _once(
        self,
        method: str,
        url: str,
        body: dict[str, Any] | None,
        headers: dict[str, str],
        timeout: float,
    ) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method)
        req.add_header("User-Agent", USER_AGENT)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        for k, v in headers.items():
            req.add_header(k, v)
        self._log(f"{method} {url}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                # One byte more than allowed tells "too large" from "exactly the limit".
                raw = resp.read(MAX_REPLY_BYTES + 1)
                status = resp.status
        except urllib.error.HTTPError as exc:
            raise _http_error(exc) from None
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, socket.gaierror):
                host = server_host(url)
                raise ProbeError(
                    f"cannot resolve the server name {host!r} ({reason.strerror})",
                    hint="check the --server URL and your Internet connection",
                ) from None
            if isinstance(reason, _TIMEOUTS):
                raise _Transient("timeout", "no reply") from None
            if isinstance(reason, ConnectionRefusedError):
                raise _Transient("refused", "connection refused") from None
            if isinstance(reason, OSError):
                raise _Transient("network", reason.strerror or str(reason)) from None
            raise _Transient("network", str(reason)) from None
        except _TIMEOUTS:
            raise _Transient("timeout", "no reply") from None
        except (http.client.HTTPException, ConnectionError) as exc:
            raise _Transient("network", f"connection broken ({type(exc).__name__})") from None
        return _parse_json(raw, status)


class _Transient(Exception):
    """A network failure worth retrying; ``final`` is what the user sees."""

    def __init__(self, kind: str, what: str) -> None:
        super().__init__(what)
        self.kind = kind
        self.what = what

    def final(self, base_url: str, timeout: float, attempts: int) -> ProbeError:
        tried = f"{attempts} attempt{'s' if attempts != 1 else ''}"
        if self.kind == "timeout":
            return ProbeError(
                f"the server at {base_url} did not reply within {timeout:g} s ({tried})",
                hint="the server or your network may be overloaded; try later or raise --timeout",
            )
        if self.kind == "refused":
            return ProbeError(
                f"cannot connect to the server at {base_url}: connection refused ({tried})",
                hint=_SERVER_HINT,
            )
        return ProbeError(
            f"cannot reach the server at {base_url}: {self.what} ({tried})", hint=_SERVER_HINT
        )


def loads_strict(raw: bytes) -> Any:
    """JSON from the server, or ValueError (never RecursionError or NaN)."""
    # UnicodeDecodeError, JSONDecodeError and the digit limit of huge
    # integers are all ValueError too.
    return strictjson.loads(raw)


def _parse_json(raw: bytes, status: int) -> dict[str, Any]:
    if len(raw) > MAX_REPLY_BYTES:
        raise ProbeError(
            f"the server's reply (HTTP {status}) is larger than {MAX_REPLY_BYTES >> 20} MB",
            hint="is --server the Kick-Ass measurement server (not a download or proxy)?",
        )
    try:
        value = loads_strict(raw)
    except ValueError:
        snippet = printable(raw[:60].decode("utf-8", "replace").strip(), 60)
        raise ProbeError(
            f"the server's reply (HTTP {status}) is not JSON: {snippet!r}",
            hint="is --server the Kick-Ass measurement server (not a web page or proxy)?",
        ) from None
    if not isinstance(value, dict):
        raise ProbeError(
            f"the server's reply (HTTP {status}) is JSON but not an object",
            hint="is --server the Kick-Ass measurement server?",
        )
    return value


def _http_error(exc: urllib.error.HTTPError) -> ApiError:
    status = exc.code
    try:
        raw = exc.read(MAX_REPLY_BYTES)
    except OSError:
        raw = b""
    code: str | None = None
    message = ""
    try:
        body = loads_strict(raw[:MAX_REPLY_BYTES])
    except ValueError:
        body = None
    if isinstance(body, dict):
        code = printable(body["error"], 64) if isinstance(body.get("error"), str) else None
        text = body.get("message")
        message = printable(text if isinstance(text, str) else code or "")
    retry_after = parse_retry_after(exc.headers.get("Retry-After") if exc.headers else None)
    reason = printable(exc.reason) if isinstance(exc.reason, str) else ""
    detail = message or reason or "no details"
    when = f"in about {retry_after:g} s" if retry_after is not None else "later"
    if status == 429:
        return ApiError(
            status, code, f"rate-limited by the server: {detail}", f"try again {when}", retry_after
        )
    if status == 503:
        return ApiError(
            status, code, f"the server is busy: {detail}", f"try again {when}", retry_after
        )
    if status == 404:
        return ApiError(
            status,
            code,
            f"not found on the server (HTTP 404): {detail}",
            "the session may have expired, or --server is not the measurement server",
        )
    if status == 400:
        return ApiError(
            status,
            code,
            f"the server rejected the request: {detail}",
            "check --repetitions, --step and --window, or upgrade kickass-probe",
        )
    if status in (401, 403):
        return ApiError(status, code, f"the server refused: {detail}")
    if status >= 500:
        return ApiError(status, code, f"server error (HTTP {status}): {detail}", "try again later")
    return ApiError(status, code, f"the server answered HTTP {status}: {detail}")


def printable(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    """Server text made safe for a terminal: no control characters, bounded.

    A server (or whatever answers at --server) could otherwise move the
    cursor, retitle the window or flood the screen through an error message.
    """
    out = "".join(c if c.isprintable() else "?" for c in text[: limit + 1])
    return out if len(out) <= limit else out[: limit - 3] + "..."


# -- what the server's replies must look like ------------------------------------------
#
# Every field the client uses is checked here, once, so that no later code
# meets a string where it expects a count: a malformed reply is a ProbeError
# ("the server sent a malformed reply: ..."), never a traceback.


def malformed(what: str) -> ProbeError:
    return ProbeError(
        f"the server sent a malformed reply: {what}",
        hint="the server may be a different version or misconfigured; try upgrading "
        "kickass-probe, or try again later",
    )


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _show_int(value: int) -> str:
    # Python refuses to print integers of more than 4300 digits; a hostile
    # reply may carry one.
    return f"{value:,}" if abs(value) < 10**18 else "an absurdly large number"


def _count(d: dict[str, Any], key: str, where: str, *, minimum: int = 0) -> int:
    value = d.get(key)
    if not _is_int(value) or value < minimum:
        raise malformed(f"{where}{key} is not a whole number of at least {minimum}")
    return int(value)


def _optional_count(d: dict[str, Any], key: str, where: str = "") -> None:
    if d.get(key) is not None:
        _count(d, key, where)


def _optional_str(d: dict[str, Any], key: str, where: str = "") -> None:
    if d.get(key) is not None and not isinstance(d.get(key), str):
        raise malformed(f"{where}{key} is neither null nor text")


def parse_plan(value: Any) -> ProbePlan:
    """The server's probe plan, checked before anything is allocated for it.

    The client keeps a byte per probe and counters per size, so a plan is
    refused when it is malformed or larger than MAX_PLAN_PROBES (a plan of a
    billion probes would otherwise take a gigabyte of the volunteer's memory).
    The checks are the core's (``ProbePlan.from_json``); this adds the wording.
    """
    if value is None:
        raise malformed("no plan")
    try:
        return ProbePlan.from_json(value, max_probes=MAX_PLAN_PROBES)
    except UnsupportedPlan as exc:
        raise ProbeError(
            f"this client cannot follow the server's probe plan ({printable(str(exc), 80)})",
            hint=_UPGRADE_HINT,
        ) from None
    except PlanTooLarge as exc:
        raise ProbeError(
            f"the server's plan has {_show_int(exc.total)} probes, more than this client "
            f"accepts ({MAX_PLAN_PROBES:,})",
            hint="the server is misconfigured or not the Kick-Ass measurement server; "
            "try again later or tell its operators",
        ) from None
    except PlanError as exc:
        raise malformed(str(exc)) from None


def validate_created(reply: dict[str, Any]) -> dict[str, Any]:
    sid = reply.get("session_id")
    cookie = reply.get("cookie")
    if not isinstance(sid, str) or not _HEX16.match(sid):
        raise malformed("session_id is not 16 hex digits")
    if not isinstance(cookie, str) or not _HEX32.match(cookie):
        raise malformed("cookie is not 32 hex digits")
    port = reply.get("probe_port")
    if not _is_int(port) or not 0 < port < 65536:
        raise malformed("probe_port is not a port number")
    host = reply.get("probe_host")
    if host is not None and (not isinstance(host, str) or not _HOST.match(host)):
        raise malformed("probe_host is neither null nor a host name")
    plan = parse_plan(reply.get("plan"))
    total = reply.get("total_probes")
    if total is not None:
        _count(reply, "total_probes", "")
        if total != plan.total_probes:
            raise malformed(
                f"total_probes {_show_int(total)} does not match its plan "
                f"({plan.total_probes:,} probes)"
            )
    expires = reply.get("expires_in_s")
    if expires is not None and (
        not isinstance(expires, (int, float)) or isinstance(expires, bool) or expires < 0
    ):
        raise malformed("expires_in_s is not a number of seconds")
    return reply


def validate_result(reply: dict[str, Any]) -> dict[str, Any]:
    """A session's state and results (GET and /end replies)."""
    state = reply.get("state")
    if not isinstance(state, str) or not state:
        raise malformed("session has no state")
    for key in ("verdict", "verdict_reason", "end_reason", "url", "server_version", "page_path"):
        _optional_str(reply, key)
    for key in ("sent", "acked", "total_probes"):
        _optional_count(reply, key)
    if reply.get("plan") is not None and not isinstance(reply.get("plan"), dict):
        raise malformed("plan is not an object")
    for phase, size_key in (("whole", "ip_len"), ("split", "leading_ip_len")):
        rows = reply.get(phase)
        if rows is None:
            reply[phase] = []
            continue
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise malformed(f"{phase!r} is not a list of rows")
        for i, row in enumerate(rows):
            where = f"{phase}[{i}]."
            # Split rows may name their size ip_len (output.phase_rows).
            key = size_key if size_key in row or phase == "whole" else "ip_len"
            _count(row, key, where)
            _optional_count(row, "sent", where)
            _optional_count(row, "acked", where)
            rate = row.get("drop_rate")
            if rate is not None and (
                not isinstance(rate, (int, float))
                or isinstance(rate, bool)
                or not math.isfinite(rate)
            ):
                raise malformed(f"{where}drop_rate is neither null nor a number")
    return reply
