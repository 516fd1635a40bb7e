"""The speedup's interval over period pairs: ``trial_speedups.clusters``.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-27

The interval stored with each speedup was a bootstrap over matched flows,
as if every flow were an independent draw. Flows of one period pair share
that time's conditions, so the interval claimed far more than it knew: an
A/A calibration (the same TCP arm twice) gave 1.014 [1.007, 1.023]. The
interval is now over clusters of period pairs (``kickass_analysis.stats``),
and ``clusters`` says how many stand behind it (below 2: no interval).

The rows computed the old way are deleted: they are derived data, the next
scheduled refresh recomputes them, and until then the report computes the
speedup from the flows (as it does before any refresh).
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = """scope, key, destination, access_capacity_bps, arm, baseline_arm, size_bucket,
       pairs, matched, speedup, speedup_low, speedup_high,
       completion_arm, completion_baseline, workload, computed_at"""


def upgrade() -> None:
    op.execute("DELETE FROM trial_speedups")
    op.execute("ALTER TABLE trial_speedups ADD COLUMN clusters integer")
    op.execute(
        f"CREATE OR REPLACE VIEW v_trial_speedups AS SELECT {COLUMNS}, clusters FROM trial_speedups"
    )


def downgrade() -> None:
    # A view cannot lose a column in place; the reader role's grant goes with it.
    op.execute("DROP VIEW v_trial_speedups")
    op.execute(f"CREATE VIEW v_trial_speedups AS SELECT {COLUMNS} FROM trial_speedups")
    op.execute("ALTER TABLE trial_speedups DROP COLUMN clusters")
    op.execute("DELETE FROM trial_speedups")
