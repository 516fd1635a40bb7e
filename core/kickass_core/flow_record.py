"""The wide-area trials' flow record: its one definition (fields, types, bounds, id).

A flow record crosses three boundaries: ``ka-send`` (Rust) prints the
transport's record, the trial runner turns it into this record and uploads
it, the server validates it and stores it in ``flows``. Every one of them
reads the table below:

* the runner builds records with ``from_transport`` and ``flow_id``;
* the server's request models are derived from ``FIELDS``
  (``kickass_server.schemas``), and the trial store writes exactly these
  columns;
* ``core/vectors/flow_record.json`` pins the table and transport-to-record
  examples; the Rust tests (ka-transport ``tests/flow_record_vectors.rs``)
  deserialise the transport halves, the Python tests
  (``tests/core/test_flow_record.py``) check the conversion and that the
  file is what this module generates (``core/vectors/make_vectors.py``).

Bounds are those of the columns the values land in (a 32-bit ``integer``, a
``real``), tightened to what a flow can mean: no flow lasts 10^9 ms. Every
bound is in ``FIELDS``; what a bound cannot say (a time, printable text, a
``real``'s smallest value, free-form JSON) is one function here or in
``strictjson`` that ``check`` and the server's model both call, and
``tests/server/test_flow_validators.py`` shows that the two accept and refuse
the same records. The other tables' bounds (router telemetry, trials, the
study, Atlas) are ``kickass_core.bounds``, on this ``Field`` and
``check_value``. Standard library only: the volunteer client ships this package.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from . import strictjson

PROTOCOLS = ("kickass", "tcp")
HANDSHAKES = ("paper", "padded")
# The congestion controls an arm names (kickass_wan.trials.schedule's grammar:
# ``kickass[:handshake][/cc][@tcpNN]``, ``tcp[:cc]``), CUBIC the default of both:
# the TCP the trials compare with is Linux's CUBIC, and so is Kick-Ass's TCP mode.
DEFAULT_CONGESTION_CONTROL = "cubic"
# A TCP arm's, the kernel's: the ones the trials compare (any name the kernel
# knows is taken, ``CONGESTION_CONTROL_RE``).
CONGESTION_CONTROLS = (DEFAULT_CONGESTION_CONTROL, "reno", "bbr")
# A Kick-Ass arm's TCP mode, ka-transport's (``CongestionControl``, ka-send --cc).
TRANSPORT_CONGESTION_CONTROLS = (DEFAULT_CONGESTION_CONTROL, "newreno")
# A flow's index within its period stays below this, so (period, index) maps
# to one number: the flow id's suffix.
FLOWS_PER_PERIOD_MAX = 100_000
INT32_MAX = 2**31 - 1
# 1 Tbit/s: far above any access link, far below float trouble.
RATE_BPS_MAX = 1e12
DURATION_MS_MAX = 1e9
SIZE_BYTES_MAX = 2**40  # 1 TiB: the workload's largest flow is 2000 x 1440 bytes
ERROR_MAX_CHARS = 2000
# The smallest normal float32: a ``real`` column takes 0 or at least this much,
# and so does every number here: nothing measured is smaller, and below it a
# reader's quotient (a rate over a capacity of 1e13) or product underflows to
# 0, which PostgreSQL refuses as an error ("value out of range: underflow").
REAL_MIN = 1.1754943508222875e-38
EXTRA_MAX_KEYS = 32
EXTRA_MAX_BYTES = 4096  # as compact JSON
# An ISO 8601 time with its offset is 32 characters at most; room for more digits.
TIME_MAX_CHARS = 64
# When anything measured here can have happened (UTC): from the Unix epoch to
# 2100. Every reader holds these, and a period's or a router run's offset
# from one (kickass_core.bounds: at most ~3 years) too; a year-9999 trial's
# periods began in year 10000, which PostgreSQL stores and no Python or
# Parquet reader reads back.
TIME_MIN = datetime(1970, 1, 1, tzinfo=timezone.utc)
TIME_MAX = datetime(2100, 1, 1, tzinfo=timezone.utc)

# Anchored with ^...$ and used with fullmatch: the same text is a valid
# pattern for Python's re and for the Rust regex engine under pydantic.
# Each pattern's longest match is its field's max_len (written once, here).
TRIAL_ID_RE = re.compile(r"^[0-9a-f]{32}$")
FLOW_ID_DIGITS = 15
FLOW_ID_MAX_CHARS = 32 + 1 + FLOW_ID_DIGITS
FLOW_ID_RE = re.compile(rf"^([0-9a-f]{{32}})-([0-9]{{1,{FLOW_ID_DIGITS}}})$")
CONGESTION_CONTROL_MAX_CHARS = 32
CONGESTION_CONTROL_RE = re.compile(rf"^[a-z][a-z0-9_]{{0,{CONGESTION_CONTROL_MAX_CHARS - 1}}}$")
# An arm's name (kickass_wan.trials.schedule): "kickass", "kickass:paper", "tcp:cubic+50ms#2"...
ARM_MAX_CHARS = 64
ARM_RE = re.compile(rf"^[a-z][a-z0-9_:+.#/@-]{{0,{ARM_MAX_CHARS - 1}}}$")
# C0 controls, DEL and lone surrogates: PostgreSQL text takes no NUL, UTF-8
# no surrogates, and none of them belongs in a flow's error message.
BAD_TEXT_RE = strictjson.UNPRINTABLE


@dataclass(frozen=True)
class Field:
    """One field: its JSON type, whether it may be null or left out, its bounds."""

    name: str
    kind: str  # "int" | "float" | "bool" | "str" | "time" | "object"
    nullable: bool = True
    required: bool = False
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] | None = None
    pattern: str | None = None
    # Characters of a text, keys of an object.
    max_len: int | None = None
    # An object's size as compact JSON.
    max_bytes: int | None = None
    # Stored in a 4-byte ``real`` column (every float, real or double, is 0 or
    # at least REAL_MIN: PostgreSQL refuses what would underflow a real).
    real: bool = False
    # The minimum itself is refused (a period lasts more than 0 s).
    exclusive_minimum: bool = False

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "kind": self.kind}
        for key in ("nullable", "required"):
            out[key] = getattr(self, key)
        if self.real:
            out["real"] = True
        if self.exclusive_minimum:
            out["exclusive_minimum"] = True
        for key in ("minimum", "maximum", "choices", "pattern", "max_len", "max_bytes"):
            value = getattr(self, key)
            if value is not None:
                out[key] = list(value) if isinstance(value, tuple) else value
        return out


# The record as uploaded and stored, in the order of the ``flows`` columns.
FIELDS: tuple[Field, ...] = (
    Field(
        "flow_id",
        "str",
        nullable=False,
        required=True,
        pattern=FLOW_ID_RE.pattern,
        max_len=FLOW_ID_MAX_CHARS,
    ),
    Field("period_index", "int", nullable=False, required=True, minimum=0, maximum=INT32_MAX),
    Field("protocol", "str", nullable=False, required=True, choices=PROTOCOLS),
    Field(
        "congestion_control",
        "str",
        pattern=CONGESTION_CONTROL_RE.pattern,
        max_len=CONGESTION_CONTROL_MAX_CHARS,
    ),
    Field("handshake", "str", choices=HANDSHAKES),
    Field("size_bytes", "int", nullable=False, required=True, minimum=1, maximum=SIZE_BYTES_MAX),
    Field("size_packets", "int", nullable=False, required=True, minimum=1, maximum=INT32_MAX),
    Field("started_at", "time", nullable=False, required=True, max_len=TIME_MAX_CHARS),
    Field("completed", "bool", nullable=False, required=True),
    Field("fct_ms", "float", minimum=0.0, maximum=DURATION_MS_MAX),
    Field("ka_mode_ms", "float", minimum=0.0, maximum=DURATION_MS_MAX),
    Field("ka_mode_fraction", "float", minimum=0.0, maximum=1.0, real=True),
    Field("mode_switches", "int", minimum=0, maximum=INT32_MAX),
    Field("retransmissions", "int", minimum=0, maximum=INT32_MAX),
    Field("srtt_ms", "float", minimum=0.0, maximum=DURATION_MS_MAX, real=True),
    Field("min_rtt_ms", "float", minimum=0.0, maximum=DURATION_MS_MAX, real=True),
    Field("advertised_rate_min_bps", "float", minimum=0.0, maximum=RATE_BPS_MAX),
    Field("advertised_rate_max_bps", "float", minimum=0.0, maximum=RATE_BPS_MAX),
    Field("advertised_rate_last_bps", "float", minimum=0.0, maximum=RATE_BPS_MAX),
    Field("advertised_rates_seen", "int", minimum=0, maximum=INT32_MAX),
    Field("error", "str", max_len=ERROR_MAX_CHARS),
    # What the transport adds (rto_count, datagrams_sent, the first mode
    # switches with their reasons...): at most EXTRA_MAX_KEYS keys and
    # EXTRA_MAX_BYTES of JSON.
    Field("extra", "object", max_len=EXTRA_MAX_KEYS, max_bytes=EXTRA_MAX_BYTES),
    # The paired design (migration 0010): the pair of periods the flow belongs
    # to (its twin under the other arm has the same pair and index), the arm
    # its period ran, how long it waited for a concurrency slot after it was
    # due (its fct_ms counts from when it was due, this wait included), and
    # the protocol the transport negotiated (a Kick-Ass period's flow that
    # fell back to TCP from the start says "tcp").
    Field("pair", "int", minimum=0, maximum=INT32_MAX),
    Field("arm", "str", pattern=ARM_RE.pattern, max_len=ARM_MAX_CHARS),
    Field("queued_ms", "float", minimum=0.0, maximum=DURATION_MS_MAX),
    Field("negotiated_protocol", "str", choices=PROTOCOLS),
)
FIELD_NAMES = tuple(f.name for f in FIELDS)
BY_NAME = {f.name: f for f in FIELDS}

# A value for each field but the id (``example``): a Kick-Ass flow of 100 packets
# that finished in Kick-Ass mode. A field added to FIELDS needs its value here.
EXAMPLE_VALUES: dict[str, Any] = {
    "period_index": 0,
    "protocol": "kickass",
    "congestion_control": None,
    "handshake": "padded",
    "size_bytes": 144000,
    "size_packets": 100,
    "started_at": "2026-11-25T12:00:01+00:00",
    "completed": True,
    "fct_ms": 312.5,
    "ka_mode_ms": 312.5,
    "ka_mode_fraction": 1.0,
    "mode_switches": 0,
    "retransmissions": 0,
    "srtt_ms": 101.2,
    "min_rtt_ms": 100.1,
    "advertised_rate_min_bps": 9.7e6,
    "advertised_rate_max_bps": 1.0e7,
    "advertised_rate_last_bps": 9.9e6,
    "advertised_rates_seen": 31,
    "error": None,
    "extra": {"rto_count": 0, "datagrams_sent": 104},
    "pair": 0,
    "arm": "kickass",
    "queued_ms": 0.0,
    "negotiated_protocol": "kickass",
}


def flow_id(trial_id: str, period_index: int, index: int) -> str:
    """The flow's idempotency key: its trial, its period and its index there."""
    if not TRIAL_ID_RE.fullmatch(trial_id):
        raise ValueError(f"trial_id must be 32 lowercase hex digits, got {trial_id!r}")
    if not 0 <= index < FLOWS_PER_PERIOD_MAX or not 0 <= period_index <= INT32_MAX:
        raise ValueError(f"flow index {index} or period {period_index} out of range")
    return f"{trial_id}-{index + FLOWS_PER_PERIOD_MAX * period_index}"


