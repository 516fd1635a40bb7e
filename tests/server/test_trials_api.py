"""The trial-upload API on a real database: signed requests, idempotency, bad input,
outages."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

import kickass_db as db
import pytest
from flask.testing import FlaskClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kickass_core import signing
from kickass_db.study_store import StudyStore
from kickass_db.trial_store import TrialStore
from kickass_server.api import ApiConfig, create_app
from kickass_server.engine import ProbeEngine
from sqlalchemy import create_engine, text
from support.trial_records import flow as _flow
from support.trial_records import trial as _trial


def app_client(database_url: str, trials: TrialStore) -> tuple[FlaskClient, ProbeEngine]:
    """The server's whole app (every blueprint), its engine never started."""
    study = StudyStore(database_url)
    engine = ProbeEngine(study, probe_port=9000, server_version="t")
    return create_app(engine, study, ApiConfig(), trials=trials).test_client(), engine


def call(
    client: FlaskClient, method: str, path: str, token: str | None, body: Any, **extra: str
) -> Any:
    """A request as the runner's uploader sends it: signed, never the token itself."""
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **extra}
    if token is not None:
        key = signing.key_from_secret(token)
        headers |= signing.sign(key, signing.runner_name(token), method, path, data)
    return client.open(path, method=method, data=data, headers=headers)


@pytest.fixture
def client_and_token(database_url: str):  # noqa: ANN201
    store = TrialStore(database_url)
    client, engine = app_client(database_url, store)
    yield client, store.add_runner("edge")
    engine.stop()
    store.close()


def test_upload_flow(client_and_token) -> None:  # noqa: ANN001
    client, token = client_and_token
    tid = secrets.token_hex(16)
    path = f"/api/v1/trials/{tid}"
    assert call(client, "PUT", path, None, _trial(tid)).status_code == 401
    assert call(client, "PUT", path, "edge.not-the-token", _trial(tid)).status_code == 401
    # The old way, the token in a header: refused (it must never travel).
    r = call(client, "PUT", path, None, _trial(tid), Authorization=f"Bearer {token}")
    assert r.status_code == 401
    assert call(client, "PUT", path, token, _trial(tid)).status_code == 200
    flows = [_flow(tid, i, "tcp", 5, 10.0 + i, None) for i in range(3)]
    r = call(client, "POST", f"{path}/flows", token, {"flows": flows})
    assert r.status_code == 200 and r.json["stored"] == [f["flow_id"] for f in flows]
    # Re-sent after a lost answer: same reply, nothing doubled.
    r = call(client, "POST", f"{path}/flows", token, {"flows": flows})
    assert r.status_code == 200 and r.json["stored"] == [f["flow_id"] for f in flows]
    bad = call(client, "POST", f"{path}/flows", token, {"flows": [{"x": 1}]})
    assert bad.status_code == 200 and bad.json["stored"] == []
    assert [r["error"] for r in bad.json["refused"]] == ["bad-flow"]
    other = secrets.token_hex(16)
    r = call(client, "POST", f"/api/v1/trials/{other}/flows", token, {"flows": []})
    assert r.status_code == 404 and r.json["error"] == "unknown-trial"


