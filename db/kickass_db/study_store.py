"""Persistence for probe sessions: the only code that writes the measurement tables.

Used from the probe engine's thread and from Flask request threads at once:
every method takes its own pooled connection and runs one short
transaction, so a StudyStore is safe to share. Results are read back through the
analysis views (db/migrations 0002), so the HTTP API shows exactly what the
dashboards and notebooks compute.

A database restart loses nothing: the pool tests connections before use
(``pool_pre_ping``), a call that meets a connection killed under it is
retried once on a fresh one, and while the database is really down calls
raise DatabaseUnavailable, which the caller may retry later — every write
here is idempotent, so re-sending a batch is always safe.
"""

from __future__ import annotations

import hmac
import logging
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, date, datetime, timedelta
from typing import Any, assert_never, cast

import psycopg
from kickass_core.errors import KickassError
from kickass_core.plan import PHASES
from kickass_core.states import FINAL_STATES, LIVE_STATES, OUTCOMES
from kickass_core.study_events import (
    Heartbeat,
    OutcomeBatch,
    RunFinished,
    RunProbing,
    StudyEvent,
)
from kickass_core.verdict import VERDICTS, decide, excess
from sqlalchemy import (
    Connection,
    Table,
    TextClause,
    bindparam,
    func,
    insert,
    literal_column,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import DBAPIError

from . import engine as db
from . import partitions
from .migrations import head_revision
from .models.study import SESSION_ID_PATTERN, ClientRow, SessionRow
from .retry import DatabaseUnavailable
from .tx import StoreBase

log = logging.getLogger("kickass.db")

_SESSION_ID_RE = re.compile(SESSION_ID_PATTERN.replace("$", r"\Z"))

ORPHAN_END_REASON = "server-restart"

# Declarative classes with a __tablename__ are mapped to a Table (typed as FromClause).
_clients = cast(Table, ClientRow.__table__)
_sessions = cast(Table, SessionRow.__table__)


class UnknownSession(KickassError):
    """The session id is not in the database."""


class SessionRetired(KickassError):
    """The session's raw rows are archived and retired, or being retired
    (migration 0023): a late report or batch cannot change its counts."""

    def __init__(self, session_id: str, day: date) -> None:
        super().__init__(
            f"session {session_id} is archived: its day ({day}) of probe_outcomes is retired, "
            "so a late write cannot change its counts",
            hint=f"kickass archive restore probe_outcomes {day} puts its raw rows back",
        )
        self.session_id = session_id
        self.day = day


# One statement for a whole batch: arrays in, rows out. executemany would
# cost a round trip (or a statement) per few rows; thousands of outcomes per
# session make that the engine's bottleneck. Each row carries its session's
# created_at, the partition key (migration 0022): a day with no partition is
# an error, which the writer sets aside (failed-*). The session row is share-locked:
# a batch and the session's finish never interleave, so the counts the finish
# stores include every row (and a batch for a final session rewrites them).
# A probe's reassembly_invalid, once set, stays set: the flag comes from the
# client's REPORTs and from its end-of-session report, in either order.
_UPSERT_OUTCOMES = text(f"""
WITH s AS (
    SELECT id, created_at, state IN {tuple(FINAL_STATES)} AS final FROM sessions
    WHERE session_id = :session_id FOR SHARE
), written AS (
    INSERT INTO probe_outcomes (
        session_pk, session_created_at, seq, phase, ip_len, sent_at, outcome, acked_at, rtt_ms,
        ack_count, received_len, observed_frag_size, reassembly_invalid
    )
    SELECT s.id, s.created_at, u.*
    FROM s
    CROSS JOIN unnest(
        CAST(:seq AS integer[]), CAST(:phase AS text[]), CAST(:ip_len AS smallint[]),
        CAST(:sent_at AS timestamptz[]), CAST(:outcome AS text[]), CAST(:acked_at AS timestamptz[]),
        CAST(:rtt_ms AS real[]), CAST(:ack_count AS smallint[]), CAST(:received_len AS integer[]),
        CAST(:observed_frag_size AS integer[]), CAST(:reassembly_invalid AS boolean[])
    ) AS u
    ON CONFLICT (session_pk, seq, session_created_at) DO UPDATE SET
        phase = excluded.phase,
        ip_len = excluded.ip_len,
        sent_at = excluded.sent_at,
        outcome = excluded.outcome,
        acked_at = excluded.acked_at,
        rtt_ms = excluded.rtt_ms,
        ack_count = excluded.ack_count,
        received_len = excluded.received_len,
        observed_frag_size = excluded.observed_frag_size,
        reassembly_invalid = probe_outcomes.reassembly_invalid OR excluded.reassembly_invalid
    RETURNING 1
)
SELECT s.id, s.final, (SELECT count(*) FROM written) AS written FROM s
""")

# New rows go in by COPY (about three times the upsert's rows/s: bench/README.md,
# scale_bench); a batch that repeats a seq already stored (a re-sent batch, a
# lost probe whose ack came late) fails it on the primary key, is rolled back to
# its savepoint and upserted instead, the last word winning. A row's values, in
# this order, are the COPY's columns after the session's and the upsert's arrays.
_COPIED = ("seq", "phase", "ip_len", "sent_at", "outcome", "acked_at", "rtt_ms", "ack_count",
           "received_len", "observed_frag_size", "reassembly_invalid")  # fmt: skip
_OutcomeRow = tuple[Any, ...]  # one probe_outcomes row: the values of _COPIED
_BATCH_SESSION = text(f"""
SELECT id, created_at, state IN {tuple(FINAL_STATES)} AS final FROM sessions
WHERE session_id = :session_id FOR SHARE
""")
_COPY_OUTCOMES = (
    "COPY probe_outcomes (session_pk, session_created_at, seq, phase, ip_len, sent_at, outcome, "
    "acked_at, rtt_ms, ack_count, received_len, observed_frag_size, reassembly_invalid) "
    "FROM STDIN"
)

_WHOLE_ROWS = text("""
SELECT ip_len, sent, acked, late, drop_rate, rtt_ms_median, fragmented_on_arrival,
       reassembly_invalid, fragments_observed, fragmented_observed
FROM v_whole_drop WHERE session_id = :session_id ORDER BY ip_len
""")
_SPLIT_ROWS = text("""
SELECT leading_ip_len, sent, acked, late, drop_rate, frag_observed, arrived_as_sent,
       largest_fragment_as_sent, reassembly_invalid, fragments_observed, leading_as_sent,
       leading_swapped
FROM v_split_drop WHERE session_id = :session_id ORDER BY leading_ip_len
""")

# A final session's counts, per phase and IP length, into unit_counts (and the
# change into unit_count_changes, for the rollups): migration 0020, under
# 0007's rules. Returns per session and phase what the verdict is decided
# from: valid sent, delivered (a late acknowledgement counts as delivered:
# kickass_core.verdict), invalid, late. A live session reaching a final state
# has them from its live counts, kept as its rows were written (0029: at most
# 8,192 raw rows left to read, so a full plan's finish stays short); a late
# write for a final session counts its raw rows again.
_FINISH_COUNTS = text("SELECT * FROM write_unit_counts_from_live(CAST(:pks AS bigint[]))")
# Before a live session's batch: its mark locked and returned, its rows below
# the batch's first seq folded into its live counts first once they are far
# enough ahead of it (0029's fold_live_counts: about every 29 batches of 280).
# A batch's new rows below the mark (an outcome that came late) the store
# counts itself (no insert trigger: it would slow COPY down); the changes of
# rows replaced below it, probe_outcomes' update trigger.
_FOLD = text("SELECT fold_live_counts(:pk, :below)")
_STORED_SEQS = text("""
SELECT seq FROM probe_outcomes
WHERE session_pk = :pk AND session_created_at = :created AND seq = ANY(CAST(:seqs AS integer[]))
""")
_COUNT_NEW = text("SELECT count_new_live_rows(:pk, CAST(:seqs AS integer[]))")
_WRITE_COUNTS = text("SELECT * FROM write_unit_counts(CAST(:pks AS bigint[]))")

# Whether a retire has claimed the day (migration 0023): a late write for a
# final session takes the day's lock shared first, so it either lands before
# the claim (and is archived) or is refused after it, never lost between.
_CLAIMED = text("SELECT archive_claimed('probe_outcomes', CAST(:day AS date))")

# A lost probe in one of the client's ranges of refused fragments becomes
# invalid: a split always, a whole packet only from the smallest size the
# path was seen to fragment (a small-MTU hop), as the engine's core does.
_MARK_INVALID = text("""
UPDATE probe_outcomes o SET reassembly_invalid = true
FROM unnest(CAST(:first AS integer[]), CAST(:end AS integer[])) AS r(first, "end")
WHERE o.session_pk = :pk AND o.session_created_at = :created
  AND o.seq >= r.first AND o.seq < r."end"
  AND o.outcome = 'lost' AND NOT o.reassembly_invalid
  AND (o.phase = 'split' OR o.ip_len >= (
        SELECT min(w.ip_len) FROM probe_outcomes w
        WHERE w.session_pk = :pk AND w.session_created_at = :created
          AND w.phase = 'whole' AND w.observed_frag_size > 0))
""")
_OBSERVE = text("""
UPDATE probe_outcomes o SET observed_leading_len = u.lead_len, observed_fragments = u.pieces
FROM unnest(
    CAST(:seq AS integer[]), CAST(:lead_len AS smallint[]), CAST(:pieces AS smallint[])
) AS u(seq, lead_len, pieces)
WHERE o.session_pk = :pk AND o.session_created_at = :created AND o.seq = u.seq
""")


class _SessionExists(Exception):
    """Internal: rolls back a create_session whose id is taken."""


class StudyStore(StoreBase):
    """``instance`` names the server process that uses this store: sessions it
    creates carry it, and at start it ends only its own orphans."""

    def __init__(self, database_url: str | None = None, instance: str | None = None) -> None:
        super().__init__(database_url)
        self.instance = instance
        # The UTC day whose probe_outcomes partitions this store last made sure of.
        self._partition_day: date | None = None

    def ping(self) -> None:
        """Raise KickassError unless the database is reachable and its schema current."""
        try:
            db.check_connection(self.engine)
        except KickassError as exc:
            raise DatabaseUnavailable(str(exc), hint=exc.hint) from exc
        current = self.run(_schema_revision)
        head = head_revision()
        if current is None:
            raise KickassError(
                f"database {db.describe_url(self.database_url)} has no kickass schema",
                hint="run: kickass db upgrade",
            )
        if head is not None and current != head:
            raise KickassError(
                f"database schema is at revision {current}, this server needs {head}",
                hint="run: kickass db upgrade",
            )

    # -- writes -----------------------------------------------------------

    def apply(self, event: StudyEvent) -> bool:
        """Store one of the probe engine's events: the one way a session's run
        is written (the engine's writer, a journal's replay, the tests' seeds).

        False when the event changed nothing: its session is unknown, or (a
        ``RunProbing``, a ``RunFinished``) already final. An ``OutcomeBatch``
        is never dropped quietly: UnknownSession for a session the database
        does not have, SessionRetired for a final one whose day is archived
        (the writer sets either aside in its journal's ``failed-*``).
        """
        # A match, not a table: mypy checks each handler against its event
        # type, and assert_never fails the check when StudyEvent gains a type
        # no case handles.
        match event:
            case RunProbing():
                return self._mark_probing(event)
            case OutcomeBatch():
                return self._record_outcomes(event)
            case Heartbeat():
                return self._heartbeat(event)
            case RunFinished():
                return self._finish_session(event)
            case _:
                assert_never(event)

    def create_session(
        self,
        *,
        session_id: str,
        cookie_hash: bytes,
        plan: dict[str, Any],
        source_address: str,
        expires_at: datetime,
        server_version: str,
        client_version: str | None = None,
        platform: str | None = None,
        install_id: str | None = None,
        client_metadata: dict[str, Any] | None = None,
    ) -> None:
        """Insert a session in state 'created', and its client (upserted by install id).

        Re-creating an existing session with the same cookie hash is a no-op
        (a retried call); with another cookie it is an error. Once a day it
        makes sure today's and tomorrow's partitions of ``probe_outcomes``
        exist (migration 0022), so a server without the scheduled housekeeping
        never stops storing.
        """
        _check_session_id(session_id)
        _check_aware("expires_at", expires_at)
        self.ensure_partitions()

        def work(conn: Connection) -> None:
            client_values = {
                "install_id": install_id,
                "last_address": source_address,
                "client_version": client_version,
                "platform": platform,
            }
            if install_id is None:
                client_stmt = insert(_clients).values(client_values)
            else:
                stmt = pg_insert(_clients).values(client_values)
                client_stmt = stmt.on_conflict_do_update(
                    index_elements=[_clients.c.install_id],
                    set_={
                        "last_seen": func.now(),
                        "last_address": stmt.excluded.last_address,
                        "client_version": func.coalesce(
                            stmt.excluded.client_version, _clients.c.client_version
                        ),
                        "platform": func.coalesce(stmt.excluded.platform, _clients.c.platform),
                    },
                )
            client_pk = conn.execute(client_stmt.returning(_clients.c.id)).scalar_one()
            session_stmt = (
                pg_insert(_sessions)
                .values(
                    session_id=session_id,
                    client_id=client_pk,
                    cookie_hash=cookie_hash,
                    source_address=source_address,
                    state="created",
                    plan=plan,
                    client_version=client_version,
                    server_version=server_version,
                    expires_at=expires_at,
                    server_instance=self.instance,
                    client_metadata=client_metadata or {},
                )
                .on_conflict_do_nothing(index_elements=[_sessions.c.session_id])
                .returning(_sessions.c.id)
            )
            if conn.execute(session_stmt).first() is None:
                raise _SessionExists  # roll back the client upsert too

        try:
            self.run(work)
        except _SessionExists:
            existing = self.cookie_hash(session_id)
            if existing is None or not hmac.compare_digest(existing, cookie_hash):
                raise KickassError(f"session {session_id} already exists") from None

    def ensure_partitions(self) -> None:
        """Today's and tomorrow's partitions of ``probe_outcomes`` (by the
        database's clock, which stamps ``created_at``), once a day. One that
        cannot be made now (its locks not free within their timeout) is
        tried again at the next session; meanwhile an outcome batch for a day
        with no partition is refused by the database and set aside, not lost."""
        day = datetime.now(UTC).date()
        if self._partition_day == day:
            return

        def work(conn: Connection) -> None:
            now = partitions.today(conn)
            for d in (now, now + timedelta(days=1)):
                partitions.ensure(conn, "probe_outcomes", d)

        try:
            self.run(work)
        except (DatabaseUnavailable, DBAPIError) as exc:
            log.warning("today's partition of probe_outcomes not made: %s", exc)
            return
        self._partition_day = day

    def _mark_probing(self, event: RunProbing) -> bool:
        """The client proved its UDP address: probing starts. False if the
        session is unknown or already over (it is never brought back)."""
        stmt = (
            update(_sessions)
            .where(_sessions.c.session_id == event.session_id, _sessions.c.state.in_(LIVE_STATES))
            .values(
                state="probing",
                probe_address=event.probe_address,
                probe_port=event.probe_port,
                rtt_ms=event.rtt_ms,
                started_at=func.coalesce(_sessions.c.started_at, func.now()),
            )
        )
        return self.run(lambda conn: conn.execute(stmt).rowcount > 0)

    def _record_outcomes(self, batch: OutcomeBatch) -> bool:
        """Store a batch of outcomes (COPY, else one upsert); the last word on a seq wins.

        Re-sending a batch is harmless, and a probe first recorded 'lost'
        becomes 'late' when its ack turns up after all. Raises UnknownSession
        rather than dropping data for a session the database does not have,
        and SessionRetired for a final session whose day is archived.
        """
        session_id = batch.session_id
        rows = _outcome_rows(batch)
        if not rows:
            return True
        # One row may not be updated twice in one statement: the last word on a seq.
        latest = list({row[0]: row for row in rows}.values())
        params: dict[str, Any] = {f: [row[i] for row in latest] for i, f in enumerate(_COPIED)}
        params["session_id"] = session_id

        def work(conn: Connection) -> int:
            row = conn.execute(_BATCH_SESSION, {"session_id": session_id}).first()
            if row is None:
                return 0
            pk, created, final = row
            new_below_mark: list[int] = []
            if final:
                _refuse_if_retired(conn, session_id, created)
            else:
                mark = conn.execute(_FOLD, {"pk": pk, "below": min(params["seq"])}).scalar_one()
                new_below_mark = [seq for seq in params["seq"] if seq < mark]
            try:
                with conn.begin_nested():
                    cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]  # None only once closed; this one is open
                    with cursor.copy(_COPY_OUTCOMES) as copy:
                        for values in latest:
                            copy.write_row((pk, created, *values))
            except psycopg.errors.UniqueViolation:
                if new_below_mark:  # a stored row is replaced, not new
                    seqs = {"pk": pk, "created": created, "seqs": new_below_mark}
                    stored = set(conn.execute(_STORED_SEQS, seqs).scalars())
                    new_below_mark = [seq for seq in new_below_mark if seq not in stored]
                conn.execute(_UPSERT_OUTCOMES, params)
            if new_below_mark:
                conn.execute(_COUNT_NEW, {"pk": pk, "seqs": new_below_mark})
            if final:  # a batch for a finished session (a replay): its counts follow
                _write_counts(conn, [pk], _WRITE_COUNTS)
            return len(latest)

        if self.run(work) == 0:
            raise UnknownSession(f"no session {session_id} to record outcomes for")
        return True

    def _heartbeat(self, event: Heartbeat) -> bool:
        """Progress counters while probing (what a client polling the API sees)."""
        stmt = (
            update(_sessions)
            .where(_sessions.c.session_id == event.session_id)
            .values(sent=event.sent, acked=event.acked)
        )
        return self.run(lambda conn: conn.execute(stmt).rowcount > 0)

    def _finish_session(self, event: RunFinished) -> bool:
        """Put a live session in a final state, and store its counts (per phase
        and IP length: ``unit_counts``, from the live counts its outcome
        batches kept) in the same transaction. The first final state wins:
        False (and nothing changed) if it had already finished, or is unknown.
        ``reassembly``: what the engine learnt from the client's REPORTs, kept
        as ``client_metadata.reassembly.server``; ``window``: an adaptive
        run's window record (kickass_server.window), kept as
        ``client_metadata.window``."""
        state, verdict = event.state, event.verdict
        if state not in FINAL_STATES:
            raise ValueError(f"state must be one of {FINAL_STATES}, got {state!r}")
        if verdict is not None and verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS} or None, got {verdict!r}")
        stmt = (
            update(_sessions)
            .where(_sessions.c.session_id == event.session_id, _sessions.c.state.in_(LIVE_STATES))
            .values(
                state=state,
                verdict=verdict,
                verdict_reason=event.verdict_reason,
                end_reason=event.end_reason,
                finished_at=func.now(),
                **_metadata_update(event.reassembly, event.window),
            )
            .returning(_sessions.c.id)
        )

        def work(conn: Connection) -> bool:
            pk = conn.execute(stmt).scalar_one_or_none()
            if pk is None:
                return False
            _write_counts(conn, [pk], _FINISH_COUNTS)
            return True

        return self.run(work)

    def record_client_report(
        self,
        session_id: str,
        *,
        metadata: dict[str, Any] | None = None,
        invalid_ranges: Sequence[tuple[int, int]] = (),
        observations: tuple[Sequence[int], Sequence[int], Sequence[int]] | None = None,
    ) -> bool:
        """The client's end-of-session report (``POST /sessions/<id>/report``).

        ``metadata`` is merged into ``client_metadata`` one level deep
        (``{"reassembly": {"client": ...}}`` keeps the ``server`` part);
        ``invalid_ranges`` mark lost probes measured while the client's kernel
        refused fragments; ``observations`` are the privileged observation's
        (seqs, leading fragment IP lengths, fragment counts). When a final
        session gains invalid probes its verdict is decided again from the
        valid ones, and the counts of a final session are stored again, in
        the same transaction. Idempotent. False if the session is unknown;
        SessionRetired (nothing changed) if its raw rows are archived.
        """

        def work(conn: Connection) -> bool:
            row = conn.execute(
                select(
                    _sessions.c.id,
                    _sessions.c.created_at,
                    _sessions.c.state,
                    _sessions.c.client_metadata,
                )
                .where(_sessions.c.session_id == session_id)
                .with_for_update()
            ).first()
            if row is None:
                return False
            pk, created, state, current = row
            if state in FINAL_STATES:
                _refuse_if_retired(conn, session_id, created)
            if metadata:
                merged = dict(current or {})
                for key, value in metadata.items():
                    old = merged.get(key)
                    if isinstance(old, dict) and isinstance(value, dict):
                        merged[key] = {**old, **value}
                    else:
                        merged[key] = value
                conn.execute(
                    update(_sessions).where(_sessions.c.id == pk).values(client_metadata=merged)
                )
            marked = 0
            if invalid_ranges:
                marked = conn.execute(
                    _MARK_INVALID,
                    {
                        "pk": pk,
                        "created": created,
                        "first": [int(a) for a, _ in invalid_ranges],
                        "end": [int(b) for _, b in invalid_ranges],
                    },
                ).rowcount
            if observations is not None and observations[0]:
                seqs, leading, fragments = observations
                conn.execute(
                    _OBSERVE,
                    {
                        "pk": pk,
                        "created": created,
                        "seq": list(seqs),
                        "lead_len": list(leading),
                        "pieces": list(fragments),
                    },
                )
            observed = observations is not None and bool(observations[0])
            if state not in FINAL_STATES or not (marked or observed):
                return True
            counts = _write_counts(conn, [pk], _WRITE_COUNTS).get(pk, {})
            if marked:
                v = _decide(counts)
                conn.execute(
                    update(_sessions)
                    .where(_sessions.c.id == pk)
                    .values(verdict=v.verdict, verdict_reason=v.reason)
                )
            return True

        return self.run(work)

    def mark_orphans_incomplete(self) -> list[str]:
        """At server start: sessions this instance's previous run left live become
        'incomplete', with the verdict their stored outcomes support. Returns
        their session ids. Their counts are stored in the same transaction.

        Only this instance's sessions (and ones no instance claims, created
        before sessions had owners): another server sharing the database keeps
        its live sessions.
        """
        owner = _sessions.c.server_instance
        mine = (
            owner.is_(None) if self.instance is None else (owner == self.instance) | owner.is_(None)
        )

        def work(conn: Connection) -> list[str]:
            orphans = conn.execute(
                select(_sessions.c.id, _sessions.c.session_id)
                .where(_sessions.c.state.in_(LIVE_STATES), mine)
                .order_by(_sessions.c.id)
                .with_for_update()
            ).all()
            if not orphans:
                return []
            counts = _write_counts(conn, [pk for pk, _ in orphans], _FINISH_COUNTS)
            updates = []
            for pk, _ in orphans:
                v = _decide(counts.get(pk, {}))
                updates.append({"pk": pk, "verdict": v.verdict, "reason": v.reason})
            conn.execute(
                update(_sessions)
                .where(_sessions.c.id == bindparam("pk"))
                .values(
                    state="incomplete",
                    verdict=bindparam("verdict"),
                    verdict_reason=bindparam("reason"),
                    end_reason=ORPHAN_END_REASON,
                    finished_at=func.now(),
                ),
                updates,
            )
            return [sid for _, sid in orphans]

        return self.run(work)

    # -- reads ------------------------------------------------------------

    def lingering_sessions(self, older_than_s: float) -> list[dict[str, Any]]:
        """Per server instance: sessions still live with nothing written for
        ``older_than_s`` (their server died, or stopped without closing
        them). Each server closes its own at its next start; this only says
        how many wait, and since when (the scheduled housekeeping)."""
        owner = func.coalesce(_sessions.c.server_instance, "(none)")
        stmt = (
            select(
                owner.label("server_instance"),
                func.count().label("sessions"),
                func.min(_sessions.c.updated_at).label("oldest_update"),
            )
            .where(
                _sessions.c.state.in_(LIVE_STATES),
                _sessions.c.updated_at
                < func.now() - func.make_interval(0, 0, 0, 0, 0, 0, older_than_s),
            )
            .group_by(owner)
            .order_by(owner)
        )
        return self.run(lambda conn: [dict(r._mapping) for r in conn.execute(stmt)])

    def cookie_hash(self, session_id: str) -> bytes | None:
        stmt = select(_sessions.c.cookie_hash).where(_sessions.c.session_id == session_id)
        return self.run(lambda conn: conn.execute(stmt).scalar_one_or_none())

    def report_context(self, session_id: str) -> dict[str, Any] | None:
        """What checking a client report needs: cookie hash, state, plan size."""
        stmt = select(
            _sessions.c.cookie_hash,
            _sessions.c.state,
            _sessions.c.plan["total_probes"].astext.label("total_probes"),
        ).where(_sessions.c.session_id == session_id)
        row = self.run(lambda conn: conn.execute(stmt).first())
        return None if row is None else dict(row._mapping)

    def session_results(self, session_id: str) -> dict[str, Any] | None:
        """The session as the HTTP API serves it (JSON-able), or None if unknown."""

        def work(conn: Connection) -> dict[str, Any] | None:
            row = conn.execute(
                select(_sessions).where(_sessions.c.session_id == session_id)
            ).first()
            if row is None:
                return None
            params = {"session_id": session_id}
            whole = [dict(r) for r in conn.execute(_WHOLE_ROWS, params).mappings()]
            split = [dict(r) for r in conn.execute(_SPLIT_ROWS, params).mappings()]
            return _results(row._mapping, whole, split)

        # One snapshot: the counters and the per-size rows must agree even
        # while the engine is writing.
        return self.run(work, isolation="REPEATABLE READ")


