"""Store ka-router telemetry (NDJSON) in PostgreSQL.

The router stays free of a database client: it prints one JSON line per
control interval (after one ``metadata`` line, and an ``exit`` line at the
end). ``kickass telemetry ingest`` reads that stream — a file or a pipe
(``ka-router ... | kickass telemetry ingest -``) — and writes ``router_runs``
and ``router_telemetry``. Malformed lines are counted and skipped; while the
database is away samples are kept and written when it is back.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any, TextIO

from kickass_core.errors import KickassError
from sqlalchemy import insert, update
from sqlalchemy.dialects.postgresql import insert as pg_insert

from . import engine as db
from .models.router import MARKING_MODES, RouterRunRow, RouterTelemetryRow
from .retry import DatabaseUnavailable, RetryPolicy, retry
from .tx import StoreBase

# A router run outlives short database restarts; give up after a minute.
FLUSH_POLICY = RetryPolicy(deadline=60.0)

log = logging.getLogger("kickass.telemetry")
BATCH = 200
_SAMPLE_COLUMNS = (
    "advertised_rate_bps", "leading_fragment_len", "input_rate_bps", "output_rate_bps",
    "queue_bytes", "queue_packets", "marking_mode", "rtt_ms", "drops", "fragmented",
    "mode_switches",
)  # fmt: skip


def _ts(value: Any) -> datetime:
    if isinstance(value, int | float):
        return datetime.fromtimestamp(float(value), UTC)
    return datetime.now(UTC)


class TelemetryIngest(StoreBase):
    """Feed it lines; it keeps one router run's rows flowing into the database."""

    def __init__(self, database_url: str | None = None, run_name: str | None = None) -> None:
        super().__init__(database_url)
        self.run_name = run_name
        self.run_id: int | None = None
        self.pending: list[dict[str, Any]] = []
        self.counts = {"samples": 0, "malformed": 0, "written": 0}

    def _create_run(self, meta: dict[str, Any]) -> None:
        options = meta.get("options") or {}
        router = options.get("router") or {}
        kind = str(router.get("kind", "kickass")).lower()
        values = {
            "run_name": self.run_name,
            "router_kind": "droptail" if "droptail" in kind else "kickass",
            "capacity_bps": router.get("capacity_bps"),
            "program_version": meta.get("program_version"),
            "options": options,
            "started_at": _ts(meta.get("started_unix")),
        }
        self.run_id = self.run(
            lambda conn: conn.execute(
                insert(RouterRunRow).returning(RouterRunRow.id), values
            ).scalar()
        )

    def feed_line(self, line: str) -> None:
        line = line.strip()
        if not line:
            return
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError("not an object")
        except ValueError:
            self.counts["malformed"] += 1
            return
        kind = rec.get("type", "sample")
        if kind == "metadata":
            self.flush()
            self._create_run(rec)
        elif kind == "exit":
            self.flush()
            self._finish(rec)
        elif kind == "sample":
            try:
                row = {
                    "t": float(rec["t"]),
                    "recorded_at": _ts(rec.get("ts")),
                    **{c: rec.get(c) for c in _SAMPLE_COLUMNS},
                }
                # Lines written before the rename call it "mode".
                if row["marking_mode"] is None:
                    row["marking_mode"] = rec.get("mode")
                if row["marking_mode"] not in MARKING_MODES:
                    raise ValueError(f"marking_mode {row['marking_mode']!r}")
                for required in (
                    "advertised_rate_bps",
                    "input_rate_bps",
                    "queue_bytes",
                    "drops",
                    "fragmented",
                ):
                    if row[required] is None:
                        raise ValueError(f"missing {required}")
            except (KeyError, TypeError, ValueError):
                self.counts["malformed"] += 1
                return
            row["extra"] = {
                k: v for k, v in rec.items() if k not in row and k not in ("type", "mode")
            }
            self.pending.append(row)
            self.counts["samples"] += 1
            if len(self.pending) >= BATCH:
                self.flush()
        else:
            self.counts["malformed"] += 1

    def flush(self, policy: RetryPolicy = FLUSH_POLICY) -> None:
        if not self.pending:
            return
        if self.run_id is None:
            # No metadata line (a truncated capture): still keep the samples.
            self._create_run({"options": {}})
        rows = [{**r, "run_id": self.run_id} for r in self.pending]
        stmt = pg_insert(RouterTelemetryRow).on_conflict_do_nothing()
        try:
            retry(
                lambda: self.run(lambda conn: conn.execute(stmt, rows)),
                policy,
                what="router telemetry write",
            )
        except DatabaseUnavailable as exc:
            raise KickassError(
                f"cannot write {len(rows)} router telemetry samples: {exc.message}",
                hint="the NDJSON file still holds them: re-run `kickass telemetry ingest FILE`",
            ) from exc
        self.counts["written"] += len(rows)
        self.pending.clear()

    def _finish(self, rec: dict[str, Any]) -> None:
        if self.run_id is None:
            return
        stmt = (
            update(RouterRunRow)
            .where(RouterRunRow.id == self.run_id)
            .values(
                finished_at=_ts(rec.get("ts")),
                exit_reason=rec.get("reason"),
                counters=rec.get("counters"),
            )
        )
        self.run(lambda conn: conn.execute(stmt))

    def feed(self, lines: Iterable[str], tee: TextIO | None = None) -> dict[str, Any]:
        for line in lines:
            if tee is not None:
                tee.write(line)
                tee.flush()
            self.feed_line(line)
        self.flush()
        return {"run_id": self.run_id, **self.counts}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "telemetry",
        help="store ka-router telemetry (NDJSON) in PostgreSQL",
        description="Read ka-router's NDJSON telemetry from a file or a pipe and store it in "
        "router_runs / router_telemetry (view v_router_telemetry). Example: "
        "ka-router --lan l0 --wan w0 --capacity 10mbit | kickass telemetry ingest - --tee",
    )
    s = p.add_subparsers(dest="telemetry_command", metavar="ACTION", required=True)
    ing = s.add_parser("ingest", help="ingest one router run's telemetry")
    ing.add_argument("source", help="NDJSON file, or - for standard input")
    ing.add_argument("--run-name", help="a label for this run (e.g. the trial id)")
    ing.add_argument("--database-url", help="postgresql:// URL (env KICKASS_DATABASE_URL)")
    ing.add_argument("--tee", action="store_true", help="copy every line to stdout")
    ing.add_argument("--json", action="store_true", help="print a JSON summary at the end")
    ing.set_defaults(func=_run_ingest)


def _run_ingest(args: argparse.Namespace) -> int:
    ingest = TelemetryIngest(args.database_url, args.run_name)
    db.check_connection(ingest.engine)
    if args.source == "-":
        summary = ingest.feed(sys.stdin, tee=sys.stdout if args.tee else None)
    else:
        try:
            with open(args.source, encoding="utf-8") as fp:
                summary = ingest.feed(fp, tee=sys.stdout if args.tee else None)
        except FileNotFoundError:
            raise KickassError(f"no such telemetry file: {args.source}") from None
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"run {summary['run_id']}: {summary['written']} samples stored, "
            f"{summary['malformed']} malformed lines skipped",
            file=sys.stderr,
        )
    return 0