def test_a_replayed_or_altered_request_is_refused(client_and_token) -> None:  # noqa: ANN001
    client, token = client_and_token
    tid = secrets.token_hex(16)
    path = f"/api/v1/trials/{tid}"
    data = json.dumps(_trial(tid)).encode()
    headers = {"Content-Type": "application/json"} | signing.sign(
        signing.key_from_secret(token), signing.runner_name(token), "PUT", path, data
    )
    assert client.open(path, method="PUT", data=data, headers=headers).status_code == 200
    again = client.open(path, method="PUT", data=data, headers=headers)
    assert again.status_code == 401 and "replayed" in again.json["message"]
    altered = dict(headers, **{signing.NONCE: "f" * 32})
    r = client.open(path, method="PUT", data=data, headers=altered)
    assert r.status_code == 401 and "bad signature" in r.json["message"]
    stale = {"Content-Type": "application/json"} | signing.sign(
        signing.key_from_secret(token), signing.runner_name(token), "PUT", path, data,
        now=time.time() - 3 * signing.WINDOW_S,
    )  # fmt: skip
    r = client.open(path, method="PUT", data=data, headers=stale)
    assert r.status_code == 401 and "clock" in r.json["message"]


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
    tid = secrets.token_hex(16)
    assert call(client, "PUT", f"/api/v1/trials/{tid}", token, _trial(tid)).status_code == 200
    good = _flow(tid, 1, "tcp", 5, 10.0, None)
    r = call(
        client,
        "POST",
        f"/api/v1/trials/{tid}/flows",
        token,
        {"flows": [{**_flow(tid, 0, "tcp", 5, 10.0, None), **patch}, good]},
    )
    assert r.status_code == 200
    assert r.json["stored"] == [good["flow_id"]]  # its neighbour is stored all the same
    (refusal,) = r.json["refused"]
    assert refusal["index"] == 0 and refusal["error"] == "bad-flow" and refusal["message"]


def test_database_outage_is_503_with_retry_after(database_url: str) -> None:
    down = TrialStore("postgresql://u@127.0.0.1:1/none?connect_timeout=1")
    client, engine = app_client(database_url, down)
    engine.stop()
    r = call(client, "PUT", f"/api/v1/trials/{secrets.token_hex(16)}", "edge.t", {})
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
    tid = "0" * 32
    for path, method in ((f"/api/v1/trials/{tid}", "PUT"), (f"/api/v1/trials/{tid}/flows", "POST")):
        r = call(client, method, path, token, body)
        assert r.status_code < 500, (path, body, r.data)
        wrapped = {"flows": [body]} if "flows" in path else {**_trial(tid), "periods": [body]}
        r = call(client, method, path, token, wrapped)
        assert r.status_code < 500, (path, body, r.data)


# -- idempotency that tells the truth (issue 16 item 3), through the real app -----------


def _stored_flows(database_url: str, tid: str) -> dict[str, dict[str, Any]]:
    engine = create_engine(db.sqlalchemy_url(database_url))
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT f.* FROM flows f JOIN trials t ON t.id = f.trial_pk "
                    "WHERE t.trial_id = :t"
                ),
                {"t": tid},
            ).mappings()
            return {r["flow_id"]: dict(r) for r in rows}
    finally:
        engine.dispose()


def _upload(client: FlaskClient, token: str, tid: str, flows: list[dict]) -> Any:
    r = call(client, "POST", f"/api/v1/trials/{tid}/flows", token, {"flows": flows})
    assert r.status_code == 200, r.json
    return r.json


def test_a_conflict_in_a_mixed_batch_is_refused_alone_and_replaces_nothing(
    client_and_token,
    database_url: str,  # noqa: ANN001
) -> None:
    client, token = client_and_token
    tid = secrets.token_hex(16)
    assert call(client, "PUT", f"/api/v1/trials/{tid}", token, _trial(tid)).status_code == 200
    first = [_flow(tid, i, "tcp", 5, 100.0 + i, None) for i in range(3)]
    assert _upload(client, token, tid, first)["stored"] == [f["flow_id"] for f in first]
    before = _stored_flows(database_url, tid)

    changed = {**first[1], "fct_ms": 999.0, "retransmissions": 4}
    new = [_flow(tid, 10 + i, "tcp", 5, 50.0, None) for i in range(2)]
    bad = {**_flow(tid, 20, "tcp", 5, 1.0, None), "size_packets": 0}
    batch = [new[0], changed, new[1], first[2], bad]
    answer = _upload(client, token, tid, batch)

    # Neighbours stored (new ones and the identical repeat), in batch order.
    assert answer["stored"] == [new[0]["flow_id"], new[1]["flow_id"], first[2]["flow_id"]]
    refused = {r["index"]: r for r in answer["refused"]}
    assert sorted(refused) == [1, 4], answer
    assert refused[1]["error"] == "conflict" and refused[1]["flow_id"] == changed["flow_id"]
    assert "other content" in refused[1]["message"]
    assert refused[4]["error"] == "bad-flow" and "size_packets" in refused[4]["message"]

    after = _stored_flows(database_url, tid)
    assert set(after) == {f["flow_id"] for f in first + new}
    for f in first:  # nothing replaced, not even in part
        assert after[f["flow_id"]] == before[f["flow_id"]]
    assert after[changed["flow_id"]]["fct_ms"] == 101.0
    assert after[changed["flow_id"]]["retransmissions"] is None