def example(trial_id: str) -> dict[str, Any]:
    """A valid record of ``trial_id``'s first period, every field of ``FIELDS`` in
    its order (the server's example of an upload; the property tests mutate it)."""
    values = {**EXAMPLE_VALUES, "flow_id": flow_id(trial_id, 0, 0)}
    return {f.name: copy.deepcopy(values[f.name]) for f in FIELDS}


def parse_flow_id(value: str) -> tuple[str, int, int]:
    """(trial_id, period_index, index) of a flow id; ValueError if malformed."""
    m = FLOW_ID_RE.fullmatch(value)
    if m is None:
        raise ValueError(f"flow_id must be '<trial_id>-<number>', got {value!r}")
    n = int(m.group(2))
    return m.group(1), n // FLOWS_PER_PERIOD_MAX, n % FLOWS_PER_PERIOD_MAX


# -- the transport's record (ka-transport FlowRecord, printed by ka-send) -------------

# Transport counters copied into ``extra`` as they are.
TRANSPORT_EXTRA = (
    "rto_count",
    "fast_retransmits",
    "datagrams_sent",
    "rtt_indicators_sent",
    "retransmitted_bytes",
    "mode_switches",
)


def _ms(ns: Any) -> float | None:
    return None if ns is None else float(ns) / 1e6


