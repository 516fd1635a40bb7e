"""The only code that writes the RIPE Atlas tables (migrations 0006 and 0009).

Bulk rows (the responder's reply log, fetched results and their per-packet
outcomes) go in with COPY into a temporary table and one ``INSERT ... ON
CONFLICT DO NOTHING``: COPY is what makes ingest fast, the conflict clause
what makes a re-sent batch, a re-fetched window or a re-imported file
harmless; a result's counts are added to its probe's durable counts
(``unit_counts``) in the same transaction, for a result new to the table
only, so they too are added once. One exception: a result stored ``invalid`` (an unreadable copy)
gives way to a readable one with the same key, which then gets its outcomes;
a readable result is never replaced. A fetched chunk, its outcomes and the
measurement's watermark (``fetched_until``, or ``rechecked_until`` for the
late re-read) commit in one transaction, so an interrupted fetch resumes
exactly after its last chunk.

Like kickass_db.StudyStore, every call runs one short transaction on a pooled
connection and raises DatabaseUnavailable while the database is away.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from kickass_core.verdict import decide
from kickass_db.tx import StoreBase
from psycopg.types.json import Jsonb
from sqlalchemy import Connection, text

from .campaign import Campaign, PlannedMeasurement
from .responder_core import ReplyRecord

# The rows live in rows.py (the join needs no database code); callers import
# them from here too.
from .rows import LoggedReply as LoggedReply
from .rows import OutcomeRow as OutcomeRow
from .rows import ResultRow as ResultRow

T = TypeVar("T")

COUNTED = ("acked", "lost", "late")


# In the order of the rows' fields (rows.py; _astuple).
RESULT_COLUMNS = (
    "msm_id", "prb_id", "result_at", "campaign_id", "firmware", "from_address", "dst_address",
    "size", "sent", "rcvd", "dup", "join_status", "raw", "stored_at", "origin", "join_error",
)  # fmt: skip
OUTCOME_COLUMNS = (
    "msm_id", "prb_id", "result_at", "packet_index", "campaign_id", "phase", "ip_len", "outcome",
    "rtt_ms", "ack_count", "icmp_seq", "replied_at", "error", "attempt",
)  # fmt: skip
REPLY_LOG_COLUMNS = (
    "responder_run", "reply_no", "campaign_id", "responder_address", "dst_address", "icmp_id",
    "icmp_seq", "request_len", "phase", "ip_len", "sent_at", "attempt", "duplicate",
)  # fmt: skip
_RAW = RESULT_COLUMNS.index("raw")
_KEY = ("msm_id", "prb_id", "result_at")
# An unreadable copy stored before (join_status invalid) gives way to a
# readable result with the same key; nothing else is ever overwritten.
_REPLACE_INVALID = (
    f"ON CONFLICT ({', '.join(_KEY)}) DO UPDATE SET "
    + ", ".join(f"{c} = excluded.{c}" for c in RESULT_COLUMNS if c not in _KEY)
    + ", fetched_at = now() "
    "WHERE atlas_results.join_status = 'invalid' AND excluded.join_status <> 'invalid'"
)

ResultKey = tuple[int, int, datetime]


@dataclass(frozen=True, slots=True)
class Stored:
    """What ``store_window`` stored: the keys of the results new to the
    table, and of those that replaced an invalid copy (both got outcomes)."""

    new: frozenset[ResultKey]
    replaced: frozenset[ResultKey]

    @property
    def fresh(self) -> frozenset[ResultKey]:
        return self.new | self.replaced


def _utc(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


class AtlasStore(StoreBase):
    """The only code that writes the Atlas tables (one transaction per call)."""

    # -- campaigns and measurements ------------------------------------------------

    def upsert_campaign(self, campaign: Campaign) -> int:
        """The campaign's id, its definition brought up to date (the file is the truth)."""
        stmt = text("""
            INSERT INTO atlas_campaigns (name, definition, credit_budget)
            VALUES (:name, :definition, :budget)
            ON CONFLICT (name) DO UPDATE SET
                definition = excluded.definition,
                credit_budget = excluded.credit_budget,
                updated_at = now()
            RETURNING id
        """)
        params = {
            "name": campaign.name,
            "definition": Jsonb(campaign.to_json()),
            "budget": campaign.credit_budget,
        }
        return self.run(lambda conn: int(conn.execute(stmt, params).scalar_one()))

    def campaign_id(self, name: str) -> int | None:
        stmt = text("SELECT id FROM atlas_campaigns WHERE name = :name")
        return self.run(lambda conn: conn.execute(stmt, {"name": name}).scalar_one_or_none())

    def record_measurement(
        self,
        campaign_id: int,
        msm_id: int,
        planned: PlannedMeasurement,
        definition: dict[str, Any],
        stop_time: datetime | None,
    ) -> None:
        stmt = text("""
            INSERT INTO atlas_measurements (
                msm_id, campaign_id, key, phase, target, ip_len, size, packets, interval_s,
                packet_interval_ms, probes_requested, definition, estimated_credits, stop_time
            ) VALUES (
                :msm_id, :campaign_id, :key, :phase, :target, :ip_len, :size, :packets,
                :interval_s, :packet_interval_ms, :probes, :definition, :credits, :stop_time
            )
            ON CONFLICT (msm_id) DO NOTHING
        """)
        params = {
            "msm_id": msm_id,
            "campaign_id": campaign_id,
            "key": planned.key,
            "phase": planned.phase,
            "target": planned.target,
            "ip_len": planned.ip_len,
            "size": planned.size,
            "packets": planned.packets,
            "interval_s": planned.interval_s,
            "packet_interval_ms": planned.packet_interval_ms,
            "probes": planned.probes,
            "definition": Jsonb(definition),
            "credits": planned.credits,
            "stop_time": stop_time,
        }
        self.run(lambda conn: conn.execute(stmt, params))

    def forget_measurement(self, msm_id: int) -> None:
        """Drop a measurement stopped before it started (it has no results):
        the next ``create`` makes it afresh."""
        stmt = text("DELETE FROM atlas_measurements WHERE msm_id = :m AND results_fetched = 0")
        self.run(lambda conn: conn.execute(stmt, {"m": msm_id}))

    def measurements(self, campaign_id: int) -> list[dict[str, Any]]:
        stmt = text("""
            SELECT * FROM atlas_measurements WHERE campaign_id = :c
            ORDER BY phase DESC, ip_len, msm_id
        """)
        return self.run(
            lambda conn: [dict(r) for r in conn.execute(stmt, {"c": campaign_id}).mappings()]
        )

    def update_measurement(self, msm_id: int, **values: Any) -> None:
        allowed = {
            "status_id", "status_name", "credits_per_result", "start_time", "stop_time",
            "last_error",
        }  # fmt: skip
        if not values or set(values) - allowed:
            raise ValueError(f"cannot update {sorted(set(values) - allowed)}")
        sets = ", ".join(f"{k} = :{k}" for k in values)
        stmt = text(f"UPDATE atlas_measurements SET {sets} WHERE msm_id = :msm_id")
        self.run(lambda conn: conn.execute(stmt, {**values, "msm_id": msm_id}))

    # -- the reply log -------------------------------------------------------------

    def write_reply_log(
        self, campaign_id: int, responder_run: uuid.UUID, records: Sequence[ReplyRecord]
    ) -> None:
        """Append the responder's replies (idempotent per run and reply number)."""
        if not records:
            return
        rows = (
            (
                responder_run, r.reply_no, campaign_id, r.responder_address, r.dst_address,
                r.icmp_id, r.icmp_seq, r.request_len, r.phase, r.ip_len, _utc(r.sent_at),
                r.attempt, r.duplicate,
            )
            for r in records
        )  # fmt: skip
        self.run(lambda conn: _copy_insert(conn, "atlas_reply_log", REPLY_LOG_COLUMNS, rows))

    def reply_log(
        self, campaign_id: int, responder_address: str, request_len: int, t0: float, t1: float
    ) -> list[LoggedReply]:
        """The replies to requests of ``request_len`` bytes at ``responder_address``
        sent between t0 and t1 (unix seconds), oldest first."""
        stmt = text("""
            SELECT host(dst_address) AS dst, icmp_id, icmp_seq, phase, ip_len,
                   extract(epoch FROM sent_at)::double precision AS sent_epoch,
                   attempt, duplicate
            FROM atlas_reply_log
            WHERE campaign_id = :c AND responder_address = CAST(:addr AS inet)
              AND request_len = :len AND sent_at BETWEEN :t0 AND :t1
            ORDER BY sent_at, reply_no
        """)
        params = {
            "c": campaign_id,
            "addr": responder_address,
            "len": request_len,
            "t0": _utc(t0),
            "t1": _utc(t1),
        }
        return self.run(lambda conn: [LoggedReply(*r) for r in conn.execute(stmt, params)])

    # -- fetched results -------------------------------------------------------------

    def store_chunk(
        self,
        msm_id: int,
        results: Sequence[ResultRow],
        outcomes: Sequence[OutcomeRow],
        fetched_until: datetime | None,
        *,
        recheck: bool = False,
    ) -> int:
        """``store_window``, returning how many results got their outcomes
        (new ones, and those that replaced an invalid copy)."""
        stored = self.store_window(msm_id, results, outcomes, fetched_until, recheck=recheck)
        return len(stored.fresh)

    def store_window(
        self,
        msm_id: int,
        results: Sequence[ResultRow],
        outcomes: Sequence[OutcomeRow],
        fetched_until: datetime | None,
        *,
        recheck: bool = False,
    ) -> Stored:
        """One window: results, the outcomes of the new ones and the new
        watermark, atomically. A result stored before is skipped with its
        outcomes, whatever the join says now, unless it was stored
        ``invalid`` and this one is readable: then this one takes its place
        (and its outcomes go in). Of two rows with one key in ``results``
        a readable one wins.

        ``fetched_until``: the window's end (``None``: an import, no watermark
        moves); with ``recheck`` it is the late re-read's watermark
        (``rechecked_until``) and the new results count as late too. A
        replaced result was counted when its invalid copy was stored: it
        counts again in neither."""

        def work(conn: Connection) -> Stored:
            stored = _store_results(conn, results)
            fresh = stored.fresh
            _copy_insert(
                conn,
                "atlas_outcomes",
                OUTCOME_COLUMNS,
                (_astuple(o) for o in outcomes if (o.msm_id, o.prb_id, o.result_at) in fresh),
            )
            _write_counts(conn, fresh)
            watermark = "rechecked_until" if recheck else "fetched_until"
            conn.execute(
                text(f"""
                    UPDATE atlas_measurements SET
                        {watermark} = CASE WHEN CAST(:u AS timestamptz) IS NULL
                            THEN {watermark}
                            ELSE greatest(coalesce({watermark}, :u), :u) END,
                        results_fetched = results_fetched + :new,
                        results_late = results_late + :late,
                        last_fetch_at = CASE WHEN CAST(:u AS timestamptz) IS NULL
                            THEN last_fetch_at ELSE now() END,
                        last_error = CASE WHEN CAST(:u AS timestamptz) IS NULL
                            THEN last_error ELSE NULL END
                    WHERE msm_id = :m
                """),
                {
                    "u": fetched_until,
                    "new": len(stored.new),
                    "late": len(stored.new) if recheck else 0,
                    "m": msm_id,
                },
            )
            return stored

        return self.run(work)

    def store_chunk_row_by_row(
        self,
        msm_id: int,
        results: Sequence[ResultRow],
        outcomes: Sequence[OutcomeRow],
        fetched_until: datetime,
    ) -> int:
        """The same as store_chunk, one INSERT per row: the benchmark's baseline only."""

        def work(conn: Connection) -> int:
            fresh: set[ResultKey] = set()
            cols = ", ".join(RESULT_COLUMNS)
            marks = ", ".join(f":{c}" for c in RESULT_COLUMNS)
            ins = text(f"INSERT INTO atlas_results ({cols}) VALUES ({marks}) {_REPLACE_INVALID}")
            for r in results:
                values = dict(zip(RESULT_COLUMNS, _result_tuple(r), strict=True))
                if conn.execute(ins, values).rowcount:
                    fresh.add((r.msm_id, r.prb_id, r.result_at))
            new = len(fresh)
            cols = ", ".join(OUTCOME_COLUMNS)
            marks = ", ".join(f":{c}" for c in OUTCOME_COLUMNS)
            ins = text(
                f"INSERT INTO atlas_outcomes ({cols}) VALUES ({marks}) ON CONFLICT DO NOTHING"
            )
            for o in outcomes:
                conn.execute(ins, dict(zip(OUTCOME_COLUMNS, _astuple(o), strict=True)))
            _write_counts(conn, fresh)
            conn.execute(
                text(
                    "UPDATE atlas_measurements SET fetched_until = :u, "
                    "results_fetched = results_fetched + :new WHERE msm_id = :m"
                ),
                {"u": fetched_until, "new": new, "m": msm_id},
            )
            return new

        return self.run(work)

    # -- probes and verdicts -------------------------------------------------------

    def known_probes(self, prb_ids: Iterable[int]) -> dict[int, str | None]:
        """Probe id -> its IPv4 address, for the probes with metadata."""
        stmt = text(
            "SELECT prb_id, host(address_v4) AS a FROM atlas_probes WHERE prb_id = ANY(:ids)"
        )
        ids = sorted(set(prb_ids))
        return self.run(lambda conn: {r.prb_id: r.a for r in conn.execute(stmt, {"ids": ids})})

    def upsert_probes(self, probes: Sequence[dict[str, Any]]) -> None:
        if not probes:
            return
        stmt = text("""
            INSERT INTO atlas_probes (
                prb_id, asn_v4, asn_v6, country_code, address_v4, prefix_v4, status_name,
                is_anchor, meta
            ) VALUES (
                :prb_id, :asn_v4, :asn_v6, :country_code, CAST(:address_v4 AS inet), :prefix_v4,
                :status_name, :is_anchor, :meta
            )
            ON CONFLICT (prb_id) DO UPDATE SET
                asn_v4 = excluded.asn_v4, asn_v6 = excluded.asn_v6,
                country_code = excluded.country_code, address_v4 = excluded.address_v4,
                prefix_v4 = excluded.prefix_v4, status_name = excluded.status_name,
                is_anchor = excluded.is_anchor, meta = excluded.meta, updated_at = now()
        """)
        rows = [
            {
                "prb_id": int(p["id"]),
                "asn_v4": p.get("asn_v4"),
                "asn_v6": p.get("asn_v6"),
                "country_code": p.get("country_code"),
                "address_v4": p.get("address_v4"),
                "prefix_v4": p.get("prefix_v4"),
                "status_name": (p.get("status") or {}).get("name"),
                "is_anchor": p.get("is_anchor"),
                "meta": Jsonb(p),
            }
            for p in probes
        ]
        self.run(lambda conn: conn.execute(stmt, rows))

    def refresh_verdicts(self, campaign_id: int, prb_ids: Iterable[int] | None = None) -> int:
        """Apply the volunteers' verdict rule to each probe's pooled counts.

        As for volunteers, a late reply (back after the probe's timeout)
        counts as delivered for the verdict, whose reason says how many;
        ``whole_acked`` and ``split_acked`` keep the paper's late-as-lost
        rule of the drop rates the views compute from them."""
        ids = None if prb_ids is None else sorted(set(prb_ids))

        def work(conn: Connection) -> int:
            counts = conn.execute(
                text(f"""
                    SELECT prb_id,
                        count(*) FILTER (WHERE phase = 'whole' AND outcome IN {COUNTED}) AS ws,
                        count(*) FILTER (WHERE phase = 'whole' AND outcome = 'acked') AS wa,
                        count(*) FILTER (WHERE phase = 'whole' AND outcome = 'late') AS wl,
                        count(*) FILTER (WHERE phase = 'split' AND outcome IN {COUNTED}) AS ss,
                        count(*) FILTER (WHERE phase = 'split' AND outcome = 'acked') AS sa,
                        count(*) FILTER (WHERE phase = 'split' AND outcome = 'late') AS sl
                    FROM atlas_outcomes
                    WHERE campaign_id = :c AND ip_len IS NOT NULL
                      AND (CAST(:ids AS integer[]) IS NULL OR prb_id = ANY(CAST(:ids AS integer[])))
                    GROUP BY prb_id
                """),
                {"c": campaign_id, "ids": ids},
            ).all()
            rows = []
            for r in counts:
                v = decide(r.ws, r.wa + r.wl, r.ss, r.sa + r.sl, late=r.wl + r.sl)
                rows.append(
                    {
                        "c": campaign_id,
                        "p": r.prb_id,
                        "ws": r.ws,
                        "wa": r.wa,
                        "ss": r.ss,
                        "sa": r.sa,
                        "v": v.verdict,
                        "why": v.reason,
                    }
                )
            if rows:
                conn.execute(
                    text("""
                        INSERT INTO atlas_verdicts (
                            campaign_id, prb_id, whole_sent, whole_acked, split_sent,
                            split_acked, verdict, verdict_reason
                        ) VALUES (:c, :p, :ws, :wa, :ss, :sa, :v, :why)
                        ON CONFLICT (campaign_id, prb_id) DO UPDATE SET
                            whole_sent = excluded.whole_sent,
                            whole_acked = excluded.whole_acked,
                            split_sent = excluded.split_sent,
                            split_acked = excluded.split_acked,
                            verdict = excluded.verdict,
                            verdict_reason = excluded.verdict_reason,
                            updated_at = now()
                    """),
                    rows,
                )
            return len(rows)

        return self.run(work)

    # -- reads for `kickass atlas status` ------------------------------------------

    def status(self, campaign: str) -> dict[str, Any]:
        def work(conn: Connection) -> dict[str, Any]:
            msms = [
                dict(r)
                for r in conn.execute(
                    text(
                        "SELECT * FROM v_atlas_measurements WHERE campaign = :c "
                        "ORDER BY phase DESC, ip_len, msm_id"
                    ),
                    {"c": campaign},
                ).mappings()
            ]
            verdicts: dict[str, int] = dict(
                conn.execute(
                    text(
                        "SELECT verdict, count(*) FROM v_verdicts_by_source "
                        "WHERE source = 'atlas' AND campaign = :c GROUP BY verdict"
                    ),
                    {"c": campaign},
                ).all()
            )
            replies = conn.execute(
                text(
                    "SELECT count(*) FROM atlas_reply_log l JOIN atlas_campaigns c "
                    "ON c.id = l.campaign_id WHERE c.name = :c"
                ),
                {"c": campaign},
            ).scalar_one()
            return {"measurements": msms, "verdicts": verdicts, "replies_logged": replies}

        return self.run(work)


