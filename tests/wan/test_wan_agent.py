"""`kickass-agent` as a real process: control API, tokens, TCP flows, restarts."""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from kickass_core import signing
from kickass_wan.tcpflow import send_flow

AGENT = str(Path(sys.executable).parent / "kickass-agent")
SECRET = "ab" * 32


@contextmanager
def agent(state: Path) -> Iterator[tuple[int, subprocess.Popen]]:
    port, proc = start_agent(state)
    try:
        yield port, proc
    finally:
        proc.terminate()
        proc.wait(10)


def start_agent(
    state: Path, control: int = 0, tcp: int = 0, extra: tuple[str, ...] = ()
) -> tuple[int, subprocess.Popen]:
    """A kickass-agent on loopback (0: any free port); returns its control
    port once it is ready. The caller stops it."""
    proc = subprocess.Popen(
        [AGENT, "--listen", f"127.0.0.1:{control}", "--tcp-port", str(tcp),
         "--kickass-receiver", "none", "--state-dir", str(state), "--name", "far-1", *extra],
        env={**os.environ, "KICKASS_AGENT_SECRET": SECRET}, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stderr is not None
    for line in proc.stderr:
        if m := re.search(r"ready on (\d+)", line):
            return int(m.group(1)), proc
    proc.kill()
    proc.wait(10)
    raise AssertionError("agent did not start")


def _call(
    port: int, path: str, body: dict | None = None, secret: str | None = SECRET
) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    method = "POST" if body is not None else "GET"
    headers = {}
    if secret:
        key = signing.key_from_secret(secret)
        headers = signing.sign(key, signing.AGENT_KEY_ID, method, path, data or b"")
    return _send(port, method, path, data, headers)


def _send(
    port: int, method: str, path: str, data: bytes | None, headers: dict[str, str]
) -> tuple[int, dict]:
    """One request with exactly these headers (a captured one, sent again)."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, method=method, headers=headers
    )
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_agent_serves_tcp_flows_to_token_holders_and_survives_restarts(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with agent(state) as (port, proc):
        status, health = _call(port, "/v1/health")
        assert status == 200 and health["status"] == "ok" and health["name"] == "far-1"
        assert _call(port, "/v1/version")[1]["agent"]
        assert _call(port, "/v1/tokens", {"kind": "tcp"}, secret=None)[0] == 401
        assert _call(port, "/v1/tokens", {"kind": "tcp"}, secret="wrong")[0] == 401
        assert _call(port, "/v1/tokens", {"kind": "udp"})[0] == 400
        assert _call(port, "/v1/tokens", {"kind": "tcp", "count": 10_000})[0] == 400
        status, issued = _call(port, "/v1/tokens", {"kind": "tcp", "count": 2})
        assert status == 200 and len(issued["tokens"]) == 2
        tcp = ("127.0.0.1", issued["port"])
        first = bytes.fromhex(issued["tokens"][0])
        assert send_flow(tcp, first, 30_000).completed
        metrics = _metrics(port)
        assert metrics['kickass_agent_tokens_issued_total{kind="tcp"}'] == 2.0
        assert metrics["kickass_agent_requests_refused_total"] == 2.0  # unsigned, wrong key
        assert metrics['kickass_agent_tcp_flows_total{result="completed"}'] == 1.0
    # Restarted on the same state: the used token stays used, the other still works.
    with agent(state) as (port, proc):
        status, health = _call(port, "/v1/health")
        tcp = ("127.0.0.1", health["receivers"]["tcp"]["port"])
        assert not send_flow(tcp, first, 30_000).completed
        assert send_flow(tcp, bytes.fromhex(issued["tokens"][1]), 30_000).completed
        assert _call(port, "/v1/health")[1]["receivers"]["tcp"]["refused"] == 1


def test_a_signed_request_replayed_to_the_agent_is_refused_also_after_a_restart(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    key = signing.key_from_secret(SECRET)
    body = json.dumps({"kind": "tcp", "count": 1}).encode()

    def captured(ahead_s: float = 0.0) -> dict[str, str]:
        return signing.sign(
            key, signing.AGENT_KEY_ID, "POST", "/v1/tokens", body, now=time.time() + ahead_s
        )

    token_request = captured()
    # From a runner whose clock runs 60 s ahead of the agent's (inside the
    # 120 s window): its time lies after the restart below, so only the
    # remembered nonce can refuse it there.
    ahead = captured(ahead_s=60.0)
    env_request = signing.sign(key, signing.AGENT_KEY_ID, "GET", "/v1/environment")
    with agent(state) as (port, _):
        for headers in (token_request, ahead):
            status, issued = _send(port, "POST", "/v1/tokens", body, headers)
            assert status == 200 and len(issued["tokens"]) == 1
        assert _send(port, "GET", "/v1/environment", None, env_request)[0] == 200
        # Within the window, byte for byte: refused, nothing minted.
        status, reply = _send(port, "POST", "/v1/tokens", body, token_request)
        assert (status, reply["error"]) == (401, "unauthorized")
        assert "replayed" in reply["message"]
        assert _metrics(port)['kickass_agent_tokens_issued_total{kind="tcp"}'] == 2.0
    with agent(state) as (port, _):
        for headers in (token_request, ahead):
            status, reply = _send(port, "POST", "/v1/tokens", body, headers)
            assert status == 401 and "replayed" in reply["message"], reply
        status, reply = _send(port, "GET", "/v1/environment", None, env_request)
        assert status == 401 and "replayed" in reply["message"], reply
        metrics = _metrics(port)
        assert metrics.get('kickass_agent_tokens_issued_total{kind="tcp"}', 0.0) == 0.0
        assert metrics["kickass_agent_requests_refused_total"] == 3.0
        # A request signed now, after the restart: accepted.
        status, issued = _call(port, "/v1/tokens", {"kind": "tcp", "count": 2})
        assert status == 200 and len(issued["tokens"]) == 2


def test_an_agent_that_cannot_record_a_nonce_refuses_the_request(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with agent(state) as (port, _):
        assert _call(port, "/v1/tokens", {"kind": "tcp"})[0] == 200
        nonces = state / "signed-nonces"
        nonces.unlink()
        nonces.mkdir()  # appending to it fails, even for root
        status, reply = _call(port, "/v1/tokens", {"kind": "tcp"})
        assert status == 503 and "state directory" in reply["message"], reply
        nonces.rmdir()
        assert _call(port, "/v1/tokens", {"kind": "tcp"})[0] == 200
        assert _metrics(port)['kickass_agent_tokens_issued_total{kind="tcp"}'] == 2.0


def test_the_nonce_cache_survives_a_restart_and_forgets_only_expired_nonces(
    tmp_path: Path,
) -> None:
    path = tmp_path / "nonces"
    t = 1_000_000
    cache = signing.NonceCache(window_s=120, state_file=path, now=t)
    assert not cache.seen("a", t, now=t)
    assert not cache.seen("b", t - 100, now=t)  # from a runner whose clock is behind
    assert not cache.seen("odd nonce\n", t, now=t)  # any header value
    assert cache.seen("a", t, now=t)
    with path.open("a") as f:
        f.write("0a0b")  # a line cut short by a crash
    # A new process 30 s later: all three remembered, the cut line dropped.
    again = signing.NonceCache(window_s=120, state_file=path, now=t + 30)
    assert again.seen("a", t, now=t + 30) and again.seen("b", t - 100, now=t + 30)
    assert again.seen("odd nonce\n", t, now=t + 30)
    assert len(path.read_text().splitlines()) == 3
    # Forgotten once the request could not pass the time check any more,
    # with a margin of one window: "b" 241 s after it was signed, not before.
    assert signing.NonceCache(window_s=120, state_file=path, now=t + 140).seen("b", t - 100)
    later = signing.NonceCache(window_s=120, state_file=path, now=t + 141)
    assert not later.seen("b", t - 100, now=t + 141) and later.seen("a", t, now=t + 141)
    # Full of live nonces: a new one refused, none forgotten.
    small = signing.NonceCache(window_s=120, max_entries=2)
    assert not small.seen("x", t, now=t)
    assert not small.seen("y", t, now=t)
    with pytest.raises(signing.SignatureError, match="too many"):
        small.seen("z", t, now=t)
    assert small.seen("x", t, now=t)
    assert not small.seen("z", t, now=t + 241)  # x and y expired


def test_the_nonce_file_is_compacted(tmp_path: Path) -> None:
    path = tmp_path / "nonces"
    cache = signing.NonceCache(window_s=1, state_file=path, now=0)
    for i in range(3000):
        assert not cache.seen(f"n{i}", i, now=i)
        # Each nonce lives 2 s: the file is rewritten with the live ones
        # every 1,024 new nonces, so it never holds many more.
        if i % 100 == 99:
            assert len(path.read_text().splitlines()) <= 1024 + 3, i
    again = signing.NonceCache(window_s=1, state_file=path, now=2999)
    assert again.seen("n2999", 2999, now=2999) and again.seen("n2000", 2000, now=2999) is False


def _metrics(port: int) -> dict[str, float]:
    """GET /metrics, parsed: sample name with labels -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_agent_metrics_only_for_the_networks_allowed(tmp_path: Path) -> None:
    port, proc = start_agent(tmp_path / "state", extra=("--metrics-from", "10.0.0.0/8"))
    try:
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
        assert exc.value.code == 404
    finally:
        proc.terminate()
        proc.wait(10)


def test_agent_refuses_to_start_without_a_secret(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KICKASS_AGENT_SECRET"}
    proc = subprocess.run(
        [AGENT, "--state-dir", str(tmp_path)], env=env, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2 and proc.stderr.startswith("ERROR: no agent secret")


def _raw(
    port: int, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> tuple[int, dict, dict[str, str]]:
    """One request by http.client (its head as given, signed over ``body``):
    status, JSON body, headers."""
    key = signing.key_from_secret(SECRET)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.putrequest(method, path)
        head = {"Content-Length": str(len(body)), "Content-Type": "application/json"}
        head |= signing.sign(key, signing.AGENT_KEY_ID, method, path, body)
        for name, value in (head | (headers or {})).items():
            conn.putheader(name, value)
        conn.endheaders(body or None)
        r = conn.getresponse()
        return r.status, json.loads(r.read()), dict(r.getheaders())
    finally:
        conn.close()


def test_the_agent_answers_on_the_servers_http_convention(tmp_path: Path) -> None:
    """The control API answers as the measurement server does (kickass_core.httpjson):
    every refusal ``{"error", "message"}``, a body read by the same parser within the
    same limits (size, strict JSON, nesting, an object, the model's refusal in one
    line naming the fields), Retry-After on a 503, and http.server's own refusals in
    that shape too."""
    state = tmp_path / "state"
    with agent(state) as (port, _):

        def refused(body: bytes) -> tuple[int, str, str]:
            status, reply, _ = _raw(port, "POST", "/v1/tokens", body)
            return status, reply["error"], reply["message"]

        status, code, message = refused(b'{"kind": "tcp",')
        assert (status, code) == (400, "bad-request")
        assert message.startswith("the body is not valid JSON: "), message
        assert refused(b'{"kind": "tcp", "count": NaN}')[2].startswith("the body is not valid")
        deep = b'{"kind": "tcp", "x": ' + b"[" * 8 + b"]" * 8 + b"}"
        assert "nested deeper than 8" in refused(deep)[2]
        assert refused(b"[]") == (400, "bad-request", "expected a JSON object body")
        status, code, message = refused(b'{"kind": "udp", "count": 0}')
        assert (status, code) == (400, "bad-request")
        assert message.startswith("kind: ") and "; count: " in message, message

        # Over the cap (said by its head; nothing more sent): 413, before any reading.
        status, reply, _ = _raw(
            port, "POST", "/v1/tokens", headers={"Content-Length": str(16 * 1024 + 1)}
        )
        assert (status, reply["error"]) == (413, "request-entity-too-large"), reply
        assert reply["message"]
        for method, path, want in (("GET", "/v1/nothing", 404), ("PUT", "/v1/tokens", 501)):
            status, reply, _ = _raw(port, method, path)
            assert status == want and set(reply) == {"error", "message"}, (method, reply)
        assert _raw(port, "GET", "/v1/nothing")[1]["error"] == "not-found"

        nonces = state / "signed-nonces"
        nonces.unlink()
        nonces.mkdir()  # the nonce cannot be recorded: 503, try again shortly
        status, reply, headers = _raw(port, "POST", "/v1/tokens", b'{"kind": "tcp"}')
        assert (status, reply["error"]) == (503, "unavailable")
        assert headers["Retry-After"] == "10"