def _outcome_rows(batch: OutcomeBatch) -> list[_OutcomeRow]:
    """A stamped batch's entries as rows (monotonic times mapped to UTC by
    its anchor, the RTT from them), each entry's phase and outcome checked."""
    anchor = batch.anchor
    if anchor is None:
        raise ValueError(f"outcomes of session {batch.session_id} without a clock anchor")
    rows = []
    for e in batch.entries:
        if e.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {e.phase!r} (seq {e.seq})")
        if e.outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {e.outcome!r} (seq {e.seq})")
        acked = e.acked_at
        rows.append(
            (
                e.seq,
                e.phase,
                e.ip_len,
                anchor.utc(e.sent_at),
                e.outcome,
                None if acked is None else anchor.utc(acked),
                None if acked is None else (acked - e.sent_at) * 1000.0,
                e.ack_count,
                e.received_len,
                e.observed_frag_size,
                bool(e.reassembly_invalid),
            )
        )
    return rows


def _metadata_update(
    reassembly: Mapping[str, object] | None, window: Mapping[str, object] | None
) -> dict[str, Any]:
    """The ``client_metadata`` assignment of a finish (none: unchanged)."""
    meta: Any = _sessions.c.client_metadata
    if reassembly is not None:
        meta = _with_server(meta, dict(reassembly))
    if window is not None:
        meta = func.jsonb_set(
            meta, literal_column("'{window}'"), bindparam("window", dict(window), type_=JSONB)
        )
    return {} if reassembly is None and window is None else {"client_metadata": meta}


