"""The report's trial figures and the volunteer page's largest group at scale.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-25

`kickass report` drew its trials section from every row of v_flow_results,
read into Python: seconds at a million flows. These two functions compute the
same numbers in PostgreSQL (exact: percentile_cont is numpy's linear
percentile; the CDF is the flows' ECDF at the same ranks ``stats.thin``
keeps), and a materialised view of each holds them for the whole history,
refreshed with the other rollups (``kickass_analysis.rollups``). The report
reads a view while it holds every flow, and calls the function
(``since``: flows started from then on) otherwise.

- ``report_fct_bins(since)``: per access capacity, arm and protocol, both per
  power-of-two size bin (``size_bucket`` NULL) and per size bucket
  (``size_bin`` NULL): flows, completed flows, FCT mean, p50 and p95 of the
  completed ones.
- ``report_ka_mode(since, points)``: per access capacity and Kick-Ass arm,
  the flows with a known ka_mode_fraction, its mean and median, the share of
  all completed flows' time spent in Kick-Ass mode, and the ECDF at no more
  than ``points`` ranks (``cdf_x``, ``cdf_y``).
- ``mv_report_fct_bins`` and ``mv_report_ka_mode`` (600 points: the figures'
  MAX_POINTS): the functions over every flow; ``v_report_fct_bins`` and
  ``v_report_ka_mode`` their views (the reader role's way in).
- ``mv_size_clients``: per phase and IP length, the distinct clients that
  measured it in a finished session (the volunteer page's "all other
  volunteers" group reads its sums from ``v_drop_rollup`` and this).
- ``v_flow_count``: how many flows are stored (the report's test of whether
  the views hold every flow).
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The report's arm label: trials from before arms have none.
ARM = "coalesce(f.arm, f.protocol || coalesce(':' || f.congestion_control, ''))"

FCT_BINS = f"""
CREATE FUNCTION report_fct_bins(since timestamptz)
RETURNS TABLE (access_capacity_bps double precision, arm text, protocol text,
               size_bin integer, size_bucket text, flows bigint, completed bigint,
               fct_ms_mean double precision, fct_ms_p50 double precision,
               fct_ms_p95 double precision)
LANGUAGE sql STABLE AS $$
SELECT cap, arm, protocol, size_bin, size_bucket, flows, completed, mean, q[1], q[2]
FROM (
    SELECT cap, arm, protocol, size_bin, size_bucket, count(*) AS flows,
           count(*) FILTER (WHERE done) AS completed,
           avg(fct_ms) FILTER (WHERE done) AS mean,
           percentile_cont(ARRAY[0.5, 0.95]) WITHIN GROUP (ORDER BY fct_ms)
               FILTER (WHERE done) AS q
    FROM (
        SELECT t.access_capacity_bps AS cap, {ARM} AS arm, f.protocol, f.fct_ms,
               f.completed AND f.fct_ms IS NOT NULL AS done,
               -- stats.size_bin: the bin's lowest size, 1, 2, 4, ... packets
               CASE WHEN f.size_packets < 2 THEN 1
                    ELSE 1 << (length(ltrim(f.size_packets::bit(32)::text, '0')) - 1) END
                   AS size_bin,
               CASE WHEN f.size_packets <= 10 THEN '1-10'
                    WHEN f.size_packets <= 100 THEN '11-100'
                    WHEN f.size_packets <= 1000 THEN '101-1000'
                    ELSE '1001+' END AS size_bucket
        FROM flows f JOIN trials t ON t.id = f.trial_pk
        WHERE since IS NULL OR f.started_at >= since
    ) x
    GROUP BY GROUPING SETS ((cap, arm, protocol, size_bin), (cap, arm, protocol, size_bucket))
) g
$$
"""

# The ECDF's ranks kept: every one up to ``points``, else ``points`` ranks
# evenly spread with the first and last (stats.thin, rounding half up).
KA_MODE = f"""
CREATE FUNCTION report_ka_mode(since timestamptz, points integer)
RETURNS TABLE (access_capacity_bps double precision, arm text, flows bigint,
               mean double precision, median double precision,
               share_of_time double precision,
               cdf_x double precision[], cdf_y double precision[])
