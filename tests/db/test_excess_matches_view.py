"""The verdict's split excess (kickass_core.verdict.excess) is the same double
as PostgreSQL's for migration 0007's formula (``v_session_summary``'s
split_excess_drop, _low, _high), for every count: the verdict, the view and
the archive's engines (which take the verdict's) never disagree in a bit."""

from __future__ import annotations

import random

import psycopg
from kickass_core import verdict
from kickass_db import libpq_url

# 0007's expressions (v_session_summary), on a VALUES list of counts.
SQL = """
SELECT r.excess, r.excess - r.half, r.excess + r.half
FROM (VALUES {rows}) c(i, whole_sent, whole_acked, split_sent, split_acked)
CROSS JOIN LATERAL (
    SELECT (c.whole_sent - c.whole_acked)::double precision / c.whole_sent AS whole_drop_rate,
           (c.split_sent - c.split_acked)::double precision / c.split_sent AS split_drop_rate,
           (c.whole_sent - c.whole_acked + 1)::double precision / (c.whole_sent + 2) AS w,
           (c.split_sent - c.split_acked + 1)::double precision / (c.split_sent + 2) AS s
) a
CROSS JOIN LATERAL (
    SELECT a.split_drop_rate - (1 - (1 - a.whole_drop_rate) ^ 2) AS excess,
           1.96 * sqrt(a.s * (1 - a.s) / c.split_sent
                       + (2 * (1 - a.w)) ^ 2 * a.w * (1 - a.w) / c.whole_sent) AS half
) r
ORDER BY c.i
"""


def test_the_verdicts_excess_is_postgresqls_to_the_bit(database_url: str) -> None:
    rng = random.Random(7)
    counts = [(82, 66, 100, 90)]  # the counts Java's pow and C's round apart
    for _ in range(3000):
        ws, ss = rng.randint(1, 20_000), rng.randint(1, 20_000)
        counts.append((ws, rng.randint(0, ws), ss, rng.randint(0, ss)))
    rows = ", ".join(f"({i}, {ws}, {wa}, {ss}, {sa})" for i, (ws, wa, ss, sa) in enumerate(counts))
    with psycopg.connect(libpq_url(database_url)) as conn:
        got = conn.execute(SQL.format(rows=rows)).fetchall()
    for c, pg in zip(counts, got, strict=True):
        x = verdict.excess(*c)
        assert x is not None
        assert (x.estimate, x.low, x.high) == pg, c
