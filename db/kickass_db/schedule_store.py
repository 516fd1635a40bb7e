"""Claims and records of scheduled work (``item_runs``, migration 0011).

Exactly once across hosts, without lock files: a run is claimed by inserting
its (item, due time) row; ``ON CONFLICT DO NOTHING`` lets exactly one of any
number of concurrent claimers win. While it runs, its host refreshes the
heartbeat; hosts that reach the database directly also hold a session-level
advisory lock on the run's id on their claiming connection, so a run whose
process died (SIGKILL, a crash) is seen dead at once by the next claimer
(the lock is free), and one whose host went silent once its heartbeat is
older than the stale limit. A dead run is taken over in place: its attempt
is incremented and the dead attempt kept in ``history``, with why.

The stale limit is the schedule's (its heartbeat policy), passed by whoever
holds the schedule: a database host's own file, or the server's for the
runner hosts that claim through it, never a claimer's word about someone
else's run. A claim names who may run the item (``owners``): a host not
among them is refused, as is a due time in the future; a refused claim
stores no run, only a count in ``claim_refusals`` (``ClaimRefused``).

Used by ``kickass_operations`` (hosts with database access) and by the
server's schedule API (trial runner hosts, which hold only a runner token).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

from kickass_core.claims import Claim
from kickass_core.errors import KickassError
from sqlalchemy import Connection, text
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.pool import NullPool

from . import partitions
from .engine import describe_url
from .models.operations import CLAIM_REFUSALS
from .retry import DatabaseUnavailable, unavailable
from .tx import StoreBase

# A run not heard of for this long is dead (the heartbeat comes every
# HEARTBEAT_S): four heartbeats, the schedule file's default
# (kickass_operations.schedule_file.STALE_FACTOR), so a busy host is not
# robbed of its run.
HEARTBEAT_S = 10.0
STALE_S = 40.0
# A due time further ahead than this of the database's clock is not due
# (hosts' clocks are NTP-synchronised: the signed API allows as much skew).
FUTURE_S = 120.0
# Advisory lock namespace of scheduled runs (the first key of the pair).
LOCK_NAMESPACE = 0x4B41
# A refusal's message is kept this long at most.
MESSAGE_CHARS = 500


class ClaimRefused(KickassError):
    """A claim the schedule does not allow: nothing is stored but its count.
    ``reason`` is one of ``CLAIM_REFUSALS``."""

    def __init__(self, reason: str, message: str, hint: str | None = None) -> None:
        assert reason in CLAIM_REFUSALS, reason
        super().__init__(message, hint)
        self.reason = reason


class _NotDue(Exception):
    """Raised inside a claim's transaction (rolled back) for a due time ahead."""


def host_id() -> str:
    """This process's host name (what ``item_runs.host`` says)."""
    return os.environ.get("KICKASS_HOST_ID") or socket.gethostname()


