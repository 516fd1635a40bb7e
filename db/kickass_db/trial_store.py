"""Storage of wide-area trial results: runners, trials, periods, flows.

Uploads are idempotent and tell the truth: a trial is keyed by its
``trial_id`` and a flow by its ``flow_id`` (both chosen by the runner), so a
runner re-sending its spool after a lost answer stores nothing twice; a
re-sent id whose content *differs* from what is stored is a conflict,
reported per record and never replacing the stored row.

The records' shapes are defined once (``kickass_core.flow_record``); the
server validates every field before calling here (``kickass_server.schemas``),
so this module only checks what a database can: ownership, and equality with
what is already stored. Only a key derived from a runner's token is kept
(``kickass_core.signing.key_from_secret``, which
verifies its signed requests): the token itself never is.
"""

from __future__ import annotations

import hmac
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kickass_core import flow_record
from kickass_core.errors import KickassError
from kickass_core.signing import key_from_secret
from sqlalchemy import Connection, Integer, column, insert, select, table, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert

from .models.trials import FlowRow, RunnerRow, TrialPeriodRow, TrialRow
from .tx import StoreBase

# The trial row's fields a re-sent trial must repeat exactly (finished_at may
# arrive later).
_TRIAL_IDENTITY = (
    "destination",
    "access_capacity_bps",
    "router_run_name",
    "parameters",
    "versions",
    "started_at",
    "environment",
)
_PERIOD_FIELDS = (
    "pair",
    "protocol",
    "congestion_control",
    "start_offset_s",
    "duration_s",
    "arm",
    "handshake",
    "handicap_ms",
    # 0021 (None on a period stored before: a re-send then fills it).
    "transport_cc",
    "tcp_share",
)
_FLOW_COLUMNS = ("trial_pk", *flow_record.FIELD_NAMES)


class BadRecord(KickassError):
    """An upload that can never be stored as sent: a client error, not an outage."""


class UnknownTrial(BadRecord):
    """Flows of a trial this runner has not uploaded (yet): keep them and retry."""


class Conflict(BadRecord):
    """An id already stored with different content; nothing was replaced."""


@dataclass
class FlowsResult:
    """What became of a batch: the ids stored (new, or identical repeats; each
    once), and the refused records as (position in the batch, flow id, why):
    ``conflict``, the same id with other content. A batch may hold one id
    twice: the first is stored, a later identical copy is stored too (it is
    the same record), a later different one is a conflict."""

    stored: list[str] = field(default_factory=list)
    conflicts: list[tuple[int, str, str]] = field(default_factory=list)