LANGUAGE sql STABLE AS $$
WITH k AS (
    SELECT t.access_capacity_bps AS cap, {ARM} AS arm,
           -- Through text: the value a client reads (the REAL's shortest
           -- decimal), not its binary expansion, so the numbers agree with Python's.
           CASE WHEN f.ka_mode_fraction <> 'NaN'
                THEN f.ka_mode_fraction::text::double precision END AS x,
           CASE WHEN f.completed THEN f.fct_ms END AS fct
    FROM flows f JOIN trials t ON t.id = f.trial_pk
    WHERE f.protocol = 'kickass' AND (since IS NULL OR f.started_at >= since)
), s AS (
    SELECT cap, arm, count(x) AS n, avg(x) AS mean,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY x) AS median,
           sum(x * fct) FILTER (WHERE fct > 0)
               / nullif(sum(fct) FILTER (WHERE fct > 0 AND x IS NOT NULL), 0) AS share
    FROM k GROUP BY cap, arm
), r AS (
    SELECT cap, arm, x, row_number() OVER (PARTITION BY cap, arm ORDER BY x) - 1 AS j
    FROM k WHERE x IS NOT NULL
), keep AS (
    SELECT DISTINCT s.cap, s.arm, s.n,
           CASE WHEN s.n <= points THEN g
                ELSE (2 * g * (s.n - 1) + (points - 1)) / (2 * (points - 1)) END AS j
    FROM s CROSS JOIN LATERAL generate_series(0, least(s.n, points) - 1) g
    WHERE s.n > 0
), c AS (
    SELECT r.cap, r.arm, array_agg(r.x ORDER BY r.j) AS xs,
           array_agg((r.j + 1)::double precision / keep.n ORDER BY r.j) AS ys
    FROM r JOIN keep ON keep.cap IS NOT DISTINCT FROM r.cap AND keep.arm = r.arm
                    AND keep.j = r.j
    GROUP BY r.cap, r.arm
)
SELECT s.cap, s.arm, s.n, s.mean, s.median, s.share, c.xs, c.ys
FROM s LEFT JOIN c ON c.cap IS NOT DISTINCT FROM s.cap AND c.arm = s.arm
$$
"""

POINTS = 600  # kickass_analysis.figures.MAX_POINTS

FINAL = "('complete', 'ended', 'expired', 'incomplete')"

# The volunteer page's "all other volunteers": how many distinct clients
# measured each size (a size measured by fewer than k is not shown). Refreshed
# with mv_session_summary in one snapshot, so it counts the same sessions; the
# page adds those finished since from the outcomes.
SIZE_CLIENTS = f"""
SELECT x.phase, x.ip_len,
       count(DISTINCT coalesce(c.install_id, 'addr:' || host(s.source_address))) AS clients
FROM (SELECT DISTINCT session_pk, phase, ip_len::integer AS ip_len FROM probe_outcomes) x
JOIN sessions s ON s.id = x.session_pk
LEFT JOIN clients c ON c.id = s.client_id
WHERE s.state IN {FINAL}
GROUP BY x.phase, x.ip_len
"""

MATVIEWS = {
    "mv_report_fct_bins": "SELECT row_number() OVER () AS rn, * FROM report_fct_bins(NULL)",
    "mv_report_ka_mode": (
        f"SELECT row_number() OVER () AS rn, * FROM report_ka_mode(NULL, {POINTS})"
    ),
}


def upgrade() -> None:
    op.execute("CREATE VIEW v_flow_count AS SELECT count(*) AS flows FROM flows")
    op.execute(FCT_BINS)
    op.execute(KA_MODE)
    for name, body in MATVIEWS.items():
        op.execute(f"CREATE MATERIALIZED VIEW {name} AS {body}")
        # REFRESH ... CONCURRENTLY needs a unique index.
        op.execute(f"CREATE UNIQUE INDEX ux_{name} ON {name} (rn)")
        op.execute(f"CREATE VIEW v_{name[3:]} AS SELECT * FROM {name}")
    op.execute(f"CREATE MATERIALIZED VIEW mv_size_clients AS {SIZE_CLIENTS}")
    op.execute("CREATE UNIQUE INDEX ux_mv_size_clients ON mv_size_clients (phase, ip_len)")


def downgrade() -> None:
    op.execute("DROP MATERIALIZED VIEW mv_size_clients")
    for name in MATVIEWS:
        op.execute(f"DROP VIEW v_{name[3:]}")
        op.execute(f"DROP MATERIALIZED VIEW {name}")
    op.execute("DROP FUNCTION report_ka_mode(timestamptz, integer)")
    op.execute("DROP FUNCTION report_fct_bins(timestamptz)")
    op.execute("DROP VIEW v_flow_count")
