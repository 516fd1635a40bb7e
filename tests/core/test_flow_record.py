"""The flow record's shared vector file against its Python definition.

The Rust half (wan-agents/transport/ka-transport/tests/flow_record_vectors.rs) checks
that every example's transport record is ka-transport's ``FlowRecord``; this
half checks that the file is what ``core/vectors/make_vectors.py`` writes
today (so the table and the examples in it are the ones the code has) and
that each transport record converts to exactly the measured record stored
beside it.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from kickass_core import flow_record

VECTORS = Path(__file__).resolve().parents[2] / "core" / "vectors"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_vectors", VECTORS / "make_vectors.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GENERATED: dict[str, str] = _generator().documents()


def _vectors() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((VECTORS / "flow_record.json").read_text())
    return doc


@pytest.mark.parametrize("name", sorted(GENERATED))
def test_each_vector_file_is_what_its_generator_writes_today(name: str) -> None:
    on_disk = (VECTORS / name).read_text()
    assert on_disk == GENERATED[name], (
        f"core/vectors/{name} differs from what core/vectors/make_vectors.py writes: "
        "regenerate it (python core/vectors/make_vectors.py) on a deliberate change, "
        "and check the Rust side (cargo test -p ka-transport --test flow_record_vectors)"
    )


def test_the_file_holds_the_table_of_fields() -> None:
    doc = _vectors()
    assert [f["name"] for f in doc["fields"]] == list(flow_record.FIELD_NAMES)
    assert doc["fields"] == [f.to_json() for f in flow_record.FIELDS]
    assert doc["transport_extra"] == list(flow_record.TRANSPORT_EXTRA)
    assert doc["flows_per_period_max"] == flow_record.FLOWS_PER_PERIOD_MAX


def test_each_transport_record_converts_to_exactly_its_measured_record() -> None:
    examples = _vectors()["examples"]
    assert len(examples) >= 3
    cases = [ex["case"] for ex in examples]
    assert len(set(cases)) == len(cases)
    for ex in examples:
        got = flow_record.from_transport(ex["transport"], ex["error"])
        assert got == ex["measured"], ex["case"]
        # == takes 1 for 1.0: the JSON text also pins each value's type.
        assert json.dumps(got, sort_keys=True) == json.dumps(ex["measured"], sort_keys=True)
        # Every measured field is a field of the record, and every counter
        # copied into extra is one the transport record has.
        assert set(got) <= set(flow_record.FIELD_NAMES), ex["case"]
        assert set(got["extra"]) <= set(ex["transport"]), ex["case"]


def test_each_measured_record_is_a_valid_flow_record() -> None:
    """What the runner uploads: the measured part beside the planned one."""
    trial = "0123456789abcdef" * 2
    for n, ex in enumerate(_vectors()["examples"]):
        t = ex["transport"]
        record = {
            **ex["measured"],
            "flow_id": flow_record.flow_id(trial, 1, n),
            "period_index": 1,
            "protocol": "kickass",
            "size_bytes": t["size_bytes"],
            "size_packets": t["size_packets"],
            "started_at": "2026-11-25T12:00:00+00:00",
        }
        flow_record.check(record)


def test_an_error_beside_the_transport_record_marks_the_flow_failed() -> None:
    t = _vectors()["examples"][0]["transport"]
    assert t["completed"] is True
    measured = flow_record.from_transport(t, "ka-send exited 3")
    assert measured["completed"] is False and measured["error"] == "ka-send exited 3"


@pytest.mark.parametrize(
    ("name", "longest"),
    [
        ("flow_id", "0123456789abcdef" * 2 + "-" + "9" * flow_record.FLOW_ID_DIGITS),
        ("congestion_control", "c" * flow_record.CONGESTION_CONTROL_MAX_CHARS),
        ("arm", "tcp:cubic#" + "2" * (flow_record.ARM_MAX_CHARS - 10)),
    ],
)
def test_a_patterned_fields_max_len_is_its_patterns_longest_match(name: str, longest: str) -> None:
    f = flow_record.BY_NAME[name]
    assert f.pattern is not None and f.max_len == len(longest)
    assert re.fullmatch(f.pattern, longest)
    assert not re.fullmatch(f.pattern, longest + longest[-1])
    patterned = {g.name for g in flow_record.FIELDS if g.pattern is not None}
    assert patterned == {"flow_id", "congestion_control", "arm"}, "list the new one above"
