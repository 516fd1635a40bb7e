"""The schedule file: items of scheduled work, each with its cron expression,
its random slip and its kind, validated before anything runs.

A schedule file is TOML (the platform's one configuration style; an Atlas
campaign keeps its own YAML file, named by the item)::

    [schedule]
    name = "wide-area"          # for logs and metrics
    heartbeat_s = 10            # a running item's host says it is alive this often

    [[item]]
    name = "atlas-nightly"
    kind = "atlas"
    cron = "0 3 * * *"          # minute hour day month weekday, UTC
    slip_s = 900                # start somewhere in the 15 minutes after
    campaign = "/etc/kickass/atlas/nightly.yaml"

Kinds and their settings (the built-in ones, and each study source's kind
from the registry, ``kickass_core.sources``: on this platform Atlas's):

* ``atlas``: ``campaign`` (the Atlas campaign file); creates its
  measurements when due (never twice), then fetches on every run until they
  settle, each fetch bounded by ``timeout_s``; with ``archive`` (a folder),
  a settled campaign's outcomes are written there as Parquet
  (``atlas_outcomes/campaign=NAME/``), again only when late results change them.
* ``trials``: ``trials`` (a ``kickass_wan.trials.service.RoundSettings`` table): one
  round of interleaved trials; the order of the agents and the seed of the
  periods are drawn per round and stored with the trial.
* ``refresh``: the analysis rollups (``kickass_analysis.rollups``).
* ``export``: ``directory``, ``views``, ``format`` (csv or parquet): what
  arrived since the last export, in dated files.
* ``housekeeping``: what the study servers left behind (sessions still live
  past their time, per server instance); makes the raw tables' day
  partitions ``partitions_ahead`` days ahead (7); with ``archive`` (a
  folder), retires the raw days older than ``keep_raw_days`` (per table:
  probe_outcomes 30, router_telemetry 7) into it as verified Parquet
  (``kickass_analysis.archive``). Without ``archive`` it deletes nothing.

Every item has ``timeout_s`` (a run still going then ends ``timeout``) and
may name its owners in ``host``: one host (a database host's id, or a runner
host's runner name) or a list of them; only those run it, and the server
refuses a runner's claim for an item that does not name it (without
``host``: any host that can). Whether a run's host is dead is the
schedule's to say, never the claimer's: a run not heard of for
``stale_s`` (at least ``STALE_FACTOR`` heartbeats; that many by default).
Paths are read relative to the schedule file.

A study source's kind is known where its package is installed: a host
without it (a trial runner host has no Atlas package) still reads a file
naming it, and leaves its items to the hosts that know it (``runs_here``);
``kickass schedule check`` says which kinds are unknown here.

A schedule file is at most ``MAX_FILE_BYTES`` of UTF-8.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import tomllib
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, Literal

from croniter import croniter
from kickass_core import sources
from kickass_core.errors import KickassError
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

SLIP_CHECK_FROM = datetime(2026, 1, 5, tzinfo=UTC)
# A thousand items take about 100 KB: ten times that is a mistake, not a schedule.
MAX_FILE_BYTES = 1024 * 1024
# A run is dead when not heard of for this many heartbeats (or the longer
# stale_s of the schedule): a host that is merely busy misses one or two.
STALE_FACTOR = 4
# Most owners an item names (runner hosts of one round, database hosts).
MAX_OWNERS = 64  # a Monday: weekday fields start there
# The kinds this package runs itself; the study sources bring theirs (``kinds``).
BUILTIN_KINDS = ("trials", "refresh", "export", "housekeeping")
# Built-in kinds that need the database (and run only where it is reachable).
BUILTIN_DATABASE_KINDS = ("refresh", "export", "housekeeping")
# The settings each built-in kind needs (a source's: its ``item_needs``).
BUILTIN_NEEDS: dict[str, tuple[str, ...]] = {
    "trials": ("trials",),
    "export": ("directory", "views"),
}
# The tables housekeeping retires into the archive (kickass_db.models.archive).
RAW_TABLES = ("probe_outcomes", "router_telemetry")


# croniter expands an expression on every construction (a third of a
# millisecond): a schedule of a thousand items, run every minute, must not
# pay that a few thousand times. Items share few expressions; each is
# expanded once, and its iterator moved to the time asked about.


@functools.lru_cache(maxsize=4096)
def _valid(value: str) -> bool:
    return len(value.split()) == 5 and bool(croniter.is_valid(value))


@functools.lru_cache(maxsize=4096)
def _prototype(value: str) -> croniter:
    return croniter(value, SLIP_CHECK_FROM)


def _walk(value: str, start: datetime) -> croniter:
    """An iterator over ``value``'s due times from ``start`` (a shared one:
    used at once, by one thread)."""
    it = _prototype(value)
    it.set_current(start, force=True)
    return it


@functools.lru_cache(maxsize=4096)
def _min_gap_s(value: str) -> float:
    """The shortest time between due times, over the next few."""
    it = _walk(value, SLIP_CHECK_FROM)
    times: list[datetime] = [it.get_next(datetime) for _ in range(6)]
    return min((b - a).total_seconds() for a, b in zip(times, times[1:], strict=False))


def _cron(value: str) -> str:
    if not _valid(value):
        raise ValueError(f"not a cron expression with 5 fields: {value!r}")
    return value


Cron = Annotated[str, AfterValidator(_cron)]
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
Name = Annotated[str, Field(pattern=NAME_PATTERN)]


def _owners(value: str | list[str]) -> str | list[str]:
    names = [value] if isinstance(value, str) else value
    if not 1 <= len(names) <= MAX_OWNERS:
        raise ValueError(f"a host name, or a list of 1 to {MAX_OWNERS} host names")
    for name in names:
        if not re.match(NAME_PATTERN, name):
            raise ValueError(f"not a host name: {name!r} (letters, digits, '_', '.', '-')")
    if len(set(names)) != len(names):
        raise ValueError("a list of distinct host names")
    return value


Owners = Annotated[str | list[str], AfterValidator(_owners)]


def kinds() -> tuple[str, ...]:
    """The kinds this host knows: the built-in ones, then the study sources'."""
    return BUILTIN_KINDS + tuple(s.item_kind for s in sources.sources() if s.item_kind)


