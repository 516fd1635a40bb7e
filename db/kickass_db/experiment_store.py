"""`ExperimentStore`: the only code that writes the congestion experiments'
tables (migration 0021), and the readers of their views.

A run of the paper's congestion experiments (§III-D1 Fig. 5, §III-D2 Fig. 7;
``kickass_testbed.congestion``) arrives as its outcome's JSON
(``CongestionOutcome.to_json()``: db does not import the testbed) and becomes

* one ``experiment_runs`` row: its kind, when its flows started, the link's
  capacity and RTT, the ka-router telemetry run beside it
  (``router_run_name``: ``router_runs.run_name``), ``parameters`` (the
  experiment's spec, as run) and ``figures`` (per TCP epoch Jain's index,
  Kick-Ass/TCP, utilisation and the router's switch times; the same of the
  Kick-Ass flows alone; each driver's summary);
* one ``experiment_rates`` row per flow and interval: ``t_s`` (seconds from
  the flows' start), ``protocol``, ``rate_bps`` (payload bit/s over the
  interval), ``ka_mode``,

in one transaction, the rates by COPY (thousands per run). Every value is
checked first against ``kickass_core.bounds`` (``EXPERIMENT_RUNS``,
``EXPERIMENT_RATES``) and the JSON columns against ``strictjson.check_bounded``:
a run with one value out of bounds is refused whole, by a KickassError that
names the value, and nothing of it is stored (the database's CHECKs, the
same bounds, are the second guard and are reported the same way). Storing
the same outcome again returns the stored run's id; another outcome with the
same kind, start and router run is a conflict, never a replacement.

The TCP-mode floor (``kickass experiment run floor``: ka-router
``--mode droptail``, no rates, so the Kick-Ass flows run in TCP mode) is the
``kickass-bottleneck`` kind with ``router_mode`` ``droptail`` in its
parameters: the kind says where the bottleneck is, the router's mode is a
setting of the run (``EXPERIMENTS`` names the four the command runs).

Experiment (d), the wide-area round (``kickass_testbed.wide_area``, kind
``wide-area``, migration 0025), is a round of trials: its flows are stored
as trials, and its run holds no rates, only ``figures.paths`` (per path its
setting, flows, completion and largest goodput per arm, the speedup with
its interval, the share finished sooner, the time in Kick-Ass mode) and
``figures.summary`` (across the paths), every number checked as an epoch's.

Readers take a connection, so the report reads them in its own snapshot;
the store's methods run them in a transaction of their own.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, TypeVar

import psycopg
from kickass_core import bounds, strictjson
from kickass_core.errors import KickassError
from kickass_core.flow_record import PROTOCOLS, FlowRecordError, parse_time
from sqlalchemy import Connection, insert, text
from sqlalchemy.exc import DataError, IntegrityError, ProgrammingError

from . import engine as db
from .models.experiments import EXPERIMENT_KINDS, ExperimentRunRow
from .tx import StoreBase

T = TypeVar("T")

ROUTER_MODES = ("kickass", "droptail")
# What `kickass experiment run` calls the experiments: (kind, router_mode).
EXPERIMENTS: dict[str, tuple[str, str]] = {
    "a": ("kickass-bottleneck", "kickass"),
    "b": ("legacy-bottleneck", "kickass"),
    "floor": ("kickass-bottleneck", "droptail"),
    "d": ("wide-area", "kickass"),
}
# A round of trials (experiment (d)): no rates, per-path figures instead.
WIDE_AREA = "wide-area"
# The JSON columns: a spec is a few dozen values; figures carry a summary
# per flow from each driver (about ten values a flow).
PARAMETERS_MAX_BYTES = 64 * 1024
FIGURES_MAX_BYTES = 1024 * 1024
FIGURES_MAX_VALUES = 50_000
FLOW_MAX_CHARS = 200
# A ratio, an index or a count of RTTs: whatever a run gives, finite.
FIGURE_MAX = 1e12
REFUSED_HINT = (
    "nothing of this run was stored; every number must lie within kickass_core.bounds "
    "(experiment_runs, experiment_rates)"
)

_STARTED_AT, _CAPACITY, _RTT = bounds.EXPERIMENT_RUNS
_T_S, _RATE = bounds.EXPERIMENT_RATES
_POSITIVE = bounds.Field("x", "float", nullable=False, required=True, minimum=0.0,
                         exclusive_minimum=True)  # fmt: skip
_INTERVAL = replace(_POSITIVE, name="interval_s", maximum=3600.0)
_DURATION = replace(_POSITIVE, name="duration_s", maximum=_T_S.maximum)
# An epoch's figures (congestion.EpochFigures): each a number from 0, or null.
EPOCH_FIGURES = ("jain", "kickass_over_tcp", "utilisation", "tcp_mode_after_rtts",
                 "kickass_mode_after_rtts")  # fmt: skip
_FIGURE = bounds.Field("figure", "float", minimum=0.0, maximum=FIGURE_MAX)
_COPY_RATES = "COPY experiment_rates (run_pk, flow, t_s, protocol, rate_bps, ka_mode) FROM STDIN"


class ExperimentRefused(KickassError):
    """An outcome that cannot be stored as it is: nothing of it was."""

    def __init__(self, message: str, hint: str = REFUSED_HINT) -> None:
        super().__init__(f"experiment not stored: {message}", hint)


def experiment_name(kind: str, router_mode: str) -> str:
    """The command's name for a run (``a``, ``b``, ``floor``), else kind (mode)."""
    for name, pair in EXPERIMENTS.items():
        if pair == (kind, router_mode):
            return name
    return f"{kind} ({router_mode})"


