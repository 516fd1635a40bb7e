"""RIPE Atlas campaigns: campaigns, measurements, probes, results, the reply log, verdicts;
views comparing Atlas probes with volunteers, marked by source.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23

How an Atlas result becomes rows (kickass_atlas.ingest):

- ``atlas_results``: one row per Atlas result (one ping of one probe), the raw
  JSON kept as Atlas served it.
- ``atlas_outcomes``: one row per echo request of that ping, joined to the
  responder's reply log (``atlas_reply_log``): ``acked`` (our reply arrived),
  ``lost`` (we replied, nothing came back in time), ``late`` (we replied, it
  came back after the probe's timeout: Atlas lists it as a duplicate), and two
  outcomes that are *not* about our replies and so stay out of every drop
  rate: ``unanswered`` (the request never reached the responder, or was over
  its rate caps) and ``error`` (the probe could not send it).
- ``ip_len``: whole: the reply's IP length; split: the leading fragment's IP
  length the responder cut that reply at (from the log); NULL when no log row
  tells it.

The drop-rate conventions are the volunteers' (0002): ``sent`` counts outcomes
acked/lost/late, ``drop_rate = 1 - acked/sent``, late counts as lost.

The existing views stay what they were (volunteers only: dashboards in the
field read them). New ``*_by_source`` views put both sources side by side, in
the volunteers' columns plus ``source`` ('volunteer' | 'atlas') first and the
Atlas probe's campaign, id, ASN and country at the end.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0006"
# 0005 is the wide-area trials' migration, written at the same time.
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FINAL_STATES = "('complete', 'ended', 'expired', 'incomplete')"
COUNTED = "('acked', 'lost', 'late')"

# Per-size aggregates over atlas_outcomes rows ``o`` (the volunteers' PER_SIZE).
ATLAS_PER_SIZE = f"""
    count(*) FILTER (WHERE o.outcome IN {COUNTED}) AS sent,
    count(*) FILTER (WHERE o.outcome = 'acked') AS acked,
    count(*) FILTER (WHERE o.outcome = 'late') AS late,
    count(*) FILTER (WHERE o.outcome IN ('lost', 'late'))::double precision
        / nullif(count(*) FILTER (WHERE o.outcome IN {COUNTED}), 0) AS drop_rate"""
ATLAS_RTT = """
    percentile_cont(0.5) WITHIN GROUP (ORDER BY o.rtt_ms)
        FILTER (WHERE o.outcome = 'acked') AS rtt_ms_median"""
# An Atlas probe within a campaign plays the part of a volunteer's session.
ATLAS_SESSION_ID = "'atlas:' || c.name || ':' || o.prb_id"

VIEWS: dict[str, tuple[str, str]] = {
    "v_atlas_whole_drop": (
        f"""
SELECT
    c.name AS campaign,
    o.prb_id,
    o.ip_len::integer AS ip_len,{ATLAS_PER_SIZE},{ATLAS_RTT},
    count(*) FILTER (WHERE o.outcome = 'unanswered') AS unanswered,
    p.asn_v4 AS asn,
    p.country_code
FROM atlas_outcomes o
JOIN atlas_campaigns c ON c.id = o.campaign_id
LEFT JOIN atlas_probes p ON p.prb_id = o.prb_id
WHERE o.phase = 'whole' AND o.ip_len IS NOT NULL
GROUP BY c.name, o.prb_id, o.ip_len, p.asn_v4, p.country_code
""",
        "Per Atlas campaign, probe and whole echo reply IP length: replies sent, acked, late, "
        "drop rate, median RTT of acked, requests that never reached the responder "
        "(unanswered, not in the drop rate), and the probe's ASN and country.",
    ),
    "v_atlas_split_drop": (
        f"""
SELECT
    c.name AS campaign,
    o.prb_id,
    o.ip_len::integer AS leading_ip_len,{ATLAS_PER_SIZE},{ATLAS_RTT},
    p.asn_v4 AS asn,
    p.country_code
FROM atlas_outcomes o
JOIN atlas_campaigns c ON c.id = o.campaign_id
LEFT JOIN atlas_probes p ON p.prb_id = o.prb_id
WHERE o.phase = 'split' AND o.ip_len IS NOT NULL
GROUP BY c.name, o.prb_id, o.ip_len, p.asn_v4, p.country_code
""",
        "Per Atlas campaign, probe and leading-fragment IP length of 1500-byte split echo "
        "replies: sent, acked, late, drop rate, median RTT of acked, the probe's ASN and country.",
    ),
    "v_size_drop_by_source": (
        f"""
