"""Every HTTP body the server accepts, as declared models (pydantic v2, strict).

One schema layer for everything that crosses a trust boundary: a volunteer's
session request and end-of-session report, a trial runner's trial and flows.
Strict mode: a string is never a number, ``1`` is never ``true``, a list is
never a string. Every number that reaches a fixed-width column is bounded by
that column (or tighter), every string and list by a length. Bodies arrive
through ``http.parse_body`` (size cap, UTF-8, ``kickass_core.strictjson``
for NaN, infinities and nesting) and only then meet these models; a
validation error becomes a 400 that names the field.

The flow model is not written here: it is derived from the one definition
of the flow record, ``kickass_core.flow_record.FIELDS``; a trial's and its
periods' numbers take their bounds from ``kickass_core.bounds`` (``Bounded``),
the table every other writer and the database's CHECKs share.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from kickass_core import bounds, flow_record, strictjson
from kickass_core.httpjson import errors_text as errors_text  # a refusal as one line
from kickass_core.plan import MAX_REPETITIONS, MAX_WINDOW, PHASES
from kickass_core.rate import FRAGMENT_UNIT, FULL_PACKET_LEN
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    create_model,
)

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
# Printable text, free-form JSON and times are checked by the functions the
# trial runner's own check of a flow record calls (kickass_core): one rule each.
_BAD_TEXT = strictjson.UNPRINTABLE


def _printable(value: str) -> str:
    if _BAD_TEXT.search(value):
        raise ValueError("holds control characters or invalid Unicode")
    return value


def _bounded_json(limit: int) -> Any:
    """Free-form JSON that PostgreSQL's jsonb takes as it is (strictjson.check_bounded)."""

    def check(value: Any) -> Any:
        strictjson.check_bounded(value, limit)
        return value

    return check


def Text(max_len: int) -> Any:  # noqa: N802 - reads as a type in the models below
    """Printable text of at most ``max_len`` characters."""
    return Annotated[str, StringConstraints(max_length=max_len), AfterValidator(_printable)]


def Truncated(max_len: int) -> Any:  # noqa: N802
    """Printable text, cut to ``max_len`` (a long version string is not an error)."""
    return Annotated[
        str,
        StringConstraints(max_length=4096),
        AfterValidator(_printable),
        AfterValidator(lambda v: v[:max_len]),
    ]


def _real(value: float) -> float:
    if not flow_record.real_ok(value):
        raise ValueError(f"too small (0, or at least {flow_record.REAL_MIN})")
    return value


def Bounded(f: flow_record.Field) -> Any:  # noqa: N802
    """A number within the bounds of ``f`` (``kickass_core.bounds``), or None
    too where its column may be NULL."""
    gt, ge = (f.minimum, None) if f.exclusive_minimum else (None, f.minimum)
    base: Any
    if f.kind == "int":
        base = Annotated[int, Field(gt=gt, ge=ge, le=f.maximum)]
    else:
        base = Annotated[
            float, Field(gt=gt, ge=ge, le=f.maximum, allow_inf_nan=False), AfterValidator(_real)
        ]
    return base | None if f.nullable else base


def JsonObject(max_bytes: int) -> Any:  # noqa: N802
    """A JSON object of at most ``max_bytes`` bytes (compact)."""
    return Annotated[dict[str, Any], AfterValidator(_bounded_json(max_bytes))]


# JSON has no time type: an ISO 8601 string with an offset, parsed before
# the (strict) datetime check.
AwareTime = Annotated[datetime, BeforeValidator(flow_record.parse_time)]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]


class Strict(BaseModel):
    """Strict types; unknown fields refused (nothing sent is silently dropped)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class Lenient(Strict):
    """Strict types, unknown fields ignored: a newer volunteer client may send
    a field this server does not know yet, and must still get a session."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


# -- a volunteer's session ---------------------------------------------------------------


def _window(value: Any) -> Any:
    # Checked here, not only by the union below, whose error would name each
    # of its members ("window.constrained-int: ...; window.literal['auto']: ...").
    if value == "auto" or (
        isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_WINDOW
    ):
        return value
    raise ValueError(f'must be an integer or "auto" (an integer from 1 to {MAX_WINDOW})')


