"""Bounds on every number a reader computes with; rows out of them quarantined.

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-28

The database accepted what its readers could not read (issue 27): router
telemetry with ``t = 1e300`` or NaN (``kickass report`` died at
``make_interval(secs => t)``), a flow with ``fct_ms = 1e308`` (``avg()``
overflowed in 0014's ``report_fct_bins``); a trial uploaded at
9999-12-31 had periods in year 10000, which no Python or Parquet reader
holds. Each column a view, the report, an export or a dashboard computes
with gets a CHECK from its bounds in ``kickass_core.bounds`` (as they are at
this revision: written out below, so this migration does what it did
whatever the table says later). A float has both ends, which also refuses
NaN and the infinities, and is 0 or at least 1.2e-38 (``REAL_MIN``: below
it a reader's quotient underflows, which PostgreSQL raises); a time lies
between 1970 and 2100 (which refuses 'infinity'). Flows' old
``ck_flows_size`` and ``ck_flows_ka_mode_fraction`` are inside the new ones
and go.

Rows already out of bounds do not stop the upgrade, and nothing measured
vanishes without a word: each is copied, whole and as it was, to the new
table ``quarantine`` (NaN and infinities become JSON strings). Where every
bad value's column may be NULL, the row stays with those values NULL
(``nulled``: its other measurements still count); where one may not (a
sample's ``t``, a trial's start), the row leaves its table (``removed``),
and the rows that belong to it (a trial's periods and flows, a router run's
samples, an Atlas result's outcomes) go to ``quarantine`` with it, with no
columns of their own. The upgrade logs how many rows, per table and column,
at WARNING (``kickass db upgrade`` prints it). What was
computed from those rows is recomputed: the router's rollups of an affected
run are deleted (the next refresh rolls the run up again from its start),
the stored speedups deleted (as 0015 did; the report computes them from the
flows until the next refresh), and the materialised views over a changed
table refreshed.

Downgrading puts every quarantined row back as it was, then drops the table.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from alembic import context, op
from sqlalchemy import text

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

log = logging.getLogger("kickass.db")

# Per table: (column, NOT NULL, CHECK), as kickass_core.bounds was at 0018.
CHECKS: dict[str, tuple[tuple[str, bool, str], ...]] = {
    "flows": (
        ("period_index", True, "period_index >= 0 AND period_index <= 2147483647"),
        ("size_bytes", True, "size_bytes >= 1 AND size_bytes <= 1099511627776"),
        ("size_packets", True, "size_packets >= 1 AND size_packets <= 2147483647"),
        (
            "started_at",
            True,
            "started_at >= '1970-01-01T00:00Z' AND started_at <= '2100-01-01T00:00Z'",
        ),
        (
            "fct_ms",
            False,
            "(fct_ms = 0 OR fct_ms >= 1.1754943508222875e-38) AND fct_ms <= 1000000000.0",
        ),
        (
            "ka_mode_ms",
            False,
            "(ka_mode_ms = 0 OR ka_mode_ms >= 1.1754943508222875e-38) "
            "AND ka_mode_ms <= 1000000000.0",
        ),
        (
            "ka_mode_fraction",
            False,
            "(ka_mode_fraction = 0 OR ka_mode_fraction >= 1.1754943508222875e-38) "
            "AND ka_mode_fraction <= 1.0",
        ),
        ("mode_switches", False, "mode_switches >= 0 AND mode_switches <= 2147483647"),
        ("retransmissions", False, "retransmissions >= 0 AND retransmissions <= 2147483647"),
        (
            "srtt_ms",
            False,
            "(srtt_ms = 0 OR srtt_ms >= 1.1754943508222875e-38) AND srtt_ms <= 1000000000.0",
        ),
        (
            "min_rtt_ms",
            False,
            "(min_rtt_ms = 0 OR min_rtt_ms >= 1.1754943508222875e-38) "
            "AND min_rtt_ms <= 1000000000.0",
        ),
        (
            "advertised_rate_min_bps",
            False,
            "(advertised_rate_min_bps = 0 OR advertised_rate_min_bps >= 1.1754943508222875e-38) "
            "AND advertised_rate_min_bps <= 1000000000000.0",
        ),
        (
            "advertised_rate_max_bps",
            False,
            "(advertised_rate_max_bps = 0 OR advertised_rate_max_bps >= 1.1754943508222875e-38) "
            "AND advertised_rate_max_bps <= 1000000000000.0",
        ),
        (
            "advertised_rate_last_bps",
            False,
            "(advertised_rate_last_bps = 0 OR advertised_rate_last_bps >= 1.1754943508222875e-38) "
            "AND advertised_rate_last_bps <= 1000000000000.0",
        ),
        (
            "advertised_rates_seen",
            False,
            "advertised_rates_seen >= 0 AND advertised_rates_seen <= 2147483647",
        ),
        ("pair", False, "pair >= 0 AND pair <= 2147483647"),
        (
            "queued_ms",
            False,
            "(queued_ms = 0 OR queued_ms >= 1.1754943508222875e-38) AND queued_ms <= 1000000000.0",
        ),
    ),
    "trials": (
        (
            "access_capacity_bps",
            False,
            "access_capacity_bps >= 1.1754943508222875e-38 "
            "AND access_capacity_bps <= 10000000000000.0",
        ),
        (
            "started_at",
            True,
            "started_at >= '1970-01-01T00:00Z' AND started_at <= '2100-01-01T00:00Z'",
        ),
        (
            "finished_at",
            False,
            "finished_at >= '1970-01-01T00:00Z' AND finished_at <= '2100-01-01T00:00Z'",
        ),
    ),
    "trial_periods": (
        ("period_index", True, "period_index >= 0 AND period_index <= 2147483647"),
        ("pair", True, "pair >= 0 AND pair <= 2147483647"),
        (
            "start_offset_s",
            True,
            "(start_offset_s = 0 OR start_offset_s >= 1.1754943508222875e-38) "
            "AND start_offset_s <= 100000000.0",
        ),
        ("duration_s", True, "duration_s >= 1.1754943508222875e-38 AND duration_s <= 100000000.0"),
        (
            "handicap_ms",
            False,
            "(handicap_ms = 0 OR handicap_ms >= 1.1754943508222875e-38) "
            "AND handicap_ms <= 1000000.0",
        ),
        (
            "actual_start_offset_s",
            False,
            "(actual_start_offset_s = 0 OR actual_start_offset_s >= 1.1754943508222875e-38) "
            "AND actual_start_offset_s <= 100000000.0",
        ),
    ),
    "router_runs": (
        (
            "capacity_bps",
            False,
            "(capacity_bps = 0 OR capacity_bps >= 1.1754943508222875e-38) "
            "AND capacity_bps <= 10000000000000.0",
        ),
        (
            "started_at",
            True,
            "started_at >= '1970-01-01T00:00Z' AND started_at <= '2100-01-01T00:00Z'",
        ),
        (
            "finished_at",
            False,
            "finished_at >= '1970-01-01T00:00Z' AND finished_at <= '2100-01-01T00:00Z'",
        ),
    ),
    "router_telemetry": (
        (
            "recorded_at",
            True,
            "recorded_at >= '1970-01-01T00:00Z' AND recorded_at <= '2100-01-01T00:00Z'",
        ),
        ("t", True, "(t = 0 OR t >= 1.1754943508222875e-38) AND t <= 100000000.0"),
        (
            "advertised_rate_bps",
            True,
            "(advertised_rate_bps = 0 OR advertised_rate_bps >= 1.1754943508222875e-38) "
            "AND advertised_rate_bps <= 1000000000000.0",
        ),
        (
            "leading_fragment_len",
            False,
            "leading_fragment_len >= 0 AND leading_fragment_len <= 32767",
        ),
        (
            "input_rate_bps",
            True,
            "(input_rate_bps = 0 OR input_rate_bps >= 1.1754943508222875e-38) "
            "AND input_rate_bps <= 1000000000000.0",
        ),
        (
            "output_rate_bps",
            False,
            "(output_rate_bps = 0 OR output_rate_bps >= 1.1754943508222875e-38) "
            "AND output_rate_bps <= 1000000000000.0",
        ),
        ("queue_bytes", True, "queue_bytes >= 0 AND queue_bytes <= 9223372036854775807"),
        ("queue_packets", False, "queue_packets >= 0 AND queue_packets <= 9223372036854775807"),
        (
            "rtt_ms",
            False,
            "(rtt_ms = 0 OR rtt_ms >= 1.1754943508222875e-38) AND rtt_ms <= 1000000000.0",
        ),
        ("drops", True, "drops >= 0 AND drops <= 9223372036854775807"),
        ("fragmented", True, "fragmented >= 0 AND fragmented <= 9223372036854775807"),
        ("mode_switches", False, "mode_switches >= 0 AND mode_switches <= 9223372036854775807"),
    ),
    "sessions": (
        (
            "rtt_ms",
            False,
            "(rtt_ms = 0 OR rtt_ms >= 1.1754943508222875e-38) AND rtt_ms <= 1000000000.0",
        ),
    ),
    "probe_outcomes": (
        ("ip_len", True, "ip_len >= 0 AND ip_len <= 32767"),
        (
            "rtt_ms",
            False,
            "(rtt_ms = 0 OR rtt_ms >= 1.1754943508222875e-38) AND rtt_ms <= 1000000000.0",
        ),
        ("ack_count", True, "ack_count >= 0 AND ack_count <= 32767"),
        ("received_len", False, "received_len >= 0 AND received_len <= 65535"),
        ("observed_frag_size", False, "observed_frag_size >= 0 AND observed_frag_size <= 65535"),
        (
            "observed_leading_len",
            False,
            "observed_leading_len >= 0 AND observed_leading_len <= 32767",
        ),
        ("observed_fragments", False, "observed_fragments >= 0 AND observed_fragments <= 32767"),
    ),
    "atlas_results": (
        (
            "result_at",
            True,
            "result_at >= '1970-01-01T00:00Z' AND result_at <= '2100-01-01T00:00Z'",
        ),
        (
            "stored_at",
            False,
            "stored_at >= '1970-01-01T00:00Z' AND stored_at <= '2100-01-01T00:00Z'",
        ),
        ("firmware", False, "firmware >= 0 AND firmware <= 2147483647"),
        ("size", False, "size >= 0 AND size <= 65535"),
        ("sent", False, "sent >= 0 AND sent <= 32767"),
        ("rcvd", False, "rcvd >= 0 AND rcvd <= 32767"),
        ("dup", False, "dup >= 0 AND dup <= 32767"),
    ),
    "atlas_outcomes": (
        ("ip_len", False, "ip_len >= 0 AND ip_len <= 32767"),
        (
            "rtt_ms",
            False,
            "(rtt_ms = 0 OR rtt_ms >= 1.1754943508222875e-38) AND rtt_ms <= 1000000000.0",
        ),
        ("ack_count", True, "ack_count >= 0 AND ack_count <= 32767"),
    ),
}
# Each table's key (kept with a quarantined row, to find a nulled row again).
KEYS = {
    "flows": ("id",),
    "trials": ("id",),
    "trial_periods": ("trial_pk", "period_index"),
    "router_runs": ("id",),
    "router_telemetry": ("run_id", "t"),
    "sessions": ("id",),
    "probe_outcomes": ("session_pk", "seq"),
    "atlas_results": ("msm_id", "prb_id", "result_at"),
    "atlas_outcomes": ("msm_id", "prb_id", "result_at", "packet_index"),
}
OLD_FLOW_CHECKS = {
    "ck_flows_size": "size_packets >= 1 AND size_bytes >= 1",
    "ck_flows_ka_mode_fraction": (
        "ka_mode_fraction IS NULL OR (ka_mode_fraction >= 0 AND ka_mode_fraction <= 1)"
    ),
}
# What is computed from a table and must be computed again when it changed.
MATVIEWS = {
    "flows": ("mv_flow_summary", "mv_flow_hourly", "mv_report_fct_bins", "mv_report_ka_mode"),
    "trials": ("mv_flow_summary", "mv_flow_hourly", "mv_report_fct_bins", "mv_report_ka_mode"),
    "sessions": ("mv_session_summary", "mv_probe_daily", "mv_size_clients"),
    "probe_outcomes": ("mv_session_summary", "mv_probe_daily", "mv_size_clients"),
    "atlas_outcomes": ("mv_atlas_probe_drop",),
}
SPEEDUP_SOURCES = ("flows", "trials", "trial_periods")
# The rows that belong to a row of a table (a foreign key, ON DELETE CASCADE):
# a removed row takes them along, so they go to quarantine with it. Per
# child: its table and (its column, the parent's key column, their type).
CHILDREN = {
    "trials": (
        ("trial_periods", (("trial_pk", "id", "bigint"),)),
        ("flows", (("trial_pk", "id", "bigint"),)),
    ),
    "router_runs": (("router_telemetry", (("run_id", "id", "bigint"),)),),
    "atlas_results": (
        (
            "atlas_outcomes",
            (
                ("msm_id", "msm_id", "bigint"),
                ("prb_id", "prb_id", "integer"),
                ("result_at", "result_at", "timestamptz"),
            ),
        ),
    ),
}
# Parents before their children: the order a downgrade puts rows back in.
RESTORE_ORDER = (
    "trials", "trial_periods", "flows", "router_runs", "router_telemetry", "sessions",
    "probe_outcomes", "atlas_results", "atlas_outcomes",
)  # fmt: skip

QUARANTINE = """
CREATE TABLE quarantine (
    id bigint GENERATED BY DEFAULT AS IDENTITY,
    table_name text NOT NULL,
    row_key jsonb NOT NULL,
    columns text[] NOT NULL,
    "row" jsonb NOT NULL,
    action text NOT NULL,
    revision text NOT NULL,
    quarantined_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT pk_quarantine PRIMARY KEY (id),
    CONSTRAINT ck_quarantine_action CHECK (action IN ('nulled', 'removed'))
)
"""


def _outside(table: str) -> dict[str, str]:
    """Per bounded column of ``table``: SQL true where its value is out of bounds."""
    return {col: f"NOT ({sql})" for col, _, sql in CHECKS[table]}


def _key(table: str, row: str) -> str:
    """SQL of the jsonb key of ``table``'s row whose jsonb is ``row``."""
    return "jsonb_build_object(" + ", ".join(f"'{k}', {row} -> '{k}'" for k in KEYS[table]) + ")"


