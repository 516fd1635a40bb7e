"""Bounds of every number a reader computes with: one table for every writer.

What the database accepts, every reader must read. A view's ``avg()``
overflows on a flow's ``fct_ms = 1e308``; the report's
``make_interval(secs => t)`` fails on router telemetry with ``t = 1e300`` or
NaN; ``jsonb`` refuses NaN, a ``smallint`` 40000, a ``real`` 1e39. So each
column that a view, the report, an export or a dashboard computes with has
its bounds here, whoever writes it:

* the HTTP API: the flows' entry is the flow record's own table
  (``flow_record.FIELDS``, which ``kickass_server.schemas`` derives its model
  from); a trial and its periods take theirs from ``TRIALS`` and
  ``TRIAL_PERIODS``;
* ``kickass telemetry ingest`` (``kickass_db.telemetry``): ``ROUTER_RUNS``,
  ``ROUTER_TELEMETRY`` and, for the wall-clock times of its lines,
  ``wall_clock``;
* ``kickass atlas import`` (``kickass_atlas.ingest``): ``ATLAS_RESULTS``,
  ``ATLAS_OUTCOMES``, ``wall_clock``;
* the probe engine: ``SESSIONS``, ``PROBE_OUTCOMES`` (its values come from its
  own clock and the plan: the table is the database's guard all the same).

Every writer checks a value with ``check_value`` (a ``flow_record.FlowRecordError``,
a ValueError naming the field, when it does not fit); the database holds the
same bounds as CHECK constraints (``kickass_db.base.check_bounds``, migration
0018), so a writer that skips the check (a script, an older server) is
refused there instead of breaking every reader. A float always has both
bounds: a range is what keeps NaN and the infinities out of a column
(PostgreSQL sorts NaN above every number, so ``x <= max`` refuses it); and a
float is 0 or at least ``REAL_MIN`` (a reader dividing 5e-324 bit/s by a
capacity underflows, which PostgreSQL raises as an error).

Standard library only, like the flow record's table, whose ``Field`` and
``check_value`` this extends to the other tables.
"""

from __future__ import annotations

from dataclasses import replace

from . import flow_record
from .flow_record import (
    DURATION_MS_MAX,
    INT32_MAX,
    RATE_BPS_MAX,
    REAL_MIN,
    TIME_MAX,
    TIME_MIN,
    Field,
    check_value,
)

__all__ = [
    "REAL_MIN",
    "TABLES",
    "TIME_MAX",
    "TIME_MIN",
    "Field",
    "check_value",
    "checked",
    "wall_clock",
]

INT16_MAX = 2**15 - 1  # smallint
INT64_MAX = 2**63 - 1  # bigint
# An IPv4 length (total length is 16 bits), where an integer column holds it.
IPV4_LEN_MAX = 2**16 - 1
# An access link's or a router's capacity: 10 Tbit/s (the trial API's bound).
CAPACITY_BPS_MAX = 1e13
# A trial period's offset and length (seconds: ~3 years) and a planted handicap (ms).
PERIOD_S_MAX = 1e8
HANDICAP_MS_MAX = 1e6
# A router run's own clock, t (seconds since it started): ~3 years.
RUN_MAX_S = 1e8
# Wall clocks (Unix seconds) of a router's lines and of Atlas results: the
# times of flow_record (1970 to 2100), so that a run's start plus RUN_MAX_S
# is a time every reader holds.
UNIX_TIME_MIN = TIME_MIN.timestamp()
UNIX_TIME_MAX = TIME_MAX.timestamp()


def _count(name: str, maximum: float = INT64_MAX, *, required: bool = False) -> Field:
    """A counter or a size: an integer from 0."""
    return Field(name, "int", nullable=not required, required=required, minimum=0, maximum=maximum)


def _time(name: str, *, required: bool = False) -> Field:
    """A time a measurement happened at: from ``TIME_MIN`` to ``TIME_MAX``."""
    return Field(name, "time", nullable=not required, required=required)


def _number(name: str, maximum: float, *, required: bool = False, real: bool = False) -> Field:
    """A measured quantity: a finite number from 0."""
    return Field(
        name,
        "float",
        nullable=not required,
        required=required,
        minimum=0.0,
        maximum=maximum,
        real=real,
    )