class PlanRequest(Lenient):
    """What a client may ask of the plan. The bounds here are the most any
    server may offer (``kickass_core.plan``); the server's policy sets its own
    within them. Absent fields take the paper's plan (null is not absent: it
    is refused)."""

    quick: bool = False
    repetitions: Annotated[int, Field(ge=1, le=MAX_REPETITIONS)] = 100
    step: Annotated[int, Field(ge=FRAGMENT_UNIT, le=FULL_PACKET_LEN, multiple_of=FRAGMENT_UNIT)] = 8
    # No window: the paper's stop-and-wait; "auto": the server adapts it.
    window: Annotated[
        Annotated[int, Field(ge=1, le=MAX_WINDOW)] | Literal["auto"], BeforeValidator(_window)
    ] = 1
    phases: Annotated[list[Literal[PHASES]], Field(min_length=1, max_length=len(PHASES))] = (  # type: ignore[valid-type]  # Literal of a tuple: pydantic expands it, mypy cannot
        Field(default_factory=lambda: list(PHASES))
    )


LIMIT_KEYS = ("high_thresh", "low_thresh", "time_s")
SAMPLE_KEYS = ("reqds", "oks", "fails", "timeouts", "overlaps", "memory", "queues")
MAX_SPLIT_CREDIT = 10_000_000


class ReassemblyLimits(Lenient):
    high_thresh: Count | None = None
    low_thresh: Count | None = None
    time_s: Count | None = None


class ReassemblySample(Lenient):
    reqds: Count | None = None
    oks: Count | None = None
    fails: Count | None = None
    timeouts: Count | None = None
    overlaps: Count | None = None
    memory: Count | None = None
    queues: Count | None = None


class AnnouncedReassembly(Lenient):
    """The client's reassembly memory before the session, and its flow control."""

    limits: ReassemblyLimits | None = None
    before: ReassemblySample | None = None
    split_credit: Annotated[int, Field(ge=0, le=MAX_SPLIT_CREDIT)] | None = None
    # "in-flight": the REPORT's limit is split_from + credit and the credit
    # bounds splits in flight (a split frees it once resolved). Absent: the
    # limit is an absolute bound (clients before this mode).
    credit_mode: Literal["in-flight"] | None = None

    def to_metadata(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "limits": None if self.limits is None else self.limits.model_dump(),
            "before": None if self.before is None else self.before.model_dump(),
        }
        if self.split_credit is not None:
            out["split_credit"] = self.split_credit
        if self.credit_mode is not None:
            out["credit_mode"] = self.credit_mode
        return out


class SessionRequest(Lenient):
    """``POST /api/v1/sessions``."""

    plan: PlanRequest | None = None
    client_version: Truncated(64) | None = None  # type: ignore[valid-type]  # a type made by a call: pydantic reads it, mypy cannot
    platform: Truncated(128) | None = None  # type: ignore[valid-type]  # a type made by a call: pydantic reads it, mypy cannot
    # Whatever the client calls itself: stored, never used to count anyone
    # (the volunteer page counts address blocks, SQL client_key of 0016).
    install_id: Truncated(64) | None = None  # type: ignore[valid-type]  # a type made by a call: pydantic reads it, mypy cannot
    reassembly: AnnouncedReassembly | None = None


# -- a volunteer's end-of-session report -------------------------------------------------

MAX_RANGES = 4096
# Free-form summaries (the client's reassembly counters, its observation's
# summary): plain JSON, bounded in bytes and depth (strictjson).
MAX_SUMMARY_BYTES = 32 * 1024
OBSERVATION_ENCODING = "zlib-base64-v1"
# Two arrays of the plan's length (at most ~40k probes), zlib'd, base64'd.
MAX_OBSERVATION_CHARS = 200_000


class FragmentObservation(Lenient):
    summary: JsonObject(MAX_SUMMARY_BYTES) | None = None  # type: ignore[valid-type]  # a type made by a call: pydantic reads it, mypy cannot
    encoding: Literal["zlib-base64-v1"] | None = None
    leading: Annotated[str, StringConstraints(max_length=MAX_OBSERVATION_CHARS)] | None = None
    fragments: Annotated[str, StringConstraints(max_length=MAX_OBSERVATION_CHARS)] | None = None


class ClientReportBody(Lenient):
    """``POST /api/v1/sessions/<id>/report``."""

    reassembly: JsonObject(MAX_SUMMARY_BYTES) | None = None  # type: ignore[valid-type]  # a type made by a call: pydantic reads it, mypy cannot
    invalid_ranges: (
        Annotated[
            list[
                Annotated[
                    list[Annotated[int, Field(ge=0, le=INT32_MAX)]],
                    Field(min_length=2, max_length=2),
                ]
            ],
            Field(max_length=MAX_RANGES),
        ]
        | None
    ) = None
    fragment_observation: FragmentObservation | None = None


# -- a trial runner's uploads ------------------------------------------------------------

MAX_FLOWS_PER_CALL = 500
MAX_PERIODS = 10_000
CongestionControl = Annotated[
    str, StringConstraints(pattern=flow_record.CONGESTION_CONTROL_RE.pattern)
]


