"""What the probe engine tells the database: one typed record per study write.

The engine's sans-IO core (``kickass_server.probe_core``) emits these events;
the engine's shell hands them to the database writer, which journals them as
JSON (``to_json``/``from_json``, the one codec) and stores each through
``kickass_db.study_store.StudyStore.apply``, the study's one write form for a
session's run (one case per event type).
The same definition is read back when a journal is replayed after a crash,
so the engine, the journal and the store cannot drift apart.

Times in an ``OutcomeBatch`` are the core's monotonic clock: turning each
probe's time into a UTC datetime has no place on the probe clock. The shell,
which owns the clocks, stamps the batch with a ``ClockAnchor`` (a wall-clock
reading and the monotonic reading taken with it) before submitting it.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from typing import Any, NamedTuple, Union

# ``slots=True`` where the dataclass decorator knows it (Python 3.10+); core
# also runs on 3.9 (the volunteer's one-file client), where the records are
# the same without __slots__.
_SLOTS: dict[str, bool] = {"slots": True} if sys.version_info >= (3, 10) else {}


class OutcomeEntry(NamedTuple):
    """One probe's outcome, as recorded: the study's one outcome type, from the
    engine's core to the store's row (times are the core's monotonic ``now``,
    mapped to UTC by the batch's ``ClockAnchor``; the RTT is ``acked_at -
    sent_at``)."""

    seq: int
    phase: str
    ip_len: int
    outcome: str
    sent_at: float
    acked_at: float | None
    ack_count: int
    received_len: int | None
    observed_frag_size: int | None
    reassembly_invalid: bool = False


@dataclass(frozen=True, **_SLOTS)
class ClockAnchor:
    """A wall-clock time (Unix seconds) and the monotonic reading taken with it."""

    unix: float
    mono: float

    def utc(self, mono: float) -> datetime:
        return datetime.fromtimestamp(self.unix, timezone.utc) - timedelta(seconds=self.mono - mono)


@dataclass(frozen=True, **_SLOTS)
class RunProbing:
    """The client proved its address; probing starts."""

    session_id: str
    probe_address: str
    probe_port: int
    rtt_ms: float | None


@dataclass(frozen=True, **_SLOTS)
class OutcomeBatch:
    """Outcomes to upsert. A seq may appear again in a later batch (late or
    duplicate ACK): each entry is the whole row, and the last word wins.
    ``anchor`` is set by the shell (the core has no wall clock)."""

    session_id: str
    entries: tuple[OutcomeEntry, ...]
    anchor: ClockAnchor | None = None

    def stamped(self, anchor: ClockAnchor) -> OutcomeBatch:
        return replace(self, anchor=anchor)


@dataclass(frozen=True, **_SLOTS)
class Heartbeat:
    """Progress counters for pollers."""

    session_id: str
    sent: int
    acked: int


@dataclass(frozen=True, **_SLOTS)
class RunFinished:
    """The run reached a final state."""

    session_id: str
    state: str
    # The engine always decides one; None (a final session without one, as
    # the sessions table and the views allow) is what tests seed.
    verdict: str | None
    verdict_reason: str | None
    end_reason: str | None
    # What the server learnt of the client's reassembly memory (None: the
    # client sent no flow control); stored in the session's metadata.
    reassembly: Mapping[str, object] | None = None
    # An adaptive run's window controller summary (None: a fixed window).
    window: Mapping[str, object] | None = None


# typing.Union, not ``|``: a type alias is evaluated at run time, and ``|``
# between classes needs Python 3.10.
StudyEvent = Union[RunProbing, OutcomeBatch, Heartbeat, RunFinished]

# The journal's type tags: part of the on-disk format, never renamed.
_TAGS: dict[type, str] = {
    RunProbing: "probing",
    OutcomeBatch: "outcomes",
    Heartbeat: "heartbeat",
    RunFinished: "finished",
}


class StudyEventError(ValueError):
    """A journal record that is not a study event this code wrote; the
    message says which field of which event type is wrong."""


def to_json(event: StudyEvent) -> dict[str, Any]:
    """The event as a JSON-able object (the journal's line)."""
    tag = _TAGS.get(type(event))
    if tag is None:
        raise TypeError(f"not a study event: {type(event).__name__}")
    # The values in the order the reader checks them (``_FIELDS``): one list
    # of each record's fields for both directions.
    out: dict[str, Any] = {"type": tag}
    for name, kind in _FIELDS[tag]:
        value = getattr(event, name)
        out[name] = dict(value) if kind.startswith("object") and value is not None else value
    if isinstance(event, OutcomeBatch):
        if event.anchor is None:
            raise ValueError("an OutcomeBatch is journaled only once the shell stamped its anchor")
        out["anchor"] = [event.anchor.unix, event.anchor.mono]
        out["entries"] = [list(e) for e in event.entries]
    return out


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# What a journal record's values may be: a kind's test and how a message says it.
_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "text": (lambda v: isinstance(v, str), "a string"),
    "int": (_int, "an integer"),
    # Numbers are kept as floats: an integer past 2**53 would come back
    # changed (and past about 1e308 would not convert at all).
    "number": (
        lambda v: (_int(v) and abs(v) <= 2**53) or (isinstance(v, float) and math.isfinite(v)),
        "a finite number",
    ),
    "flag": (lambda v: isinstance(v, bool), "true or false"),
    "object": (lambda v: isinstance(v, dict), "an object"),
}
# Each record's values in order, "?" for those that may be null.
_ENTRY = (
    ("seq", "int"),
    ("phase", "text"),
    ("ip_len", "int"),
    ("outcome", "text"),
    ("sent_at", "number"),
    ("acked_at", "number?"),
    ("ack_count", "int"),
    ("received_len", "int?"),
    ("observed_frag_size", "int?"),
    ("reassembly_invalid", "flag"),
)
_FIELDS: dict[str, tuple[tuple[str, str], ...]] = {
    "probing": (
        ("session_id", "text"),
        ("probe_address", "text"),
        ("probe_port", "int"),
        ("rtt_ms", "number?"),
    ),
    "outcomes": (("session_id", "text"),),
    "heartbeat": (("session_id", "text"), ("sent", "int"), ("acked", "int")),
    "finished": (
        ("session_id", "text"),
        ("state", "text"),
        ("verdict", "text?"),
        ("verdict_reason", "text?"),
        ("end_reason", "text?"),
        ("reassembly", "object?"),
        ("window", "object?"),
    ),
}
# Written by servers before the field existed: absent means null.
_MAY_BE_ABSENT = ("reassembly", "window")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _value(where: str, name: str, kind: str, value: Any) -> Any:
    nullable = kind.endswith("?")
    check, said = _KINDS[kind.rstrip("?")]
    if (value is None and nullable) or (value is not None and check(value)):
        return value
    raise StudyEventError(
        f"{where}: {name} must be {'null or ' if nullable else ''}{said}, got {_shown(value)}"
    )