ROUTER_RUNS: tuple[Field, ...] = (
    _number("capacity_bps", CAPACITY_BPS_MAX),
    _time("started_at", required=True),
    _time("finished_at"),
)
# One NDJSON sample line of ka-router, column by column (the line's "ts" is
# ``recorded_at``: ``wall_clock``).
ROUTER_TELEMETRY: tuple[Field, ...] = (
    _time("recorded_at", required=True),
    _number("t", RUN_MAX_S, required=True),
    _number("advertised_rate_bps", RATE_BPS_MAX, required=True),
    _count("leading_fragment_len", INT16_MAX),
    _number("input_rate_bps", RATE_BPS_MAX, required=True),
    _number("output_rate_bps", RATE_BPS_MAX),
    _count("queue_bytes", required=True),
    _count("queue_packets"),
    _number("rtt_ms", DURATION_MS_MAX, real=True),
    _count("drops", required=True),
    _count("fragmented", required=True),
    _count("mode_switches"),
)
TRIALS: tuple[Field, ...] = (
    Field(
        "access_capacity_bps",
        "float",
        minimum=0.0,
        exclusive_minimum=True,
        maximum=CAPACITY_BPS_MAX,
    ),
    _time("started_at", required=True),
    _time("finished_at"),
)
TRIAL_PERIODS: tuple[Field, ...] = (
    _count("period_index", INT32_MAX, required=True),
    _count("pair", INT32_MAX, required=True),
    _number("start_offset_s", PERIOD_S_MAX, required=True),
    Field(
        "duration_s",
        "float",
        nullable=False,
        required=True,
        minimum=0.0,
        exclusive_minimum=True,
        maximum=PERIOD_S_MAX,
    ),
    _number("handicap_ms", HANDICAP_MS_MAX),
    _number("actual_start_offset_s", PERIOD_S_MAX),
    # 0021: a Kick-Ass arm's share of flows run as TCP (below 1: at least one
    # flow is Kick-Ass's), and what the period's flows offered.
    _number("tcp_share", 0.99),
    _number("offered_load_bps", CAPACITY_BPS_MAX),
)
# 0021: the congestion experiments (kickass_testbed.congestion): each flow's
# rate every interval, seconds from the flows' start.
EXPERIMENT_RUNS: tuple[Field, ...] = (
    _time("started_at", required=True),
    Field(
        "capacity_bps",
        "float",
        nullable=False,
        required=True,
        minimum=0.0,
        exclusive_minimum=True,
        maximum=CAPACITY_BPS_MAX,
    ),
    Field(
        "rtt_ms",
        "float",
        nullable=False,
        required=True,
        minimum=0.0,
        exclusive_minimum=True,
        maximum=DURATION_MS_MAX,
    ),
)
EXPERIMENT_RATES: tuple[Field, ...] = (
    _number("t_s", PERIOD_S_MAX, required=True),
    _number("rate_bps", RATE_BPS_MAX, required=True),
)
SESSIONS: tuple[Field, ...] = (_number("rtt_ms", DURATION_MS_MAX, real=True),)
PROBE_OUTCOMES: tuple[Field, ...] = (
    _count("ip_len", INT16_MAX, required=True),
    _number("rtt_ms", DURATION_MS_MAX, real=True),
    _count("ack_count", INT16_MAX, required=True),
    _count("received_len", IPV4_LEN_MAX),
    _count("observed_frag_size", IPV4_LEN_MAX),
    _count("observed_leading_len", INT16_MAX),
    _count("observed_fragments", INT16_MAX),
)
# An Atlas result line's numbers, by the column each lands in (``timestamp``
# and ``stored_timestamp`` are ``result_at`` and ``stored_at``: ``wall_clock``;
# ``fw`` is ``firmware``).
ATLAS_RESULTS: tuple[Field, ...] = (
    _time("result_at", required=True),
    _time("stored_at"),
    _count("firmware", INT32_MAX),
    _count("size", IPV4_LEN_MAX),
    _count("sent", INT16_MAX),
    _count("rcvd", INT16_MAX),
    _count("dup", INT16_MAX),
)
# A result's key: matched and grouped on, never computed with, so no CHECK
# holds it; the import refuses a line whose key its columns cannot hold.
ATLAS_RESULT_KEY: tuple[Field, ...] = (
    _count("msm_id", INT64_MAX, required=True),
    _count("prb_id", INT32_MAX, required=True),
)
ATLAS_OUTCOMES: tuple[Field, ...] = (
    _count("ip_len", INT16_MAX),
    _number("rtt_ms", DURATION_MS_MAX, real=True),
    _count("ack_count", INT16_MAX, required=True),
)

# Every bounded column, by table: what migration 0018 made CHECK constraints
# of (the models declare the same, ``kickass_db.base.check_bounds``). An
# Atlas outcome's result_at is its result's (a foreign key).
TABLES: dict[str, tuple[Field, ...]] = {
    "flows": flow_record.FIELDS,
    "trials": TRIALS,
    "trial_periods": TRIAL_PERIODS,
    "experiment_runs": EXPERIMENT_RUNS,
    "experiment_rates": EXPERIMENT_RATES,
    "router_runs": ROUTER_RUNS,
    "router_telemetry": ROUTER_TELEMETRY,
    "sessions": SESSIONS,
    "probe_outcomes": PROBE_OUTCOMES,
    "atlas_results": ATLAS_RESULTS,
    "atlas_outcomes": ATLAS_OUTCOMES,
}


def checked(table: str) -> tuple[Field, ...]:
    """The numbers and times of ``table``'s entry (a CHECK constraint each)."""
    return tuple(f for f in TABLES[table] if f.kind in ("int", "float", "time"))


def numbers(fields: tuple[Field, ...]) -> tuple[Field, ...]:
    """The numbers among ``fields`` (what a line carries as numbers)."""
    return tuple(f for f in fields if f.kind in ("int", "float"))


def wall_clock(name: str, *, required: bool = False) -> Field:
    """A wall-clock time in Unix seconds, as a router's line or an Atlas result
    carries it, named as in the line."""
    return Field(
        name,
        "float",
        nullable=not required,
        required=required,
        minimum=UNIX_TIME_MIN,
        maximum=UNIX_TIME_MAX,
    )


def renamed(f: Field, name: str) -> Field:
    """``f`` under another name (a line's key for the column it lands in)."""
    return replace(f, name=name)
