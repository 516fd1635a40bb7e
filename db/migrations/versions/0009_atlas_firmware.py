"""RIPE Atlas against the real probe firmware (issue 17): the reply log tells a
re-sent sequence number from a duplicated request, results keep when Atlas
stored them and where they came from, a result that cannot be joined is kept
as such.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-25

What the probe firmware (``eperd/ping.c``) does that 0006 did not model:
after the first reply of a run, a lost reply leaves no entry in the result
and the next echo request *re-uses* the same sequence number. The responder
now answers a re-used sequence number as a new request (the split sweep moves
on) and logs which attempt it was:

- ``atlas_reply_log.attempt``: 0 for the first request with a sequence
  number from a probe (requester, ICMP id, target, size), 1, 2, ... for each
  re-send of that sequence number with new data (the probe's send time
  changed). Only requests that reached the responder are counted.
- ``atlas_reply_log.duplicate``: the request was a byte-identical copy of
  one already answered (a duplicated packet, not a re-send); it got the same
  split again and is not a request of its own.
- ``atlas_outcomes.attempt``: the logged attempt the outcome is about.

Results:

- ``atlas_results.stored_at``: Atlas's ``stored_timestamp`` (when the result
  reached RIPE's store; probes upload late). NULL when the line had none.
- ``atlas_results.origin``: ``fetch`` (the results API) or ``import``
  (``kickass atlas import``: files, archive dumps).
- ``atlas_results.join_status`` gains ``invalid``: a result of one of our
  measurements that could not be read or joined (``join_error`` says why);
  it is stored with no outcomes so that a fetch never stops on it.

Late uploads: the results API filters by ``timestamp`` only, and probes
upload late (a probe offline for hours uploads its buffered results when it
is back). ``fetch`` reads each window once when it has settled, and once
more when it is ``late_horizon`` old:

- ``atlas_measurements.rechecked_until``: every window before this was read
  the second time.
- ``atlas_measurements.results_late``: results the second read found (they
  were uploaded after the first one).

``v_atlas_measurements`` gains, at the end, ``results_late``,
``rechecked_until`` and ``results_invalid``; every other view keeps its
columns and definitions.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_JOIN = "('exact', 'ambiguous', 'inconsistent', 'no-log', 'aggregate')"
NEW_JOIN = "('exact', 'ambiguous', 'inconsistent', 'no-log', 'aggregate', 'invalid')"

# 0006's v_atlas_measurements, unchanged, then the new columns at the end.
MEASUREMENTS_0006 = """
SELECT
    c.name AS campaign,
    m.msm_id, m.phase, m.target, m.ip_len::integer AS ip_len, m.size, m.packets,
    m.interval_s, m.probes_requested, m.status_id::integer AS status_id, m.status_name,
    m.estimated_credits, m.credits_per_result,
    m.results_fetched,
    m.results_fetched::bigint
        * coalesce(m.credits_per_result, m.packets * (m.size / 1500 + 1)) AS credits_spent,
    m.fetched_until, m.last_fetch_at, m.last_error, m.created_at, m.start_time, m.stop_time"""
MEASUREMENTS_FROM = """
FROM atlas_measurements m
JOIN atlas_campaigns c ON c.id = m.campaign_id
"""
MEASUREMENTS_0009 = (
    MEASUREMENTS_0006
    + """,
    m.results_late,
    m.rechecked_until,
    (SELECT count(*) FROM atlas_results r
     WHERE r.msm_id = m.msm_id AND r.join_status = 'invalid') AS results_invalid"""
    + MEASUREMENTS_FROM
)
MEASUREMENTS_COMMENT_0006 = (
    "One row per Atlas measurement: its campaign, phase, size, Atlas status, results "
    "fetched so far and the credits they cost (results x credits_per_result read back "
    "from Atlas, else the Atlas rule packets x (size div 1500 + 1))."
)
MEASUREMENTS_COMMENT = (
    "One row per Atlas measurement: its campaign, phase, size, Atlas status, results "
    "fetched so far and the credits they cost (results x credits_per_result read back "
    "from Atlas, else the Atlas rule packets x (size div 1500 + 1)); since 0009 the "
    "results only a late re-read found (uploaded late), how far that re-read got, and "
    "the results that could not be joined (join_status invalid)."
)


def upgrade() -> None:
    op.add_column(
        "atlas_reply_log",
        sa.Column("attempt", sa.SmallInteger(), server_default="0", nullable=False),
    )
    op.add_column(
        "atlas_reply_log",
        sa.Column("duplicate", sa.Boolean(), server_default=sa.text("false"), nullable=False),
    )
    op.add_column(
        "atlas_results", sa.Column("stored_at", sa.DateTime(timezone=True), nullable=True)
    )
    op.add_column(
        "atlas_results",
        sa.Column("origin", sa.Text(), server_default="fetch", nullable=False),
    )
    op.add_column("atlas_results", sa.Column("join_error", sa.Text(), nullable=True))
    op.create_check_constraint(
        op.f("ck_atlas_results_origin"), "atlas_results", "origin IN ('fetch', 'import')"
    )
    op.drop_constraint(op.f("ck_atlas_results_join_status"), "atlas_results", type_="check")
    op.create_check_constraint(
        op.f("ck_atlas_results_join_status"), "atlas_results", f"join_status IN {NEW_JOIN}"
    )
    op.add_column("atlas_outcomes", sa.Column("attempt", sa.SmallInteger(), nullable=True))
    op.add_column(
        "atlas_measurements",
        sa.Column("rechecked_until", sa.DateTime(timezone=True), nullable=True),
    )
    op.add_column(
        "atlas_measurements",
        sa.Column("results_late", sa.Integer(), server_default="0", nullable=False),
    )
    op.execute(f"CREATE OR REPLACE VIEW v_atlas_measurements AS {MEASUREMENTS_0009}")
    quoted = MEASUREMENTS_COMMENT.replace("'", "''")
    op.execute(f"COMMENT ON VIEW v_atlas_measurements IS '{quoted}'")


def downgrade() -> None:
    # CREATE OR REPLACE cannot drop columns: back to 0006's view by DROP + CREATE.
    op.execute("DROP VIEW v_atlas_measurements")
    op.execute(f"CREATE VIEW v_atlas_measurements AS {MEASUREMENTS_0006}{MEASUREMENTS_FROM}")
    quoted = MEASUREMENTS_COMMENT_0006.replace("'", "''")
    op.execute(f"COMMENT ON VIEW v_atlas_measurements IS '{quoted}'")
    op.drop_column("atlas_measurements", "results_late")
    op.drop_column("atlas_measurements", "rechecked_until")
    op.drop_column("atlas_outcomes", "attempt")
    # Results that could not be joined have no place in 0006's schema.
    op.execute("DELETE FROM atlas_results WHERE join_status = 'invalid'")
    op.drop_constraint(op.f("ck_atlas_results_join_status"), "atlas_results", type_="check")
    op.create_check_constraint(
        op.f("ck_atlas_results_join_status"), "atlas_results", f"join_status IN {OLD_JOIN}"
    )
    op.drop_constraint(op.f("ck_atlas_results_origin"), "atlas_results", type_="check")
    op.drop_column("atlas_results", "join_error")
    op.drop_column("atlas_results", "origin")
    op.drop_column("atlas_results", "stored_at")
    op.drop_column("atlas_reply_log", "duplicate")
    op.drop_column("atlas_reply_log", "attempt")