def _quarantine(table: str) -> None:
    """Copy ``table``'s rows out of bounds, whole, to ``quarantine`` (one scan)."""
    outside = _outside(table)
    required = [col for col, not_null, _ in CHECKS[table] if not_null]
    columns = ", ".join(f"CASE WHEN {cond} THEN '{col}' END" for col, cond in outside.items())
    removed = f"r.columns && ARRAY[{', '.join(repr(c) for c in required)}]::text[]"
    op.execute(f"""
        INSERT INTO quarantine (table_name, row_key, columns, "row", action, revision)
        SELECT '{table}', {_key(table, 'r."row"')}, r.columns, r."row",
               CASE WHEN {removed if required else "false"} THEN 'removed' ELSE 'nulled' END,
               '{revision}'
        FROM (
            SELECT to_jsonb(quarantined) AS "row",
                   array_remove(ARRAY[{columns}]::text[], NULL) AS columns
            FROM {table} quarantined
            WHERE {" OR ".join(outside.values())}
        ) r
    """)


def _quarantine_children(parent: str) -> None:
    """The rows that belong to a removed row of ``parent`` go to quarantine with
    it (``columns`` empty: nothing of their own out of bounds); one already
    there for a value of its own set to NULL is removed whole instead."""
    for child, link in CHILDREN[parent]:
        live = " AND ".join(f"quarantined.{c} = (q.row_key ->> '{k}')::{t}" for c, k, t in link)
        kept = " AND ".join(f"(cq.\"row\" ->> '{c}')::{t} = (q.row_key ->> '{k}')::{t}"
                            for c, k, t in link)  # fmt: skip
        removed_parent = f"q.table_name = '{parent}' AND q.action = 'removed'"
        op.execute(f"""
            UPDATE quarantine cq SET action = 'removed'
            FROM quarantine q
            WHERE {removed_parent} AND cq.table_name = '{child}' AND {kept}
        """)
        op.execute(f"""
            INSERT INTO quarantine (table_name, row_key, columns, "row", action, revision)
            SELECT '{child}', {_key(child, 'r."row"')}, '{{}}', r."row", 'removed', '{revision}'
            FROM (
                SELECT to_jsonb(quarantined) AS "row" FROM {child} quarantined
                WHERE EXISTS (SELECT 1 FROM quarantine q WHERE {removed_parent} AND {live})
            ) r
            WHERE NOT EXISTS (
                SELECT 1 FROM quarantine cq
                WHERE cq.table_name = '{child}' AND cq.row_key = {_key(child, 'r."row"')})
        """)


