"""`kickass-agent` as a real process: control API, tokens, TCP flows, restarts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
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
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", method="POST" if body is not None else "GET"
    )
    if body is not None:
        req.data = json.dumps(body).encode()
    if secret:
        key = signing.key_from_secret(secret)
        for name, value in signing.sign(
            key, signing.AGENT_KEY_ID, req.get_method(), path, req.data or b""
        ).items():
            req.add_header(name, value)
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
