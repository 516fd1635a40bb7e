"""Store ka-router telemetry (NDJSON) in PostgreSQL.

The router stays free of a database client: it prints one JSON line per
control interval (after one ``metadata`` line, and an ``exit`` line at the
end). ``kickass telemetry ingest`` reads that stream — a file or a pipe
(``ka-router ... | kickass telemetry ingest -``) — and writes ``router_runs``
and ``router_telemetry``; while the database is away samples are kept and
written when it is back.

Every line is checked before anything of it is stored: strict JSON (no NaN
or infinities, bounded nesting and length), each number within its column's
bounds (``kickass_core.bounds``: ``t`` finite and within the run's clock,
rates, counters, the wall clock from 1970 to 2100), the free-form fields
small and plain enough for ``jsonb``. A line that is not (malformed or
refused alike) is skipped and counted with its line number and the reason;
the others are stored. Should the database still refuse a batch, its rows
are written one by one and only the refused ones are skipped. The command
exits 1 when it skipped a line, after its summary.

``router_telemetry`` is partitioned by the UTC day of ``recorded_at``
(migration 0022): a line's ``ts``, else its run's start + ``t``. The ingest
makes the partitions of its own days (the database's yesterday, today and
tomorrow: a live router's) and refuses, by line number, a line of any other
day without one (``kickass db partitions add`` makes past days).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from functools import partial
from typing import IO, Any

from kickass_core import bounds, strictjson
from kickass_core.cli import group
from kickass_core.errors import KickassError
from sqlalchemy import insert, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import DBAPIError

from . import engine as db
from . import partitions
from .models.router import MARKING_MODES, RouterRunRow, RouterTelemetryRow
from .retry import DatabaseUnavailable, RetryPolicy, retry
from .tx import StoreBase

# A router run outlives short database restarts; give up after a minute.
FLUSH_POLICY = RetryPolicy(deadline=60.0)

log = logging.getLogger("kickass.telemetry")
TABLE = "router_telemetry"
BATCH = 200
# A sample line is about 600 bytes; the metadata line carries the options.
MAX_LINE_BYTES = 256 * 1024
# Free-form JSON of a line: a sample's other fields, the run's options, the
# exit line's counters (strictjson.check_bounded).
EXTRA_MAX_BYTES = 4096
OPTIONS_MAX_BYTES = 64 * 1024
TEXT_MAX_CHARS = 2000
# How many skipped lines the text summary names (--json names every one).
SHOWN_SKIPPED = 20
EXIT_SKIPPED = 1

# What a sample line carries (its "ts" is recorded_at: _TS).
_SAMPLE = bounds.numbers(bounds.ROUTER_TELEMETRY)
_COLUMNS = frozenset(f.name for f in _SAMPLE) | {"marking_mode"}
_TS = bounds.wall_clock("ts")
_STARTED = bounds.wall_clock("started_unix")
_CAPACITY = bounds.renamed(bounds.ROUTER_RUNS[0], "options.router.capacity_bps")


class LineRefused(ValueError):
    """A line skipped: what is wrong with it, for its summary."""


@dataclass(frozen=True)
class Skipped:
    line: int
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"line": self.line, "reason": self.reason}


@dataclass
class Summary:
    run_id: int | None
    lines: int
    samples: int
    written: int
    skipped: list[Skipped] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "lines": self.lines,
            "samples": self.samples,
            "written": self.written,
            "skipped": len(self.skipped),
            "skipped_lines": [s.to_json() for s in self.skipped],
        }


def _time(unix: float | None) -> datetime:
    """A line's wall clock (checked against ``bounds.wall_clock``), else now."""
    return datetime.fromtimestamp(float(unix), UTC) if unix is not None else datetime.now(UTC)


def _check(f: bounds.Field, value: Any) -> Any:
    try:
        bounds.check_value(f, value)
    except ValueError as exc:
        raise LineRefused(str(exc)) from None
    return value


def _text(name: str, value: Any, max_chars: int = TEXT_MAX_CHARS) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > max_chars or strictjson.UNPRINTABLE.search(value):
        raise LineRefused(f"{name}: must be printable text of at most {max_chars} characters")
    return value