def database_kinds() -> tuple[str, ...]:
    """The known kinds that need the database."""
    return BUILTIN_DATABASE_KINDS + tuple(
        s.item_kind for s in sources.sources() if s.item_kind and s.item_needs_database
    )


def _kind(value: str) -> str:
    # A kind no package here registers may be a source's whose package this
    # host lacks (a runner host reads the file with its Atlas items): the
    # name is checked here, what it is by ``Item.known`` where it matters.
    if not re.match(sources.NAME_PATTERN, value):
        raise ValueError(f"not a kind: {value!r} (the known kinds: {', '.join(kinds())})")
    return value


Kind = Annotated[str, AfterValidator(_kind)]


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class Item(_Model):
    name: Name
    kind: Kind
    cron: Cron
    # The schedule's spread: each due time starts at a random offset in
    # [0, slip_s), the same on every host (drawn from the item and the time).
    slip_s: Annotated[float, Field(ge=0, le=86_400)] = 0.0
    timeout_s: Annotated[float, Field(gt=0, le=7 * 86_400)] = 3600.0
    # A due time not started within this long of its (slipped) time is not
    # run late: it is recorded ``skipped`` (no host ran the schedule then).
    late_s: Annotated[float, Field(ge=60, le=30 * 86_400)] = 3600.0
    # Only this host, or these hosts, run the item (None: any host that can):
    # database hosts by their host id, runner hosts by their runner name.
    host: Owners | None = None
    enabled: bool = True
    # atlas
    campaign: str | None = None
    # trials
    trials: dict[str, Any] | None = None
    # export
    directory: str | None = None
    views: list[str] | None = None
    format: Literal["csv", "parquet"] = "parquet"
    # housekeeping: the study servers' journal folders readable from here,
    # and how many days of the raw tables' partitions to make ahead (0022)
    journals: list[str] | None = None
    partitions_ahead: Annotated[int, Field(ge=2, le=366)] = 7
    # housekeeping: where the raw days past keeping go (None: nothing is
    # retired), and how many days each raw table keeps (the archive's
    # defaults for a table not named: probe_outcomes 30, router_telemetry 7);
    # atlas: where a settled campaign's outcomes are archived
    archive: str | None = None
    keep_raw_days: dict[str, Annotated[int, Field(ge=1, le=36_500)]] | None = None

    @model_validator(mode="after")
    def _kind_settings(self) -> Item:
        if self.slip_s > 0:
            # Due times must start in their order: the slip is shorter than
            # the time between them (checked over the next few; croniter is
            # slow enough that a thousand items must not cost a second here).
            gap = _min_gap_s(self.cron)
            if self.slip_s >= gap:
                raise ValueError(
                    f"slip_s ({self.slip_s:g}) must be shorter than the time between "
                    f"due times ({gap:g} s)"
                )
        for table in self.keep_raw_days or {}:
            if table not in RAW_TABLES:
                raise ValueError(
                    f"keep_raw_days: {table!r} is not a raw table ({', '.join(RAW_TABLES)})"
                )
        source = sources.by_kind(self.kind)
        needs = source.item_needs if source else BUILTIN_NEEDS.get(self.kind, ())
        for need in needs:
            if getattr(self, need, None) is None:
                raise ValueError(f"a {self.kind} item needs {need!r}")
        return self

    @property
    def known(self) -> bool:
        """Whether this host knows the item's kind (built in, or a study
        source's whose package is installed here)."""
        return self.kind in kinds()

    def unknown_kind(self) -> str | None:
        """Why this host cannot run the item's kind (None: it can)."""
        if self.known:
            return None
        return (
            f"kind {self.kind!r} is not known on this host (known: {', '.join(kinds())}); "
            "a study source's kind is known where its package is installed"
        )

    @property
    def owners(self) -> tuple[str, ...] | None:
        """The hosts that may run the item (None: any host that can)."""
        if self.host is None:
            return None
        return (self.host,) if isinstance(self.host, str) else tuple(self.host)

    def may_run(self, host: str) -> bool:
        return self.owners is None or host in self.owners

    def on_cron(self, due: datetime) -> bool:
        """Whether ``due`` is one of the item's due times (cron times are whole minutes)."""
        due = due.astimezone(UTC)
        if due.second or due.microsecond:
            return False
        it = _walk(self.cron, due - timedelta(seconds=1))
        nxt: datetime = it.get_next(datetime)
        return nxt.astimezone(UTC) == due

    def definition_hash(self) -> str:
        """What the item is (its settings), so a run says what it ran."""
        blob = json.dumps(self.model_dump(), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def slip(self, due: datetime) -> timedelta:
        if self.slip_s <= 0:
            return timedelta(0)
        h = hashlib.sha256(f"{self.name}|{due.isoformat()}".encode()).digest()
        return timedelta(seconds=int.from_bytes(h[:8], "big") / 2**64 * self.slip_s)

    def due_now(self, now: datetime) -> datetime | None:
        """The latest due time whose slipped start has come: what a run at
        ``now`` does, if nobody has done it yet. Any due time at least
        ``slip_s`` ago has started, so the walk back ends there."""
        it = _walk(self.cron, now)
        for _ in range(10_000):
            due: datetime = it.get_prev(datetime)
            if due + self.slip(due) <= now:
                return due.astimezone(UTC)
        return None

    def next_start(self, now: datetime) -> datetime:
        """When the next due time starts (its slip included)."""
        it = _walk(self.cron, now)
        for _ in range(3):
            due: datetime = it.get_next(datetime)
            start = due + self.slip(due)
            if start > now:
                return start.astimezone(UTC)
        return start.astimezone(UTC)

    def previous_dues(self, now: datetime, n: int) -> list[datetime]:
        it = _walk(self.cron, now)
        return [it.get_prev(datetime).astimezone(UTC) for _ in range(n)]


class Settings(_Model):
    name: Name = "kickass"
    # A running item's host says it is alive this often...
    heartbeat_s: Annotated[float, Field(gt=0, le=3600)] = 10.0
    # ...and is dead when not heard of for this long: at least STALE_FACTOR
    # heartbeats (the default), so a live run is never taken for dead.
    stale_s: Annotated[float, Field(ge=2, le=86_400)] | None = None
    # Where claims are made when no database URL is given: the measurement
    # server's schedule API, with this host's runner token.
    server: Annotated[str, Field(pattern=r"^https?://", max_length=200)] | None = None
    runner_token_file: str | None = None

    @model_validator(mode="after")
    def _heartbeat_below_stale(self) -> Settings:
        if self.stale_s is not None and self.stale_s < self.heartbeat_s * STALE_FACTOR:
            raise ValueError(
                f"stale_s ({self.stale_s:g}) must be at least {STALE_FACTOR} heartbeats "
                f"({STALE_FACTOR} x heartbeat_s = {self.heartbeat_s * STALE_FACTOR:g})"
            )
        return self

    @property
    def stale_after_s(self) -> float:
        """How long a run may go unheard of before it is dead."""
        return self.stale_s if self.stale_s is not None else self.heartbeat_s * STALE_FACTOR


class Schedule(_Model):
    schedule: Settings = Field(default_factory=Settings)
    item: list[Item] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique(self) -> Schedule:
        names = [i.name for i in self.item]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"item names must be unique: {sorted(dup)}")
        return self

    def find(self, name: str) -> Item | None:
        return next((i for i in self.item if i.name == name), None)