def from_json(obj: Any) -> StudyEvent:
    """The event ``to_json`` wrote; StudyEventError (a ValueError) naming the
    event type and the field for anything else."""
    if not isinstance(obj, Mapping):
        raise StudyEventError(f"not a study event: a {type(obj).__name__}, not an object")
    tag = obj.get("type")
    fields = _FIELDS.get(tag) if isinstance(tag, str) else None
    if fields is None:
        raise StudyEventError(
            f"unknown study event type {_shown(tag)} (known: {', '.join(sorted(_FIELDS))})"
        )
    where = f"study event {tag!r}"
    values = []
    for name, kind in fields:
        if name not in obj and name not in _MAY_BE_ABSENT:
            raise StudyEventError(f"{where}: {name} missing")
        values.append(_value(where, name, kind, obj.get(name)))
    if tag == "probing":
        sid, address, port, rtt_ms = values
        return RunProbing(sid, address, port, None if rtt_ms is None else float(rtt_ms))
    if tag == "heartbeat":
        return Heartbeat(*values)
    if tag == "finished":
        return RunFinished(*values)
    anchor = obj.get("anchor")
    number = _KINDS["number"][0]
    if not (isinstance(anchor, list) and len(anchor) == 2 and all(map(number, anchor))):
        raise StudyEventError(f"{where}: anchor must be [unix, mono], two finite numbers")
    entries = obj.get("entries")
    if not isinstance(entries, list):
        raise StudyEventError(f"{where}: entries must be a list")
    return OutcomeBatch(
        values[0],
        tuple(_entry(f"{where} entry {i}", e) for i, e in enumerate(entries)),
        ClockAnchor(float(anchor[0]), float(anchor[1])),
    )


def _entry(where: str, e: Any) -> OutcomeEntry:
    # Nine values: an entry journaled before reassembly_invalid existed.
    if not isinstance(e, list) or len(e) not in (len(_ENTRY) - 1, len(_ENTRY)):
        raise StudyEventError(f"{where}: must be a list of {len(_ENTRY)} values")
    values = [_value(where, name, kind, v) for (name, kind), v in zip(_ENTRY, e)]
    seq, phase, ip_len, outcome, sent_at, acked_at = values[:6]
    return OutcomeEntry(
        seq,
        phase,
        ip_len,
        outcome,
        float(sent_at),
        None if acked_at is None else float(acked_at),
        *values[6:],
    )