def _repair(table: str) -> None:
    """Remove the rows a NOT NULL column of which is out of bounds, NULL the other values."""
    outside = _outside(table)
    required = [col for col, not_null, _ in CHECKS[table] if not_null]
    if required:
        op.execute(f"DELETE FROM {table} WHERE {' OR '.join(outside[c] for c in required)}")
    for col, not_null, _ in CHECKS[table]:
        if not not_null:
            op.execute(f"UPDATE {table} SET {col} = NULL WHERE {outside[col]}")


def _report() -> set[str]:
    """Log what was quarantined, per table and column; the tables that changed."""
    rows = op.get_bind().execute(
        text("""
            SELECT table_name, col, action, count(*)
            FROM quarantine LEFT JOIN LATERAL unnest(columns) AS col ON true
            GROUP BY 1, 2, 3 ORDER BY 1, 2, 3
        """)
    )
    changed = set()
    for table, col, action, n in rows:
        changed.add(table)
        if col is None:
            log.warning(
                "%s: %d rows of %s removed with the row they belong to (kept in table quarantine)",
                revision,
                n,
                table,
            )
            continue
        what = "row removed" if action == "removed" else "value set to NULL"
        log.warning(
            "%s: %s.%s out of bounds in %d rows: %s (kept in table quarantine)",
            revision,
            table,
            col,
            n,
            what,
        )
    return changed


