"""Analysis views: the stable columns dashboards, notebooks and the API read.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21

Conventions shared by every view:
- ``sent`` counts probe_outcomes rows (every probe the server resolved);
  ``acked`` counts only outcome 'acked'; ``late`` (acked after its timeout)
  counts as lost, as in the paper, and is reported on its own.
- ``drop_rate = 1 - acked/sent``, NULL when nothing was sent.
- Fragment observations (IP_RECVFRAGSIZE) are counted among acked probes, so
  they read as fractions of ``acked``.
- A split datagram is 1500 bytes of IP: its second fragment has IP length
  20 + (1480 - (leading - 20)) = 1520 - leading, so an intact split reports
  greatest(leading, 1520 - leading) (kickass_core.plan.expected_max_fragment).

Changing a view's columns means a new view or a new migration that keeps
the old columns: dashboards in the field depend on these names.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FINAL_STATES = "('complete', 'ended', 'expired', 'incomplete')"

# Per-size aggregates over probe_outcomes rows ``o`` of one phase.
PER_SIZE = """
    count(*) AS sent,
    count(*) FILTER (WHERE o.outcome = 'acked') AS acked,
    count(*) FILTER (WHERE o.outcome = 'late') AS late,
    count(*) FILTER (WHERE o.outcome <> 'acked')::double precision / count(*) AS drop_rate"""
WHOLE_EXTRA = """
    percentile_cont(0.5) WITHIN GROUP (ORDER BY o.rtt_ms)
        FILTER (WHERE o.outcome = 'acked') AS rtt_ms_median,
    count(*) FILTER (WHERE o.outcome = 'acked' AND o.observed_frag_size > 0)
        AS fragmented_on_arrival"""
SPLIT_EXTRA = """
    count(*) FILTER (WHERE o.outcome = 'acked' AND o.observed_frag_size > 0) AS frag_observed,
    count(*) FILTER (
        WHERE o.outcome = 'acked'
          AND o.observed_frag_size = greatest(o.ip_len, 1520 - o.ip_len)
    ) AS arrived_as_sent"""

VIEWS: dict[str, tuple[str, str]] = {
    "v_whole_drop": (
        f"""
SELECT
    s.session_id,
    o.ip_len::integer AS ip_len,{PER_SIZE},{WHOLE_EXTRA}
FROM probe_outcomes o
JOIN sessions s ON s.id = o.session_pk
WHERE o.phase = 'whole'
GROUP BY s.session_id, o.ip_len
""",
        "Per session and whole-packet IP length: probes sent, acked, late, drop rate, "
        "median RTT of acked probes, acked probes that arrived fragmented.",
    ),
    "v_split_drop": (
        f"""
SELECT
    s.session_id,
    o.ip_len::integer AS leading_ip_len,{PER_SIZE},{SPLIT_EXTRA}
FROM probe_outcomes o
JOIN sessions s ON s.id = o.session_pk
WHERE o.phase = 'split'
GROUP BY s.session_id, o.ip_len
""",
        "Per session and leading-fragment IP length of 1500-byte split datagrams: sent, "
        "acked, late, drop rate, acked with a fragment size observed, acked that arrived "
        "split exactly as sent.",
    ),
    "v_session_summary": (
        """
SELECT
    s.session_id,
    s.state,
    s.verdict,
    s.verdict_reason,
    s.created_at,
    s.finished_at,
    s.client_version,
    s.server_version,
    s.source_address,
    c.whole_sent,
    c.whole_acked,
    r.whole_drop_rate,
    c.split_sent,
    c.split_acked,
    r.split_drop_rate,
    r.split_drop_rate / nullif(r.whole_drop_rate, 0) AS split_to_whole_ratio
FROM sessions s
CROSS JOIN LATERAL (
    SELECT
        count(*) FILTER (WHERE o.phase = 'whole') AS whole_sent,
        count(*) FILTER (WHERE o.phase = 'whole' AND o.outcome = 'acked') AS whole_acked,
        count(*) FILTER (WHERE o.phase = 'split') AS split_sent,
        count(*) FILTER (WHERE o.phase = 'split' AND o.outcome = 'acked') AS split_acked
    FROM probe_outcomes o
    WHERE o.session_pk = s.id
) c
CROSS JOIN LATERAL (
    SELECT
        (c.whole_sent - c.whole_acked)::double precision / nullif(c.whole_sent, 0)
            AS whole_drop_rate,
        (c.split_sent - c.split_acked)::double precision / nullif(c.split_sent, 0)
            AS split_drop_rate
) r
""",
        "One row per session: state, verdict and pooled drop rates per phase. "
        "split_to_whole_ratio is NULL when the whole drop rate is 0 (the paper's bound is "
        "a ratio of at most about 2).",
    ),
    "v_client_verdicts": (
        f"""
SELECT
    c.id AS client_id,
    c.install_id,
    c.last_address,
    n.sessions,
    l.session_id AS latest_session_id,
    l.verdict AS latest_verdict,
    l.finished_at AS latest_finished_at
FROM clients c
CROSS JOIN LATERAL (
    SELECT count(*) AS sessions FROM sessions s WHERE s.client_id = c.id
) n
LEFT JOIN LATERAL (
    SELECT s.session_id, s.verdict, s.finished_at
    FROM sessions s
    WHERE s.client_id = c.id AND s.state IN {FINAL_STATES}
    ORDER BY s.finished_at DESC NULLS LAST, s.id DESC
    LIMIT 1
) l ON true
""",
        "One row per client: number of sessions, and its most recently finished session "
        "with that session's verdict (NULL while none has finished).",
    ),
    "v_size_drop_all": (
        f"""
SELECT
    o.ip_len::integer AS ip_len,
    count(DISTINCT o.session_pk) AS sessions,{PER_SIZE},{WHOLE_EXTRA}
FROM probe_outcomes o
JOIN sessions s ON s.id = o.session_pk
WHERE o.phase = 'whole' AND s.state IN {FINAL_STATES}
GROUP BY o.ip_len
""",
        "Per whole-packet IP length, pooled over every finished session: the paper's "
        "drop rate by packet size.",
    ),
    "v_split_drop_all": (
        f"""
SELECT
    o.ip_len::integer AS leading_ip_len,
    count(DISTINCT o.session_pk) AS sessions,{PER_SIZE},{SPLIT_EXTRA}
FROM probe_outcomes o
JOIN sessions s ON s.id = o.session_pk
WHERE o.phase = 'split' AND s.state IN {FINAL_STATES}
GROUP BY o.ip_len
""",
        "Per leading-fragment IP length, pooled over every finished session: the paper's "
        "drop rate by split.",
    ),
}


def upgrade() -> None:
    for name, (query, comment) in VIEWS.items():
        op.execute(f"CREATE VIEW {name} AS {query}")
        quoted = comment.replace("'", "''")
        op.execute(f"COMMENT ON VIEW {name} IS '{quoted}'")


def downgrade() -> None:
    for name in reversed(VIEWS):
        op.execute(f"DROP VIEW {name}")
