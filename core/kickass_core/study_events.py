"""What the probe engine tells the database: one typed record per study write.

The engine's sans-IO core (``kickass_server.probe_core``) emits these events;
the engine's shell hands them to the database writer, which journals them as
JSON (``to_json``/``from_json``, the one codec) and applies each through one
table from event type to store call (``kickass_db.study_store.StudyStore.apply``).
The same definition is read back when a journal is replayed after a crash,
so the engine, the journal and the store cannot drift apart.

Times in an ``OutcomeBatch`` are the core's monotonic clock: turning each
probe's time into a UTC datetime has no place on the probe clock. The shell,
which owns the clocks, stamps the batch with a ``ClockAnchor`` (a wall-clock
reading and the monotonic reading taken with it) before submitting it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from typing import Any, NamedTuple, Union

# ``slots=True`` where the dataclass decorator knows it (Python 3.10+); core
# also runs on 3.9 (the volunteer's one-file client), where the records are
# the same without __slots__.
_SLOTS: dict[str, bool] = {"slots": True} if sys.version_info >= (3, 10) else {}


class OutcomeEntry(NamedTuple):
    """One probe's outcome, as recorded (times are the core's monotonic ``now``)."""

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
    verdict: str
    verdict_reason: str
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


def to_json(event: StudyEvent) -> dict[str, Any]:
    """The event as a JSON-able object (the journal's line)."""
    tag = _TAGS[type(event)]
    if isinstance(event, OutcomeBatch):
        if event.anchor is None:
            raise ValueError("an OutcomeBatch is journaled only once the shell stamped its anchor")
        return {
            "type": tag,
            "session_id": event.session_id,
            "anchor": [event.anchor.unix, event.anchor.mono],
            "entries": [list(e) for e in event.entries],
        }
    if isinstance(event, RunFinished):
        return {
            "type": tag,
            "session_id": event.session_id,
            "state": event.state,
            "verdict": event.verdict,
            "verdict_reason": event.verdict_reason,
            "end_reason": event.end_reason,
            "reassembly": None if event.reassembly is None else dict(event.reassembly),
            "window": None if event.window is None else dict(event.window),
        }
    if isinstance(event, RunProbing):
        return {
            "type": tag,
            "session_id": event.session_id,
            "probe_address": event.probe_address,
            "probe_port": event.probe_port,
            "rtt_ms": event.rtt_ms,
        }
    return {"type": tag, "session_id": event.session_id, "sent": event.sent, "acked": event.acked}


def from_json(obj: Mapping[str, Any]) -> StudyEvent:
    """The event ``to_json`` wrote; ValueError for anything else."""
    try:
        tag = obj["type"]
        sid = str(obj["session_id"])
        if tag == "outcomes":
            unix, mono = obj["anchor"]
            return OutcomeBatch(
                sid,
                tuple(OutcomeEntry(*e) for e in obj["entries"]),
                ClockAnchor(float(unix), float(mono)),
            )
        if tag == "finished":
            return RunFinished(
                sid,
                obj["state"],
                obj["verdict"],
                obj["verdict_reason"],
                obj["end_reason"],
                obj.get("reassembly"),
                obj.get("window"),
            )
        if tag == "probing":
            return RunProbing(sid, obj["probe_address"], int(obj["probe_port"]), obj["rtt_ms"])
        if tag == "heartbeat":
            return Heartbeat(sid, int(obj["sent"]), int(obj["acked"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a study event: {exc}") from None
    raise ValueError(f"unknown study event type {obj.get('type')!r}")
