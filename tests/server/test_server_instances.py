"""Real `kickass server` processes sharing one database (issue: sessions have an owner).

- Restarting one server leaves another server's live session live.
- A second server on a busy probe port refuses to start, with an ERROR line,
  and ends nothing of the first one's.
- Bad settings are ERROR lines with a hint, never tracebacks.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import urllib.request

import kickass_db as db
import pytest
from sqlalchemy import create_engine, text
from support.live_server import KICKASS, free_port, server

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the probe engine needs a raw socket")


def _new_session(http_port: int) -> str:
    req = urllib.request.Request(
        f"http://127.0.0.1:{http_port}/api/v1/sessions",
        data=json.dumps({"plan": {"repetitions": 1, "step": 512}}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.load(resp)["session_id"]


def _state(database_url: str, session_id: str) -> tuple[str, str | None]:
    engine = create_engine(db.sqlalchemy_url(database_url))
    try:
        with engine.connect() as conn:
            row = conn.execute(
                text("SELECT state, server_instance FROM sessions WHERE session_id = :s"),
                {"s": session_id},
            ).one()
            return row[0], row[1]
    finally:
        engine.dispose()


def test_restarting_one_server_leaves_the_others_live_session(database_url: str) -> None:
    a_probe, b_probe = free_port(socket.SOCK_DGRAM), free_port(socket.SOCK_DGRAM)
    a_http, b_http = free_port(socket.SOCK_STREAM), free_port(socket.SOCK_STREAM)
    with server(database_url, a_probe, a_http):
        sid_a = _new_session(a_http)
        with server(database_url, b_probe, b_http):
            sid_b = _new_session(b_http)
        # B stopped while its session was live; A's session is untouched.
        assert _state(database_url, sid_a)[0] == "created"
        with server(database_url, b_probe, b_http):
            # B's restart ends B's orphan only.
            state_a, owner_a = _state(database_url, sid_a)
            state_b, owner_b = _state(database_url, sid_b)
            assert state_a == "created", "restarting B ended A's live session"
            assert owner_a != owner_b
            assert owner_a.endswith(f":{a_probe}") and owner_b.endswith(f":{b_probe}")
        assert _state(database_url, sid_b)[0] in ("incomplete", "expired", "ended")


def test_second_server_on_busy_probe_port_refuses_and_ends_nothing(database_url: str) -> None:
    probe = free_port(socket.SOCK_DGRAM)
    a_http, b_http = free_port(socket.SOCK_STREAM), free_port(socket.SOCK_STREAM)
    with server(database_url, probe, a_http):
        sid = _new_session(a_http)
        second = subprocess.run(
            [
                KICKASS,
                "server",
                "--listen",
                f"127.0.0.1:{b_http}",
                "--probe-bind",
                "127.0.0.1",
                "--probe-port",
                str(probe),
                "--database-url",
                database_url,
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert second.returncode != 0
        assert "ERROR:" in second.stderr and "Traceback" not in second.stderr
        assert _state(database_url, sid)[0] == "created"


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--probe-port", "70000"], {}, "out of range"),
        (["--probe-port", "abc"], {}, "not a port number"),
        ([], {"KICKASS_PROBE_PORT": "x"}, "KICKASS_PROBE_PORT"),
        (["--listen", "127.0.0.1:99999"], {}, "bad listen address"),
        (["--threads", "0"], {}, "at least 1"),
        (["--database-url", "postgresql://u@127.0.0.1:abc/db"], {}, "database"),
    ],
)
def test_bad_settings_are_error_lines(args: list[str], env: dict[str, str], message: str) -> None:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KICKASS_")}
    full_env.update(env)
    full_env.setdefault("KICKASS_DATABASE_URL", "postgresql://u@127.0.0.1:1/none")
    proc = subprocess.run(
        [KICKASS, "server", *args], capture_output=True, text=True, timeout=30, env=full_env
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("ERROR:") and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_database_url_for_db_upgrade_is_an_error_line() -> None:
    proc = subprocess.run(
        [KICKASS, "db", "upgrade", "--database-url", "postgresql://u@127.0.0.1:abc/db"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("ERROR:") and "Traceback" not in proc.stderr, proc.stderr
