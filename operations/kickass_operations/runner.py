"""``kickass schedule run``: do what is due, once across hosts, then exit.

For each enabled item of the schedule this host may run, the latest due time
whose slip has passed is looked up in ``item_runs`` (one query for all); an
item not yet run for it is claimed (``Claims``: the database, or the server's
API on a trial runner host), carried out in a child process, heartbeated
while it runs, and finished with its outcome, reason and counts. Items are
tried in an order shuffled per host and run, so hosts started together
spread the work instead of queueing on the same claim.

The child process (``multiprocessing``'s spawn: a clean interpreter, no
inherited connections or threads) dies with its parent (PR_SET_PDEATHSIG),
so a run killed with SIGKILL leaves no orphan working on: the next
``schedule run`` finds the run dead and takes it over.

A claim the schedule does not allow (an item this host may not run, a due
time not due: the server's schedule and this host's disagree, or the clocks
do) is logged ``refused`` and counted (``kickass schedule status``); the
other items go on.

Exit codes (for cron mail and monitors): 0 every due item ok or skipped (or
nothing due), 1 an item failed or timed out, or a claim was refused, 2 a bad
schedule file or usage, 3 the claim backend (database or server)
unreachable: nothing could be claimed, the items wait for the next run.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import multiprocessing
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO, Any

from kickass_core.claims import Claim
from kickass_core.errors import KickassError

from . import items as kinds
from .claims import ClaimRefused, Claims
from .schedule_file import Item, Schedule, database_kinds

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3

# After the timeout (or SIGTERM), how long the child gets to stop before SIGKILL.
GRACE_S = 10.0
# How long the outcome of a finished run is retried while the database (or
# the server) is down; past this the run stays ``running`` and the next
# ``schedule run`` takes it over (every kind's work is safe to redo).
FINISH_RETRY_S = 120.0
PR_SET_PDEATHSIG = 1


class EventLog:
    """Structured log: one JSON object per line. When the lines go to a file,
    failures are also printed to stderr as ``ERROR:`` lines, so cron mails
    only what needs a person."""

    def __init__(
        self,
        stream: IO[str],
        *,
        schedule: str,
        host: str,
        errors_to_stderr: bool = False,
    ) -> None:
        self.stream = stream
        self.base = {"schedule": schedule, "host": host}
        self.errors_to_stderr = errors_to_stderr
        self._lock = threading.Lock()

    def __call__(self, event: str, **fields: Any) -> None:
        line = {"time": datetime.now(UTC).isoformat(timespec="milliseconds"), "event": event}
        line.update(self.base)
        line.update({k: v for k, v in fields.items() if v is not None})
        text = json.dumps(line, default=_jsonable, separators=(",", ":"))
        with self._lock:
            self.stream.write(text + "\n")
            self.stream.flush()
        if self.errors_to_stderr and (
            fields.get("outcome") in (kinds.FAILED, kinds.TIMEOUT) or event == "refused"
        ):
            print(
                f"ERROR: {fields.get('item')} (due {fields.get('due_at')}) "
                f"{fields.get('outcome', event)}: {fields.get('reason')}",
                file=sys.stderr,
            )


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Path):
        return str(value)
    return str(value)


@dataclass
class RunSummary:
    due: int = 0
    ran: list[dict[str, Any]] = field(default_factory=list)
    refused: list[dict[str, Any]] = field(default_factory=list)
    unreachable: str | None = None

    @property
    def exit_code(self) -> int:
        if self.unreachable is not None:
            return EXIT_UNREACHABLE
        if self.refused or any(r["outcome"] in (kinds.FAILED, kinds.TIMEOUT) for r in self.ran):
            return EXIT_FAILED
        return EXIT_OK

    def to_json(self) -> dict[str, Any]:
        return {
            "due": self.due,
            "ran": self.ran,
            "refused": self.refused,
            "unreachable": self.unreachable,
            "exit_code": self.exit_code,
        }


class Runner:
    def __init__(
        self,
        schedule: Schedule,
        base_dir: Path,
        claims: Claims,
        log: EventLog,
        *,
        database_url: str | None = None,
        only: list[str] | None = None,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.schedule = schedule
        self.base_dir = base_dir
        self.claims = claims
        self.log = log
        self.database_url = database_url
        self.only = set(only) if only else None
        self.now = now
        # Set by SIGTERM/SIGINT: the child is asked to stop, the run recorded.
        self.stop = threading.Event()
        self.has_database = not getattr(claims, "api", False)

    def mine(self, item: Item) -> bool:
        if not item.enabled or (self.only is not None and item.name not in self.only):
            return False
        if item.host is not None and item.host != self.claims.host:
            return False
        # A kind this host does not know (a study source whose package is not
        # installed here) is left to the hosts that know it; a host that
        # claims through the server has no database for the database kinds.
        if not item.known:
            return False
        return self.has_database or item.kind not in database_kinds()

    def due(self) -> list[tuple[Item, datetime]]:
        now = self.now()
        out = []
        for item in self.schedule.item:
            if not self.mine(item):
                continue
            due = item.due_now(now)
            if due is not None:
                out.append((item, due))
        return out

    def run_once(self) -> RunSummary:
        summary = RunSummary()
        try:
            candidates = self.due()
            existing = self.claims.existing([(i.name, d) for i, d in candidates])
            # Not run yet, or running: a running one may be dead (claim() tells).
            todo = [(i, d) for i, d in candidates if existing.get((i.name, d)) in (None, "running")]
            summary.due = len(todo)
            for r in self.claims.reap({i.name: d for i, d in candidates}):
                self.log("reaped", **r)
            rng = random.Random(f"{self.claims.host}|{time.time_ns()}")
            rng.shuffle(todo)
            for item, due in todo:
                if self.stop.is_set():
                    break
                try:
                    claim = self.claims.claim(item, due)
                except ClaimRefused as exc:
                    refused = {"item": item.name, "due_at": due, "refusal": exc.reason,
                               "reason": exc.message}  # fmt: skip
                    self.log("refused", **refused)
                    summary.refused.append(refused)
                    continue
                if claim is None:
                    continue
                late = (self.now() - (due + item.slip(due))).total_seconds()
                if late > item.late_s and claim.took_over is None:
                    summary.ran.append(self.too_late(item, claim, late))
                    continue
                summary.ran.append(self.carry_out(item, claim))
        except KickassError as exc:
            if not _unreachable(exc):
                raise
            summary.unreachable = exc.message
            self.log("unreachable", reason=exc.message)
        return summary

    # -- one claimed run --------------------------------------------------------------------

    def carry_out(self, item: Item, claim: Claim) -> dict[str, Any]:
        settings = self.schedule.schedule
        base = {"item": item.name, "kind": item.kind, "due_at": claim.due_at,
                "run_id": claim.run_id, "attempt": claim.attempt}  # fmt: skip
        if claim.took_over:
            self.log("took-over", **base, previous=claim.took_over)
        else:
            self.log("claimed", **base)
        payload = {
            "item": item.model_dump(mode="json"),
            "base_dir": str(self.base_dir),
            "database_url": self.database_url,
            "host": self.claims.host,
            "due_at": claim.due_at.isoformat(),
            "run_id": claim.run_id,
            "attempt": claim.attempt,
            "took_over": claim.took_over,
            "parent_pid": os.getpid(),
        }
        t0 = time.monotonic()
        result = self._in_child(item, claim, payload, settings.heartbeat_s)
        duration = round(time.monotonic() - t0, 3)
        counts = dict(result.counts)
        counts["duration_s"] = duration
        recorded = self._finish(claim, result, counts)
        self.log(
            "finished",
            **base,
            outcome=result.outcome,
            reason=result.reason,
            counts=counts,
            duration_s=duration,
            recorded=recorded,
        )
        return {**base, "outcome": result.outcome, "reason": result.reason,
                "duration_s": duration, "recorded": recorded}  # fmt: skip

    def too_late(self, item: Item, claim: Claim, late_s: float) -> dict[str, Any]:
        """A due time nobody started in time: recorded, not run hours late."""
        reason = (
            f"too late: {late_s / 60:.0f} min after its time (late_s {item.late_s:g} s); "
            "no host ran the schedule then"
        )
        result = kinds.Result(kinds.SKIPPED, reason, {"late_s": round(late_s, 1)})
        recorded = self._finish(claim, result, result.counts)
        base = {"item": item.name, "kind": item.kind, "due_at": claim.due_at,
                "run_id": claim.run_id, "attempt": claim.attempt}  # fmt: skip
        self.log("finished", **base, outcome=result.outcome, reason=reason, recorded=recorded)
        return {**base, "outcome": result.outcome, "reason": reason, "duration_s": 0.0,
                "recorded": recorded}  # fmt: skip

    def _in_child(
        self, item: Item, claim: Claim, payload: dict[str, Any], heartbeat_s: float
    ) -> kinds.Result:
        ctx = multiprocessing.get_context("spawn")
        receive, send = ctx.Pipe(duplex=False)
        child = ctx.Process(
            target=child_main, args=(payload, send), name=f"kickass-item-{item.name}"
        )
        child.start()
        send.close()
        deadline = time.monotonic() + item.timeout_s
        next_beat = time.monotonic() + heartbeat_s
        result: kinds.Result | None = None
        ended_why: kinds.Result | None = None
        try:
            while result is None:
                now = time.monotonic()
                wait = max(0.0, min(next_beat, deadline) - now)
                if self.stop.is_set():
                    ended_why = kinds.Result(kinds.FAILED, "interrupted (SIGTERM/SIGINT)")
                    break
                try:
                    if receive.poll(min(wait, 0.5)):
                        kind, body = receive.recv()
                        if kind == "progress":
                            self.log("progress", item=item.name, run_id=claim.run_id, **body)
                        elif kind == "result":
                            result = kinds.Result(**body)
                        continue
                except (EOFError, OSError):
                    child.join(GRACE_S)
                    ended_why = kinds.Result(
                        kinds.FAILED,
                        f"the item's process ended without a result (exit {child.exitcode})",
                    )
                    break
                now = time.monotonic()
                if now >= deadline:
                    ended_why = kinds.Result(
                        kinds.TIMEOUT, f"still running after its timeout of {item.timeout_s:g} s"
                    )
                    break
                if now >= next_beat:
                    next_beat = now + heartbeat_s
                    if not self._heartbeat(claim):
                        ended_why = kinds.Result(
                            kinds.FAILED, "the run was taken over by another host (heartbeat lost)"
                        )
                        break
        finally:
            _end(child)
            receive.close()
        return result if result is not None else ended_why or kinds.Result(kinds.FAILED, "?")

    def _heartbeat(self, claim: Claim) -> bool:
        try:
            return self.claims.heartbeat(claim)
        except KickassError as exc:
            # The database or the server is down for a moment: the run goes
            # on (its outcome is retried at the end); only a claim that is
            # no longer ours stops it.
            self.log("heartbeat-failed", run_id=claim.run_id, reason=exc.message)
            return True

    def _finish(self, claim: Claim, result: kinds.Result, counts: dict[str, Any]) -> bool:
        start = time.monotonic()
        delay = 0.5
        while True:
            try:
                return self.claims.finish(claim, result.outcome, result.reason, counts)
            except KickassError as exc:
                if not _unreachable(exc) or time.monotonic() - start + delay > FINISH_RETRY_S:
                    self.log(
                        "finish-failed",
                        run_id=claim.run_id,
                        reason=exc.message,
                        note="left running: the next schedule run takes it over",
                    )
                    return False
                self.log("finish-retry", run_id=claim.run_id, reason=exc.message, in_s=delay)
                time.sleep(delay)
                delay = min(delay * 2, 10.0)


def _unreachable(exc: KickassError) -> bool:
    from_db = type(exc).__name__ == "DatabaseUnavailable"
    return from_db or "unreachable" in exc.message


def _end(child: multiprocessing.process.BaseProcess) -> None:
    """Stop the child if it still runs: SIGTERM (a trial round stops between
    periods, its results spooled), then SIGKILL after the grace time."""
    if child.is_alive():
        child.terminate()
        child.join(GRACE_S)
    if child.is_alive():
        child.kill()
        child.join()


# -- the child ---------------------------------------------------------------------------


def _die_with_parent(parent: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the prctl
        os._exit(1)


def child_main(payload: dict[str, Any], send: Connection) -> None:
    """One item's run, in its own process; its result goes back on ``send``."""
    _die_with_parent(int(payload.get("parent_pid") or os.getppid()))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides
    lock = threading.Lock()

    def progress(event: str, fields: dict[str, Any]) -> None:
        with lock, contextlib.suppress(OSError, ValueError):  # the parent is gone
            send.send(("progress", {"step": event, **fields}))

    item = Item.model_validate(payload["item"])
    ctx = kinds.Context(
        base_dir=Path(payload["base_dir"]),
        database_url=payload["database_url"],
        host=payload["host"],
        due_at=datetime.fromisoformat(payload["due_at"]),
        run_id=payload["run_id"],
        attempt=payload["attempt"],
        took_over=payload["took_over"],
        stop=stop,
        progress=progress,
    )
    try:
        result = kinds.execute(item, ctx)
    except Exception as exc:  # noqa: BLE001 - a bug in one item is that run's failure, not the host's
        result = kinds.Result(kinds.FAILED, f"{type(exc).__name__}: {exc}"[:2000])
    with lock:
        counts = json.loads(json.dumps(result.counts, default=_jsonable))
        body = {"outcome": result.outcome, "reason": result.reason, "counts": counts}
        send.send(("result", body))
    send.close()


# -- loop ---------------------------------------------------------------------------------


def loop(runner: Runner, interval_s: float, on_pass: Callable[[RunSummary], None]) -> int:
    """``schedule run --loop``: a pass at every ``interval_s`` boundary until
    SIGTERM/SIGINT (containers, where cron is absent)."""
    worst = EXIT_OK
    while not runner.stop.is_set():
        summary = runner.run_once()
        on_pass(summary)
        worst = max(worst, summary.exit_code) if summary.exit_code != EXIT_UNREACHABLE else worst
        wait = interval_s - (time.time() % interval_s)
        runner.stop.wait(wait)
    return worst


def install_stop_handlers(runner: Runner) -> None:
    def handler(signum: int, _frame: object) -> None:
        runner.log("stopping", signal=signal.Signals(signum).name)
        runner.stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
