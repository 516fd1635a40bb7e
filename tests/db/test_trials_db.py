"""Trial results in PostgreSQL: idempotent uploads and the v_flow_results / v_flow_summary views."""

from __future__ import annotations

import secrets
from typing import cast

import kickass_db as db
import pytest
from kickass_db.trial_store import BadRecord, TrialStore
from sqlalchemy import Table, create_engine, text
from support.trial_records import flow as _flow
from support.trial_records import trial as _trial


@pytest.fixture
def trials(database_url: str):  # noqa: ANN201
    s = TrialStore(database_url)
    yield s
    s.close()


def test_uploads_are_idempotent_and_the_summary_is_right(
    trials: TrialStore, database_url: str
) -> None:
    runner = trials.authenticate(trials.add_runner("edge-1"))
    assert runner is not None
    tid = secrets.token_hex(16)
    trials.put_trial(runner, _trial(tid))
    trials.put_trial(runner, _trial(tid))  # a re-sent trial is a no-op
    # 11-100 bucket: TCP 300, 500, 700 ms (mean 500); Kick-Ass 100, 150, 200 (mean 150).
    flows = [_flow(tid, i, "tcp", 50, f, None) for i, f in enumerate((300.0, 500.0, 700.0))]
    flows += [_flow(tid, 3 + i, "kickass", 50, f, 1.0) for i, f in enumerate((100.0, 150.0, 200.0))]
    flows.append(_flow(tid, 6, "kickass", 5, None, 0.5))  # did not complete
    assert trials.put_flows(runner, tid, flows).stored == [f["flow_id"] for f in flows]
    trials.put_flows(runner, tid, flows[:4])  # a re-sent batch stores nothing twice
    engine = create_engine(db.sqlalchemy_url(database_url))
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM v_flow_results")).scalar() == 7
        rows = {
            (r.protocol, r.size_bucket): r
            for r in conn.execute(text("SELECT * FROM v_flow_summary")).mappings()
        }
    engine.dispose()
    ka, tcp = rows[("kickass", "11-100")], rows[("tcp", "11-100")]
    assert (ka["flows"], tcp["flows"]) == (3, 3)
    assert ka["fct_ms_mean"] == pytest.approx(150.0) and tcp["fct_ms_mean"] == pytest.approx(500.0)
    assert ka["fct_ms_p50"] == pytest.approx(150.0)
    assert tcp["fct_ms_p95"] == pytest.approx(680.0)  # linear interpolation of 300, 500, 700
    assert ka["speedup"] == pytest.approx(500.0 / 150.0)
    assert tcp["speedup"] is None
    small = rows[("kickass", "1-10")]
    assert (small["flows"], small["completed"], small["speedup"]) == (1, 0, None)


def test_a_destination_with_old_and_paired_trials_has_one_summary_row_per_group(
    trials: TrialStore, database_url: str
) -> None:
    """Trials before arms (TCP arm 'tcp') beside paired ones ('tcp:cubic'):
    one row per group, and Kick-Ass's pooled ratio against tcp:cubic."""
    runner = trials.authenticate(trials.add_runner("edge-1"))
    assert runner is not None
    old, paired = secrets.token_hex(16), secrets.token_hex(16)
    trials.put_trial(runner, _trial(old))
    trials.put_trial(runner, _trial(paired))
    trials.put_flows(runner, old, [_flow(old, i, "tcp", 50, 900.0, None) for i in range(3)])
    trials.put_flows(
        runner,
        paired,
        [{**_flow(paired, i, "tcp", 50, 400.0, None), "arm": "tcp:cubic"} for i in range(3)]
        + [
            {**_flow(paired, 3 + i, "kickass", 50, 200.0, 1.0), "arm": "kickass"} for i in range(3)
        ],  # fmt: skip
    )
    engine = create_engine(db.sqlalchemy_url(database_url))
    with engine.connect() as conn:
        rows = [dict(r) for r in conn.execute(text("SELECT * FROM v_flow_summary")).mappings()]
    engine.dispose()
    keys = [(r["destination"], r["arm"], r["size_bucket"]) for r in rows]
    assert len(keys) == len(set(keys)) == 3, keys
    [ka] = [r for r in rows if r["arm"] == "kickass"]
    assert ka["speedup"] == pytest.approx(400.0 / 200.0)
    assert sum(r["flows"] for r in rows) == 9


