"""What the database accepts, every reader can read: each writer fed hostile values.

A property test over every writer of the numbers the readers compute with:
the trial API (a runner's signed uploads through the real Flask app), `kickass
telemetry ingest`, `kickass atlas import` and the congestion experiments'
store (`ExperimentStore.store`, what `kickass experiment run|import` call).
Each example gives every
bounded field of every writer a value of its own (the field's bounds and just
past them, NaN, the infinities, 1e308, integers past smallint, integer,
bigint and a double's mantissa, the smallest subnormal, text, booleans;
times at and past the ends of what the API takes, 1970 and 2100, and of
what Python holds), one record per field, on top of a seeded database (the
study, paired trials, router runs, an Atlas campaign, scheduled runs).
Whatever a writer stored, then: the scheduled refresh, `kickass report`,
`kickass export` of every view as CSV and as Parquet, and every Grafana
panel's SQL as the reader role runs it (tests/analysis/test_grafana.py's
way), each run to its end. A second test stores every field at each end of
its bounds, which random draws may miss, and checks every one was stored.

Before the bounds (kickass_core.bounds, their CHECKs and the writers' line
checks) the ingest died on such values with a traceback and lost its batch,
the report died on what it had stored ("timestamp out of range" at
make_interval, "value out of range: overflow" in avg()), and a trial the
API took at 9999-12-31 could not be exported as Parquet (its periods in
year 10000).
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from flask.testing import FlaskClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kickass_analysis import rollups
from kickass_analysis.export import views
from kickass_atlas.campaign import Campaign
from kickass_atlas.result_files import SourceLine, import_campaign
from kickass_atlas.store import AtlasStore
from kickass_core import bounds, cli, flow_record, signing
from kickass_db.experiment_store import EPOCH_FIGURES, ExperimentRefused, ExperimentStore
from kickass_db.partitions import Partitions, day_of
from kickass_db.study_store import StudyStore
from kickass_db.telemetry import TelemetryIngest
from kickass_db.trial_store import TrialStore
from kickass_server.api import ApiConfig, create_app
from kickass_server.engine import ProbeEngine
from kickass_testbed.pg import create_database, drop_database
from support.experiments import synthetic_outcome
from support.grafana import TimeRange, expand, panel_interval, panel_queries
from support.seed import seed_atlas, seed_item_runs, seed_paired_trials, seed_router, seed_study
from support.trial_records import flow as good_flow
from support.trial_records import trial as good_trial
from test_grafana import DASHBOARDS, reader, variable_values

NOW = datetime.now(UTC)
# The seeded Atlas campaign (support.seed.seed_atlas): its first measurement.
ATLAS_CAMPAIGN = "seed-atlas"
ATLAS_MSM = 5_000_000

# -- hostile values ------------------------------------------------------------------------

ANY_HOSTILE = [
    math.nan, math.inf, -math.inf, 1e308, -1e308, 1e300, 1e39, 1e-40, 5e-324, -0.0, -1, 0, 1,
    2**15, 2**16, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 10**30,
    flow_record.REAL_MIN, "12", "", "NaN", True, None, [], {},
]  # fmt: skip


def edges(f: bounds.Field) -> list[Any]:
    """A field's bounds and the numbers just past them."""
    out: list[Any] = []
    for b in (f.minimum, f.maximum):
        if b is None:
            continue
        if f.kind == "int":
            out += [int(b), int(b) - 1, int(b) + 1]
        else:
            out += [b, math.nextafter(b, -math.inf), math.nextafter(b, math.inf)]
    return out


def hostile(f: bounds.Field) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.sampled_from(edges(f) + ANY_HOSTILE),
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(min_value=-(2**70), max_value=2**70),
    )