def load(path: str | Path) -> tuple[Schedule, Path]:
    """The schedule and its file's folder (relative paths are read from it)."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise KickassError(
            f"no schedule file {p}", hint="see operations/example-schedule.toml"
        ) from None
    except OSError as exc:
        raise KickassError(f"cannot read the schedule file {p}: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise KickassError(
            f"{p} is larger than {MAX_FILE_BYTES:,} bytes, the most a schedule file may be",
            hint="a schedule of a thousand items takes about 100 KB: is this the right file?",
        )
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise KickassError(
            f"{p} is not UTF-8: byte 0x{raw[exc.start]:02x} at line {line}, column {column}",
            hint="save the file as UTF-8 (a schedule file is TOML, which is UTF-8 only)",
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise KickassError(f"{p} is not TOML: {exc}") from None
    return parse(data, str(p)), p.resolve().parent


def parse(data: dict[str, Any], where: str = "schedule") -> Schedule:
    try:
        return Schedule.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        loc = first.get("loc", ())
        field = ".".join(str(x) for x in loc) or "schedule"
        if len(loc) >= 2 and loc[0] == "item" and isinstance(loc[1], int):
            items = data.get("item") or []
            name = items[loc[1]].get("name") if loc[1] < len(items) else None
            field = f"item {name or loc[1]!r}: " + ".".join(str(x) for x in loc[2:])
        raise KickassError(
            f"{where}: {field}: {first.get('msg')}",
            hint="see operations/example-schedule.toml",
        ) from None