def _bps(bytes_per_ms: Any) -> float | None:
    return None if bytes_per_ms is None else float(bytes_per_ms) * 8000.0


def from_transport(record: Mapping[str, Any], error: str | None = None) -> dict[str, Any]:
    """The measured part of a flow record from ka-transport's FlowRecord
    (nanoseconds and bytes/ms become milliseconds and bit/s)."""
    rates = record.get("advertised_rates") or {}
    negotiated = record.get("protocol")
    return {
        "negotiated_protocol": negotiated if negotiated in PROTOCOLS else None,
        "completed": bool(record.get("completed")) and not error,
        "handshake": record.get("handshake_mode"),
        "fct_ms": _ms(record.get("fct_ns")),
        "ka_mode_ms": _ms(record.get("ka_mode_ns")),
        "ka_mode_fraction": record.get("ka_mode_fraction"),
        "mode_switches": record.get("mode_switch_count"),
        "retransmissions": record.get("retransmissions"),
        "srtt_ms": _ms(record.get("srtt_ns")),
        "min_rtt_ms": _ms(record.get("min_rtt_ns")),
        "advertised_rate_min_bps": _bps(rates.get("min_bytes_per_ms")),
        "advertised_rate_max_bps": _bps(rates.get("max_bytes_per_ms")),
        "advertised_rate_last_bps": _bps(rates.get("last_bytes_per_ms")),
        "advertised_rates_seen": rates.get("count"),
        "error": error or record.get("error"),
        "extra": {k: record[k] for k in TRANSPORT_EXTRA if k in record},
    }