@dataclass(frozen=True)
class ExperimentRun:
    """One stored run, as ``v_experiment_runs`` shows it."""

    run_id: int
    kind: str
    started_at: datetime
    capacity_bps: float
    rtt_ms: float
    router_run_name: str | None
    parameters: dict[str, Any]
    figures: dict[str, Any]
    created_at: datetime
    flows: dict[str, int] = field(default_factory=dict)  # protocol -> flows
    samples: int = 0

    @property
    def router_mode(self) -> str:
        return str(self.parameters.get("router_mode") or "kickass")

    @property
    def experiment(self) -> str:
        return experiment_name(self.kind, self.router_mode)

    @property
    def duration_s(self) -> float | None:
        d = self.parameters.get("duration_s")
        return float(d) if isinstance(d, (int, float)) else None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["started_at"] = self.started_at.isoformat()
        out["created_at"] = self.created_at.isoformat()
        out["experiment"] = self.experiment
        out["router_mode"] = self.router_mode
        return out


@dataclass(frozen=True)
class FlowSeries:
    """One flow's rate and mode every interval (``v_experiment_rates``)."""

    flow: str
    protocol: str
    t_s: list[float]
    rate_bps: list[float]
    ka_mode: list[bool]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def flow_series(outcome: Mapping[str, Any]) -> list[FlowSeries]:
    """An outcome's rates as the readers return them (ordered the same way)."""
    protocols = outcome.get("protocols") or {}
    out = [
        FlowSeries(
            flow,
            protocols.get(flow, ""),
            [float(p[0]) for p in pts],
            [float(p[1]) for p in pts],
            [bool(p[2]) for p in pts],
        )
        for flow, pts in (outcome.get("rates") or {}).items()
    ]
    return sorted(out, key=lambda s: (s.protocol, s.flow))


# -- checking an outcome ---------------------------------------------------------------------


@dataclass
class _Prepared:
    run: dict[str, Any]
    rates: list[tuple[str, float, str, float, bool]]  # flow, t_s, protocol, rate_bps, ka_mode


def _check(f: bounds.Field, value: Any, where: str) -> None:
    try:
        bounds.check_value(f, value)
    except FlowRecordError as exc:
        raise ExperimentRefused(f"{where}: {exc}") from None


def _json(value: Any, what: str, max_bytes: int, max_values: int) -> None:
    try:
        strictjson.check_bounded(value, max_bytes, max_values)
    except ValueError as exc:
        raise ExperimentRefused(f"{what}: {exc}") from None


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ExperimentRefused(f"{what} must be a non-empty string, not {value!r}")
    if len(value) > FLOW_MAX_CHARS or strictjson.UNPRINTABLE.search(value):
        raise ExperimentRefused(
            f"{what} {value[:40]!r} must be printable and at most {FLOW_MAX_CHARS} characters"
        )
    return value