class TrialStore(StoreBase):
    # -- runners ----------------------------------------------------------

    def add_runner(self, name: str) -> str:
        """Register a runner; returns its token (shown once, never stored):
        ``NAME.SECRET``, so a runner knows the name it signs as from its token."""
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise KickassError(f"bad runner name {name!r}", hint="letters, digits, _ . - only")
        token = f"{name}.{secrets.token_urlsafe(32)}"

        def work(conn: Connection) -> None:
            stmt = pg_insert(RunnerRow).values(name=name, token_hash=key_from_secret(token))
            stmt = stmt.on_conflict_do_update(
                index_elements=[RunnerRow.name],
                set_={"token_hash": stmt.excluded.token_hash, "revoked_at": None},
            )
            conn.execute(stmt)

        self.run(work)
        return token

    def runner_key(self, name: str) -> tuple[int, bytes] | None:
        """(runner id, signing key) of an active runner, or None."""
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            return None
        stmt = select(RunnerRow.id, RunnerRow.token_hash).where(
            RunnerRow.name == name, RunnerRow.revoked_at.is_(None)
        )
        row = self.run(lambda conn: conn.execute(stmt).first())
        return None if row is None else (int(row[0]), bytes(row[1]))

    def authenticate(self, token: str) -> int | None:
        """The runner id for ``token``, or None (unknown or revoked)."""
        if not token or len(token) > 256:
            return None
        digest = key_from_secret(token)

        def work(conn: Connection) -> int | None:
            rows = conn.execute(
                select(RunnerRow.id, RunnerRow.token_hash).where(RunnerRow.revoked_at.is_(None))
            ).all()
            for rid, h in rows:
                if hmac.compare_digest(h, digest):
                    return int(rid)
            return None

        return self.run(work)

    def seen_nonce(self, runner_id: int, nonce: str, window_s: float) -> bool:
        """Record a signed request's nonce; True if it was seen before (a
        replay). Nonces older than twice the window are forgotten: a request
        that old fails the time check anyway."""

        def work(conn: Connection) -> bool:
            conn.execute(
                text(
                    "DELETE FROM request_nonces WHERE seen_at < now() - make_interval(secs => :w)"
                ),
                {"w": 2 * window_s},
            )
            new = conn.execute(
                text(
                    "INSERT INTO request_nonces (runner_id, nonce) VALUES (:r, :n) "
                    "ON CONFLICT DO NOTHING RETURNING 1"
                ),
                {"r": runner_id, "n": nonce},
            ).first()
            return new is None

        return self.run(work)

    # -- results ----------------------------------------------------------

    def put_trial(self, runner_id: int | None, trial: Mapping[str, Any]) -> None:
        """Store a trial and its schedule (``trial``: the upload's fields, times
        as aware datetimes or ISO strings). A repeat stores nothing new but a
        later ``finished_at``; a repeat that differs raises Conflict."""
        row, periods = _trial_rows(trial)
        tid = row["trial_id"]

        def work(conn: Connection) -> None:
            stmt = pg_insert(TrialRow).values(runner_id=runner_id, **row)
            upsert = stmt.on_conflict_do_update(
                index_elements=[TrialRow.trial_id],
                set_={
                    "finished_at": text("coalesce(excluded.finished_at, trials.finished_at)"),
                },
                where=TrialRow.runner_id.is_not_distinct_from(runner_id),
            ).returning(TrialRow.id)
            pk = conn.execute(upsert).scalar()
            if pk is None:
                raise BadRecord(f"trial {tid} belongs to another runner")
            stored = conn.execute(
                select(*(getattr(TrialRow, k) for k in _TRIAL_IDENTITY)).where(TrialRow.id == pk)
            ).one()
            for key, old in zip(_TRIAL_IDENTITY, stored, strict=True):
                if _differs(old, row[key]):
                    raise Conflict(f"trial {tid} was stored with another {key}")
            if periods:
                conn.execute(
                    pg_insert(TrialPeriodRow).on_conflict_do_nothing(),
                    [{"trial_pk": pk, **p} for p in periods],
                )
                have = {
                    r[0]: r[1:]
                    for r in conn.execute(
                        select(
                            TrialPeriodRow.period_index,
                            TrialPeriodRow.actual_start_offset_s,
                            TrialPeriodRow.offered_load_bps,
                            *(getattr(TrialPeriodRow, k) for k in _PERIOD_FIELDS),
                        ).where(TrialPeriodRow.trial_pk == pk)
                    )
                }

                def fill(index: int, **values: Any) -> None:
                    """A stored period's value that was not known yet, now given."""
                    conn.execute(
                        update(TrialPeriodRow)
                        .where(TrialPeriodRow.trial_pk == pk, TrialPeriodRow.period_index == index)
                        .values(**values)
                    )

                for p in periods:
                    old = have.get(p["period_index"])
                    if old is None:
                        continue
                    actual, offered, fields = old[0], old[1], old[2:]
                    # What the period carried is known once it ended (as
                    # when it started), sent again with the trial's end.
                    new_offered = p.get("offered_load_bps")
                    if offered is None and new_offered is not None:
                        fill(p["period_index"], offered_load_bps=new_offered)
                    if any(_differs(a, p[k]) for a, k in zip(fields, _PERIOD_FIELDS, strict=True)):
                        raise Conflict(
                            f"trial {tid}: period {p['period_index']} was stored differently"
                        )
                    # When it really started arrives later, as finished_at does.
                    new_actual = p.get("actual_start_offset_s")
                    if actual is None and new_actual is not None:
                        fill(p["period_index"], actual_start_offset_s=new_actual)
                    elif new_actual is not None and _differs(actual, new_actual):
                        raise Conflict(
                            f"trial {tid}: period {p['period_index']} started at another time"
                        )

        self.run(work)

    def put_flows(
        self, runner_id: int | None, trial_id: str, flows: Sequence[Mapping[str, Any]]
    ) -> FlowsResult:
        """Store flow records of a trial (validated: kickass_core.flow_record).

        Every record of the batch comes back either as stored (new, or an
        identical repeat) or as a conflict, by its position (its id is stored
        with other content, maybe by a copy earlier in the same batch: the
        stored row is kept). Raises UnknownTrial before the trial is
        uploaded, BadRecord for a flow of another trial.
        """
        rows = []
        for f in flows:
            owner, _, _ = flow_record.parse_flow_id(str(f["flow_id"]))
            if owner != trial_id:
                raise BadRecord(f"flow {f['flow_id']} is not of trial {trial_id}")
            row: dict[str, Any] = {k: f.get(k) for k in flow_record.FIELD_NAMES}
            row["started_at"] = _aware("started_at", row["started_at"])
            rows.append(row)

        def work(conn: Connection) -> FlowsResult:
            pk = conn.execute(
                select(TrialRow.id).where(
                    TrialRow.trial_id == trial_id,
                    TrialRow.runner_id.is_not_distinct_from(runner_id),
                )
            ).scalar()
            if pk is None:
                raise UnknownTrial(
                    f"no trial {trial_id} of this runner", hint="upload the trial first"
                )
            if not rows:
                return FlowsResult()
            cols = ", ".join(_FLOW_COLUMNS)
            # The batch in a scratch table of the same column types, so the
            # comparison with stored rows sees exactly what would be stored
            # (real columns round the same way on both sides); ``position``
            # tells a batch's copies of one id apart.
            conn.execute(
                text(
                    "CREATE TEMP TABLE incoming_flows ON COMMIT DROP AS "
                    f"SELECT 0 AS position, {cols} FROM flows WITH NO DATA"
                )
            )
            # Typed as the flows columns are (extra is jsonb).
            types = FlowRow.__table__.c
            incoming = table(
                "incoming_flows",
                column("position", Integer()),
                *(column(c, types[c].type) for c in _FLOW_COLUMNS),
            )
            conn.execute(
                insert(incoming), [{"position": i, "trial_pk": pk, **r} for i, r in enumerate(rows)]
            )
            # Of one id sent twice, the first copy is the one stored.
            conn.execute(
                text(
                    f"INSERT INTO flows ({cols}) SELECT DISTINCT ON (flow_id) {cols} "
                    "FROM incoming_flows ORDER BY flow_id, position "
                    "ON CONFLICT (flow_id) DO NOTHING"
                )
            )
            differing = conn.execute(
                text(
                    "SELECT i.position FROM incoming_flows i JOIN flows f USING (flow_id) "
                    f"WHERE ({', '.join('f.' + c for c in _FLOW_COLUMNS)}) IS DISTINCT FROM "
                    f"({', '.join('i.' + c for c in _FLOW_COLUMNS)})"
                )
            ).scalars()
            bad = set(differing)
            out = FlowsResult()
            for i, r in enumerate(rows):
                fid = r["flow_id"]
                if i in bad:
                    why = "this flow id is stored with other content; the stored record was kept"
                    out.conflicts.append((i, fid, why))
                elif fid not in out.stored:
                    out.stored.append(fid)
            return out

        return self.run(work)

    def finish_trial(self, trial_id: str, finished_at: datetime) -> None:
        self.run(
            lambda conn: conn.execute(
                update(TrialRow)
                .where(TrialRow.trial_id == trial_id)
                .values(finished_at=finished_at)
            )
        )


