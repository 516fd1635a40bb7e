"""The HTTP API (Flask test client) over a real PostgreSQL, with the engine's
shell on a simulated clock and no sockets: sessions, health, stats, and the
defects of issue 7 — liveness only from the owner, no quota spent on a
session the database never stored, bad input is a 400 and never a 5xx.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient
from kickass_core import wire
from kickass_db.study_store import StudyStore
from kickass_server import http
from kickass_server.api import ApiConfig, create_app
from kickass_server.engine import ProbeEngine
from kickass_server.policy import Policy
from sqlalchemy.engine import make_url

CLIENT_IP = "198.51.100.7"
PEER = (CLIENT_IP, 40000)
DEAD_URL = "postgresql://kickass@127.0.0.1:1/none"  # nothing listens on port 1


class Clock:
    def __init__(self) -> None:
        self.t = 5000.0

    def __call__(self) -> float:
        return self.t


class SwitchableStore:
    """The real StudyStore, or (``down``) one whose database cannot be reached: a
    real outage through the real code path, switched on and off at will."""

    def __init__(self, real: StudyStore) -> None:
        self.real = real
        self.dead = StudyStore(DEAD_URL)
        self.down = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dead if self.down else self.real, name)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(database_url: str) -> Iterator[SwitchableStore]:
    s = SwitchableStore(StudyStore(database_url))
    try:
        yield s
    finally:
        s.real.close()
        s.dead.close()


def make_engine(store: Any, clock: Clock, **policy: Any) -> ProbeEngine:
    return ProbeEngine(store, Policy(**policy), probe_port=9000, server_version="test", clock=clock)


@pytest.fixture
def engine(store: SwitchableStore, clock: Clock) -> Iterator[ProbeEngine]:
    e = make_engine(store, clock)
    try:
        yield e
    finally:
        e.stop()


def client_for(engine: ProbeEngine, store: Any, **config: Any) -> FlaskClient:
    app = create_app(
        engine, store, ApiConfig(probe_host="probe.example", health_cache_s=0, **config)
    )
    return app.test_client()


@pytest.fixture
def client(engine: ProbeEngine, store: SwitchableStore) -> FlaskClient:
    return client_for(engine, store)


def new_session(client: FlaskClient, plan: dict | None = None, **headers: str) -> dict:
    r = client.post(
        "/api/v1/sessions",
        json={"plan": plan or {"repetitions": 1, "step": 512, "window": 1}, "client_version": "t"},
        environ_base={"REMOTE_ADDR": CLIENT_IP},
        headers=headers,
    )
    assert r.status_code == 201, r.get_json()
    return r.get_json()


def prove(engine: ProbeEngine, session: dict) -> None:
    """The client's handshake, fed straight into the engine at its clock."""
    tag, cookie = bytes.fromhex(session["session_id"]), bytes.fromhex(session["cookie"])
    engine.handle_datagram(wire.Hello(tag, cookie).encode(), PEER, "192.0.2.1")
    token = engine.core.runs[session["session_id"]].challenges[PEER].token
    engine.handle_datagram(wire.Echo(tag, token).encode(), PEER, "192.0.2.1")
    assert engine.snapshot(session["session_id"]).state == "probing"


# -- the contract ------------------------------------------------------------------------


def test_create_read_and_end_a_session(client: FlaskClient, engine: ProbeEngine) -> None:
    s = new_session(client)
    assert s["probe_host"] == "probe.example" and s["probe_port"] == 9000
    assert s["total_probes"] == 8 and s["plan"]["repetitions"] == 1 and s["expires_in_s"] == 30
    r = client.get(f"/api/v1/sessions/{s['session_id']}")
    assert r.status_code == 200 and r.get_json()["state"] == "created"
    r = client.post(f"/api/v1/sessions/{s['session_id']}/end")
    assert r.status_code == 403 and r.get_json()["error"] == "forbidden"
    r = client.post(
        f"/api/v1/sessions/{s['session_id']}/end", headers={"X-Kickass-Cookie": s["cookie"]}
    )
    assert r.status_code == 200
    engine.tick()  # the loop's turn: nothing outstanding, the run ends at once
    engine.writer_sync()
    res = client.get(f"/api/v1/sessions/{s['session_id']}").get_json()
    assert res["state"] == "ended" and res["end_reason"] == "client-ended"