_PERIOD = {f.name: f for f in bounds.TRIAL_PERIODS}


class TrialPeriod(Strict):
    index: Bounded(_PERIOD["period_index"])  # type: ignore[valid-type]  # a type made by a call: pydantic reads it, mypy cannot
    pair: Bounded(_PERIOD["pair"])  # type: ignore[valid-type]  # a type made by a call: pydantic reads it, mypy cannot
    protocol: Literal[flow_record.PROTOCOLS]  # type: ignore[valid-type]  # Literal of a tuple: pydantic expands it, mypy cannot
    start_s: Bounded(_PERIOD["start_offset_s"])  # type: ignore[valid-type]  # a type made by a call: pydantic reads it, mypy cannot
    duration_s: Bounded(_PERIOD["duration_s"])  # type: ignore[valid-type]  # a type made by a call: pydantic reads it, mypy cannot
    congestion_control: CongestionControl | None = None
    # Written by older runners beside the schedule: the destination's name.
    destination: Text(255) | None = None  # type: ignore[valid-type]  # a type made by a call: pydantic reads it, mypy cannot
    # 0010: what the period ran, and when it really started (seconds from the
    # trial's start; known once the period began, re-sent with the trial's end).
    arm: Annotated[str, StringConstraints(pattern=flow_record.ARM_RE.pattern)] | None = None
    handshake: Literal[flow_record.HANDSHAKES] | None = None  # type: ignore[valid-type]  # Literal of a tuple: pydantic expands it, mypy cannot
    handicap_ms: Bounded(_PERIOD["handicap_ms"]) = None  # type: ignore[valid-type]  # a type made by a call: pydantic reads it, mypy cannot
    actual_start_s: Bounded(_PERIOD["actual_start_offset_s"]) = None  # type: ignore[valid-type]  # a type made by a call: pydantic reads it, mypy cannot
    # 0021: a Kick-Ass arm's TCP mode, its share of flows run as kernel TCP,
    # and what the period's flows offered (known once it ended).
    transport_cc: Literal[flow_record.TRANSPORT_CONGESTION_CONTROLS] | None = None  # type: ignore[valid-type]  # Literal of a tuple: pydantic expands it, mypy cannot
    tcp_share: Bounded(_PERIOD["tcp_share"]) = None  # type: ignore[valid-type]  # a type made by a call: pydantic reads it, mypy cannot
    offered_load_bps: Bounded(_PERIOD["offered_load_bps"]) = None  # type: ignore[valid-type]  # a type made by a call: pydantic reads it, mypy cannot


class TrialBody(Strict):
    """``PUT /api/v1/trials/<trial_id>``."""

    trial_id: Annotated[str, StringConstraints(pattern=flow_record.TRIAL_ID_RE.pattern)] | None = (
        None
    )
    destination: Annotated[
        str, StringConstraints(min_length=1, max_length=255), AfterValidator(_printable)
    ]
    access_capacity_bps: Bounded(bounds.TRIALS[0]) = None  # type: ignore[valid-type]  # a type made by a call: pydantic reads it, mypy cannot
    router_run_name: Text(128) | None = None  # type: ignore[valid-type]  # a type made by a call: pydantic reads it, mypy cannot
    parameters: JsonObject(64 * 1024) = Field(default_factory=dict)  # type: ignore[valid-type]  # a type made by a call: pydantic reads it, mypy cannot
    versions: JsonObject(16 * 1024) = Field(default_factory=dict)  # type: ignore[valid-type]  # a type made by a call: pydantic reads it, mypy cannot
    started_at: AwareTime
    finished_at: AwareTime | None = None
    periods: Annotated[list[TrialPeriod], Field(max_length=MAX_PERIODS)] = Field(
        default_factory=list
    )
    # 0010: both ends' environment record (kickass_wan.environment), free-form.
    environment: JsonObject(64 * 1024) = Field(default_factory=dict)  # type: ignore[valid-type]  # a type made by a call: pydantic reads it, mypy cannot


class FlowsBody(Strict):
    """``POST /api/v1/trials/<trial_id>/flows``: each flow is checked on its own
    (``FlowRecord``), so one bad record never takes its neighbours with it."""

    flows: Annotated[list[Any], Field(max_length=MAX_FLOWS_PER_CALL)]