def prepare(outcome: Mapping[str, Any]) -> _Prepared:
    """The rows of ``outcome``, every value checked (ExperimentRefused otherwise)."""
    if not isinstance(outcome, Mapping):
        raise ExperimentRefused("the outcome must be a JSON object")
    spec = outcome.get("spec")
    if not isinstance(spec, Mapping):
        raise ExperimentRefused("the outcome has no spec (the experiment's parameters)")
    kind = spec.get("kind")
    if kind not in EXPERIMENT_KINDS:
        raise ExperimentRefused(f"spec.kind must be one of {list(EXPERIMENT_KINDS)}, not {kind!r}")
    mode = spec.get("router_mode", "kickass")
    if mode not in ROUTER_MODES:
        raise ExperimentRefused(f"spec.router_mode must be one of {list(ROUTER_MODES)}")
    started = outcome.get("started_at")
    _check(_STARTED_AT, started, "started_at")
    _check(_CAPACITY, spec.get("capacity_bps"), "spec.capacity_bps")
    _check(_RTT, spec.get("rtt_ms"), "spec.rtt_ms")
    # What the readers compute with besides the columns: the sampling
    # interval and the run's length (bounded here, not by a CHECK: they are
    # parameters, free JSON otherwise).
    if kind != WIDE_AREA:
        _check(_INTERVAL, spec.get("interval_s"), "spec.interval_s")
    _check(_DURATION, spec.get("duration_s"), "spec.duration_s")
    router_run = outcome.get("router_run_name")
    if router_run is not None:
        _text(router_run, "router_run_name")
    _json(dict(spec), "spec", PARAMETERS_MAX_BYTES, strictjson.MAX_VALUES)
    for key, kind_of in (("epochs", list), ("alone", dict), ("drivers", list)):
        if not isinstance(outcome.get(key, kind_of()), kind_of):
            raise ExperimentRefused(f"{key} must be a JSON {kind_of.__name__}")
    epochs: list[Any] = list(outcome.get("epochs") or [])
    alone: dict[str, Any] = dict(outcome.get("alone") or {})
    figures = {"epochs": epochs, "alone": alone, "drivers": list(outcome.get("drivers") or [])}
    for i, e in enumerate(epochs):
        if not isinstance(e, Mapping):
            raise ExperimentRefused(f"epochs[{i}] must be an object")
        for k in ("start_s", "end_s"):
            _check(_T_S, e.get(k), f"epochs[{i}].{k}")
        for k in EPOCH_FIGURES:
            _check(_FIGURE, e.get(k), f"epochs[{i}].{k}")
    for k in ("jain", "utilisation"):
        _check(_FIGURE, alone.get(k), f"alone.{k}")
    if kind == WIDE_AREA:
        figures.update(_wide_area_figures(outcome))
    _json(figures, "figures", FIGURES_MAX_BYTES, FIGURES_MAX_VALUES)

    protocols = outcome.get("protocols") or {}
    rates = outcome.get("rates") or {}
    if not isinstance(protocols, Mapping) or not isinstance(rates, Mapping):
        raise ExperimentRefused("rates and protocols must be JSON objects keyed by flow")
    rows: list[tuple[str, float, str, float, bool]] = []
    for flow, points in rates.items():
        _text(flow, "a flow's name")
        protocol = protocols.get(flow)
        if protocol not in PROTOCOLS:
            raise ExperimentRefused(
                f"flow {flow!r}: protocol must be one of {list(PROTOCOLS)}, not {protocol!r}"
            )
        if not isinstance(points, Sequence) or isinstance(points, str):
            raise ExperimentRefused(f"flow {flow!r}: rates must be a list of [t_s, rate, ka_mode]")
        seen: set[float] = set()
        for n, p in enumerate(points):
            if not isinstance(p, Sequence) or isinstance(p, str) or len(p) != 3:
                raise ExperimentRefused(
                    f"flow {flow!r}, sample {n}: not [t_s, rate_bps, ka_mode]: {p!r}"
                )
            t, rate, ka = p
            _check(_T_S, t, f"flow {flow!r}, sample {n}, t_s")
            _check(_RATE, rate, f"flow {flow!r}, sample {n} (t_s {t}), rate_bps")
            if not isinstance(ka, bool):
                raise ExperimentRefused(f"flow {flow!r}, sample {n}: ka_mode must be true or false")
            if float(t) in seen:  # the table's key: (run, flow, t_s)
                raise ExperimentRefused(f"flow {flow!r}: two samples at t_s {t}")
            seen.add(float(t))
            rows.append((flow, float(t), protocol, float(rate), ka))
    run = {
        "kind": kind,
        "started_at": parse_time(started),
        "capacity_bps": float(spec["capacity_bps"]),
        "rtt_ms": float(spec["rtt_ms"]),
        "router_run_name": router_run,
        "parameters": dict(spec),
        "figures": figures,
    }
    return _Prepared(run, rows)


