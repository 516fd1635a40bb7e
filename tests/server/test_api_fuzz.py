"""Fuzzing the HTTP API's JSON bodies (and paths and cookies) against a real
PostgreSQL: whatever arrives, the answer is a 2xx or a 4xx — never a 5xx,
never a traceback in the log.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
from flask.testing import FlaskClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kickass_db.study_store import StudyStore
from kickass_server.api import ApiConfig, create_app
from kickass_server.engine import ProbeEngine
from kickass_server.policy import Policy

# Strings a client could send: any text, plus what JSON can carry and
# PostgreSQL or UTF-8 cannot (NUL, lone surrogates).
texts = st.text(max_size=80) | st.sampled_from(
    ["", "\x00", "a\x00b", "\ud800", "x\udfffy", "\u202e", "\ufeff", "🐧" * 40, "\x1b[2J"]
)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | texts
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)
plan_fields = st.fixed_dictionaries(
    {},
    optional={
        "repetitions": st.integers(-3, 300) | json_values,
        "step": st.sampled_from([8, 16, 64, 512, 12, 0, 1500, 1501]) | json_values,
        "window": st.integers(-1, 80) | json_values,
        "phases": st.lists(st.sampled_from(["whole", "split", "other"]), max_size=3) | json_values,
        "quick": st.booleans() | json_values,
    },
)
bodies = (
    st.fixed_dictionaries(
        {},
        optional={
            "plan": plan_fields | json_values,
            "client_version": texts | json_values,
            "platform": texts | json_values,
            "install_id": texts | json_values,
        },
    )
    | json_values
)


@pytest.fixture
def client(database_url: str) -> Iterator[FlaskClient]:
    store = StudyStore(database_url)
    # Limits high enough that every valid body really creates a session (and
    # reaches PostgreSQL); unproven sessions cost the engine no plan-sized memory.
    policy = Policy(
        sessions_per_address=10**6,
        sessions_per_prefix=10**6,
        sessions_per_address_hour=10**6,
        sessions_per_prefix_hour=10**6,
        bytes_per_address_hour=10**15,
        bytes_per_prefix_hour=10**15,
        max_sessions=10**6,
    )
    engine = ProbeEngine(store, policy, probe_port=9000, server_version="fuzz")
    try:
        yield create_app(engine, store, ApiConfig()).test_client()
    finally:
        engine.stop()
        store.close()


def _assert_no_server_error(status: int, caplog: pytest.LogCaptureFixture) -> None:
    assert status < 500, [r.getMessage() for r in caplog.records]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


@settings(
    max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=bodies)
def test_fuzz_session_bodies(
    client: FlaskClient, caplog: pytest.LogCaptureFixture, body: object
) -> None:
    caplog.clear()
    r = client.post(
        "/api/v1/sessions",
        data=json.dumps(body),  # NaN/Infinity as Python writes them
        content_type="application/json",
        environ_base={"REMOTE_ADDR": "198.51.100.7"},
    )
    _assert_no_server_error(r.status_code, caplog)
    assert r.is_json and ("session_id" in r.get_json()) == (r.status_code == 201)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(raw=st.binary(max_size=300) | texts.map(lambda t: t.encode("utf-8", "surrogatepass")))
def test_fuzz_raw_bodies(client: FlaskClient, caplog: pytest.LogCaptureFixture, raw: bytes) -> None:
    caplog.clear()
    r = client.post(
        "/api/v1/sessions",
        data=raw,
        content_type="application/json",
        environ_base={"REMOTE_ADDR": "198.51.100.7"},
    )
    _assert_no_server_error(r.status_code, caplog)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sid=st.text(alphabet="0123456789abcdefABCDEF/%.", min_size=1, max_size=20),
    cookie=st.text(max_size=40).filter(lambda c: "\n" not in c and "\r" not in c),
)
def test_fuzz_session_paths_and_cookies(
    client: FlaskClient, caplog: pytest.LogCaptureFixture, sid: str, cookie: str
) -> None:
    caplog.clear()
    headers = {"X-Kickass-Cookie": cookie.encode("latin-1", "replace").decode("latin-1")}
    for r in (
        client.get(f"/api/v1/sessions/{sid}", headers=headers),
        client.post(f"/api/v1/sessions/{sid}/end", headers=headers),
    ):
        _assert_no_server_error(r.status_code, caplog)