def _json(name: str, value: Any, max_bytes: int) -> Any:
    try:
        strictjson.check_bounded(value, max_bytes)
    except ValueError as exc:
        raise LineRefused(f"{name}: {exc}") from None
    return value


def parse_line(raw: bytes | str) -> dict[str, Any] | None:
    """A line's JSON object (None for a blank line); LineRefused otherwise."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise LineRefused("not UTF-8") from None
    text_line = raw.strip()
    if not text_line:
        return None
    if len(text_line.encode("utf-8", "surrogatepass")) > MAX_LINE_BYTES:
        raise LineRefused(f"longer than {MAX_LINE_BYTES} bytes")
    try:
        rec = strictjson.loads(text_line)
    except ValueError as exc:
        raise LineRefused(f"not JSON: {str(exc)[:200]}") from None
    if not isinstance(rec, dict):
        raise LineRefused("not a JSON object")
    return rec


def sample_row(rec: Mapping[str, Any]) -> dict[str, Any]:
    """The ``router_telemetry`` row of a sample line; LineRefused if it does
    not fit (``bounds.ROUTER_TELEMETRY``, its marking mode, its wall clock,
    its other fields as ``extra``)."""
    for f in _SAMPLE:
        if f.required and f.name not in rec:
            raise LineRefused(f"{f.name}: missing")
        _check(f, rec.get(f.name))
    # Lines written before the rename call it "mode".
    mode = rec.get("marking_mode", rec.get("mode"))
    if mode not in MARKING_MODES:
        raise LineRefused(f"marking_mode: must be one of {list(MARKING_MODES)}")
    row = {f.name: rec.get(f.name) for f in _SAMPLE}
    row["marking_mode"] = mode
    ts = _check(_TS, rec.get("ts"))
    # Without a wall clock of its own: the run's start + t (TelemetryIngest.flush).
    row["recorded_at"] = None if ts is None else _time(ts)
    extra = {k: v for k, v in rec.items() if k not in _COLUMNS and k not in ("type", "mode")}
    row["extra"] = _json("extra fields", extra, EXTRA_MAX_BYTES)
    return row


def run_values(meta: Mapping[str, Any], run_name: str | None) -> dict[str, Any]:
    """The ``router_runs`` row of a metadata line; LineRefused if it does not fit."""
    options = _json("options", meta.get("options") or {}, OPTIONS_MAX_BYTES)
    if not isinstance(options, dict):
        raise LineRefused("options: must be an object")
    router = options.get("router") or {}
    if not isinstance(router, dict):
        raise LineRefused("options.router: must be an object")
    kind = str(router.get("kind", "kickass")).lower()
    return {
        "run_name": run_name,
        "router_kind": "droptail" if "droptail" in kind else "kickass",
        "capacity_bps": _check(_CAPACITY, router.get("capacity_bps")),
        "program_version": _text("program_version", meta.get("program_version"), 200),
        "options": options,
        "started_at": _time(_check(_STARTED, meta.get("started_unix"))),
    }


def exit_values(rec: Mapping[str, Any]) -> dict[str, Any]:
    """What an exit line adds to its run; LineRefused if it does not fit."""
    counters = rec.get("counters")
    return {
        "finished_at": _time(_check(_TS, rec.get("ts"))),
        "exit_reason": _text("reason", rec.get("reason")),
        "counters": None if counters is None else _json("counters", counters, OPTIONS_MAX_BYTES),
    }


class TelemetryIngest(StoreBase):
    """Feed it lines; it keeps one router run's rows flowing into the database."""

    def __init__(self, database_url: str | None = None, run_name: str | None = None) -> None:
        super().__init__(database_url)
        self.run_name = run_name
        self.run_id: int | None = None
        self.lines = 0
        self.samples = 0
        self.written = 0
        self.skipped: list[Skipped] = []
        # When the run started: a sample line without "ts" is recorded at it + t.
        self.started_at: datetime | None = None
        # Days router_telemetry has a partition of (migration 0022), as last read.
        self._days: set[date] | None = None
        # (line number, row): rows waiting for their batch.
        self.pending: list[tuple[int, dict[str, Any]]] = []

    def skip(self, line: int, reason: str) -> None:
        self.skipped.append(Skipped(line, reason))
        log.debug("line %d skipped: %s", line, reason)

    def _create_run(self, values: dict[str, Any]) -> None:
        self.started_at = values["started_at"]
        self.run_id = self.run(
            lambda conn: conn.execute(
                insert(RouterRunRow).returning(RouterRunRow.id), values
            ).scalar()
        )

    def feed_line(self, line: bytes | str) -> None:
        """One line of the stream (its number: how many were fed so far)."""
        self.lines += 1
        try:
            rec = parse_line(line)
            if rec is None:
                return
            kind = rec.get("type", "sample")
            if kind == "sample":
                row = sample_row(rec)
            elif kind == "metadata":
                values = run_values(rec, self.run_name)
            elif kind == "exit":
                values = exit_values(rec)
            else:
                raise LineRefused(f"type: not one of sample, metadata, exit ({str(kind)[:40]!r})")
        except LineRefused as exc:
            self.skip(self.lines, str(exc))
            return
        if kind == "sample":
            self.pending.append((self.lines, row))
            self.samples += 1
            if len(self.pending) >= BATCH:
                self.flush()
        elif kind == "metadata":
            self.flush()
            self._create_run(values)
        else:
            self.flush()
            self._finish(values)

    def flush(self, policy: RetryPolicy = FLUSH_POLICY) -> None:
        if not self.pending:
            return
        if self.run_id is None:
            # No metadata line (a truncated capture): still keep the samples.
            self._create_run(run_values({}, self.run_name))
        assert self.started_at is not None
        for _, row in self.pending:
            if row["recorded_at"] is None:
                row["recorded_at"] = self.started_at + timedelta(seconds=row["t"])
        try:
            self.pending = self._partitioned(self.pending, policy)
            try:
                self.written += self._write(self.pending, policy)
            except DBAPIError:
                # A row the checks let through and the database refuses: one
                # by one, so that only it is skipped, with the database's reason.
                self._write_each(policy)
        except DatabaseUnavailable as exc:
            raise KickassError(
                f"cannot write {len(self.pending)} router telemetry samples: {exc.message}",
                hint="the NDJSON file still holds them: re-run `kickass telemetry ingest FILE`",
            ) from exc
        self.pending.clear()

    def _partitioned(
        self, rows: list[tuple[int, dict[str, Any]]], policy: RetryPolicy
    ) -> list[tuple[int, dict[str, Any]]]:
        """The rows whose day has a partition; the others are refused, each
        line named. The ingest makes the partitions of its own days (the
        database's yesterday, today and tomorrow: a live router's), never of
        another day: an older day's raw samples may have been retired."""
        needed = {partitions.day_of(r["recorded_at"]) for _, r in rows}
        if self._days is None or not needed <= self._days:
            self._days = retry(
                lambda: self.run(lambda c: partitions.days(c, TABLE)), policy, what="partitions"
            )
            missing = needed - self._days
            if missing:
                today = self.run(partitions.today)
                own = {today + timedelta(days=n) for n in (-1, 0, 1)}
                for day in sorted(missing & own):
                    try:
                        self.run(partial(partitions.ensure, table=TABLE, day=day))
                    except (DatabaseUnavailable, DBAPIError) as exc:
                        log.warning("partition of %s for %s not made: %s", TABLE, day, exc)
                        continue
                    self._days.add(day)
        kept = []
        for number, row in rows:
            day = partitions.day_of(row["recorded_at"])
            if day in self._days:
                kept.append((number, row))
                continue
            self.skip(
                number,
                f"refused: router_telemetry has no partition for {day} (UTC), the day of its "
                f"time {row['recorded_at'].isoformat()}; `kickass db partitions add "
                f"router_telemetry {day}` makes one",
            )
            self.samples -= 1
        return kept

    def _write(self, rows: list[tuple[int, dict[str, Any]]], policy: RetryPolicy) -> int:
        return retry(lambda: self._insert(rows), policy, what="router telemetry write")

    def _write_each(self, policy: RetryPolicy) -> None:
        for number, row in self.pending:
            try:
                self.written += self._write([(number, row)], policy)
            except DBAPIError as exc:
                reason = str(exc.orig or exc).strip().splitlines()[0][:200]
                self.skip(number, f"refused by the database: {reason}")
                self.samples -= 1
        self.skipped.sort(key=lambda s: s.line)

    def _insert(self, rows: list[tuple[int, dict[str, Any]]]) -> int:
        stmt = (
            pg_insert(RouterTelemetryRow).on_conflict_do_nothing().returning(RouterTelemetryRow.t)
        )
        values = [{**r, "run_id": self.run_id} for _, r in rows]
        return self.run(lambda conn: len(conn.execute(stmt, values).all()))

    def _finish(self, values: dict[str, Any]) -> None:
        if self.run_id is None:
            return
        stmt = update(RouterRunRow).where(RouterRunRow.id == self.run_id).values(**values)
        self.run(lambda conn: conn.execute(stmt))

    def feed(self, lines: Iterable[bytes | str]) -> dict[str, Any]:
        """Every line, then the last batch; the summary (``Summary.to_json``)."""
        for line in lines:
            self.feed_line(line)
        self.flush()
        return self.summary().to_json()

    def summary(self) -> Summary:
        skipped = sorted(self.skipped, key=lambda s: s.line)
        return Summary(self.run_id, self.lines, self.samples, self.written, skipped)