class ScheduleStore(StoreBase):
    """``item_runs`` through one transaction per call; ``hold`` keeps the
    advisory locks of this process's runs on a connection of its own."""

    def __init__(self, database_url: str | None = None) -> None:
        # No pool: a scheduler process makes a few short calls a minute, and
        # fifty of them started together must not each keep connections open
        # (the database's connection limit is shared with the work itself).
        # The lock holder below is the one connection kept while a run lasts.
        super().__init__(database_url, poolclass=NullPool)
        self._holder: Connection | None = None
        self._held: set[int] = set()
        self._relock: set[int] = set()

    def close(self) -> None:
        if self._holder is not None:
            self._holder.close()
            self._holder = None
        super().close()

    # -- claims ------------------------------------------------------------------------

    def claim(
        self,
        item: str,
        kind: str,
        due_at: datetime,
        host: str,
        definition_hash: str | None = None,
        *,
        stale_s: float = STALE_S,
        lock: bool = True,
        owners: Sequence[str] | None = None,
    ) -> Claim | None:
        """The run of ``item`` at ``due_at`` for this host, or None (another
        host has it, alive, or it is over). A dead run (one not heard of for
        ``stale_s``, the schedule's limit, or whose lock is free) is taken
        over. ``owners``: the hosts the schedule lets run the item (None:
        any); ClaimRefused, counted, for another host or a due time in the
        future."""
        if owners is not None and host not in owners:
            self.refuse(
                host, item, "not-owner",
                f"{item} is run by {', '.join(sorted(owners))}, not by {host}",
            )  # fmt: skip

        def work(conn: Connection) -> tuple[Claim | None, bool]:
            ahead = conn.execute(
                text("SELECT CAST(:due AS timestamptz) - now() > make_interval(secs => :s)"),
                {"due": due_at, "s": FUTURE_S},
            ).scalar()
            if ahead:
                raise _NotDue
            row = conn.execute(
                text(
                    "INSERT INTO item_runs (item, kind, due_at, host, definition_hash) "
                    "VALUES (:item, :kind, :due, :host, :hash) "
                    "ON CONFLICT (item, due_at) DO NOTHING RETURNING id, attempt"
                ),
                {"item": item, "kind": kind, "due": due_at, "host": host, "hash": definition_hash},
            ).first()
            if row is not None:
                return Claim(int(row[0]), item, due_at, int(row[1])), True
            # Taken: alive, over, or dead?
            existing = conn.execute(
                text(
                    "SELECT id, host, attempt, outcome, claimed_at, heartbeat_at, "
                    "now() - heartbeat_at > make_interval(secs => :stale) AS stale "
                    "FROM item_runs WHERE item = :item AND due_at = :due FOR UPDATE SKIP LOCKED"
                ),
                {"item": item, "due": due_at, "stale": stale_s},
            ).first()
            if existing is None or existing.outcome != "running":
                return None, False
            dead_why = None
            if existing.stale:
                dead_why = f"no heartbeat for more than {stale_s:g} s (host {existing.host})"
            elif self._lock_free(conn, int(existing.id)):
                dead_why = f"its process on {existing.host} is gone (its lock is free)"
            if dead_why is None:
                return None, False
            previous = {
                "attempt": existing.attempt,
                "host": existing.host,
                "claimed_at": existing.claimed_at.isoformat(),
                "heartbeat_at": existing.heartbeat_at.isoformat(),
                "outcome": "killed",
                "reason": dead_why,
            }
            taken = conn.execute(
                text(
                    "UPDATE item_runs SET attempt = attempt + 1, host = :host, "
                    "claimed_at = now(), heartbeat_at = now(), definition_hash = :hash, "
                    # The dead attempt's lock mark goes: the new one sets its own once
                    # it holds the lock (until then only the heartbeat tells).
                    "counts = counts - '_locked', "
                    "history = history || CAST(:prev AS jsonb) "
                    "WHERE id = :id AND outcome = 'running' RETURNING attempt"
                ),
                {
                    "host": host,
                    "hash": definition_hash,
                    "prev": json.dumps([previous]),
                    "id": existing.id,
                },  # fmt: skip
            ).first()
            if taken is None:
                return None, False
            return Claim(int(existing.id), item, due_at, int(taken[0]), previous), True

        try:
            claim, won = self.run(work)
        except _NotDue:
            self.refuse(host, item, "not-due", f"{item} due {due_at.isoformat()} is not due yet")
        if claim is not None and won and lock:
            self._lock(claim.run_id)
        return claim

    def refuse(self, host: str, item: str, reason: str, message: str) -> NoReturn:
        """Count a refused claim (``item``: '' for a name the schedule does not
        have) and raise ClaimRefused with ``message``."""
        self.count_refusal(host, item, reason, message)
        raise ClaimRefused(reason, message)

    def count_refusal(self, host: str, item: str, reason: str, message: str) -> None:
        if reason not in CLAIM_REFUSALS:
            raise ValueError(f"not a refusal reason: {reason!r}")
        self.run(
            lambda c: c.execute(
                text(
                    "INSERT INTO claim_refusals (host, item, reason, refusals, last_message) "
                    "VALUES (:host, :item, :reason, 1, :message) "
                    "ON CONFLICT (host, item, reason) DO UPDATE SET "
                    "refusals = claim_refusals.refusals + 1, last_at = now(), "
                    "last_message = EXCLUDED.last_message"
                ),
                {"host": host, "item": item, "reason": reason, "message": message[:MESSAGE_CHARS]},
            )
        )

    def refusals(self, items: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Refused claims per host, item and reason (``items``: only these and
        the names no schedule has, '')."""
        return self.run(
            lambda c: [
                dict(r)
                for r in c.execute(
                    text(
                        "SELECT host, item, reason, refusals, first_at, last_at, last_message "
                        "FROM claim_refusals WHERE CAST(:all AS boolean) OR item = ANY(:items) "
                        "ORDER BY last_at DESC"
                    ),
                    {"all": items is None, "items": [*(items or []), ""]},
                ).mappings()
            ]
        )

    def reap(
        self, current: Mapping[str, datetime], *, stale_s: float = STALE_S
    ) -> list[dict[str, Any]]:
        """Runs of these items due before their ``current`` due time, still
        marked running, whose host died: nobody will take them over any more
        (their due time has passed on), so they are closed as ``failed``,
        with why. One query over the running runs (a partial index)."""
        if not current:
            return []

        def work(conn: Connection) -> list[dict[str, Any]]:
            rows = conn.execute(
                text(
                    "SELECT id, item, kind, host, attempt, due_at, heartbeat_at, history, "
                    "now() - heartbeat_at > make_interval(secs => :stale) AS stale "
                    "FROM item_runs WHERE outcome = 'running' AND item = ANY(:items) "
                    "FOR UPDATE SKIP LOCKED"
                ),
                {"items": list(current), "stale": stale_s},
            ).all()
            out = []
            for r in rows:
                if r.due_at >= current[r.item]:
                    continue  # the current run: claim() takes it over if dead
                if r.stale:
                    why = f"no heartbeat for more than {stale_s:g} s (host {r.host})"
                elif self._lock_free(conn, int(r.id)):
                    why = f"its process on {r.host} is gone (its lock is free)"
                else:
                    continue
                reason = f"killed: {why}; its next due time came before anyone took it over"
                conn.execute(
                    text(
                        "UPDATE item_runs SET outcome = 'failed', reason = :reason, "
                        "finished_at = now(), counts = counts - '_locked' WHERE id = :id"
                    ),
                    {"reason": reason, "id": r.id},
                )
                if r.kind == "trials":
                    dead = {int(h["attempt"]): h["heartbeat_at"] for h in r.history or []}
                    dead[int(r.attempt)] = r.heartbeat_at
                    _close_dead_trials(conn, int(r.id), dead)
                out.append(
                    {"item": r.item, "run_id": int(r.id), "due_at": r.due_at,
                     "host": r.host, "attempt": int(r.attempt), "reason": reason}
                )  # fmt: skip
            return out

        return self.run(work)

    # -- exports: what is published, and by which attempt ----------------------------------

    def export_since(
        self, item: str, due_at: datetime
    ) -> tuple[datetime | None, dict[str, datetime]]:
        """Where the export of ``item`` due at ``due_at`` starts: the upper
        bound of its newest ``ok`` run before then, and per view the newest
        window any run before then published (a run that died half-way, then
        reaped, published some of its views: those go on from there, so no
        window overlaps another)."""

        def work(conn: Connection) -> tuple[datetime | None, dict[str, datetime]]:
            until = conn.execute(
                text(
                    "SELECT CAST(counts->>'until' AS timestamptz) FROM item_runs "
                    "WHERE item = :item AND outcome = 'ok' AND due_at < :due "
                    "ORDER BY due_at DESC LIMIT 1"
                ),
                {"item": item, "due": due_at},
            ).scalar()
            published = conn.execute(
                text(
                    "SELECT p.key, max(CAST(p.value AS timestamptz)) FROM item_runs r "
                    "CROSS JOIN LATERAL jsonb_each_text(CASE WHEN jsonb_typeof("
                    "r.counts->'published') = 'object' THEN r.counts->'published' "
                    "ELSE '{}'::jsonb END) AS p "
                    "WHERE r.item = :item AND r.due_at < :due GROUP BY p.key"
                ),
                {"item": item, "due": due_at},
            ).all()
            return until, {str(k): v for k, v in published}

        return self.run(work)

    def mark_published(self, run_id: int, attempt: int, view: str, until: datetime) -> bool:
        """Note in the run's counts, at once, that ``view`` is published up to
        ``until`` (the run may yet die: its windows are not exported again)."""
        return self.run(
            lambda c: (
                c.execute(
                    text(
                        "UPDATE item_runs SET counts = jsonb_set(counts, '{published}', "
                        "CASE WHEN jsonb_typeof(counts->'published') = 'object' "
                        "THEN counts->'published' ELSE '{}'::jsonb END "
                        "|| jsonb_build_object(CAST(:view AS text), CAST(:until AS text))) "
                        "WHERE id = :id AND attempt = :attempt AND outcome = 'running'"
                    ),
                    {"id": run_id, "attempt": attempt, "view": view, "until": until.isoformat()},
                ).rowcount
                > 0
            )
        )

    def running_attempts(self, run_ids: Sequence[int]) -> dict[int, int]:
        """Run id -> its live attempt, for the runs among ``run_ids`` still running."""
        if not run_ids:
            return {}
        return self.run(
            lambda c: {
                int(r.id): int(r.attempt)
                for r in c.execute(
                    text(
                        "SELECT id, attempt FROM item_runs "
                        "WHERE id = ANY(:ids) AND outcome = 'running'"
                    ),
                    {"ids": list(run_ids)},
                )
            }
        )

    def _lock_free(self, conn: Connection, run_id: int) -> bool:
        """Whether a run's advisory lock is free (its holder's session ended).
        Only for runs of hosts that lock (a trial runner host does not: its
        claims come through the server, and only the heartbeat tells)."""
        got = conn.execute(
            text("SELECT pg_try_advisory_xact_lock(:ns, :id)"),
            {"ns": LOCK_NAMESPACE, "id": run_id},
        ).scalar()
        if not got:
            return False
        # Free now: but was it ever held? Runs claimed without a lock (through
        # the server) have a lock nobody takes; those die by the heartbeat.
        locked = conn.execute(
            text("SELECT counts ? '_locked' FROM item_runs WHERE id = :id"), {"id": run_id}
        ).scalar()
        return bool(locked)

    def _holder_conn(self) -> Connection:
        """The connection holding this process's locks; a new one if the
        database restarted under it (its locks went with it: re-taken by the
        next heartbeat)."""
        if self._holder is not None:
            try:
                self._holder.execute(text("SELECT 1"))
            except (OperationalError, InterfaceError):
                self._holder.invalidate()
                self._holder.close()
                self._holder = None
        if self._holder is None:
            try:
                self._holder = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
            except (OperationalError, InterfaceError) as exc:
                raise unavailable(describe_url(self.database_url), exc) from exc
            # A fresh session holds nothing yet.
            self._relock = set(self._held)
        return self._holder

    def _lock(self, run_id: int) -> None:
        conn = self._holder_conn()
        conn.execute(
            text("SELECT pg_advisory_lock(:ns, :id)"), {"ns": LOCK_NAMESPACE, "id": run_id}
        )
        self._held.add(run_id)
        self.run(
            lambda c: c.execute(
                text(
                    "UPDATE item_runs SET counts = counts || '{\"_locked\": true}' WHERE id = :id"
                ),
                {"id": run_id},
            )
        )

    def _unlock(self, run_id: int) -> None:
        self._held.discard(run_id)
        if self._holder is None:
            return
        # If the session is gone, its locks went with it.
        with contextlib.suppress(OperationalError, InterfaceError):
            self._holder.execute(
                text("SELECT pg_advisory_unlock(:ns, :id)"), {"ns": LOCK_NAMESPACE, "id": run_id}
            )

    def _keep_lock(self, run_id: int) -> None:
        """After a database restart, the lock of a run still ours is taken again."""
        if run_id not in self._held:
            return
        try:
            conn = self._holder_conn()
            if run_id in self._relock:
                conn.execute(
                    text("SELECT pg_try_advisory_lock(:ns, :id)"),
                    {"ns": LOCK_NAMESPACE, "id": run_id},
                )
                self._relock.discard(run_id)
        except DatabaseUnavailable:
            pass  # the heartbeat itself says whether the database is back

    # -- a run's life ------------------------------------------------------------------------

    def heartbeat(self, run_id: int, host: str) -> bool:
        """Still alive; False if the run is no longer ours (taken over)."""
        ours = self.run(
            lambda c: (
                c.execute(
                    text(
                        "UPDATE item_runs SET heartbeat_at = now() "
                        "WHERE id = :id AND host = :host AND outcome = 'running'"
                    ),
                    {"id": run_id, "host": host},
                ).rowcount
                > 0
            )
        )
        if ours:
            self._keep_lock(run_id)
        return ours

    def finish(
        self,
        run_id: int,
        host: str,
        outcome: str,
        reason: str | None = None,
        counts: dict[str, Any] | None = None,
    ) -> bool:
        """Record the outcome; False if the run is no longer ours. A trial
        round that took over dead attempts closes their trials (see
        ``_close_dead_trials``)."""

        def work(c: Connection) -> bool:
            row = c.execute(
                text(
                    "UPDATE item_runs SET outcome = :outcome, reason = :reason, "
                    "counts = (counts - '_locked') || CAST(:counts AS jsonb), "
                    "finished_at = now(), heartbeat_at = now() "
                    "WHERE id = :id AND host = :host AND outcome = 'running' "
                    "RETURNING kind, history"
                ),
                {
                    "id": run_id,
                    "host": host,
                    "outcome": outcome,
                    "reason": reason,
                    "counts": json.dumps(counts or {}),
                },  # fmt: skip
            ).first()
            if row is None:
                return False
            if row.kind == "trials":
                dead = {int(h["attempt"]): h["heartbeat_at"] for h in row.history or []}
                _close_dead_trials(c, run_id, dead)
            return True

        done = self.run(work)
        self._unlock(run_id)
        return done

    # -- reads ----------------------------------------------------------------------------

    def existing(self, keys: Sequence[tuple[str, datetime]]) -> dict[tuple[str, datetime], str]:
        """The outcome of each (item, due) that has a row (one query)."""
        if not keys:
            return {}

        def work(conn: Connection) -> dict[tuple[str, datetime], str]:
            rows = conn.execute(
                text(
                    "SELECT r.item, r.due_at, r.outcome FROM item_runs r "
                    "JOIN unnest(CAST(:items AS text[]), CAST(:dues AS timestamptz[])) "
                    "AS k(item, due_at) ON r.item = k.item AND r.due_at = k.due_at"
                ),
                {"items": [k[0] for k in keys], "dues": [k[1] for k in keys]},
            )
            return {(r.item, r.due_at): r.outcome for r in rows}

        return self.run(work)

    def last_runs(self, items: Sequence[str], per_item: int = 1) -> dict[str, list[dict[str, Any]]]:
        """The newest runs of each item."""

        def work(conn: Connection) -> dict[str, list[dict[str, Any]]]:
            rows = conn.execute(
                text(
                    "SELECT * FROM (SELECT r.*, row_number() OVER "
                    "(PARTITION BY item ORDER BY due_at DESC) AS n FROM item_runs r "
                    "WHERE item = ANY(:items)) x WHERE n <= :k ORDER BY item, due_at DESC"
                ),
                {"items": list(items), "k": per_item},
            ).mappings()
            out: dict[str, list[dict[str, Any]]] = {}
            for r in rows:
                out.setdefault(r["item"], []).append(dict(r))
            return out

        return self.run(work)

    def failures(self, items: Sequence[str], limit: int = 20) -> list[dict[str, Any]]:
        return self.run(
            lambda c: [
                dict(r)
                for r in c.execute(
                    text(
                        "SELECT item, due_at, host, attempt, outcome, reason, finished_at "
                        "FROM item_runs WHERE item = ANY(:items) AND outcome IN "
                        "('failed', 'timeout') ORDER BY finished_at DESC NULLS LAST LIMIT :n"
                    ),
                    {"items": list(items), "n": limit},
                ).mappings()
            ]
        )

    def counts_since(self, items: Sequence[str], since: datetime) -> list[dict[str, Any]]:
        """Counts of the runs of ``items`` finished since ``since``."""
        return self.run(
            lambda c: [
                dict(r)
                for r in c.execute(
                    text(
                        "SELECT item, kind, outcome, counts FROM item_runs "
                        "WHERE item = ANY(:items) AND finished_at >= :since"
                    ),
                    {"items": list(items), "since": since},
                ).mappings()
            ]
        )

    def flows_per_destination(self, since: datetime) -> dict[str, int]:
        """Flows stored per agent (trial destination) that started since ``since``."""
        return self.run(
            lambda c: {
                r.destination: int(r.n)
                for r in c.execute(
                    text(
                        "SELECT t.destination, count(*) AS n FROM flows f "
                        "JOIN trials t ON t.id = f.trial_pk WHERE f.started_at >= :since "
                        "GROUP BY t.destination ORDER BY t.destination"
                    ),
                    {"since": since},
                )
            }
        )

    def partitions_ahead(self) -> dict[str, int]:
        """Per raw table partitioned by day (migration 0022), how many days
        after today have a partition (``kickass schedule status`` warns)."""
        return self.run(partitions.ahead)

    def outcome_counts(self, items: Sequence[str] | None) -> list[dict[str, Any]]:
        """Runs per item (None: every item), kind and outcome, with the newest
        finish of each."""
        return self.run(
            lambda c: [
                dict(r)
                for r in c.execute(
                    text(
                        "SELECT item, kind, outcome, count(*) AS runs, "
                        "max(finished_at) AS last_finished FROM item_runs "
                        "WHERE CAST(:all AS boolean) OR item = ANY(:items) "
                        "GROUP BY item, kind, outcome"
                    ),
                    {"all": items is None, "items": list(items or [])},
                ).mappings()
            ]
        )

    @contextlib.contextmanager
    def exclusive(self, name: str) -> Iterator[bool]:
        """Whether this process got the lock named ``name`` (held by one process
        at a time across hosts, a session advisory lock, until the block
        ends): for work that must not overlap itself, like refreshing the
        rollups, which two runs at once would fail on each other's rows. Not
        waited for: a loser is told at once and holds no connection."""
        key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") & 0x7FFFFFFF
        args = {"ns": LOCK_NAMESPACE + 1, "k": key}
        try:
            conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        except (OperationalError, InterfaceError) as exc:
            raise unavailable(describe_url(self.database_url), exc) from exc
        try:
            got = bool(conn.execute(text("SELECT pg_try_advisory_lock(:ns, :k)"), args).scalar())
            if not got:
                conn.close()
                yield False
                return
            try:
                yield True
            finally:
                with contextlib.suppress(OperationalError, InterfaceError):
                    conn.execute(text("SELECT pg_advisory_unlock(:ns, :k)"), args)
        finally:
            conn.close()


def _close_dead_trials(conn: Connection, run_id: int, dead: Mapping[int, Any]) -> None:
    """Close the trials of a scheduled round's dead attempts (attempt -> its
    last heartbeat): each trial still open gets that heartbeat as its
    ``finished_at`` (it measured nothing after), and the run's counts list
    them as ``interrupted_trials``. Their flows stay as measured, each once.
    A trial whose record is still in a spool when this runs stays open."""
    closed: list[str] = []
    for attempt, last_heard in sorted(dead.items()):
        scheduled = json.dumps({"scheduled": {"run_id": run_id, "attempt": attempt}})
        closed += (
            conn.execute(
                text(
                    "UPDATE trials SET finished_at = CAST(:at AS timestamptz) "
                    "WHERE finished_at IS NULL AND parameters @> CAST(:scheduled AS jsonb) "
                    "RETURNING trial_id"
                ),
                {"at": last_heard, "scheduled": scheduled},
            )
            .scalars()
            .all()
        )
    if closed:
        conn.execute(
            text(
                "UPDATE item_runs SET counts = counts || jsonb_build_object("
                "'interrupted_trials', CAST(:ids AS jsonb)) WHERE id = :id"
            ),
            {"ids": json.dumps(sorted(closed)), "id": run_id},
        )