SELECT
    'volunteer'::text AS source,
    v.ip_len, v.sessions, v.sent, v.acked, v.late, v.drop_rate, v.rtt_ms_median,
    v.fragmented_on_arrival
FROM v_size_drop_all v
UNION ALL
SELECT
    'atlas'::text AS source,
    o.ip_len::integer AS ip_len,
    count(DISTINCT (o.campaign_id, o.prb_id)) FILTER (WHERE o.outcome IN {COUNTED})
        AS sessions,{ATLAS_PER_SIZE},{ATLAS_RTT},
    NULL::bigint AS fragmented_on_arrival
FROM atlas_outcomes o
WHERE o.phase = 'whole' AND o.ip_len IS NOT NULL
GROUP BY o.ip_len
HAVING count(*) FILTER (WHERE o.outcome IN {COUNTED}) > 0
""",
        "v_size_drop_all for both sources: per source and whole-packet IP length, pooled over "
        "finished volunteer sessions or over every Atlas probe of every campaign (sessions = "
        "probes there). Atlas cannot observe fragmentation on arrival (NULL).",
    ),
    "v_split_drop_by_source": (
        f"""
SELECT
    'volunteer'::text AS source,
    v.leading_ip_len, v.sessions, v.sent, v.acked, v.late, v.drop_rate, v.frag_observed,
    v.arrived_as_sent
FROM v_split_drop_all v
UNION ALL
SELECT
    'atlas'::text AS source,
    o.ip_len::integer AS leading_ip_len,
    count(DISTINCT (o.campaign_id, o.prb_id)) FILTER (WHERE o.outcome IN {COUNTED})
        AS sessions,{ATLAS_PER_SIZE},
    NULL::bigint AS frag_observed,
    NULL::bigint AS arrived_as_sent
FROM atlas_outcomes o
WHERE o.phase = 'split' AND o.ip_len IS NOT NULL
GROUP BY o.ip_len
HAVING count(*) FILTER (WHERE o.outcome IN {COUNTED}) > 0
""",
        "v_split_drop_all for both sources: per source and leading-fragment IP length. Atlas "
        "probes report no fragment sizes (frag_observed, arrived_as_sent NULL).",
    ),
    "v_verdicts_by_source": (
        f"""
SELECT
    'volunteer'::text AS source,
    s.session_id, s.verdict, s.verdict_reason, s.finished_at,
    s.whole_sent, s.whole_acked, s.whole_drop_rate,
    s.split_sent, s.split_acked, s.split_drop_rate, s.split_to_whole_ratio,
    NULL::text AS campaign, NULL::integer AS prb_id, NULL::bigint AS asn,
    NULL::text AS country_code
FROM v_session_summary s
WHERE s.state IN {FINAL_STATES}
UNION ALL
SELECT
    'atlas'::text AS source,
    'atlas:' || c.name || ':' || v.prb_id AS session_id,
    v.verdict, v.verdict_reason, v.updated_at AS finished_at,
    v.whole_sent::bigint, v.whole_acked::bigint,
    (v.whole_sent - v.whole_acked)::double precision / nullif(v.whole_sent, 0),
    v.split_sent::bigint, v.split_acked::bigint,
    (v.split_sent - v.split_acked)::double precision / nullif(v.split_sent, 0),
    ((v.split_sent - v.split_acked)::double precision / nullif(v.split_sent, 0))
        / nullif((v.whole_sent - v.whole_acked)::double precision
                 / nullif(v.whole_sent, 0), 0),
    c.name, v.prb_id, p.asn_v4, p.country_code
FROM atlas_verdicts v
JOIN atlas_campaigns c ON c.id = v.campaign_id
LEFT JOIN atlas_probes p ON p.prb_id = v.prb_id
""",
        "One row per finished volunteer session or per Atlas probe of a campaign: the same "
        "verdict rule (kickass_core.verdict), pooled counts and drop rates per phase. An Atlas "
        "probe's session_id is atlas:<campaign>:<probe id>.",
    ),
    "v_atlas_measurements": (
        """
SELECT
    c.name AS campaign,
    m.msm_id, m.phase, m.target, m.ip_len::integer AS ip_len, m.size, m.packets,
    m.interval_s, m.probes_requested, m.status_id::integer AS status_id, m.status_name,
    m.estimated_credits, m.credits_per_result,
    m.results_fetched,
    m.results_fetched::bigint
        * coalesce(m.credits_per_result, m.packets * (m.size / 1500 + 1)) AS credits_spent,
    m.fetched_until, m.last_fetch_at, m.last_error, m.created_at, m.start_time, m.stop_time