def read(stream: IO[bytes], tee: IO[bytes] | None = None) -> Iterable[bytes]:
    """The stream's lines, bounded (``strictjson.read_lines``), each copied to
    ``tee`` as it is read."""

    def copy(chunk: bytes) -> None:
        assert tee is not None
        tee.write(chunk)
        tee.flush()

    return strictjson.read_lines(stream, MAX_LINE_BYTES, copy if tee is not None else None)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    s = group(
        sub,
        "telemetry",
        help="store ka-router telemetry (NDJSON) in PostgreSQL",
        description="Read ka-router's NDJSON telemetry from a file or a pipe and store it in "
        "router_runs / router_telemetry (view v_router_telemetry). Example: "
        "ka-router --lan l0 --wan w0 --capacity 10mbit | kickass telemetry ingest - --tee",
    )
    ing = s.add_parser(
        "ingest",
        help="ingest one router run's telemetry",
        description="Store one router run's telemetry. A line that is not JSON, or whose "
        "values do not fit their columns (kickass_core.bounds), is skipped and named with "
        f"its line number; the rest is stored. Exit status {EXIT_SKIPPED} when a line was "
        "skipped, 2 on an error (nothing of the run is lost: re-run on the same file).",
    )
    ing.add_argument("source", help="NDJSON file, or - for standard input")
    ing.add_argument("--run-name", help="a label for this run (e.g. the trial id)")
    ing.add_argument("--database-url", help="postgresql:// URL (env KICKASS_DATABASE_URL)")
    ing.add_argument("--tee", action="store_true", help="copy every line to stdout")
    ing.add_argument("--json", action="store_true", help="print a JSON summary at the end")
    ing.set_defaults(func=_run_ingest)