def _with_server(meta: Any, reassembly: dict[str, Any]) -> Any:
    """``meta`` with ``reassembly.server`` set (the rest kept)."""
    return func.jsonb_set(
        meta,
        literal_column("'{reassembly}'"),
        func.coalesce(meta["reassembly"], literal_column("'{}'::jsonb")).op("||")(
            func.jsonb_build_object(
                literal_column("'server'"), bindparam("reassembly", reassembly, type_=JSONB)
            )
        ),
    )


PhaseCounts = dict[str, tuple[int, int, int, int]]


def _refuse_if_retired(conn: Connection, session_id: str, created: datetime) -> None:
    day = partitions.day_of(created)
    if conn.execute(_CLAIMED, {"day": day}).scalar_one():
        raise SessionRetired(session_id, day)


def _write_counts(conn: Connection, pks: list[int], counting: TextClause) -> dict[int, PhaseCounts]:
    """Store these sessions' counts (``unit_counts``) by ``counting``
    (``_FINISH_COUNTS`` for sessions live until now, ``_WRITE_COUNTS`` for
    final ones); per session and phase (valid sent, delivered, invalid,
    late), what the verdict is decided from."""
    out: dict[int, PhaseCounts] = {}
    for pk, phase, sent, delivered, invalid, late in conn.execute(counting, {"pks": pks}):
        out.setdefault(pk, {})[phase] = (sent, delivered, invalid, late)
    return out


