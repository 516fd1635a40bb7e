"""Every HTTP endpoint that takes a body, enumerated from the app's URL map,
fuzzed with valid credentials (so bodies reach validation): whatever the body,
the answer is a 2xx or a 4xx with a message, never a 5xx, never a traceback.

A new endpoint is covered without editing this test: it declares its body
with ``http.accepts(Model, example)`` (the test fails for one that does not),
and the example is mutated here, field by field, with values of every type
and size, and with numbers at and just past the limits of the columns they
reach (smallint, integer, bigint, real, double).

An endpoint that takes flow records answers per record: there a mutated
record must be answered as the flow record's own check (``kickass_core.
flow_record.check``) judges it, refused with a message naming the field or
not refused as bad at all; and each field at its own limits from
``flow_record.FIELDS`` (``support.flow_limits``) is stored as sent, and just
past them refused by name and not stored.
"""

from __future__ import annotations

import json
import logging
import secrets
import shutil
import struct
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kickass_db as db
import pytest
from flask import Flask
from flask.testing import FlaskClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kickass_core import flow_record, signing
from kickass_core.study_events import RunFinished
from kickass_db.schedule_store import ScheduleStore
from kickass_db.study_store import StudyStore
from kickass_db.trial_store import TrialStore
from kickass_server.api import ApiConfig, create_app
from kickass_server.engine import ProbeEngine
from kickass_server.policy import Policy
from kickass_server.schemas import FlowsBody
from sqlalchemy import create_engine, text
from support.flow_limits import limit_cases
from support.schedule import write_schedule

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
        self.database_url = database_url
        self.study = StudyStore(database_url)
        self.trials = TrialStore(database_url)
        policy = Policy(
            sessions_per_address=10**6, sessions_per_prefix=10**6,
            sessions_per_address_hour=10**6, sessions_per_prefix_hour=10**6,
            bytes_per_address_hour=10**15, bytes_per_prefix_hour=10**15, max_sessions=10**6,
        )  # fmt: skip
        self.engine = ProbeEngine(self.study, policy, probe_port=9000, server_version="fuzz")
        self.schedule = ScheduleStore(database_url)
        # The runner "fuzz" may claim the schedule API's example item (schedule_api.py).
        self.schedule_file = Path(tempfile.mkdtemp(prefix="kickass-fuzz-")) / "s.toml"
        write_schedule(self.schedule_file, [{
            "name": "round-example", "kind": "trials", "cron": "0 3 * * *", "host": "fuzz",
            "trials": {"pairs": 1},
        }])  # fmt: skip
        self.app: Flask = create_app(
            self.engine, self.study, ApiConfig(schedule_file=str(self.schedule_file)),
            trials=self.trials, schedule=self.schedule,
        )  # fmt: skip
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
        assert self.study.apply(
            RunFinished(self.session_id, "ended", "inconclusive", "fixture", "ended by the test")
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

    def flow_routes(self) -> list[tuple[str, str]]:
        """(method, path) of every route whose body is a batch of flow records."""
        return [(m, p) for m, p, v in self.body_routes() if v.body_model is FlowsBody]

    def stored_flows(self) -> dict[str, dict[str, Any]]:
        engine = create_engine(db.sqlalchemy_url(self.database_url))
        try:
            with engine.connect() as conn:
                rows = conn.execute(text("SELECT * FROM flows")).mappings()
                return {r["flow_id"]: dict(r) for r in rows}
        finally:
            engine.dispose()

    def close(self) -> None:
        self.engine.stop()
        self.study.close()
        self.trials.close()
        self.schedule.close()
        shutil.rmtree(self.schedule_file.parent, ignore_errors=True)


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


def _check_flow_answer(r: Any, flow: Any, field: str, what: Any) -> None:
    """A batch of one mutated flow record is answered per record, as the flow
    record's own check judges it."""
    assert r.status_code == 200, (what, r.status_code, r.json)
    refusals = [x for x in r.json["refused"] if x["index"] == 0]
    try:
        flow_record.check(flow)
    except flow_record.FlowRecordError as exc:
        assert exc.field == field, (what, str(exc))
        assert [x["error"] for x in refusals] == ["bad-flow"], (what, r.json)
        assert field in refusals[0]["message"], (what, refusals[0]["message"])
        assert r.json["stored"] == [], (what, r.json)
    else:
        # Valid: stored, or (its id was stored by an earlier mutation) a conflict.
        assert [x["error"] for x in refusals] in ([], ["conflict"]), (what, r.json)


def test_every_field_at_and_past_the_limits_of_its_column(
    api: Api, caplog: pytest.LogCaptureFixture
) -> None:
    """Each field of each example, in turn, set to every edge value."""
    tried = flows_checked = 0
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
                body = _replace(example, where, new)
                r = api.request(method, path, body)
                _check(r, caplog, (method, path, where, new))
                if view.body_model is FlowsBody and where[:2] == ("flows", 0) and len(where) > 2:
                    _check_flow_answer(r, body["flows"][0], where[2], (path, where, new))
                    flows_checked += 1
                tried += 1
    assert tried > 500
    assert flows_checked > 300


def _float32(value: float) -> float:
    rounded: float = struct.unpack("f", struct.pack("f", value))[0]
    return rounded


def _same_as_stored(f: flow_record.Field, sent: Any, stored: Any) -> bool:
    """Whether a column holding ``stored`` holds what was sent for field ``f``."""
    if sent is None or stored is None:
        return sent is None and stored is None
    if f.kind == "time":
        return bool(stored == flow_record.parse_time(sent))
    if f.real:
        # A real column holds a float32; psycopg reads it back as its shortest
        # decimal, so both sides are compared as float32.
        return _float32(stored) == _float32(sent)
    return bool(stored == sent and type(stored) is type(sent))


def test_each_flow_field_at_its_own_limits_is_stored_and_just_past_is_refused_by_name(
    api: Api, caplog: pytest.LogCaptureFixture
) -> None:
    """The limits of ``flow_record.FIELDS`` (not only the columns' generic ones),
    all in one batch per flow endpoint: each record stands or falls alone."""
    routes = api.flow_routes()
    assert routes, "no endpoint takes flow records"
    for method, path in routes:
        base = api.view("trials.put_flows").body_example(api.args)["flows"][0]
        cases = limit_cases(api.trial_id)
        batch = []
        for n, case in enumerate(cases):
            fid = flow_record.flow_id(api.trial_id, 1, n)  # period 1: not the example's ids
            batch.append({**base, "flow_id": fid, case.field: case.value})
        caplog.clear()
        r = api.request(method, path, {"flows": batch})
        _check(r, caplog, (method, path))
        assert r.status_code == 200, r.json
        refused = {x["index"]: x for x in r.json["refused"]}
        stored_ids = set(r.json["stored"])
        rows = api.stored_flows()
        for n, (case, record) in enumerate(zip(cases, batch, strict=True)):
            f = flow_record.BY_NAME[case.field]
            fid = record["flow_id"]
            if case.ok:
                assert n not in refused, (str(case), refused.get(n))
                assert fid in stored_ids and fid in rows, str(case)
                assert _same_as_stored(f, case.value, rows[fid][f.name]), (
                    str(case),
                    rows[fid][f.name],
                )
            else:
                assert n in refused, f"{case} was not refused"
                assert refused[n]["error"] == "bad-flow", (str(case), refused[n])
                assert case.field in refused[n]["message"], (str(case), refused[n])
                if isinstance(fid, str) and flow_record.FLOW_ID_RE.fullmatch(fid):
                    assert fid not in rows and fid not in stored_ids, str(case)
        assert len(refused) == sum(not c.ok for c in cases)


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