# Times at the ends of what the API takes (1970 to 2100 in UTC), just past
# them, and at the ends of what Python holds.
TIMES = [
    flow_record.TIME_MIN.isoformat(), flow_record.TIME_MAX.isoformat(),
    "1969-12-31T23:59:59+00:00", "2100-01-01T00:00:00-00:01", "0001-01-01T00:00:00+00:00",
    "9999-12-31T23:59:59+00:00", "9999-12-31T23:00:00-05:00", "2026-11-25T12:00:00+00:00",
]  # fmt: skip

FLOW_FIELDS = [f for f in flow_record.FIELDS if f.kind in ("int", "float", "time")]
PERIOD_KEYS = {  # the API's names of trial_periods' columns
    "period_index": "index", "pair": "pair", "start_offset_s": "start_s",
    "duration_s": "duration_s", "handicap_ms": "handicap_ms",
    "actual_start_offset_s": "actual_start_s", "tcp_share": "tcp_share",
    "offered_load_bps": "offered_load_bps",
}  # fmt: skip
SAMPLE_FIELDS = [*bounds.numbers(bounds.ROUTER_TELEMETRY), bounds.wall_clock("ts")]
RUN_FIELDS = [bounds.ROUTER_RUNS[0], bounds.wall_clock("started_unix")]
# An Atlas result's numbers as a line names them; its times are whole seconds.
_ATLAS = {f.name: f for f in (*bounds.ATLAS_RESULTS, *bounds.ATLAS_OUTCOMES)}
ATLAS_FIELDS = [
    *bounds.ATLAS_RESULT_KEY[1:], replace(bounds.wall_clock("timestamp"), kind="int"),
    replace(bounds.wall_clock("stored_timestamp"), kind="int"),
    bounds.renamed(_ATLAS["firmware"], "fw"), *(_ATLAS[n] for n in ("size", "sent", "rcvd", "dup")),
    bounds.renamed(_ATLAS["rtt_ms"], "rtt"),
]  # fmt: skip
# A congestion experiment's numbers: its run's columns, an epoch's figures
# (the report draws and tabulates them) and one rate sample's.
_RUN = {f.name: f for f in bounds.EXPERIMENT_RUNS}
EXPERIMENT_FIELDS = [
    *bounds.EXPERIMENT_RUNS, *bounds.EXPERIMENT_RATES,
    *(bounds.Field(k, "float", minimum=0.0, maximum=1e9) for k in EPOCH_FIGURES),
]  # fmt: skip


@st.composite
def hostile_writes(draw: st.DrawFn) -> dict[str, list[tuple[str, Any]]]:
    """One hostile value per bounded field of every writer."""

    def value(f: bounds.Field) -> Any:
        if f.kind == "time":
            return draw(st.sampled_from(TIMES))
        return draw(hostile(f))

    return {
        "flows": [(f.name, value(f)) for f in FLOW_FIELDS],
        "trials": [(f.name, value(f)) for f in bounds.TRIALS],
        "periods": [(PERIOD_KEYS[f.name], value(f)) for f in bounds.TRIAL_PERIODS],
        "samples": [(f.name, value(f)) for f in SAMPLE_FIELDS],
        "runs": [(f.name, value(f)) for f in RUN_FIELDS],
        "atlas": [(f.name, value(f)) for f in ATLAS_FIELDS],
        "experiments": [(f.name, value(f)) for f in EXPERIMENT_FIELDS],
    }


# -- the writers -------------------------------------------------------------------------


def json_text(value: Any) -> str:
    """JSON as a hostile writer sends it: NaN and Infinity as Python writes them."""
    return json.dumps(value)


def signed(client: FlaskClient, token: str, method: str, path: str, body: Any) -> int:
    data = json_text(body).encode()
    headers = {"Content-Type": "application/json"} | signing.sign(
        signing.key_from_secret(token), signing.runner_name(token), method, path, data
    )
    response = client.open(path, method=method, data=data, headers=headers)
    assert response.status_code < 500, response.get_data(as_text=True)
    return response.status_code