def _run_ingest(args: argparse.Namespace) -> int:
    if args.run_name is not None:
        _text("--run-name", args.run_name, 200)
    ingest = TelemetryIngest(args.database_url, args.run_name)
    db.check_connection(ingest.engine)
    tee = sys.stdout.buffer if args.tee else None
    if args.source == "-":
        ingest.feed(read(sys.stdin.buffer, tee))
    else:
        try:
            fp = open(args.source, "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            raise KickassError(f"no such telemetry file: {args.source}") from None
        except OSError as exc:
            raise KickassError(f"cannot read {args.source}: {exc.strerror or exc}") from None
        with fp:
            ingest.feed(read(fp, tee))
    summary = ingest.summary()
    if args.json:
        print(json.dumps(summary.to_json()))
    else:
        _print_summary(summary)
    return EXIT_SKIPPED if summary.skipped else 0


def _print_summary(summary: Summary) -> None:
    out = sys.stderr
    print(
        f"run {summary.run_id}: {summary.written} samples stored of {summary.lines} lines, "
        f"{len(summary.skipped)} lines skipped",
        file=out,
    )
    for s in summary.skipped[:SHOWN_SKIPPED]:
        print(f"  line {s.line}: {s.reason}", file=out)
    if len(summary.skipped) > SHOWN_SKIPPED:
        print(
            f"  ... and {len(summary.skipped) - SHOWN_SKIPPED} more (--json lists every one)",
            file=out,
        )