def _numbers(value: Any, where: str) -> None:
    """Every number in ``value`` (nested objects and lists) a figure: from 0, finite."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            _numbers(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _numbers(v, f"{where}[{i}]")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        _check(_FIGURE, value, where)


def _wide_area_figures(outcome: Mapping[str, Any]) -> dict[str, Any]:
    """A wide-area run's ``paths`` (each named) and ``summary``, checked."""
    paths, summary = outcome.get("paths"), outcome.get("summary") or {}
    if not isinstance(paths, list) or not paths:
        raise ExperimentRefused("a wide-area run needs its paths: a non-empty JSON list")
    if not isinstance(summary, Mapping):
        raise ExperimentRefused("summary must be a JSON object")
    for i, p in enumerate(paths):
        if not isinstance(p, Mapping):
            raise ExperimentRefused(f"paths[{i}] must be an object")
        _text(p.get("path"), f"paths[{i}].path")
        _numbers(p, f"paths[{i}]")
    _numbers(summary, "summary")
    return {"paths": paths, "summary": dict(summary)}


# -- reading ---------------------------------------------------------------------------------

_RUN_COLUMNS = (
    "run_id, kind, started_at, capacity_bps, rtt_ms, router_run_name, parameters, figures, "
    "created_at"
)
_RUNS = f"""
SELECT {_RUN_COLUMNS},
       coalesce((SELECT jsonb_object_agg(protocol, n) FROM (
                    SELECT protocol, count(DISTINCT flow) AS n FROM v_experiment_rates x
                    WHERE x.run_id = r.run_id GROUP BY protocol) c), '{{}}'::jsonb) AS flows,
       (SELECT count(*) FROM v_experiment_rates x WHERE x.run_id = r.run_id) AS samples
FROM v_experiment_runs r
WHERE (CAST(:run_id AS bigint) IS NULL OR run_id = CAST(:run_id AS bigint))
  AND (CAST(:since AS timestamptz) IS NULL OR started_at >= CAST(:since AS timestamptz))
ORDER BY started_at, run_id
"""
_RATES = """
SELECT flow, protocol, t_s, rate_bps, ka_mode FROM v_experiment_rates
WHERE run_id = :run_id ORDER BY protocol, flow, t_s
"""
# A run's router samples, on the flows' clock; the window keeps to the
# run's own time (router_runs.run_name is not unique, and the telemetry is
# partitioned by recorded_at).
_ROUTER_MODES = """
SELECT extract(epoch FROM recorded_at - CAST(:started_at AS timestamptz))::float8 AS t_s,
       marking_mode
FROM v_router_telemetry
WHERE run_name = :name
  AND recorded_at >= CAST(:started_at AS timestamptz) - interval '1 minute'
  AND recorded_at <= CAST(:until AS timestamptz)
ORDER BY recorded_at
"""
_EXISTING = text("""
SELECT id, parameters = CAST(:parameters AS jsonb) AND figures = CAST(:figures AS jsonb)
FROM experiment_runs
WHERE kind = :kind AND started_at = :started_at
  AND router_run_name IS NOT DISTINCT FROM CAST(:router_run_name AS text)
""")
_STORED_RATES = text("SELECT count(*) FROM experiment_rates WHERE run_pk = :id")


def _run(row: Mapping[Any, Any]) -> ExperimentRun:
    return ExperimentRun(
        run_id=int(row["run_id"]),
        kind=row["kind"],
        started_at=row["started_at"],
        capacity_bps=float(row["capacity_bps"]),
        rtt_ms=float(row["rtt_ms"]),
        router_run_name=row["router_run_name"],
        parameters=dict(row["parameters"] or {}),
        figures=dict(row["figures"] or {}),
        created_at=row["created_at"],
        flows={k: int(v) for k, v in (row.get("flows") or {}).items()},
        samples=int(row.get("samples") or 0),
    )


def read_runs(
    conn: Connection, since: datetime | None = None, run_id: int | None = None
) -> list[ExperimentRun]:
    """Stored runs, oldest first (those whose flows started since ``since``)."""
    rows = conn.execute(text(_RUNS), {"since": since, "run_id": run_id}).mappings()
    return [_run(r) for r in rows]


def read_rates(conn: Connection, run_id: int) -> list[FlowSeries]:
    """Every flow's rate and mode over time, by protocol then flow."""
    out: list[FlowSeries] = []
    for r in conn.execute(text(_RATES), {"run_id": run_id}).mappings():
        if not out or out[-1].flow != r["flow"]:
            out.append(FlowSeries(r["flow"], r["protocol"], [], [], []))
        s = out[-1]
        s.t_s.append(float(r["t_s"]))
        s.rate_bps.append(float(r["rate_bps"]))
        s.ka_mode.append(bool(r["ka_mode"]))
    return out