def write_api(url: str, writes: dict[str, list[tuple[str, Any]]]) -> None:
    """Through the server's whole app (its probe engine never started)."""
    trials = TrialStore(url)
    study = StudyStore(url)
    engine = ProbeEngine(study, probe_port=9000, server_version="t")
    try:
        client = create_app(engine, study, ApiConfig(), trials=trials).test_client()
        token = trials.add_runner(f"hostile-{secrets.token_hex(3)}")
        tid = secrets.token_hex(16)
        assert signed(client, token, "PUT", f"/api/v1/trials/{tid}", good_trial(tid)) == 200
        flows = []
        for i, (name, v) in enumerate(writes["flows"]):
            flows.append({**good_flow(tid, i, "kickass", 100, 250.0, 0.9), name: v})
        signed(client, token, "POST", f"/api/v1/trials/{tid}/flows", {"flows": flows})
        for name, v in writes["trials"]:
            other = secrets.token_hex(16)
            signed(client, token, "PUT", f"/api/v1/trials/{other}", {**good_trial(other), name: v})
            flow = good_flow(other, 0, "tcp", 5, 20.0, None)
            signed(client, token, "POST", f"/api/v1/trials/{other}/flows", {"flows": [flow]})
        for name, v in writes["periods"]:
            other = secrets.token_hex(16)
            body = good_trial(other)
            body["periods"] = [dict(body["periods"][0], **{name: v}), body["periods"][1]]
            signed(client, token, "PUT", f"/api/v1/trials/{other}", body)
    finally:
        engine.stop()
        trials.close()
        study.close()


def write_telemetry(url: str, writes: dict[str, list[tuple[str, Any]]]) -> None:
    start = NOW.timestamp() - 600
    meta = {"type": "metadata", "started_unix": start, "program_version": "hostile",
            "options": {"router": {"kind": "kickass", "capacity_bps": 1e7}}}  # fmt: skip
    lines = [json_text(meta)]
    for i, (name, v) in enumerate(writes["samples"]):
        t = 1.0 + i * 0.01
        line = {"type": "sample", "t": t, "advertised_rate_bps": 9e6, "input_rate_bps": 8e6,
                "output_rate_bps": 7e6, "queue_bytes": 100, "marking_mode": "kickass",
                "rtt_ms": 100.0, "drops": 0, "fragmented": 1, "ts": start + t, name: v}  # fmt: skip
        lines.append(json_text(line))
    # A run per field of its metadata line, each with a sample.
    sample = {"type": "sample", "t": 0.5, "advertised_rate_bps": 1e6, "input_rate_bps": 1e6,
              "queue_bytes": 0, "marking_mode": "tcp", "drops": 0, "fragmented": 0}  # fmt: skip
    for name, v in writes["runs"]:
        router = {"kind": "kickass", "capacity_bps": v if name == "capacity_bps" else 1e7}
        run = {**meta, "options": {"router": router}}
        if name == "started_unix":
            run["started_unix"] = v
        lines += [json_text(run), json_text(sample)]
    ingest = TelemetryIngest(url, "hostile")
    try:
        ingest.feed(lines)
    finally:
        ingest.close()


def write_atlas(url: str, writes: dict[str, list[tuple[str, Any]]]) -> None:
    at = int(NOW.timestamp()) - 3600
    lines = []
    for i, (name, v) in enumerate(writes["atlas"]):
        line: dict[str, Any] = {
            "type": "ping", "af": 4, "msm_id": ATLAS_MSM, "prb_id": 6001, "timestamp": at + i,
            "fw": 5080, "from": "198.51.100.1", "dst_addr": "192.0.2.11", "proto": "ICMP",
            "size": 1472, "sent": 1, "rcvd": 1, "dup": 0, "result": [{"rtt": 20.5}],
        }  # fmt: skip
        if name == "rtt":
            line["result"] = [{"rtt": v}]
        else:
            line[name] = v
        lines.append(SourceLine("hostile", i + 1, json_text(line).encode()))
    with AtlasStore(url) as store:
        import_campaign(store, _campaign(), lines)