FROM atlas_measurements m
JOIN atlas_campaigns c ON c.id = m.campaign_id
""",
        "One row per Atlas measurement: its campaign, phase, size, Atlas status, results "
        "fetched so far and the credits they cost (results x credits_per_result read back "
        "from Atlas, else the Atlas rule packets x (size div 1500 + 1)).",
    ),
}


def upgrade() -> None:
    op.create_table(
        "atlas_campaigns",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("definition", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("credit_budget", sa.BigInteger(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_atlas_campaigns")),
        sa.UniqueConstraint("name", name=op.f("uq_atlas_campaigns_name")),
    )
    op.create_table(
        "atlas_measurements",
        sa.Column("msm_id", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("campaign_id", sa.BigInteger(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("phase", sa.Text(), nullable=False),
        sa.Column("target", postgresql.INET(), nullable=False),
        sa.Column("ip_len", sa.SmallInteger(), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("packets", sa.SmallInteger(), nullable=False),
        sa.Column("interval_s", sa.Integer(), nullable=False),
        sa.Column("packet_interval_ms", sa.Integer(), nullable=False),
        sa.Column("probes_requested", sa.Integer(), nullable=False),
        sa.Column("definition", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("estimated_credits", sa.BigInteger(), nullable=False),
        sa.Column("credits_per_result", sa.Integer(), nullable=True),
        sa.Column("status_id", sa.SmallInteger(), nullable=True),
        sa.Column("status_name", sa.Text(), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("start_time", sa.DateTime(timezone=True), nullable=True),
        sa.Column("stop_time", sa.DateTime(timezone=True), nullable=True),
        sa.Column("fetched_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("results_fetched", sa.Integer(), server_default="0", nullable=False),
        sa.Column("last_fetch_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.CheckConstraint("phase IN ('whole', 'split')", name=op.f("ck_atlas_measurements_phase")),
        sa.ForeignKeyConstraint(
            ["campaign_id"],
            ["atlas_campaigns.id"],
            name=op.f("fk_atlas_measurements_campaign_id_atlas_campaigns"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("msm_id", name=op.f("pk_atlas_measurements")),
        sa.UniqueConstraint(
            "campaign_id", "key", name=op.f("uq_atlas_measurements_campaign_id_key")
        ),
    )
    op.create_table(
        "atlas_probes",
        sa.Column("prb_id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("asn_v4", sa.BigInteger(), nullable=True),
        sa.Column("asn_v6", sa.BigInteger(), nullable=True),
        sa.Column("country_code", sa.Text(), nullable=True),
        sa.Column("address_v4", postgresql.INET(), nullable=True),
        sa.Column("prefix_v4", sa.Text(), nullable=True),
        sa.Column("status_name", sa.Text(), nullable=True),
        sa.Column("is_anchor", sa.Boolean(), nullable=True),
        sa.Column("meta", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("prb_id", name=op.f("pk_atlas_probes")),
    )
    op.create_table(
        "atlas_reply_log",
        sa.Column("responder_run", sa.Uuid(), nullable=False),
        sa.Column("reply_no", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("campaign_id", sa.BigInteger(), nullable=False),
        sa.Column("responder_address", postgresql.INET(), nullable=False),
        sa.Column("dst_address", postgresql.INET(), nullable=False),
        sa.Column("icmp_id", sa.Integer(), nullable=False),
        sa.Column("icmp_seq", sa.Integer(), nullable=False),
        sa.Column("request_len", sa.SmallInteger(), nullable=False),
        sa.Column("phase", sa.Text(), nullable=False),
        sa.Column("ip_len", sa.SmallInteger(), nullable=False),
        sa.Column("sent_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("phase IN ('whole', 'split')", name=op.f("ck_atlas_reply_log_phase")),
        sa.ForeignKeyConstraint(
            ["campaign_id"],
            ["atlas_campaigns.id"],
            name=op.f("fk_atlas_reply_log_campaign_id_atlas_campaigns"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("responder_run", "reply_no", name=op.f("pk_atlas_reply_log")),
    )
    op.create_index(
        op.f("ix_atlas_reply_log_campaign_id_responder_address_sent_at"),
        "atlas_reply_log",
        ["campaign_id", "responder_address", "sent_at"],
    )
    op.create_table(
        "atlas_results",
        sa.Column("msm_id", sa.BigInteger(), nullable=False),
        sa.Column("prb_id", sa.Integer(), nullable=False),
        sa.Column("result_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("campaign_id", sa.BigInteger(), nullable=False),
        sa.Column("firmware", sa.Integer(), nullable=True),
        sa.Column("from_address", postgresql.INET(), nullable=True),
        sa.Column("dst_address", postgresql.INET(), nullable=True),
        sa.Column("size", sa.Integer(), nullable=True),
        sa.Column("sent", sa.SmallInteger(), nullable=True),
        sa.Column("rcvd", sa.SmallInteger(), nullable=True),
        sa.Column("dup", sa.SmallInteger(), nullable=True),
        sa.Column("join_status", sa.Text(), nullable=False),
        sa.Column("raw", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column(
            "fetched_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint(
            "join_status IN ('exact', 'ambiguous', 'inconsistent', 'no-log', 'aggregate')",
            name=op.f("ck_atlas_results_join_status"),
        ),
        sa.ForeignKeyConstraint(
            ["msm_id"],
            ["atlas_measurements.msm_id"],
            name=op.f("fk_atlas_results_msm_id_atlas_measurements"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("msm_id", "prb_id", "result_at", name=op.f("pk_atlas_results")),
    )
    op.create_table(
        "atlas_outcomes",
        sa.Column("msm_id", sa.BigInteger(), nullable=False),
        sa.Column("prb_id", sa.Integer(), nullable=False),
        sa.Column("result_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("packet_index", sa.SmallInteger(), nullable=False),
        sa.Column("campaign_id", sa.BigInteger(), nullable=False),
        sa.Column("phase", sa.Text(), nullable=False),
        sa.Column("ip_len", sa.SmallInteger(), nullable=True),
        sa.Column("outcome", sa.Text(), nullable=False),
        sa.Column("rtt_ms", sa.REAL(), nullable=True),
        sa.Column("ack_count", sa.SmallInteger(), server_default="0", nullable=False),
        sa.Column("icmp_seq", sa.Integer(), nullable=True),
        sa.Column("replied_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.CheckConstraint("phase IN ('whole', 'split')", name=op.f("ck_atlas_outcomes_phase")),
        sa.CheckConstraint(
            "outcome IN ('acked', 'lost', 'late', 'unanswered', 'error')",
            name=op.f("ck_atlas_outcomes_outcome"),
        ),
        sa.ForeignKeyConstraint(
            ["msm_id", "prb_id", "result_at"],
            ["atlas_results.msm_id", "atlas_results.prb_id", "atlas_results.result_at"],
            name=op.f("fk_atlas_outcomes_msm_id_atlas_results"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint(
            "msm_id", "prb_id", "result_at", "packet_index", name=op.f("pk_atlas_outcomes")
        ),
    )
    op.create_index(
        op.f("ix_atlas_outcomes_campaign_id_phase_ip_len"),
        "atlas_outcomes",
        ["campaign_id", "phase", "ip_len"],
    )
    op.create_table(
        "atlas_verdicts",
        sa.Column("campaign_id", sa.BigInteger(), nullable=False),
        sa.Column("prb_id", sa.Integer(), nullable=False),
        sa.Column("whole_sent", sa.Integer(), nullable=False),
        sa.Column("whole_acked", sa.Integer(), nullable=False),
        sa.Column("split_sent", sa.Integer(), nullable=False),
        sa.Column("split_acked", sa.Integer(), nullable=False),
        sa.Column("verdict", sa.Text(), nullable=False),
        sa.Column("verdict_reason", sa.Text(), nullable=False),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint(
            "verdict IN ('fragments-ok', 'fragment-intolerant', 'inconclusive')",
            name=op.f("ck_atlas_verdicts_verdict"),
        ),
        sa.ForeignKeyConstraint(
            ["campaign_id"],
            ["atlas_campaigns.id"],
            name=op.f("fk_atlas_verdicts_campaign_id_atlas_campaigns"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("campaign_id", "prb_id", name=op.f("pk_atlas_verdicts")),
    )
    for name, (query, comment) in VIEWS.items():
        op.execute(f"CREATE VIEW {name} AS {query}")
        quoted = comment.replace("'", "''")
        op.execute(f"COMMENT ON VIEW {name} IS '{quoted}'")


def downgrade() -> None:
    for name in reversed(VIEWS):
        op.execute(f"DROP VIEW {name}")
    op.drop_table("atlas_verdicts")
    op.drop_index(op.f("ix_atlas_outcomes_campaign_id_phase_ip_len"), table_name="atlas_outcomes")
    op.drop_table("atlas_outcomes")
    op.drop_table("atlas_results")
    op.drop_index(
        op.f("ix_atlas_reply_log_campaign_id_responder_address_sent_at"),
        table_name="atlas_reply_log",
    )
    op.drop_table("atlas_reply_log")
    op.drop_table("atlas_probes")
    op.drop_table("atlas_measurements")
    op.drop_table("atlas_campaigns")
