"""The congestion experiments' store (issue 24 item 6; migration 0021):
a run's outcome, its figures computed by ``kickass_testbed.congestion``,
stored in one transaction and read back exactly through the views; a value
out of ``kickass_core.bounds`` refused by name with nothing stored.
"""

from __future__ import annotations

import copy
import math
from datetime import datetime
from typing import Any

import pytest
from kickass_core.errors import KickassError
from kickass_db.experiment_store import ExperimentStore, flow_series
from sqlalchemy import text
from support.experiments import synthetic_outcome


def _counts(store: ExperimentStore) -> tuple[int, int]:
    with store.engine.connect() as conn:
        return (
            conn.execute(text("SELECT count(*) FROM experiment_runs")).scalar_one(),
            conn.execute(text("SELECT count(*) FROM experiment_rates")).scalar_one(),
        )


@pytest.fixture
def experiments(database_url: str) -> Any:
    with ExperimentStore(database_url) as s:
        yield s


def test_an_outcome_is_stored_and_read_back_exactly(experiments: ExperimentStore) -> None:
    outcome = synthetic_outcome("a")
    floor = synthetic_outcome("floor", router_run_name=None)
    run_id = experiments.store(outcome)
    floor_id = experiments.store(floor)
    samples = sum(len(v) for v in outcome["rates"].values())
    assert samples > 3000
    assert _counts(experiments) == (2, samples + sum(len(v) for v in floor["rates"].values()))

    run = experiments.get(run_id)
    assert run.kind == "kickass-bottleneck" and run.experiment == "a"
    assert run.router_mode == "kickass"
    assert run.started_at == datetime.fromisoformat(outcome["started_at"])
    assert (run.capacity_bps, run.rtt_ms) == (20e6, 100.0)
    assert run.router_run_name == "exp-router"
    assert run.parameters == outcome["spec"]
    assert run.figures == {
        "epochs": outcome["epochs"],
        "alone": outcome["alone"],
        "drivers": outcome["drivers"],
    }
    # The figures are congestion.figures' own: (a)'s switch times as played.
    (epoch,) = run.figures["epochs"]
    assert (epoch["tcp_mode_after_rtts"], epoch["kickass_mode_after_rtts"]) == (1.5, 3.5)
    assert 0.9 < epoch["jain"] < 1 and 0.9 < epoch["utilisation"] < 1
    assert run.flows == {"kickass": 8, "tcp": 8} and run.samples == samples
    # Every rate, time and mode as sent, to the last bit.
    got = experiments.rates(run_id)
    assert got == flow_series(outcome)
    assert all(isinstance(x, float) for s in got for x in s.rate_bps)

    # The floor is (a)'s kind with the router in drop-tail mode.
    f = experiments.get(floor_id)
    assert (f.kind, f.router_mode, f.experiment) == ("kickass-bottleneck", "droptail", "floor")
    assert f.router_run_name is None
    assert [r.run_id for r in experiments.runs()] == [run_id, floor_id]
    assert experiments.runs(since=datetime.fromisoformat(outcome["started_at"])) != []
    with pytest.raises(KickassError, match="no experiment run 999"):
        experiments.get(999)


def test_storing_the_same_outcome_again_is_the_same_run(experiments: ExperimentStore) -> None:
    outcome = synthetic_outcome("b")
    first = experiments.store(outcome)
    assert experiments.store(copy.deepcopy(outcome)) == first
    assert _counts(experiments)[0] == 1
    edited = copy.deepcopy(outcome)
    edited["epochs"][0]["jain"] = 0.5
    with pytest.raises(KickassError, match=f"run {first} has the same kind, start"):
        experiments.store(edited)
    assert _counts(experiments)[0] == 1
    assert experiments.get(first).figures["epochs"] == outcome["epochs"]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda o: o["rates"]["tcp-3"].__setitem__(40, [12.5, 1e300, False]),
         r"flow 'tcp-3', sample 40 \(t_s 12.5\), rate_bps: .*must lie within"),
        (lambda o: o["rates"]["ka-0"].__setitem__(7, [0.8, math.nan, True]),
         r"flow 'ka-0', sample 7 \(t_s 0.8\), rate_bps: .*finite"),
        (lambda o: o["rates"]["ka-1"].__setitem__(0, [-0.1, 1e6, True]),
         r"flow 'ka-1', sample 0, t_s: .*must lie within"),
        (lambda o: o["rates"]["ka-1"].__setitem__(1, o["rates"]["ka-1"][0]),
         r"flow 'ka-1': two samples at t_s 0.1"),
        (lambda o: o["spec"].__setitem__("capacity_bps", 0.0), r"spec.capacity_bps: .*\(0.0, "),
        (lambda o: o.__setitem__("started_at", "2026-01-01T00:00:00"), r"started_at: .*UTC offset"),
        (lambda o: o["spec"].__setitem__("kind", "wan"), r"spec.kind must be one of"),
        (lambda o: o["protocols"].__setitem__("ka-2", "quic"), r"flow 'ka-2': protocol must be"),
        (lambda o: o["spec"].__setitem__("interval_s", "fast"), r"spec.interval_s: .*a number"),
        (lambda o: o["spec"].__setitem__("duration_s", 0), r"spec.duration_s: .*\(0.0, "),
        (lambda o: o["epochs"][0].__setitem__("jain", "high"), r"epochs\[0\].jain: .*a number"),
        (lambda o: o["epochs"][0].__setitem__("end_s", None), r"epochs\[0\].end_s: .*null"),
        (lambda o: o["alone"].__setitem__("utilisation", -1.0), r"alone.utilisation: .*within"),
        (lambda o: o["epochs"][0].__setitem__("jain", math.inf), r"epochs\[0\].jain: .*finite"),
        (lambda o: o["drivers"][0]["flows"]["ka-0"].__setitem__("retransmissions", math.inf),
         r"figures: numbers must be finite"),
    ],
)  # fmt: skip
def test_a_value_out_of_bounds_is_refused_and_nothing_stored(
    experiments: ExperimentStore, edit: Any, message: str
) -> None:
    outcome = synthetic_outcome("a")
    experiments.store(synthetic_outcome("b"))  # a run stored before stays
    edit(outcome)
    with pytest.raises(KickassError, match=message) as err:
        experiments.store(outcome)
    assert err.value.message.startswith("experiment not stored: ")
    assert "nothing of this run was stored" in (err.value.hint or "")
    runs, rates = _counts(experiments)
    assert runs == 1 and rates == sum(len(v) for v in synthetic_outcome("b")["rates"].values())


def test_a_database_without_the_tables_is_named(empty_database_url: str) -> None:
    with ExperimentStore(empty_database_url) as s:
        with pytest.raises(KickassError, match="has no experiment tables") as err:
            s.ping()
        assert err.value.hint == "run: kickass db upgrade"
        with pytest.raises(KickassError, match="has no experiment tables"):
            s.runs()


def test_the_database_check_is_the_second_guard(
    experiments: ExperimentStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer that skipped the check (here: the store's own, switched off)
    meets the same bounds as CHECK constraints, reported the same way."""
    from kickass_db import experiment_store

    monkeypatch.setattr(experiment_store, "_check", lambda *_: None)
    outcome = synthetic_outcome("a")
    outcome["rates"]["tcp-0"][5][1] = 1e300
    with pytest.raises(KickassError, match=r"the database refused it \(ck_experiment_rates_"):
        experiments.store(outcome)
    assert _counts(experiments) == (0, 0)
