"""Every HTTP endpoint that takes a body, enumerated from the app's URL map,
fuzzed with valid credentials (so bodies reach validation): whatever the body,
the answer is a 2xx or a 4xx with a message, never a 5xx, never a traceback.

A new endpoint is covered without editing this test: it declares its body
with ``http.accepts(Model, example)`` (the test fails for one that does not),
and the example is mutated here, field by field, with values of every type
and size, and with numbers at and just past the limits of the columns they
reach (smallint, integer, bigint, real, double).
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kickass_core import signing
from kickass_db.schedule_store import ScheduleStore
from kickass_db.study_store import StudyStore
from kickass_db.trial_store import TrialStore
from kickass_server.api import ApiConfig, create_app
from kickass_server.engine import ProbeEngine
from kickass_server.policy import Policy

BODY_METHODS = {"POST", "PUT", "PATCH"}
# The limits of PostgreSQL's number columns, and one past each.
INT_EDGES = [
    -(2**63) - 1, -(2**63), -(2**31) - 1, -(2**31), -32769, -32768, -1, 0, 1,
    32767, 32768, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, 10**30,
]  # fmt: skip
FLOAT_EDGES = [
    -1.7e308, -3.5e38, -3.4e38, -1e-300, -0.0, 0.0, 5e-324, 1e-45, 1.5, 3.4e38, 3.5e38,
    1e300, 1.7e308,
]  # fmt: skip
TEXT_EDGES = ["", "\x00", "a\udfffb", "é" * 64, "x" * 65, "y" * 256, "z" * 5000]

texts = st.text(max_size=40) | st.sampled_from(TEXT_EDGES)
scalars = (
    st.none()
    | st.booleans()
    | st.sampled_from(INT_EDGES)
    | st.integers()
    | st.sampled_from(FLOAT_EDGES)
    | st.floats(allow_nan=False, allow_infinity=False)
    | texts
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(texts, inner, max_size=5),
    max_leaves=16,
)


class Api:
    """The whole app with a finished session, a stored trial and a runner."""

    def __init__(self, database_url: str) -> None:
        self.study = StudyStore(database_url)
        self.trials = TrialStore(database_url)
        policy = Policy(
            sessions_per_address=10**6, sessions_per_prefix=10**6,
            sessions_per_address_hour=10**6, sessions_per_prefix_hour=10**6,
            bytes_per_address_hour=10**15, bytes_per_prefix_hour=10**15, max_sessions=10**6,
        )  # fmt: skip
        self.engine = ProbeEngine(self.study, policy, probe_port=9000, server_version="fuzz")
        self.schedule = ScheduleStore(database_url)
        self.app: Flask = create_app(
            self.engine, self.study, ApiConfig(), trials=self.trials, schedule=self.schedule
        )
        self.client: FlaskClient = self.app.test_client()
        self.token = self.trials.add_runner("fuzz")
        # A session that is over (the report endpoint takes only those).
        r = self.client.post(
            "/api/v1/sessions", json={"plan": {"quick": True}},
            environ_base={"REMOTE_ADDR": "198.51.100.7"},
        )  # fmt: skip
        assert r.status_code == 201, r.json
        self.session_id, self.cookie = r.json["session_id"], r.json["cookie"]
        # Over in the database (the engine's loop is not running here).
        assert self.study.finish_session(
            self.session_id, "ended", "inconclusive", "fixture", "ended by the test"
        )
        self.trial_id = secrets.token_hex(16)
        # A scheduled run this runner holds (the runs/<run_id> endpoints).
        run = self.schedule.claim(
            "round-held", "trials", datetime(2026, 11, 25, 3, tzinfo=UTC), "runner:fuzz",
            lock=False,
        )  # fmt: skip
        assert run is not None
        self.args = {
            "session_id": self.session_id, "trial_id": self.trial_id, "run_id": str(run.run_id)
        }  # fmt: skip
        trial = self.view("trials.put_trial").body_example(self.args)
        assert self.request("PUT", f"/api/v1/trials/{self.trial_id}", trial).status_code == 200

    def view(self, endpoint: str) -> Any:
        return self.app.view_functions[endpoint]

    def body_routes(self) -> list[tuple[str, str, Any]]:
        """(method, path, view) of every route that takes a body."""
        out = []
        for rule in self.app.url_map.iter_rules():
            for method in sorted((rule.methods or set()) & BODY_METHODS):
                missing = set(rule.arguments) - set(self.args)
                assert not missing, f"teach this test a value for {missing} of {rule.rule}"
                values = {k: self.args[k] for k in rule.arguments}
                out.append((method, rule.build(values)[1], self.view(rule.endpoint)))
        return out

    def request(self, method: str, path: str, body: Any, raw: bytes | None = None) -> Any:
        data = raw if raw is not None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", "X-Kickass-Cookie": self.cookie}
        if path.startswith(("/api/v1/trials", "/api/v1/schedule")):
            key, name = signing.key_from_secret(self.token), signing.runner_name(self.token)
            headers |= signing.sign(key, name, method, path, data)
        return self.client.open(
            path, method=method, data=data, headers=headers,
            environ_base={"REMOTE_ADDR": "198.51.100.8"},
        )  # fmt: skip

    def close(self) -> None:
        self.engine.stop()
        self.study.close()
        self.trials.close()
        self.schedule.close()


@pytest.fixture
def api(database_url: str) -> Iterator[Api]:
    a = Api(database_url)
    try:
        yield a
    finally:
        a.close()


def _check(r: Any, caplog: pytest.LogCaptureFixture, what: Any) -> None:
    errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR or rec.exc_info]
    assert r.status_code < 500, (what, r.status_code, r.data[:300])
    assert not errors, [rec.getMessage() for rec in errors]
    if r.status_code >= 400:
        assert r.is_json and r.json.get("message"), (what, r.data[:300])


def test_every_body_endpoint_declares_its_body_and_takes_its_example(
    api: Api, caplog: pytest.LogCaptureFixture
) -> None:
    routes = api.body_routes()
    assert len(routes) >= 5, routes
    for method, path, view in routes:
        assert hasattr(view, "body_model"), f"{method} {path}: declare its body with @accepts"
        if view.body_model is None:
            continue
        example = view.body_example(api.args)
        view.body_model.model_validate(example)  # the example is valid
        r = api.request(method, path, example)
        _check(r, caplog, (method, path))
        assert r.status_code < 400, (method, path, r.json)


def _leaves(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    yield path, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _leaves(v, (*path, i))


def _replace(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: _replace(value[head], rest, new)}
    out = list(value)
    out[head] = _replace(out[head], rest, new)
    return out


def test_every_field_at_and_past_the_limits_of_its_column(
    api: Api, caplog: pytest.LogCaptureFixture
) -> None:
    """Each field of each example, in turn, set to every edge value."""
    tried = 0
    for method, path, view in api.body_routes():
        if view.body_model is None:
            continue
        example = view.body_example(api.args)
        for where, old in _leaves(example):
            if not where:
                continue
            edges: list[Any] = INT_EDGES + FLOAT_EDGES if isinstance(old, int | float) else []
            edges += [None, "", [], {}, True, "x" * 300, [0] * 5000]
            for new in edges:
                caplog.clear()
                r = api.request(method, path, _replace(example, where, new))
                _check(r, caplog, (method, path, where, new))
                tried += 1
    assert tried > 500


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_body_on_any_endpoint(
    api: Api, caplog: pytest.LogCaptureFixture, data: st.DataObject
) -> None:
    routes = api.body_routes()
    method, path, view = data.draw(st.sampled_from(routes))
    example = view.body_example(api.args) if view.body_model is not None else {}
    kind = data.draw(st.sampled_from(["any", "fields", "raw"]))
    raw = None
    body: Any = None
    if kind == "any":
        body = data.draw(json_values)
    elif kind == "fields":
        # The example with any of its fields (at any depth) of any type and size.
        body = example
        for _ in range(data.draw(st.integers(1, 3))):
            leaves = [p for p, _ in _leaves(body) if p]
            if not leaves:
                break
            body = _replace(body, data.draw(st.sampled_from(leaves)), data.draw(json_values))
    else:
        raw = data.draw(st.binary(max_size=300))
    caplog.clear()
    r = api.request(method, path, body, raw=raw)
    _check(r, caplog, (method, path, kind, body if raw is None else raw))