def _differs(stored: Any, sent: Any) -> bool:
    if isinstance(stored, float) and isinstance(sent, int | float):
        return stored != float(sent)
    differs: bool = stored != sent
    return differs


def _aware(name: str, value: Any) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError as exc:
            raise BadRecord(f"{name}: not an ISO 8601 time: {value[:40]!r}") from exc
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise BadRecord(f"{name} must be a time with a UTC offset")
    return value


def _trial_rows(trial: Mapping[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The trials row and trial_periods rows of an upload (fields validated)."""
    tid = trial.get("trial_id")
    if not isinstance(tid, str) or not flow_record.TRIAL_ID_RE.fullmatch(tid):
        raise BadRecord("trial_id must be 32 lowercase hex digits")
    started = _aware("started_at", trial.get("started_at"))
    if started is None:
        raise BadRecord("started_at is required")
    row = {
        "trial_id": tid,
        "destination": trial["destination"],
        "access_capacity_bps": trial.get("access_capacity_bps"),
        "router_run_name": trial.get("router_run_name"),
        "parameters": trial.get("parameters") or {},
        "versions": trial.get("versions") or {},
        "started_at": started,
        "finished_at": _aware("finished_at", trial.get("finished_at")),
        "environment": trial.get("environment") or {},
    }
    periods = [
        {
            "period_index": p["index"],
            "pair": p["pair"],
            "protocol": p["protocol"],
            "congestion_control": p.get("congestion_control"),
            "start_offset_s": float(p["start_s"]),
            "duration_s": float(p["duration_s"]),
            "arm": p.get("arm"),
            "handshake": p.get("handshake"),
            "handicap_ms": None if p.get("handicap_ms") is None else float(p["handicap_ms"]),
            "actual_start_offset_s": None
            if p.get("actual_start_s") is None
            else float(p["actual_start_s"]),
            "transport_cc": p.get("transport_cc"),
            "tcp_share": None if p.get("tcp_share") is None else float(p["tcp_share"]),
            "offered_load_bps": None
            if p.get("offered_load_bps") is None
            else float(p["offered_load_bps"]),
        }
        for p in trial.get("periods") or ()
    ]
    return row, periods