@pytest.mark.parametrize("sid", ["0123456789abcdef", "nothex", "0123456789ABCDEF", "a" * 17])
def test_unknown_or_malformed_session_ids_are_404(client: FlaskClient, sid: str) -> None:
    for r in (client.get(f"/api/v1/sessions/{sid}"), client.post(f"/api/v1/sessions/{sid}/end")):
        assert r.status_code == 404 and r.get_json()["error"] == "not-found"


def test_stats_and_health(client: FlaskClient) -> None:
    stats = client.get("/api/v1/stats").get_json()
    assert stats["counters"]["probes_sent"] == 0 and "db_write_backlog" in stats
    health = client.get("/api/v1/health")
    body = health.get_json()
    assert health.status_code == 200 and body["status"] == "ok" and body["degraded"] == []
    assert body["components"]["database"]["status"] == "ok"


def test_rate_limited_is_429_with_retry_after(client: FlaskClient) -> None:
    new_session(client)
    new_session(client)
    r = client.post("/api/v1/sessions", json={}, environ_base={"REMOTE_ADDR": CLIENT_IP})
    assert r.status_code == 429 and r.get_json()["error"] == "rate-limited"
    assert r.headers["Retry-After"] == "60"


def test_retry_after_is_one_setting_for_every_answer_that_carries_it(
    engine: ProbeEngine, store: SwitchableStore
) -> None:
    """The API's Retry-After is its one policy (``http.RetryAfter``), set as a whole."""
    client = client_for(
        engine, store, retry_after=http.RetryAfter(unavailable_s=7, rate_limited_s=90)
    )
    s = new_session(client)
    new_session(client)
    r = client.post("/api/v1/sessions", json={}, environ_base={"REMOTE_ADDR": CLIENT_IP})
    assert r.status_code == 429 and r.headers["Retry-After"] == "90"
    store.down = True
    r = client.get(f"/api/v1/sessions/{s['session_id']}")
    assert r.status_code == 503 and r.headers["Retry-After"] == "7"


def test_behind_a_proxy_the_last_forwarded_hop_is_the_client(
    engine: ProbeEngine, store: SwitchableStore
) -> None:
    client = client_for(engine, store, trust_proxy=True)
    # The left part is whatever the client wrote; our proxy appended the right one.
    s = new_session(client, **{"X-Forwarded-For": "203.0.113.66, 198.51.100.23"})  # type: ignore[arg-type]  # a header, never plan
    assert engine.snapshot(s["session_id"]).source_address == "198.51.100.23"
    r = client.post(
        "/api/v1/sessions",
        json={},
        environ_base={"REMOTE_ADDR": CLIENT_IP},
        headers={"X-Forwarded-For": "not-an-address"},
    )
    assert r.status_code == 400