def _recompute() -> None:
    """What was computed from quarantined rows, computed again (or deleted,
    for the next refresh to compute); nothing when nothing was quarantined."""
    op.execute("""
        DELETE FROM router_telemetry_1s WHERE run_id IN (
            SELECT (row_key ->> 'run_id')::bigint FROM quarantine
            WHERE table_name = 'router_telemetry')
    """)
    op.execute("""
        DELETE FROM router_telemetry_1m WHERE run_id IN (
            SELECT (row_key ->> 'run_id')::bigint FROM quarantine
            WHERE table_name = 'router_telemetry')
    """)
    sources = ", ".join(repr(t) for t in SPEEDUP_SOURCES)
    op.execute(f"""
        DELETE FROM trial_speedups
        WHERE EXISTS (SELECT 1 FROM quarantine WHERE table_name IN ({sources}))
    """)
    for table, names in MATVIEWS.items():
        refresh = " ".join(f"REFRESH MATERIALIZED VIEW {n};" for n in names)
        op.execute(f"""
            DO $$ BEGIN
                IF EXISTS (SELECT 1 FROM quarantine WHERE table_name = '{table}') THEN
                    {refresh}
                END IF;
            END $$
        """)


def upgrade() -> None:
    op.execute(QUARANTINE)
    for table in CHECKS:
        _quarantine(table)
    for parent in CHILDREN:
        _quarantine_children(parent)
    # Offline (--sql), a script for a DBA: every repair, whatever the data.
    changed = set(CHECKS) if context.is_offline_mode() else _report()
    for table in CHECKS:
        if table in changed:
            _repair(table)
    _recompute()
    for name in OLD_FLOW_CHECKS:
        op.execute(f"ALTER TABLE flows DROP CONSTRAINT {name}")
    # One ALTER TABLE per table: its rows are checked against them all in one scan.
    for table, checks in CHECKS.items():
        adds = ", ".join(
            f"ADD CONSTRAINT ck_{table}_{col}_bounds CHECK ({sql})" for col, _, sql in checks
        )
        op.execute(f"ALTER TABLE {table} {adds}")