def _flow_annotation(f: flow_record.Field) -> Any:
    if f.kind in ("int", "float"):
        return Bounded(f)
    base: Any
    if f.kind == "bool":
        base = bool
    elif f.kind == "time":
        limit = f.max_len or flow_record.TIME_MAX_CHARS
        base = Annotated[datetime, BeforeValidator(lambda v: flow_record.parse_time(v, limit))]
    elif f.kind == "object":
        base = Annotated[
            dict[str, Any],
            Field(max_length=f.max_len),
            AfterValidator(_bounded_json(f.max_bytes or flow_record.EXTRA_MAX_BYTES)),
        ]
    elif f.choices is not None:
        base = Literal[f.choices]
    else:
        base = Annotated[
            str,
            StringConstraints(pattern=f.pattern, max_length=f.max_len),
            AfterValidator(_printable),
        ]
    return base | None if f.nullable else base


FlowRecord = create_model(  # type: ignore[call-overload]  # fields from a ** mapping: no overload of create_model types them
    "FlowRecord",
    __base__=Strict,
    __doc__="One trial flow record (kickass_core.flow_record.FIELDS).",
    **{f.name: (_flow_annotation(f), ... if f.required else None) for f in flow_record.FIELDS},
)


# -- valid examples (the property test over every endpoint mutates them) ----------------


def session_example(_args: dict[str, str]) -> dict[str, Any]:
    return {
        "plan": {"repetitions": 1, "step": 512, "window": "auto"},
        "client_version": "kickass-probe 0.1.0",
        "platform": "Linux-6.1-x86_64",
        "install_id": "0123456789abcdef",
        "reassembly": {
            "limits": {"high_thresh": 4194304, "low_thresh": 3145728, "time_s": 30},
            "before": {"reqds": 0, "oks": 0, "fails": 0, "timeouts": 0, "overlaps": 0,
                       "memory": 0, "queues": 0},
            "split_credit": 512,
            "credit_mode": "in-flight",
        },
    }  # fmt: skip


def report_example(_args: dict[str, str]) -> dict[str, Any]:
    return {
        "reassembly": {"after": {"fails": 0, "memory": 0}, "budget": {"fraction": 0.5}},
        "invalid_ranges": [[0, 1]],
        "fragment_observation": {"summary": {"split_observed": 0}},
    }


def trial_example(args: dict[str, str]) -> dict[str, Any]:
    return {
        "trial_id": args["trial_id"],
        "destination": "far-1",
        "access_capacity_bps": 10e6,
        "router_run_name": "edge-1",
        "parameters": {"pairs": 1, "workload": {"seed": 1}},
        "versions": {"kickass-wan": "0.1.0"},
        "started_at": "2026-11-25T12:00:00+00:00",
        "finished_at": None,
        "periods": [
            {"index": 0, "pair": 0, "protocol": "tcp", "start_s": 0.0, "duration_s": 120.0,
             "congestion_control": "cubic"},
            {"index": 1, "pair": 0, "protocol": "kickass", "start_s": 120.0, "duration_s": 120.0},
        ],
    }  # fmt: skip


def flows_example(args: dict[str, str]) -> dict[str, Any]:
    # Every field of the flow record's table (kickass_core.flow_record.FIELDS).
    return {"flows": [flow_record.example(args["trial_id"])]}


# -- /api/v1/schedule (trial runner hosts' scheduled items) -------------------------------


class ClaimBody(Strict):
    """``POST /api/v1/schedule/claims``: a runner host claims the run of one of
    its trials items at one due time (kickass_operations.claims.ApiClaims)."""

    item: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]
    kind: Literal["trials"]
    due_at: AwareTime
    definition_hash: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{1,64}$")] | None = None
    # Accepted from runners that still send it and ignored: whether a run is
    # stale is the server's call, from the schedule (schedule_api.py).
    stale_s: Annotated[float, Field(ge=2, le=86_400, allow_inf_nan=False)] = 45.0


class FinishBody(Strict):
    """``PUT /api/v1/schedule/runs/<run_id>``: the run's outcome."""

    outcome: Literal["ok", "failed", "skipped", "timeout"]
    reason: Text(2000) | None = None  # type: ignore[valid-type]  # a type made by a call: pydantic reads it, mypy cannot
    counts: JsonObject(64 * 1024) = Field(default_factory=dict)  # type: ignore[valid-type]  # a type made by a call: pydantic reads it, mypy cannot


def claim_example(_args: dict[str, str]) -> dict[str, Any]:
    return {
        "item": "round-example",
        "kind": "trials",
        "due_at": "2026-11-25T03:00:00+00:00",
        "definition_hash": "0123456789abcdef",
        "stale_s": 45.0,
    }


def finish_example(_args: dict[str, str]) -> dict[str, Any]:
    return {"outcome": "ok", "reason": None, "counts": {"flows_failed": 0, "trials": {}}}
