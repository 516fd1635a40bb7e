"""The probe client's HTTP layer: error mapping, retries, reply validation.

urlopen is replaced by a script of outcomes, so every failure mode is
exercised without a network (the loopback tests cover real sockets).
"""

from __future__ import annotations

import email.message
import io
import json
import socket
import urllib.error
import urllib.request
from typing import Any

import pytest
from kickass_core.plan import ProbePlan
from kickass_probe import api
from kickass_probe.api import ApiClient, ApiError, normalize_server_url, parse_retry_after
from kickass_probe.errors import EXIT_USAGE, ProbeError

SID = "0123456789abcdef"
COOKIE = "00112233445566778899aabbccddeeff"
PLAN = ProbePlan.quick()


class _Resp:
    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self._body = body

    def read(self, n: int = -1) -> bytes:
        return self._body

    def __enter__(self) -> _Resp:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _http_error(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    msg = email.message.Message()
    for k, v in (headers or {}).items():
        msg[k] = v
    raw = io.BytesIO(json.dumps(body).encode())
    return urllib.error.HTTPError("http://x/", status, "status", msg, raw)


def scripted(monkeypatch: pytest.MonkeyPatch, outcomes: list[Any]) -> list[Any]:
    """urlopen returns/raises each outcome in turn; returns the requests seen."""
    seen: list[Any] = []

    def fake_urlopen(req: Any, timeout: float) -> Any:
        seen.append(req)
        out = outcomes.pop(0)
        if isinstance(out, BaseException):
            raise out
        return out

    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
    return seen


def client(**kw: Any) -> tuple[ApiClient, list[float]]:
    waits: list[float] = []
    return ApiClient("http://measure.test/", timeout=1, sleep=waits.append, **kw), waits


def created_body(**over: Any) -> bytes:
    body = {
        "session_id": SID,
        "cookie": COOKIE,
        "probe_host": None,
        "probe_port": 9000,
        "plan": PLAN.to_json(),
        "total_probes": PLAN.total_probes,
        "expires_in_s": 30,
    }
    body.update(over)
    return json.dumps(body).encode()


def test_create_sends_the_contract_body(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = scripted(monkeypatch, [_Resp(201, created_body())])
    c, _ = client()
    assert c.create_session({"quick": True}, platform="Linux")["session_id"] == SID
    (req,) = seen
    assert req.full_url == "http://measure.test/api/v1/sessions"
    assert req.get_method() == "POST"
    body = json.loads(req.data)
    assert body == {
        "plan": {"quick": True},
        "client_version": "0.1.0",
        "platform": "Linux",
        "install_id": None,
    }
    assert req.get_header("User-agent").startswith("kickass-probe/")


def test_end_sends_the_cookie_header(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = scripted(monkeypatch, [_Resp(200, json.dumps({"state": "ended"}).encode())])
    c, _ = client()
    res = c.end_session(SID, COOKIE)
    assert res["state"] == "ended" and res["whole"] == [] and res["split"] == []
    assert seen[0].get_header("X-kickass-cookie") == COOKIE
    assert seen[0].full_url.endswith(f"/api/v1/sessions/{SID}/end")


def test_poll_sends_the_cookie_header_like_end(monkeypatch: pytest.MonkeyPatch) -> None:
    body = json.dumps({"state": "probing", "sent": 3}).encode()
    seen = scripted(monkeypatch, [_Resp(200, body), _Resp(200, body)])
    c, _ = client()
    assert c.get_session(SID, cookie=COOKIE)["state"] == "probing"
    assert seen[0].get_method() == "GET"
    assert seen[0].get_header("X-kickass-cookie") == COOKIE
    assert api.COOKIE_HEADER == "X-Kickass-Cookie"
    # Without a cookie (a third party reading a session) no header is sent.
    c.get_session(SID)
    assert seen[1].get_header("X-kickass-cookie") is None


def test_dns_failure_is_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    err = urllib.error.URLError(socket.gaierror(-2, "Name or service not known"))
    seen = scripted(monkeypatch, [err])
    c, waits = client()
    with pytest.raises(ProbeError) as info:
        c.health()
    assert "cannot resolve the server name 'measure.test'" in info.value.message
    assert len(seen) == 1 and waits == []


def test_refused_then_ok_is_retried_with_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    refused = urllib.error.URLError(ConnectionRefusedError(111, "refused"))
    ok = _Resp(200, b'{"status": "ok"}')
    scripted(monkeypatch, [refused, refused, ok])
    c, waits = client(backoff=0.5)
    assert c.health() == {"status": "ok"}
    assert waits == [0.5, 1.0]


def test_gateway_errors_are_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    bad = _http_error(502, {"error": "bad-gateway", "message": "upstream down"})
    scripted(monkeypatch, [bad, _Resp(200, b'{"status": "ok"}')])
    c, waits = client()
    assert c.health()["status"] == "ok" and len(waits) == 1


def test_client_errors_are_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = scripted(monkeypatch, [_http_error(400, {"error": "bad-plan", "message": "step 4"})])
    c, _ = client()
    with pytest.raises(ApiError) as info:
        c.create_session({"step": 4}, platform="Linux")
    assert info.value.status == 400 and info.value.code == "bad-plan"
    assert "the server rejected the request: step 4" in info.value.message
    assert len(seen) == 1


def test_busy_without_retry_after_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    scripted(monkeypatch, [_http_error(503, {"error": "unavailable", "message": "full"})])
    c, waits = client()
    with pytest.raises(ApiError) as info:
        c.create_session({"quick": True}, platform="Linux")
    assert info.value.message == "the server is busy: full"
    assert info.value.hint == "try again later" and waits == []


def test_retry_after_is_honoured_once(monkeypatch: pytest.MonkeyPatch) -> None:
    limited = _http_error(
        429, {"error": "rate-limited", "message": "slow down"}, {"Retry-After": "5"}
    )
    limited2 = _http_error(429, {"error": "rate-limited", "message": "still"}, {"Retry-After": "5"})
    seen = scripted(monkeypatch, [limited, limited2])
    c, waits = client()
    with pytest.raises(ApiError) as info:
        c.create_session({"quick": True}, platform="Linux")
    assert waits == [5.0] and len(seen) == 2
    assert "still" in info.value.message and info.value.hint == "try again in about 5 s"


@pytest.mark.parametrize(
    "body, message",
    [
        (b"<html>hi</html>", "is not JSON"),
        (b"[1, 2]", "not an object"),
        (b"\xff\xfe", "is not JSON"),
    ],
)
def test_non_json_replies(monkeypatch: pytest.MonkeyPatch, body: bytes, message: str) -> None:
    scripted(monkeypatch, [_Resp(200, body)])
    c, _ = client()
    with pytest.raises(ProbeError) as info:
        c.health()
    assert message in info.value.message and info.value.hint


@pytest.mark.parametrize(
    "over, message",
    [
        ({"session_id": "XYZ"}, "session_id"),
        ({"cookie": "abc"}, "cookie"),
        ({"probe_port": 0}, "probe_port"),
        ({"probe_port": True}, "probe_port"),
        ({"probe_host": ""}, "probe_host"),
        ({"probe_host": "a\x1b]0;x\x07"}, "probe_host"),
        ({"plan": None}, "no plan"),
        ({"total_probes": "lots"}, "total_probes is not a whole number"),
        ({"total_probes": -5}, "total_probes is not a whole number"),
        ({"total_probes": 1.5}, "total_probes is not a whole number"),
        ({"total_probes": True}, "total_probes is not a whole number"),
        ({"total_probes": 7}, "total_probes 7 does not match its plan"),
        ({"expires_in_s": "soon"}, "expires_in_s"),
    ],
)
def test_created_reply_is_validated(
    monkeypatch: pytest.MonkeyPatch, over: dict[str, Any], message: str
) -> None:
    ended = _Resp(200, json.dumps({"state": "ended"}).encode())
    seen = scripted(monkeypatch, [_Resp(201, created_body(**over)), ended])
    c, _ = client()
    with pytest.raises(ProbeError) as info:
        c.create_session({"quick": True}, platform="Linux")
    assert message in info.value.message
    assert info.value.message.startswith("the server sent a malformed reply: ")
    assert info.value.exit_code == 1
    if "session_id" in over or "cookie" in over:
        assert len(seen) == 1  # no session we could name
    else:
        # The server made a session this client cannot use: released at once.
        assert [r.get_method() for r in seen] == ["POST", "POST"]
        assert seen[1].full_url.endswith(f"/sessions/{SID}/end")
        assert seen[1].get_header("X-kickass-cookie") == COOKIE


def test_result_without_state_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    scripted(monkeypatch, [_Resp(200, b'{"whole": []}')])
    c, _ = client()
    with pytest.raises(ProbeError, match="no state"):
        c.get_session(SID)


def test_parse_retry_after() -> None:
    assert parse_retry_after("60") == 60.0
    assert parse_retry_after(" 1.5 ") == 1.5
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") is None
    assert parse_retry_after("-3") is None
    assert parse_retry_after(None) is None


def test_normalize_server_url() -> None:
    assert normalize_server_url("https://m.example.org/") == "https://m.example.org"
    assert normalize_server_url("http://m.example.org:8080/k/") == "http://m.example.org:8080/k"
    for bad in ("m.example.org", "ftp://m.example.org", "http://", "http://h:99999"):
        with pytest.raises(ProbeError) as info:
            normalize_server_url(bad)
        assert info.value.exit_code == EXIT_USAGE