def downgrade() -> None:
    for table, checks in CHECKS.items():
        for col, _, _ in checks:
            op.execute(f"ALTER TABLE {table} DROP CONSTRAINT ck_{table}_{col}_bounds")
    for name, sql in OLD_FLOW_CHECKS.items():
        op.execute(f"ALTER TABLE flows ADD CONSTRAINT {name} CHECK ({sql})")
    # Every quarantined row back as it was: removed rows whole (parents before
    # their children), nulled values in place.
    for table in RESTORE_ORDER:
        checks = CHECKS[table]
        op.execute(f"""
            INSERT INTO {table}
            SELECT (jsonb_populate_record(NULL::{table}, q."row")).*
            FROM quarantine q WHERE q.table_name = '{table}' AND q.action = 'removed'
            ORDER BY q.id
        """)
        match = " AND ".join(
            f't.{k} = (jsonb_populate_record(NULL::{table}, q."row")).{k}' for k in KEYS[table]
        )
        for col, not_null, _ in checks:
            if not not_null:
                op.execute(f"""
                    UPDATE {table} t
                    SET {col} = (jsonb_populate_record(NULL::{table}, q."row")).{col}
                    FROM quarantine q
                    WHERE q.table_name = '{table}' AND q.action = 'nulled'
                      AND '{col}' = ANY (q.columns) AND {match}
                """)
    op.execute("DROP TABLE quarantine")