def write_experiments(url: str, writes: dict[str, list[tuple[str, Any]]]) -> None:
    """One experiment (a) per field, that field hostile: stored, or refused whole
    by ExperimentRefused (never another error, never a part of it stored)."""
    with ExperimentStore(url) as store:
        for i, (name, v) in enumerate(writes["experiments"]):
            outcome = synthetic_outcome(
                "a", started_at=NOW - timedelta(hours=2, minutes=i), router_run_name=None
            )
            # Two flows' first seconds: the values, not the volume, are the test.
            keep = (
                list(outcome["rates"])[:1]
                + [f for f in outcome["rates"] if f.startswith("tcp")][:1]
            )
            outcome["rates"] = {f: outcome["rates"][f][:20] for f in keep}
            outcome["protocols"] = {f: outcome["protocols"][f] for f in keep}
            if name == "started_at":
                outcome["started_at"] = v
            elif name in _RUN:
                outcome["spec"][name] = v
            elif name in EPOCH_FIGURES:
                outcome["epochs"][0][name] = v
            else:  # a rate sample: [t_s, rate_bps, ka_mode]
                flow = next(iter(outcome["rates"]))
                outcome["rates"][flow][0][0 if name == "t_s" else 1] = v
            before = len(store.runs())
            try:
                store.store(json.loads(json_text(outcome)))
            except ExperimentRefused:
                assert len(store.runs()) == before, name


def _campaign() -> Campaign:
    # Only its name is read: the measurements are the stored ones.
    return Campaign.from_dict({
        "name": ATLAS_CAMPAIGN, "target": {"whole": "192.0.2.10", "split": "192.0.2.11"},
        "probes": {"ids": [6001]}, "whole": {"sizes": [576]}, "split": {"leading": [68]},
        "packets": 16, "interval": 3600, "packet_interval": 1000, "duration": 86400,
        "credit_budget": 1_000_000,
    })  # fmt: skip


# -- the readers -------------------------------------------------------------------------


def read_everything(url: str, out: Path) -> None:
    rollups.refresh(url)
    assert cli.main(["report", "--database-url", url, "-o", str(out / "report.html")]) == 0
    for view in views():
        for fmt in ("csv", "parquet"):
            argv = ["export", view, "--format", fmt, "-o", str(out / fmt), "--database-url", url]
            assert cli.main(argv) == 0, (view, fmt)
    month = TimeRange.last(timedelta(days=30))
    with reader(url) as conn:
        for path in DASHBOARDS:
            variables = variable_values(conn, path, month, {}, choose_all=True)
            for q in panel_queries([path]):
                query = expand(q.raw_sql, month, panel_interval(month, q.min_interval), variables)
                conn.execute(query).fetchall()


# -- the test ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def seeded_template(pg_server_url: str, _migrated_template: str) -> Iterator[str]:
    """A database with a little of everything, as the template of each example's."""
    name = f"hostile_template_{secrets.token_hex(4)}"
    url = create_database(pg_server_url, name, template=_migrated_template)
    try:
        study = StudyStore(url)
        try:
            seed_study(study, n_clients=12, rng=3, spread=timedelta(days=3))
        finally:
            study.close()
        seed_paired_trials(url, pairs=1, flows_per_period=6, fallbacks=1)
        seed_router(url, seconds=5.0)
        seed_atlas(url, results_per_probe=1)
        seed_item_runs(url)
        # The router's wall clock at the ends of its bounds: those days'
        # partitions (migration 0022), as an operator makes an old day's.
        with Partitions(url) as days:
            for t in (flow_record.TIME_MIN, flow_record.TIME_MAX):
                days.ensure_days("router_telemetry", day_of(t), day_of(t))
        rollups.refresh(url)
        yield name
    finally:
        drop_database(pg_server_url, name)


