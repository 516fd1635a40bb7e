"""The trial-upload API on a real database: tokens, idempotency, bad input, outages."""

from __future__ import annotations

import secrets

import pytest
from flask import Flask
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kickass_db.trial_store import TrialStore
from kickass_server import trials_api
from test_trials_db import _flow, _trial


@pytest.fixture
def client_and_token(database_url: str):  # noqa: ANN201
    store = TrialStore(database_url)
    app = Flask("t")
    trials_api.register(app, store)
    yield app.test_client(), store.add_runner("edge")
    store.close()


def test_upload_flow(client_and_token) -> None:  # noqa: ANN001
    client, token = client_and_token
    auth = {"Authorization": f"Bearer {token}"}
    tid = secrets.token_hex(16)
    assert client.put(f"/api/v1/trials/{tid}", json=_trial(tid)).status_code == 401
    assert (
        client.put(
            f"/api/v1/trials/{tid}", json=_trial(tid), headers={"Authorization": "Bearer x"}
        ).status_code
        == 401
    )
    assert client.put(f"/api/v1/trials/{tid}", json=_trial(tid), headers=auth).status_code == 200
    flows = [_flow(tid, i, "tcp", 5, 10.0 + i, None) for i in range(3)]
    r = client.post(f"/api/v1/trials/{tid}/flows", json={"flows": flows}, headers=auth)
    assert r.status_code == 200 and r.json["stored"] == [f["flow_id"] for f in flows]
    # Re-sent after a lost answer: same reply, nothing doubled.
    r = client.post(f"/api/v1/trials/{tid}/flows", json={"flows": flows}, headers=auth)
    assert r.status_code == 200
    bad = client.post(f"/api/v1/trials/{tid}/flows", json={"flows": [{"x": 1}]}, headers=auth)
    assert bad.status_code == 400 and bad.json["error"] == "bad-flows"
    other = secrets.token_hex(16)
    r = client.post(f"/api/v1/trials/{other}/flows", json={"flows": []}, headers=auth)
    assert r.status_code == 400


def test_database_outage_is_503_with_retry_after() -> None:
    app = Flask("t")
    trials_api.register(app, TrialStore("postgresql://u@127.0.0.1:1/none?connect_timeout=1"))
    r = app.test_client().put(
        f"/api/v1/trials/{secrets.token_hex(16)}", json={}, headers={"Authorization": "Bearer t"}
    )
    assert r.status_code == 503 and r.headers["Retry-After"]


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    body=st.recursive(
        st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=20),
        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
        max_leaves=20,
    )
)
def test_any_json_body_gets_a_4xx_or_2xx_never_a_5xx(client_and_token, body) -> None:  # noqa: ANN001
    client, token = client_and_token
    auth = {"Authorization": f"Bearer {token}"}
    tid = "0" * 32
    for path, method in (
        (f"/api/v1/trials/{tid}", client.put),
        (f"/api/v1/trials/{tid}/flows", client.post),
    ):
        r = method(path, json=body, headers=auth)
        assert r.status_code < 500, (path, body, r.data)
        r = method(
            path,
            json={"flows": [body]} if "flows" in path else {**_trial(tid), "periods": [body]},
            headers=auth,
        )
        assert r.status_code < 500, (path, body, r.data)