def _astuple(row: Any) -> tuple[Any, ...]:
    return tuple(getattr(row, f) for f in row.__slots__)


def _result_tuple(row: ResultRow) -> tuple[Any, ...]:
    values = list(_astuple(row))
    values[_RAW] = Jsonb(row.raw)
    return tuple(values)


@contextmanager
def _staged(
    conn: Connection, table: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]
) -> Iterator[tuple[Any, str]]:
    """COPY ``rows`` into a per-connection temporary twin of ``table``;
    yields a cursor and the twin's name, empties the twin afterwards."""
    tmp = f"_in_{table}"
    raw = conn.connection.driver_connection
    assert raw is not None
    cols = ", ".join(columns)
    with raw.cursor() as cur:
        # Kept per pooled connection (created once); ON COMMIT DELETE ROWS
        # empties it whatever happens to the transaction.
        cur.execute(
            f"CREATE TEMP TABLE IF NOT EXISTS {tmp} "
            f"(LIKE {table} INCLUDING DEFAULTS) ON COMMIT DELETE ROWS"
        )
        with cur.copy(f"COPY {tmp} ({cols}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)
        yield cur, tmp
        cur.execute(f"TRUNCATE {tmp}")


def _copy_insert(
    conn: Connection,
    table: str,
    columns: Sequence[str],
    rows: Iterable[Sequence[Any]],
) -> int:
    """COPY ``rows`` in, then insert them, skipping rows already there.
    Returns how many were new."""
    cols = ", ".join(columns)
    with _staged(conn, table, columns, rows) as (cur, tmp):
        cur.execute(f"INSERT INTO {table} ({cols}) SELECT {cols} FROM {tmp} ON CONFLICT DO NOTHING")
        new: int = cur.rowcount
    return new


def _write_counts(conn: Connection, keys: Iterable[ResultKey]) -> None:
    """Adds these results' counts to their probes' durable counts (migration
    0028). Each result once: only those just stored with their outcomes."""
    ordered = sorted(keys)
    if ordered:
        conn.execute(
            text(
                "SELECT write_atlas_unit_counts(CAST(:m AS bigint[]), CAST(:p AS integer[]), "
                "CAST(:t AS timestamptz[]))"
            ),
            {
                "m": [k[0] for k in ordered],
                "p": [k[1] for k in ordered],
                "t": [k[2] for k in ordered],
            },
        )


def _store_results(conn: Connection, results: Sequence[ResultRow]) -> Stored:
    """Insert result rows; a readable one replaces a stored invalid copy."""
    cols = ", ".join(RESULT_COLUMNS)
    key = ", ".join(_KEY)
    staged = _staged(conn, "atlas_results", RESULT_COLUMNS, map(_result_tuple, results))
    with staged as (cur, tmp):
        # The CTEs see the table as it was before the INSERT: which keys held
        # an invalid copy. DISTINCT ON: one row per key, a readable one first
        # (one INSERT may not touch a row twice).
        cur.execute(f"""
            WITH was_invalid AS (
                SELECT {key} FROM atlas_results r
                WHERE r.join_status = 'invalid' AND ({key}) IN (SELECT {key} FROM {tmp})
            ), stored AS (
                INSERT INTO atlas_results ({cols})
                SELECT DISTINCT ON ({key}) {cols} FROM {tmp}
                ORDER BY {key}, join_status = 'invalid'
                {_REPLACE_INVALID}
                RETURNING {key}
            )
            SELECT s.msm_id, s.prb_id, s.result_at, w.msm_id IS NOT NULL
            FROM stored s LEFT JOIN was_invalid w USING ({key})
        """)
        rows = cur.fetchall()
    new = frozenset((r[0], r[1], r[2]) for r in rows if not r[3])
    replaced = frozenset((r[0], r[1], r[2]) for r in rows if r[3])
    return Stored(new, replaced)