def test_a_bug_is_a_500_with_a_traceback(
    client: FlaskClient, store: SwitchableStore, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:  # noqa: ANN001
    def boom(_sid: str) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(store.real, "session_results", boom)
    with caplog.at_level(logging.INFO, logger="kickass.api"):
        r = client.get("/api/v1/sessions/0123456789abcdef")
    assert r.status_code == 500 and r.get_json()["error"] == "internal-error"
    assert any(rec.exc_info for rec in caplog.records)


# -- issue 7 item 2: only the owner proves liveness -----------------------------------------


def test_a_strangers_polls_do_not_keep_a_silent_session_alive(
    client: FlaskClient, engine: ProbeEngine, clock: Clock
) -> None:
    s = new_session(client)
    sid = s["session_id"]
    prove(engine, s)
    proven_at = clock.t
    for _ in range(5):  # someone who knows the id polls every 5 s, no cookie
        clock.t += 5.0
        assert client.get(f"/api/v1/sessions/{sid}").status_code == 200
        engine.tick()
    r = client.get(f"/api/v1/sessions/{sid}", headers={"X-Kickass-Cookie": "00" * 16})
    assert r.status_code == 200  # a wrong cookie is a stranger too
    clock.t = proven_at + engine.policy.silence_timeout_s
    engine.tick()
    snap = engine.snapshot(sid)
    assert snap.state == "incomplete" and snap.end_reason == "client-silent"
    assert engine.stats()["counters"]["polls_without_cookie"] == 6


def test_the_owners_polls_keep_a_silent_session_alive(
    client: FlaskClient, engine: ProbeEngine, clock: Clock
) -> None:
    s = new_session(client)
    sid = s["session_id"]
    prove(engine, s)
    proven_at = clock.t
    for _ in range(10):  # e.g. a fragment-dropping path: no ACK for a whole phase
        clock.t += 5.0
        r = client.get(f"/api/v1/sessions/{sid}", headers={"X-Kickass-Cookie": s["cookie"]})
        assert r.status_code == 200
        engine.tick()
    assert clock.t - proven_at > engine.policy.silence_timeout_s
    assert engine.snapshot(sid).state == "probing"


# -- issue 7 item 4: an outage costs no quota; 503s carry Retry-After ---------------------------


def test_a_session_the_database_did_not_store_costs_no_quota(
    store: SwitchableStore, clock: Clock
) -> None:
    engine = make_engine(store, clock, sessions_per_address=10, sessions_per_address_hour=2)
    try:
        client = client_for(engine, store)
        store.down = True
        for _ in range(3):
            r = client.post("/api/v1/sessions", json={}, environ_base={"REMOTE_ADDR": CLIENT_IP})
            assert r.status_code == 503 and r.get_json()["error"] == "unavailable"
            assert int(r.headers["Retry-After"]) > 0
        store.down = False
        new_session(client)
        new_session(client)
        r = client.post("/api/v1/sessions", json={}, environ_base={"REMOTE_ADDR": CLIENT_IP})
        assert r.status_code == 429 and "per hour" in r.get_json()["message"]
    finally:
        engine.stop()


def test_reads_during_an_outage_are_503_with_retry_after(
    client: FlaskClient, store: SwitchableStore
) -> None:
    s = new_session(client)
    store.down = True
    r = client.get(f"/api/v1/sessions/{s['session_id']}")
    assert r.status_code == 503 and r.headers["Retry-After"]


def test_health_is_degraded_while_the_database_is_down(
    client: FlaskClient, store: SwitchableStore
) -> None:
    store.down = True
    body = client.get("/api/v1/health").get_json()
    assert body["status"] == "degraded" and body["degraded"] == ["database"]
    assert body["components"]["database"] == {"status": "down", "detail": "database unavailable"}
    store.down = False
    assert client.get("/api/v1/health").get_json()["status"] == "ok"


def test_health_names_nothing_about_where_the_database_is(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 27 item 4: with the database really stopped, anyone's health check
    said where it was (user, socket directory, database name) and psycopg's
    error. Now it says "database unavailable"; the detail is in the server's log."""
    from kickass_db import upgrade
    from kickass_testbed.pg import EmbeddedPostgres

    pg = EmbeddedPostgres(tmp_path / "pg")
    url = pg.start()
    try:
        upgrade(url)
        store = StudyStore(url)
        engine = make_engine(store, Clock())
        try:
            client = client_for(engine, store)
            assert client.get("/api/v1/health").get_json()["status"] == "ok"
            pg.stop()
            caplog.set_level(logging.INFO, "kickass")
            r = client.get("/api/v1/health")
            body = r.get_json()
            assert r.status_code == 200 and body["degraded"] == ["database"]
            assert body["components"]["database"] == {
                "status": "down",
                "detail": "database unavailable",
            }
            parsed = make_url(url)
            where = [str(pg.data_dir), parsed.username, parsed.database, "psycopg", "socket"]
            text = r.get_data(as_text=True)
            assert not [w for w in where if w and w in text], text
            # Where it is and why not: in the server's log, once per outage.
            client.get("/api/v1/health")
            logged = [rec.getMessage() for rec in caplog.records if "database" in rec.getMessage()]
            assert len(logged) == 1 and str(pg.data_dir) in logged[0], logged
            pg.start()
            assert client.get("/api/v1/health").get_json()["status"] == "ok"
            assert any("database is back" in rec.getMessage() for rec in caplog.records)
        finally:
            engine.stop()
            store.close()
    finally:
        pg.stop()


# -- issue 7 item 8: bad input is a 400 with a one-line log -----------------------------------

_NEST = 3000
BAD_BODIES = {
    "overflowing number": '{"plan": {"repetitions": 1e400}}',
    "Infinity": '{"plan": {"repetitions": Infinity}}',
    "-Infinity": '{"plan": {"window": -Infinity}}',
    "NaN": '{"plan": {"step": NaN}}',
    "float count": '{"plan": {"repetitions": 10.0}}',
    "string count": '{"plan": {"repetitions": "10"}}',
    "boolean count": '{"plan": {"window": true}}',
    "huge integer": '{"plan": {"step": ' + "9" * 50 + "}}",
    "too many digits": '{"plan": {"step": ' + "9" * 5000 + "}}",
    "NUL in client_version": '{"client_version": "1.0\\u0000evil"}',
    "lone surrogate in client_version": '{"client_version": "\\ud800"}',
    "control character in platform": '{"platform": "linux\\u001b[31m"}',
    "deeply nested plan": '{"plan": ' + "[" * _NEST + "]" * _NEST + "}",
    "deeply nested body": "[" * _NEST + "]" * _NEST,
    "nested objects": '{"a":' * 50 + "1" + "}" * 50,
    "array body": "[]",
    "string body": '"plan"',
    "number body": "1",
    "null body": "null",
    "plan is a list": '{"plan": [1, 2]}',
    "plan is a string": '{"plan": "quick"}',
    "quick is a string": '{"plan": {"quick": "yes"}}',
    "phases is a string": '{"plan": {"phases": "whole"}}',
    "client_version is a number": '{"client_version": 12}',
    "install_id is an object": '{"install_id": {}}',
    "truncated JSON": '{"plan": {',
    "empty body": "",
    "trailing garbage": "{} x",
}


@pytest.mark.parametrize("body", BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_bad_input_is_a_400_with_one_log_line(client: FlaskClient, body: str, caplog) -> None:  # noqa: ANN001
    with caplog.at_level(logging.DEBUG):
        r = client.post(
            "/api/v1/sessions",
            data=body,
            content_type="application/json",
            environ_base={"REMOTE_ADDR": CLIENT_IP},
        )
    assert r.status_code == 400, r.get_json()
    assert r.get_json()["error"] in ("bad-request", "bad-plan")
    api = [rec for rec in caplog.records if rec.name == "kickass.api"]
    assert len(api) == 1 and api[0].levelno == logging.INFO
    assert "\n" not in api[0].getMessage() and not api[0].exc_info
    assert not [rec for rec in caplog.records if rec.levelno >= logging.WARNING]


@pytest.mark.parametrize(
    ("data", "content_type", "status"),
    [
        (b"\xff\xfe{}", "application/json", 400),  # not UTF-8
        (b"{}", "text/plain", 400),  # not declared JSON (a cross-site form post)
        (b'{"x": "' + b"a" * 20000 + b'"}', "application/json", 413),
    ],
)
def test_undecodable_undeclared_and_oversized_bodies(
    client: FlaskClient, data: bytes, content_type: str, status: int
) -> None:
    r = client.post(
        "/api/v1/sessions",
        data=data,
        content_type=content_type,
        environ_base={"REMOTE_ADDR": CLIENT_IP},
    )
    assert r.status_code == status and "error" in r.get_json()


def test_bad_input_costs_no_quota(store: SwitchableStore, clock: Clock) -> None:
    engine = make_engine(store, clock, sessions_per_address_hour=1)
    try:
        client = client_for(engine, store)
        for body in BAD_BODIES.values():
            client.post(
                "/api/v1/sessions",
                data=body,
                content_type="application/json",
                environ_base={"REMOTE_ADDR": CLIENT_IP},
            )
        new_session(client)
    finally:
        engine.stop()


def test_strings_are_stored_as_sent_within_their_limits(
    client: FlaskClient, store: SwitchableStore
) -> None:
    r = client.post(
        "/api/v1/sessions",
        data=json.dumps({"client_version": "ünïcødé ✓ " + "v" * 100, "platform": "Linux 🐧"}),
        content_type="application/json",
        environ_base={"REMOTE_ADDR": CLIENT_IP},
    )
    assert r.status_code == 201
    res = store.session_results(r.get_json()["session_id"])
    assert res["client_version"] == ("ünïcødé ✓ " + "v" * 100)[:64]
