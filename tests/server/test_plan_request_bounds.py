"""Every number a request model takes is bounded at the schema, and a plan
request's bounds are the most any server may offer (``kickass_core.plan``),
inside which a server's policy sets its own."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import pytest
from flask.testing import FlaskClient
from kickass_core.errors import KickassError
from kickass_core.plan import MAX_REPETITIONS, MAX_WINDOW
from kickass_core.rate import FRAGMENT_UNIT, FULL_PACKET_LEN
from kickass_db.study_store import StudyStore
from kickass_server import schemas
from kickass_server.api import ApiConfig, create_app
from kickass_server.engine import ProbeEngine
from kickass_server.policy import Policy
from pydantic import BaseModel

# A step is a multiple of the fragment unit: the largest is 1496.
STEP_MAX = FULL_PACKET_LEN - FULL_PACKET_LEN % FRAGMENT_UNIT


def _unbounded_numbers(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(node, dict):
        if node.get("type") in ("integer", "number"):
            has_max = "maximum" in node or "exclusiveMaximum" in node
            has_min = "minimum" in node or "exclusiveMinimum" in node
            if not (has_max and has_min):
                yield path
        for key, value in node.items():
            yield from _unbounded_numbers(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _unbounded_numbers(value, (*path, i))


def test_every_number_of_every_request_model_is_bounded_both_ways() -> None:
    models = [
        m
        for m in vars(schemas).values()
        if inspect.isclass(m) and issubclass(m, BaseModel) and m.__module__ == schemas.__name__
    ]
    models.append(schemas.FlowRecord)
    assert schemas.PlanRequest in models and len(models) >= 10
    loose = {m.__name__: list(_unbounded_numbers(m.model_json_schema())) for m in models}
    assert not any(loose.values()), {k: v for k, v in loose.items() if v}


@pytest.mark.parametrize(
    ("field", "lowest", "highest"),
    [
        ("repetitions", 1, MAX_REPETITIONS),
        ("step", FRAGMENT_UNIT, STEP_MAX),
        ("window", 1, MAX_WINDOW),
    ],
)
def test_plan_request_limits_come_from_the_plan(field: str, lowest: int, highest: int) -> None:
    for ok in (lowest, highest):
        assert getattr(schemas.PlanRequest.model_validate({field: ok}), field) == ok
    for bad in (lowest - 1, highest + 1, highest + FRAGMENT_UNIT, 10**40):
        with pytest.raises(ValueError, match=field):
            schemas.PlanRequest.model_validate({field: bad})


def test_a_policy_above_the_plans_ceiling_is_a_configuration_error() -> None:
    Policy(max_repetitions=MAX_REPETITIONS, max_window=MAX_WINDOW)
    with pytest.raises(KickassError, match="max_repetitions") as exc:
        Policy(max_repetitions=MAX_REPETITIONS + 1)
    assert exc.value.hint == "check KICKASS_POLICY_MAX_REPETITIONS"
    with pytest.raises(KickassError, match="max_window"):
        Policy.from_env({"KICKASS_POLICY_MAX_WINDOW": str(MAX_WINDOW + 1)})


@pytest.fixture
def client(database_url: str) -> Iterator[FlaskClient]:
    """The whole app with the most generous policy a server may have."""
    study = StudyStore(database_url)
    engine = ProbeEngine(
        study,
        Policy(max_repetitions=MAX_REPETITIONS, max_window=MAX_WINDOW),
        probe_port=9000,
        server_version="t",
    )
    try:
        yield create_app(engine, study, ApiConfig()).test_client()
    finally:
        engine.stop()
        study.close()


def _session(client: FlaskClient, plan: dict[str, Any], n: int) -> Any:
    return client.post(
        "/api/v1/sessions", json={"plan": plan}, environ_base={"REMOTE_ADDR": f"198.51.100.{n}"}
    )


def test_through_the_api_the_ceiling_is_a_session_and_past_it_a_400_naming_the_field(
    client: FlaskClient,
) -> None:
    at = {"repetitions": MAX_REPETITIONS, "step": STEP_MAX, "window": MAX_WINDOW}
    r = _session(client, at, 1)
    assert r.status_code == 201, r.json
    plan = r.json["plan"]
    assert (plan["repetitions"], plan["step"], plan["window"]) == (
        MAX_REPETITIONS,
        STEP_MAX,
        MAX_WINDOW,
    )
    for n, (field, past) in enumerate(
        [("repetitions", MAX_REPETITIONS + 1), ("step", STEP_MAX + FRAGMENT_UNIT), ("step", 12),
         ("window", MAX_WINDOW + 1), ("repetitions", 2**63), ("window", 0)],
        start=2,
    ):  # fmt: skip
        r = _session(client, {**at, field: past}, n)
        assert r.status_code == 400, (field, past, r.json)
        assert f"plan.{field}" in r.json["message"], r.json
