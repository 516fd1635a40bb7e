"""Beside the matched speedup, the flows an arm failed to finish: ``trial_speedups.sooner``.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-01

The speedup on matched flows leaves out every pair in which either arm's
flow did not complete, so it flatters whichever arm fails more (issue 24:
in the heavy-load bench Kick-Ass lost 34-39 flows, CUBIC 11). ``sooner`` is
the share of matched flows that finished sooner under the arm than under
the baseline, a flow that did not finish ranked slower than any that did,
ties half (``kickass_analysis.stats.sooner``), with its 95% interval over
clusters of period pairs (``sooner_low``, ``sooner_high``; none below two
``sooner_clusters``) and the pairs it compares (``sooner_pairs``: all
matched flows but those a stopped trial or a skipped period never gave
their time). ``v_trial_speedups`` gains the five columns at its end.

The rows computed before have none of it: they are deleted (derived data,
as 0015 did), the next scheduled refresh writes them again, and until then
the report computes both from the flows.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = """scope, key, destination, access_capacity_bps, arm, baseline_arm, size_bucket,
       pairs, matched, speedup, speedup_low, speedup_high,
       completion_arm, completion_baseline, workload, computed_at, clusters"""
ADDED = "sooner, sooner_low, sooner_high, sooner_pairs, sooner_clusters"


def upgrade() -> None:
    op.execute("DELETE FROM trial_speedups")
    op.execute("""
        ALTER TABLE trial_speedups
            ADD COLUMN sooner double precision,
            ADD COLUMN sooner_low double precision,
            ADD COLUMN sooner_high double precision,
            ADD COLUMN sooner_pairs integer,
            ADD COLUMN sooner_clusters integer
    """)
    op.execute(
        f"CREATE OR REPLACE VIEW v_trial_speedups AS SELECT {COLUMNS}, {ADDED} FROM trial_speedups"
    )


def downgrade() -> None:
    # A view cannot lose a column in place; the reader role's grant goes with it.
    op.execute("DROP VIEW v_trial_speedups")
    op.execute(f"CREATE VIEW v_trial_speedups AS SELECT {COLUMNS} FROM trial_speedups")
    for column in ADDED.split(", "):
        op.execute(f"ALTER TABLE trial_speedups DROP COLUMN {column}")
    op.execute("DELETE FROM trial_speedups")