@settings(
    max_examples=4,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(writes=hostile_writes())
def test_every_reader_reads_what_every_writer_stored(
    pg_server_url: str, seeded_template: str, tmp_path_factory: pytest.TempPathFactory,
    writes: dict[str, list[tuple[str, Any]]],
) -> None:  # fmt: skip
    name = f"hostile_{secrets.token_hex(4)}"
    url = create_database(pg_server_url, name, template=seeded_template)
    try:
        write_api(url, writes)
        write_telemetry(url, writes)
        write_atlas(url, writes)
        write_experiments(url, writes)
        read_everything(url, tmp_path_factory.mktemp("read"))
    finally:
        drop_database(pg_server_url, name)


def at(f: bounds.Field, end: str) -> Any:
    """The value at ``f``'s ``end`` ("minimum" or "maximum") that it still accepts."""
    if f.kind == "time":
        return (flow_record.TIME_MAX if end == "maximum" else flow_record.TIME_MIN).isoformat()
    b = getattr(f, end)
    if f.exclusive_minimum and end == "minimum":
        b = math.nextafter(b, math.inf)
    if f.kind == "float" and b != 0:
        b = max(b, flow_record.REAL_MIN)  # a float is 0 or at least that
    return int(b) if f.kind == "int" else float(b)


# Where each writer's field lands: (table, column), and how a value is stored there.
def _landing(writer: str, name: str) -> tuple[str, str]:
    if writer == "periods":
        return "trial_periods", {v: k for k, v in PERIOD_KEYS.items()}[name]
    if writer == "samples":
        return "router_telemetry", "recorded_at" if name == "ts" else name
    if writer == "runs":
        return "router_runs", "started_at" if name == "started_unix" else name
    if writer == "atlas":
        columns = {"timestamp": "result_at", "stored_timestamp": "stored_at", "fw": "firmware"}
        if name == "rtt":
            return "atlas_outcomes", "rtt_ms"
        return "atlas_results", columns.get(name, name)
    return writer, name


@pytest.mark.parametrize("end", ["maximum", "minimum"])
def test_every_field_at_its_bound_is_stored_and_read(
    pg_server_url: str, seeded_template: str, tmp_path: Path, end: str
) -> None:
    """The values at the very ends of the bounds, which random examples may
    miss: each writer stores every one of them, and every reader reads them."""
    writes = {
        "flows": [(f.name, at(f, end)) for f in FLOW_FIELDS],
        "trials": [(f.name, at(f, end)) for f in bounds.TRIALS],
        "periods": [(PERIOD_KEYS[f.name], at(f, end)) for f in bounds.TRIAL_PERIODS],
        "samples": [(f.name, at(f, end)) for f in SAMPLE_FIELDS],
        "runs": [(f.name, at(f, end)) for f in RUN_FIELDS],
        "atlas": [(f.name, at(f, end)) for f in ATLAS_FIELDS],
    }
    name = f"hostile_{end}_{secrets.token_hex(4)}"
    url = create_database(pg_server_url, name, template=seeded_template)
    try:
        write_api(url, writes)
        write_telemetry(url, writes)
        write_atlas(url, writes)
        missing = []
        with psycopg.connect(url) as conn:
            for writer, fields in writes.items():
                for field_name, v in fields:
                    table, column = _landing(writer, field_name)
                    if isinstance(v, str):
                        v = flow_record.parse_time(v)
                    stored = (
                        "to_timestamp(%s)"
                        if isinstance(v, int | float) and column.endswith("_at")
                        else "%s"
                    )
                    (n,) = conn.execute(
                        f"SELECT count(*) FROM {table} WHERE {column} = {stored}", (v,)
                    ).fetchone() or (0,)
                    # A stored_timestamp of 0 is Atlas's "none": stored as NULL.
                    if not n and (field_name, v) != ("stored_timestamp", 0):
                        missing.append((writer, field_name, v))
        assert missing == []
        read_everything(url, tmp_path)
    finally:
        drop_database(pg_server_url, name)
