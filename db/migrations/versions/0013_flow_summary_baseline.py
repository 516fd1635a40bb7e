"""v_flow_summary: one row per group, whatever TCP arms a destination has.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-25

0010's view joined each group to every TCP arm named ``tcp`` (trials before
arms) or ``tcp:cubic``: a destination with trials of both kinds had every
row twice, and sums over the view counted flows twice (found by the
dashboards' rollup, which had to number its rows). The pooled ratio of means
(``speedup``, kept for old readers) now takes one baseline per group,
``tcp:cubic`` where there is one, else ``tcp``, and only for Kick-Ass rows.
The columns, their names and order are unchanged, so the views built on it
(0012's ``mv_flow_summary``) stay as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

POOLED = """
WITH pooled AS (
    SELECT destination, access_capacity_bps, protocol, coalesce(arm, protocol) AS arm,
           size_bucket,
           count(*) AS flows,
           count(fct_ms) AS completed,
           avg(fct_ms) AS fct_ms_mean,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY fct_ms) AS fct_ms_p50,
           percentile_cont(0.95) WITHIN GROUP (ORDER BY fct_ms) AS fct_ms_p95,
           avg(ka_mode_fraction) AS ka_mode_fraction_mean
    FROM v_flow_results
    GROUP BY destination, access_capacity_bps, protocol, coalesce(arm, protocol), size_bucket
)
SELECT k.destination, k.access_capacity_bps, k.protocol, k.size_bucket,
       k.flows, k.completed, k.fct_ms_mean, k.fct_ms_p50, k.fct_ms_p95,
       k.ka_mode_fraction_mean,
       -- The pooled ratio of means (kept for old readers): the paired speedup
       -- with its interval is v_trial_speedups.
       CASE WHEN k.protocol = 'kickass' AND k.fct_ms_mean > 0
            THEN tcp.fct_ms_mean / k.fct_ms_mean END AS speedup,
       k.arm,
       k.completed::double precision / nullif(k.flows, 0) AS completion_rate
FROM pooled k
"""

ONE_BASELINE = (
    POOLED
    + """
LEFT JOIN LATERAL (
    SELECT b.fct_ms_mean FROM pooled b
    WHERE k.protocol = 'kickass' AND b.arm IN ('tcp:cubic', 'tcp')
      AND b.destination = k.destination AND b.size_bucket = k.size_bucket
      AND b.access_capacity_bps IS NOT DISTINCT FROM k.access_capacity_bps
    ORDER BY b.arm = 'tcp:cubic' DESC
    LIMIT 1
) tcp ON true
"""
)

EVERY_BASELINE_0010 = (
    POOLED
    + """
LEFT JOIN pooled tcp
  ON tcp.arm IN ('tcp', 'tcp:cubic') AND tcp.destination = k.destination
 AND tcp.size_bucket = k.size_bucket
 AND tcp.access_capacity_bps IS NOT DISTINCT FROM k.access_capacity_bps
"""
)


def upgrade() -> None:
    op.execute("CREATE OR REPLACE VIEW v_flow_summary AS " + ONE_BASELINE)


def downgrade() -> None:
    op.execute("CREATE OR REPLACE VIEW v_flow_summary AS " + EVERY_BASELINE_0010)