def test_runners_are_kept_apart(trials: TrialStore) -> None:
    a = trials.authenticate(trials.add_runner("a"))
    b = trials.authenticate(trials.add_runner("b"))
    assert trials.authenticate("not-a-token") is None
    tid = secrets.token_hex(16)
    trials.put_trial(a, _trial(tid))
    with pytest.raises(BadRecord):
        trials.put_trial(b, _trial(tid))
    with pytest.raises(BadRecord):
        trials.put_flows(b, tid, [_flow(tid, 0, "tcp", 5, 10.0, None)])


def test_conflicts_are_answered_by_position_and_the_first_copy_is_stored(
    trials: TrialStore, database_url: str
) -> None:
    runner = trials.authenticate(trials.add_runner("edge-1"))
    assert runner is not None
    tid = secrets.token_hex(16)
    trials.put_trial(runner, _trial(tid))
    kept = _flow(tid, 0, "tcp", 5, 10.0, None)
    assert trials.put_flows(runner, tid, [kept]).stored == [kept["flow_id"]]
    new = _flow(tid, 1, "kickass", 5, 20.0, 0.5)
    other = {**new, "ka_mode_fraction": 0.25}
    # A real column rounds 0.1 to float32 both in the table and in the
    # comparison: a repeat of it is identical, not a conflict.
    real = _flow(tid, 2, "kickass", 5, 30.0, 0.1)
    batch = [{**kept, "fct_ms": 11.0}, new, other, new, real, kept, real]
    result = trials.put_flows(runner, tid, batch)
    assert result.stored == [new["flow_id"], real["flow_id"], kept["flow_id"]]
    assert [(pos, fid) for pos, fid, _ in result.conflicts] == [
        (0, kept["flow_id"]),
        (2, new["flow_id"]),
    ]
    assert all("other content" in why for _, _, why in result.conflicts)
    engine = create_engine(db.sqlalchemy_url(database_url))
    with engine.connect() as conn:
        rows = {
            r.flow_id: r.fct_ms for r in conn.execute(text("SELECT flow_id, fct_ms FROM flows"))
        }
        fraction = conn.execute(
            text("SELECT ka_mode_fraction FROM flows WHERE flow_id = :f"), {"f": new["flow_id"]}
        ).scalar()
    engine.dispose()
    assert rows == {kept["flow_id"]: 10.0, new["flow_id"]: 20.0, real["flow_id"]: 30.0}
    assert fraction == 0.5


def test_the_orm_flow_row_is_the_flow_records_table_column_by_column() -> None:
    """``FlowRow`` (which the migrations match, test_db_migrations) against
    ``kickass_core.flow_record.FIELDS``: after its keys, the record's fields in their
    order, each column of the type its kind and bounds take, nullable as the field,
    and every number and time bounded by the CHECK made from its field."""
    from kickass_core import flow_record
    from kickass_db.base import check_bounds
    from kickass_db.models.trials import FlowRow
    from sqlalchemy import (
        REAL,
        BigInteger,
        Boolean,
        CheckConstraint,
        DateTime,
        Float,
        Integer,
        Text,
    )
    from sqlalchemy.dialects.postgresql import JSONB

    table = cast(Table, FlowRow.__table__)
    keys = {"id", "trial_pk"}
    assert tuple(c.name for c in table.columns if c.name not in keys) == flow_record.FIELD_NAMES
    checks = {
        str(c.name).removeprefix("ck_flows_"): str(c.sqltext)
        for c in table.constraints
        if isinstance(c, CheckConstraint)
    }
    for f in flow_record.FIELDS:
        column = table.c[f.name]
        if f.kind == "int":
            assert f.maximum is not None
            want: type = Integer if f.maximum <= flow_record.INT32_MAX else BigInteger
        elif f.kind == "float":
            want = REAL if f.real else Float
        else:
            want = {"bool": Boolean, "str": Text, "time": DateTime, "object": JSONB}[f.kind]
        assert type(column.type) is want, (f.name, column.type, want)
        if f.kind == "time":
            assert column.type.timezone, f.name  # type: ignore[attr-defined]  # a time column: DateTime
        assert column.nullable == f.nullable, f.name
        if f.kind in ("int", "float", "time"):
            assert checks.get(f"{f.name}_bounds") == check_bounds(f), f.name
