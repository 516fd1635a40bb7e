"""The two validators of a flow record agree: the trial runner's own check
(``kickass_core.flow_record.check``, standard library only) and the server's
model (``kickass_server.schemas.FlowRecord``) are both built from
``flow_record.FIELDS``; here they accept and refuse the same records, and
name the same culprit, for valid records, every field at its limits and
just past them, wrong types, missing and unknown fields."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kickass_core import flow_record
from kickass_core.flow_record import Field, FlowRecordError
from kickass_server.schemas import FlowRecord
from pydantic import ValidationError
from support.flow_limits import limit_cases

TRIAL = "0123456789abcdef" * 2
VALID: dict[str, Any] = {
    "flow_id": flow_record.flow_id(TRIAL, 0, 0),
    "period_index": 0,
    "protocol": "kickass",
    "size_bytes": 144000,
    "size_packets": 100,
    "started_at": "2026-11-25T12:00:01+00:00",
    "completed": True,
}
CASES = limit_cases(TRIAL)


def verdicts(record: Any) -> tuple[str | None, set[str] | None]:
    """(the field core's check blames or None, the fields the model blames or None)."""
    core: str | None = None
    model: set[str] | None = None
    try:
        flow_record.check(record)
    except FlowRecordError as exc:
        core = exc.field
    try:
        FlowRecord.model_validate(record)
    except ValidationError as exc:
        model = {str(e["loc"][0]) if e["loc"] else "record" for e in exc.errors()}
    return core, model


def assert_agree(record: Any) -> bool:
    core, model = verdicts(record)
    assert (core is None) == (model is None), (record, core, model)
    if core is not None:
        assert model is not None and core in model, (record, core, model)
    return core is None


def test_the_valid_record_is_valid() -> None:
    assert assert_agree(VALID)
    assert assert_agree({**VALID, **{f.name: None for f in flow_record.FIELDS if f.nullable}})


@pytest.mark.parametrize("case", CASES, ids=str)
def test_each_field_at_and_just_past_its_limits(case: Any) -> None:
    record = {**VALID, case.field: case.value}
    assert assert_agree(record) is case.ok, case
    if not case.ok:
        assert verdicts(record)[0] == case.field


def test_every_field_has_limits_both_sides() -> None:
    """Each field has a case accepted and a case refused."""
    for f in flow_record.FIELDS:
        oks = {c.ok for c in CASES if c.field == f.name}
        assert oks == {True, False}, f.name


# Values of every JSON type and the numbers that break naive checks (an
# integer no double holds, NaN, infinities).
ODD_VALUES: list[Any] = [
    None, True, False, 0, -1, 1.5, 2**31, 2**63, 10**400, -(10**400), math.nan, math.inf,
    -math.inf, "", "1", "true", "x" * 5000, [], [1], {}, {"a": 1}, {"a": [1, {"b": None}]},
]  # fmt: skip


def test_every_field_given_values_of_every_type() -> None:
    tried = 0
    for f in flow_record.FIELDS:
        for value in ODD_VALUES:
            assert_agree({**VALID, f.name: value})
            tried += 1
    assert tried == len(flow_record.FIELDS) * len(ODD_VALUES)


def test_missing_required_and_unknown_fields() -> None:
    for f in flow_record.FIELDS:
        record = {k: v for k, v in VALID.items() if k != f.name}
        assert assert_agree(record) is (not f.required), f.name
    assert not assert_agree({**VALID, "flowid": VALID["flow_id"]})
    assert not assert_agree([VALID])


# -- any record -------------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([2**31, 2**63, 10**400, -(2**63) - 1])
    | st.floats()
    | st.text(max_size=30)
    | st.sampled_from(["", "\x00", "a\ud800", "é" * 300])
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=70), inner, max_size=4)
    ),
    max_leaves=12,
)


def _valid_values(f: Field) -> st.SearchStrategy[Any]:
    if f.kind == "int":
        return st.integers(int(f.minimum or 0), int(f.maximum or 0))
    if f.kind == "float":
        s = st.floats(f.minimum, f.maximum)
        return s.filter(flow_record.real_ok)
    if f.kind == "bool":
        return st.booleans()
    if f.kind == "time":
        # Within flow_record.TIME_MIN and TIME_MAX whatever the offset (a day inside).
        day = timedelta(days=1)
        low, high = (flow_record.TIME_MIN + day, flow_record.TIME_MAX - day)
        return st.datetimes(
            low.replace(tzinfo=None), high.replace(tzinfo=None), timezones=st.timezones()
        ).map(lambda t: t.isoformat())
    if f.kind == "object":
        return st.dictionaries(st.text(max_size=10), json_values, max_size=5)
    if f.choices is not None:
        return st.sampled_from(f.choices)
    if f.pattern is not None:
        return st.from_regex(f.pattern, fullmatch=True)
    return st.text(max_size=f.max_len or 100)


def _value(f: Field) -> st.SearchStrategy[Any]:
    edges = [c.value for c in CASES if c.field == f.name]
    nearby: list[st.SearchStrategy[Any]] = [_valid_values(f), st.sampled_from(edges), json_values]
    if f.kind in ("int", "float") and f.minimum is not None and f.maximum is not None:
        nearby.append(
            st.sampled_from([f.minimum, f.maximum]).flatmap(
                lambda b: st.floats(b - 1, b + 1) | st.integers(math.floor(b) - 2, math.ceil(b) + 2)
            )
        )
    return st.one_of(nearby)


@st.composite
def records(draw: st.DrawFn) -> dict[str, Any]:
    record = dict(VALID)
    for f in flow_record.FIELDS:
        how = draw(st.sampled_from(["keep", "keep", "value", "absent"]))
        if how == "value":
            record[f.name] = draw(_value(f))
        elif how == "absent" and not f.required:
            record.pop(f.name, None)
    if draw(st.integers(0, 9)) == 0:
        key = draw(st.text(min_size=1, max_size=20).filter(lambda k: k not in flow_record.BY_NAME))
        record[key] = draw(json_values)
    return record


@settings(max_examples=400, deadline=None)
@given(record=records())
def test_the_two_validators_accept_and_refuse_the_same_records(record: dict[str, Any]) -> None:
    assert_agree(record)


@settings(max_examples=200, deadline=None)
@given(
    field=st.sampled_from(flow_record.FIELDS).flatmap(lambda f: st.tuples(st.just(f), _value(f)))
)
def test_one_field_changed_the_two_validators_agree(field: tuple[Field, Any]) -> None:
    f, value = field
    assert_agree({**VALID, f.name: value})


def test_a_periods_handshake_is_one_of_the_flow_records() -> None:
    """The server's period model takes the flow record's handshakes, in its order."""
    from typing import get_args

    from kickass_server.schemas import TrialPeriod

    literal, _none = get_args(TrialPeriod.model_fields["handshake"].annotation)
    assert get_args(literal) == flow_record.HANDSHAKES


def test_the_apis_example_of_an_upload_is_the_flow_records_every_field() -> None:
    """``schemas.flows_example`` is derived from the flow record's table: every field,
    in its order, a record both validators take."""
    from kickass_server import schemas

    [record] = schemas.flows_example({"trial_id": TRIAL})["flows"]
    assert tuple(record) == flow_record.FIELD_NAMES
    assert record == flow_record.example(TRIAL)
    assert verdicts(record) == (None, None)
