"""Experiment (d), the wide-area round, as an experiment run.

Revision ID: 0025
Revises: 0024
Create Date: 2026-11-28

Issue 24 item 6 (d), the paper's §IV-B in miniature
(``kickass_testbed.wide_area``): one round of paired trials to ten emulated
paths is stored as trials (its flows, per path one trial) and, for the
report's per-path table, as one ``experiment_runs`` row of kind
``wide-area`` whose ``figures`` hold each path's speedup and time in
Kick-Ass mode. The kind's CHECK takes it; a run has no rates.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from kickass_db.base import check_in

revision: str = "0025"
down_revision: str | None = "0024"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen here (a migration does not follow the code): models.experiments.EXPERIMENT_KINDS.
OLD = ("kickass-bottleneck", "legacy-bottleneck")
NEW = (*OLD, "wide-area")
NAME = "ck_experiment_runs_kind"


def upgrade() -> None:
    op.drop_constraint(op.f(NAME), "experiment_runs", type_="check")
    op.create_check_constraint(op.f(NAME), "experiment_runs", check_in("kind", NEW))


def downgrade() -> None:
    # A wide-area run cannot stay under the old CHECK; its trials stay.
    op.execute(f"DELETE FROM experiment_runs WHERE kind NOT IN {OLD!r}")
    op.drop_constraint(op.f(NAME), "experiment_runs", type_="check")
    op.create_check_constraint(op.f(NAME), "experiment_runs", check_in("kind", OLD))
