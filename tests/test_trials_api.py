"""The trial-upload API on a real database: tokens, idempotency, bad input, outages."""

from __future__ import annotations

import secrets

import pytest
from flask.testing import FlaskClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kickass_db.study_store import StudyStore
from kickass_db.trial_store import TrialStore
from kickass_server.api import ApiConfig, create_app
from kickass_server.engine import ProbeEngine
from test_trials_db import _flow, _trial


def app_client(database_url: str, trials: TrialStore) -> tuple[FlaskClient, ProbeEngine]:
    """The server's whole app (every blueprint), its engine never started."""
    study = StudyStore(database_url)
    engine = ProbeEngine(study, probe_port=9000, server_version="t")
    return create_app(engine, study, ApiConfig(), trials=trials).test_client(), engine


@pytest.fixture
def client_and_token(database_url: str):  # noqa: ANN201
    store = TrialStore(database_url)
    client, engine = app_client(database_url, store)
    yield client, store.add_runner("edge")
    engine.stop()
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
    assert bad.status_code == 200 and bad.json["stored"] == []
    assert [r["error"] for r in bad.json["refused"]] == ["bad-flow"]
    other = secrets.token_hex(16)
    r = client.post(f"/api/v1/trials/{other}/flows", json={"flows": []}, headers=auth)
    assert r.status_code == 404 and r.json["error"] == "unknown-trial"


@pytest.mark.parametrize(
    "patch",
    [
        {"protocol": "udp"},
        {"size_packets": 0},
        {"ka_mode_fraction": 1.5},
        {"fct_ms": -1},
        {"started_at": "yesterday"},
        {"started_at": "2026-11-22T12:00:00"},  # no UTC offset
        {"flow_id": "x-1"},
        {"extra": [1, 2]},
    ],
)
def test_bad_flows_are_refused_with_a_reason(client_and_token, patch: dict) -> None:  # noqa: ANN001
    client, token = client_and_token
    auth = {"Authorization": f"Bearer {token}"}
    tid = secrets.token_hex(16)
    assert client.put(f"/api/v1/trials/{tid}", json=_trial(tid), headers=auth).status_code == 200
    good = _flow(tid, 1, "tcp", 5, 10.0, None)
    r = client.post(
        f"/api/v1/trials/{tid}/flows",
        json={"flows": [{**_flow(tid, 0, "tcp", 5, 10.0, None), **patch}, good]},
        headers=auth,
    )
    assert r.status_code == 200
    assert r.json["stored"] == [good["flow_id"]]  # its neighbour is stored all the same
    (refusal,) = r.json["refused"]
    assert refusal["index"] == 0 and refusal["error"] == "bad-flow" and refusal["message"]


def test_database_outage_is_503_with_retry_after(database_url: str) -> None:
    down = TrialStore("postgresql://u@127.0.0.1:1/none?connect_timeout=1")
    client, engine = app_client(database_url, down)
    engine.stop()
    r = client.put(
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