def read_router_modes(conn: Connection, run: ExperimentRun) -> list[tuple[float, str]]:
    """The router's marking mode at each of its samples during ``run``
    (seconds from the flows' start); empty when its telemetry was not stored."""
    if not run.router_run_name:
        return []
    span = run.duration_s if run.duration_s is not None else 24 * 3600.0
    until = run.started_at + timedelta(seconds=span + 60)
    rows = conn.execute(
        text(_ROUTER_MODES),
        {"name": run.router_run_name, "started_at": run.started_at, "until": until},
    )
    return [(float(t), str(mode)) for t, mode in rows if math.isfinite(t)]


# -- the store ----------------------------------------------------------------------------


class ExperimentStore(StoreBase):
    """Writes experiment runs and reads them back (module docstring)."""

    def ping(self) -> None:
        """KickassError unless the database is reachable and has the
        experiments' tables (before an experiment runs for minutes)."""
        db.check_connection(self.engine)
        present = self.run(
            lambda conn: conn.execute(text("SELECT to_regclass('experiment_runs')")).scalar()
        )
        if present is None:
            raise KickassError(
                f"database {db.describe_url(self.database_url)} has no experiment tables",
                hint="run: kickass db upgrade",
            )

    def store(self, outcome: Mapping[str, Any]) -> int:
        """Store one run's outcome (its JSON); its run id. ExperimentRefused
        when a value is out of bounds or another run holds its key."""
        prepared = prepare(outcome)
        run = prepared.run

        def work(conn: Connection) -> int:
            # One writer at a time: the check for a stored twin below holds.
            conn.execute(text("SELECT pg_advisory_xact_lock(hashtext('experiment_runs'))"))
            twin = conn.execute(
                _EXISTING,
                {
                    **run,
                    "parameters": json.dumps(run["parameters"]),
                    "figures": json.dumps(run["figures"]),
                },
            ).first()
            if twin is not None:
                stored = conn.execute(_STORED_RATES, {"id": twin[0]}).scalar_one()
                if not (twin[1] and stored == len(prepared.rates)):
                    raise ExperimentRefused(
                        f"run {twin[0]} has the same kind, start and router run but other figures",
                        hint="a stored run is never replaced; is this the same run edited?",
                    )
                return int(twin[0])
            run_id = conn.execute(
                insert(ExperimentRunRow).values(**run).returning(ExperimentRunRow.id)
            ).scalar_one()
            cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]  # None only once closed; this one is open
            with cursor.copy(_COPY_RATES) as copy:
                for row in prepared.rates:
                    copy.write_row((run_id, *row))
            return int(run_id)

        return self._guarded(work)

    def runs(self, since: datetime | None = None) -> list[ExperimentRun]:
        return self._guarded(lambda conn: read_runs(conn, since))

    def get(self, run_id: int) -> ExperimentRun:
        """One run; KickassError when there is none with that id."""
        found = self._guarded(lambda conn: read_runs(conn, run_id=run_id))
        if not found:
            raise KickassError(
                f"no experiment run {run_id} in {db.describe_url(self.database_url)}",
                hint="kickass experiment list shows the stored runs",
            )
        return found[0]

    def rates(self, run_id: int) -> list[FlowSeries]:
        return self._guarded(lambda conn: read_rates(conn, run_id))

    def router_modes(self, run: ExperimentRun) -> list[tuple[float, str]]:
        return self._guarded(lambda conn: read_router_modes(conn, run))

    def _guarded(self, work: Callable[[Connection], T]) -> T:
        """``work`` in a transaction; what the database refuses as a KickassError."""
        try:
            return self.run(work)
        except (IntegrityError, DataError, psycopg.IntegrityError, psycopg.DataError) as exc:
            orig = getattr(exc, "orig", exc)
            diag = getattr(orig, "diag", None)
            name = getattr(diag, "constraint_name", None)
            reason = str(orig).strip().splitlines()[0]
            raise ExperimentRefused(
                f"the database refused it ({name or reason})",
            ) from exc
        except (ProgrammingError, psycopg.errors.UndefinedTable) as exc:
            orig = getattr(exc, "orig", exc)
            if isinstance(orig, psycopg.errors.UndefinedTable):
                raise KickassError(
                    f"database {db.describe_url(self.database_url)} has no experiment tables",
                    hint="run: kickass db upgrade",
                ) from exc
            raise