# -- validation (the runner's own check before it spools) --------------------------------
# The server's model (kickass_server.schemas.FlowRecord) is built from the same
# FIELDS and calls parse_time, real_ok and strictjson.check_bounded for what a
# declared bound cannot say, so the two accept the same records.


class FlowRecordError(ValueError):
    """A record (or one value, ``check_value``) that does not fit its definition;
    ``field`` names the culprit."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


def check(record: Mapping[str, Any]) -> None:
    """Raise FlowRecordError unless ``record`` fits ``FIELDS`` (unknown keys too).

    Times are ISO 8601 strings with an offset (``parse_time``), as uploaded.
    """
    if not isinstance(record, Mapping):
        raise FlowRecordError("record", "must be an object")
    unknown = sorted(str(k)[:64] for k in record if k not in BY_NAME)
    if unknown:
        raise FlowRecordError(unknown[0], "not a field of a flow record")
    for f in FIELDS:
        if f.name not in record:
            if f.required:
                raise FlowRecordError(f.name, "missing")
            continue
        check_value(f, record[f.name])


def real_ok(value: float) -> bool:
    """Whether ``value`` is 0 or of a normal float32 magnitude (``REAL_MIN``), as
    every float of a record must be."""
    return value == 0 or abs(value) >= REAL_MIN


def parse_time(value: Any, max_len: int = TIME_MAX_CHARS) -> datetime:
    """An ISO 8601 time with a UTC offset, as a flow record (and every upload)
    carries it, from ``TIME_MIN`` to ``TIME_MAX``; ValueError otherwise."""
    if not isinstance(value, str) or len(value) > max_len:
        raise ValueError("not an ISO 8601 time")
    try:
        t = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError("not an ISO 8601 time") from None
    if t.utcoffset() is None:
        raise ValueError("needs a UTC offset (a time without one is hours off)")
    try:
        utc = t.astimezone(timezone.utc)
    except OverflowError:
        utc = None
    if utc is None or not TIME_MIN <= utc <= TIME_MAX:
        raise ValueError(f"must lie within {TIME_MIN.isoformat()} and {TIME_MAX.isoformat()}")
    return t


def check_value(f: Field, value: Any) -> None:
    """Raise FlowRecordError unless ``value`` fits the field ``f`` (of this table or
    of any in ``kickass_core.bounds``, which holds every other writer's columns)."""
    if value is None:
        if not f.nullable:
            raise FlowRecordError(f.name, "may not be null")
        return
    if f.kind == "bool":
        if not isinstance(value, bool):
            raise FlowRecordError(f.name, "must be true or false")
    elif f.kind in ("int", "float"):
        ok = isinstance(value, int) if f.kind == "int" else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok:
            raise FlowRecordError(
                f.name, f"must be {'an integer' if f.kind == 'int' else 'a number'}"
            )
        if f.kind == "float":
            try:
                value = float(value)  # an integer beyond a double's range is no number here
            except OverflowError:
                raise FlowRecordError(f.name, "must be a finite number") from None
            if not math.isfinite(value):
                raise FlowRecordError(f.name, "must be finite")
        low = f.minimum is not None and (
            value <= f.minimum if f.exclusive_minimum else value < f.minimum
        )
        if low or (f.maximum is not None and value > f.maximum):
            opening = "(" if f.exclusive_minimum else "["
            raise FlowRecordError(f.name, f"must lie within {opening}{f.minimum}, {f.maximum}]")
        if f.kind == "float" and not real_ok(value):
            raise FlowRecordError(f.name, f"too small (0, or at least {REAL_MIN})")
    elif f.kind == "time":
        try:
            parse_time(value, f.max_len or TIME_MAX_CHARS)
        except ValueError as exc:
            raise FlowRecordError(f.name, str(exc)) from None
    elif f.kind == "str":
        if not isinstance(value, str):
            raise FlowRecordError(f.name, "must be a string")
        if f.choices is not None and value not in f.choices:
            raise FlowRecordError(f.name, f"must be one of {list(f.choices)}")
        if f.pattern is not None and not re.fullmatch(f.pattern, value):
            raise FlowRecordError(f.name, f"must match {f.pattern}")
        if f.max_len is not None and len(value) > f.max_len:
            raise FlowRecordError(f.name, f"longer than {f.max_len} characters")
        if BAD_TEXT_RE.search(value):
            raise FlowRecordError(f.name, "holds control characters or invalid Unicode")
    elif f.kind == "object":
        if not isinstance(value, dict):
            raise FlowRecordError(f.name, "must be an object")
        if f.max_len is not None and len(value) > f.max_len:
            raise FlowRecordError(f.name, f"more than {f.max_len} keys")
        try:
            strictjson.check_bounded(value, f.max_bytes or EXTRA_MAX_BYTES)
        except ValueError as exc:
            raise FlowRecordError(f.name, str(exc)) from None


def vectors_document(examples: list[dict[str, Any]]) -> dict[str, Any]:
    """The shared vector file's content (core/vectors/flow_record.json)."""
    return {
        "description": "The trial flow record (kickass_core.flow_record): fields with types and "
        "bounds, and ka-transport FlowRecord -> flow record conversions. Generated by "
        "core/vectors/make_vectors.py; read by Python and Rust tests.",
        "flows_per_period_max": FLOWS_PER_PERIOD_MAX,
        "fields": [f.to_json() for f in FIELDS],
        "transport_extra": list(TRANSPORT_EXTRA),
        "examples": examples,
    }