def test_one_flow_id_twice_in_a_batch(client_and_token, database_url: str) -> None:  # noqa: ANN001
    client, token = client_and_token
    tid = secrets.token_hex(16)
    assert call(client, "PUT", f"/api/v1/trials/{tid}", token, _trial(tid)).status_code == 200

    # Identical copies: stored once, and neither copy refused.
    same = _flow(tid, 0, "tcp", 5, 10.0, None)
    answer = _upload(client, token, tid, [same, dict(same)])
    assert answer == {"stored": [same["flow_id"]], "refused": []}

    # Different copies of a new id: the first stored, the second a conflict.
    a = _flow(tid, 1, "tcp", 5, 20.0, None)
    b = {**a, "fct_ms": 30.0}
    answer = _upload(client, token, tid, [a, b, dict(a)])
    assert answer["stored"] == [a["flow_id"]]
    assert [(r["index"], r["flow_id"], r["error"]) for r in answer["refused"]] == [
        (1, a["flow_id"], "conflict")
    ]

    # Both copies differ from what is stored: both conflicts, nothing stored.
    c, d = {**a, "fct_ms": 40.0}, {**a, "fct_ms": 50.0}
    answer = _upload(client, token, tid, [c, d])
    assert answer["stored"] == []
    assert [(r["index"], r["error"]) for r in answer["refused"]] == [
        (0, "conflict"),
        (1, "conflict"),
    ]

    stored = _stored_flows(database_url, tid)
    assert set(stored) == {same["flow_id"], a["flow_id"]}
    assert stored[a["flow_id"]]["fct_ms"] == 20.0


def test_a_trial_re_sent_with_other_content_is_a_409_and_replaces_nothing(
    client_and_token,
    database_url: str,  # noqa: ANN001
) -> None:
    client, token = client_and_token
    tid = secrets.token_hex(16)
    path = f"/api/v1/trials/{tid}"
    trial = _trial(tid)
    assert call(client, "PUT", path, token, trial).status_code == 200
    assert call(client, "PUT", path, token, trial).status_code == 200  # identical: a no-op

    moved_period = {**trial["periods"][1], "start_s": 130}
    for changed, what in (
        ({**trial, "destination": "agent-b"}, "destination"),
        ({**trial, "parameters": {"workload": {"seed": 2}}}, "parameters"),
        ({**trial, "periods": [trial["periods"][0], moved_period]}, "period 1"),
    ):
        r = call(client, "PUT", path, token, changed)
        assert r.status_code == 409, (what, r.json)
        assert r.json["error"] == "conflict" and what in r.json["message"], r.json

    engine = create_engine(db.sqlalchemy_url(database_url))
    try:
        with engine.connect() as conn:
            row = conn.execute(
                text("SELECT id, destination, parameters FROM trials WHERE trial_id = :t"),
                {"t": tid},
            ).one()
            periods = conn.execute(
                text(
                    "SELECT period_index, start_offset_s FROM trial_periods "
                    "WHERE trial_pk = :pk ORDER BY period_index"
                ),
                {"pk": row.id},
            ).all()
    finally:
        engine.dispose()
    assert (row.destination, row.parameters) == ("agent-a", {"workload": {"seed": 1}})
    assert [tuple(p) for p in periods] == [(0, 0.0), (1, 120.0)]