def _decide(counts: PhaseCounts) -> Any:
    """The verdict from per-phase (valid sent, acked in time or late, invalid,
    late) counts."""
    whole = counts.get("whole", (0, 0, 0, 0))
    split = counts.get("split", (0, 0, 0, 0))
    return decide(
        whole[0], whole[1], split[0], split[1],
        whole_invalid=whole[2], split_invalid=split[2], late=whole[3] + split[3],
    )  # fmt: skip


def _results(s: Any, whole: list[dict[str, Any]], split: list[dict[str, Any]]) -> dict[str, Any]:
    rows = whole + split
    if rows:
        sent = sum(r["sent"] for r in rows)
        acked = sum(r["acked"] for r in rows)
    else:
        sent, acked = s["sent"], s["acked"]
    ws, wa = sum(r["sent"] for r in whole), sum(r["acked"] for r in whole)
    ss, sa = sum(r["sent"] for r in split), sum(r["acked"] for r in split)
    x = excess(ws, wa, ss, sa)
    return {
        "session_id": s["session_id"],
        "state": s["state"],
        "verdict": s["verdict"],
        "verdict_reason": s["verdict_reason"],
        "end_reason": s["end_reason"],
        "created_at": _iso(s["created_at"]),
        "started_at": _iso(s["started_at"]),
        "finished_at": _iso(s["finished_at"]),
        "client_version": s["client_version"],
        "server_version": s["server_version"],
        "plan": s["plan"],
        "total_probes": s["plan"].get("total_probes"),
        "sent": sent,
        "acked": acked,
        "rtt_ms": s["rtt_ms"],
        # 0007: invalid probes (the client's kernel refused fragments) are
        # out of every count above; the excess over the two-fragment bound
        # with its 95% interval (kickass_core.verdict.excess); what the
        # client reported about its reassembly memory and observations.
        "reassembly_invalid": {
            "whole": sum(r["reassembly_invalid"] or 0 for r in whole),
            "split": sum(r["reassembly_invalid"] or 0 for r in split),
        },
        "excess": None if x is None else x.to_json(),
        "client_metadata": s["client_metadata"],
        "whole": whole,
        "split": split,
    }


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _schema_revision(conn: Connection) -> str | None:
    if conn.execute(text("SELECT to_regclass('alembic_version')")).scalar() is None:
        return None
    return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()


def _check_session_id(session_id: str) -> None:
    if not _SESSION_ID_RE.match(session_id):
        raise ValueError(f"session_id must be 16 lowercase hex characters, got {session_id!r}")


def _check_aware(name: str, value: datetime | None) -> None:
    # A naive datetime would be read in the connection's time zone: refuse
    # rather than store a time that is off by hours.
    if value is not None and value.utcoffset() is None:
        raise ValueError(f"{name} must be timezone-aware, got {value!r}")
