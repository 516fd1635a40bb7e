"""Fragment-study validity (issue 11): the client's reassembly memory, invalid
probes, privileged fragment observations, the excess over the two-fragment
bound.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24

New columns:

- ``sessions.client_metadata`` (jsonb, ``{}``): what the volunteer client
  reported about itself, today ``reassembly`` (its reassembly limits and
  counters before, during and after the split phase, the flow-control
  budget and the ranges of refused fragments: ``announced`` from the HTTP
  request, ``server`` from its UDP REPORTs, ``client`` from its end-of-session
  report) and ``fragment_observation`` (the privileged observation's summary).
- ``probe_outcomes.reassembly_invalid``: the probe was measured while the
  client's kernel refused fragments (its reassembly memory was full). Only a
  probe with outcome ``lost`` is *invalid*: it is evidence of nothing, and
  leaves ``sent`` and ``drop_rate`` of every view below (acked and late
  probes arrived, flag or not).
- ``probe_outcomes.observed_leading_len`` / ``observed_fragments``: with the
  client's opt-in ``--observe-fragments`` (root or CAP_NET_RAW: AF_PACKET
  before reassembly), the IP length of the datagram's fragment at offset 0
  and the number of distinct fragments seen; NULL when not observed.

Views: the study views keep every column and gain new ones at the end
(``CREATE OR REPLACE VIEW`` refuses anything else). ``sent`` and
``drop_rate`` now leave invalid probes out (the change this issue asks for:
invalid is not loss); before 0007 there were none, so no stored number moves.
``arrived_as_sent`` keeps its definition, which has always been *the largest
fragment as sent* (IP_RECVFRAGSIZE reports only the largest piece, so a split
re-cut with its pieces swapped passes it): ``largest_fragment_as_sent`` is the
same number under its honest name, and ``leading_as_sent`` /
``leading_swapped`` are the privileged observation's answer.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FINAL_STATES = "('complete', 'ended', 'expired', 'incomplete')"
INVALID = "(o.reassembly_invalid AND o.outcome = 'lost')"
VALID = f"(NOT {INVALID})"

PER_SIZE = f"""
    count(*) FILTER (WHERE {VALID}) AS sent,
    count(*) FILTER (WHERE o.outcome = 'acked') AS acked,
    count(*) FILTER (WHERE o.outcome = 'late') AS late,
    count(*) FILTER (WHERE {VALID} AND o.outcome <> 'acked')::double precision
        / nullif(count(*) FILTER (WHERE {VALID}), 0) AS drop_rate"""
WHOLE_EXTRA = """
    percentile_cont(0.5) WITHIN GROUP (ORDER BY o.rtt_ms)
        FILTER (WHERE o.outcome = 'acked') AS rtt_ms_median,
    count(*) FILTER (WHERE o.outcome = 'acked' AND o.observed_frag_size > 0)
        AS fragmented_on_arrival"""
WHOLE_NEW = f""",
    count(*) FILTER (WHERE {INVALID}) AS reassembly_invalid,
    count(*) FILTER (WHERE o.outcome = 'acked' AND o.observed_fragments IS NOT NULL)
        AS fragments_observed,
    count(*) FILTER (WHERE o.outcome = 'acked' AND o.observed_fragments > 1)
        AS fragmented_observed"""
LARGEST_AS_SENT = """count(*) FILTER (
        WHERE o.outcome = 'acked'
          AND o.observed_frag_size = greatest(o.ip_len, 1520 - o.ip_len)
    )"""
SPLIT_EXTRA = f"""
    count(*) FILTER (WHERE o.outcome = 'acked' AND o.observed_frag_size > 0) AS frag_observed,
    {LARGEST_AS_SENT} AS arrived_as_sent"""
# A split of a 1500-byte datagram: leading fragment ip_len, the rest 1520 - ip_len.
SPLIT_NEW = f""",
    count(*) FILTER (WHERE {INVALID}) AS reassembly_invalid,
    {LARGEST_AS_SENT} AS largest_fragment_as_sent,
    count(*) FILTER (WHERE o.outcome = 'acked' AND o.observed_fragments IS NOT NULL)
        AS fragments_observed,
    count(*) FILTER (
        WHERE o.outcome = 'acked' AND o.observed_fragments = 2
          AND o.observed_leading_len = o.ip_len
    ) AS leading_as_sent,
    count(*) FILTER (
        WHERE o.outcome = 'acked' AND o.observed_fragments = 2
          AND o.observed_leading_len = 1520 - o.ip_len AND o.ip_len <> 760
    ) AS leading_swapped"""

META = "s.client_metadata"

VIEWS: dict[str, tuple[str, str]] = {
    "v_whole_drop": (
        f"""
SELECT
    s.session_id,
    o.ip_len::integer AS ip_len,{PER_SIZE},{WHOLE_EXTRA}{WHOLE_NEW}
FROM probe_outcomes o
JOIN sessions s ON s.id = o.session_pk
WHERE o.phase = 'whole'
GROUP BY s.session_id, o.ip_len
""",
        "Per session and whole-packet IP length: probes sent (valid: not measured while the "
        "client's kernel refused fragments), acked, late, drop rate, median RTT of acked, acked "
        "that arrived fragmented (IP_RECVFRAGSIZE); reassembly_invalid = lost while the client's "
        "reassembly memory refused fragments (not in sent); fragments_observed / "
        "fragmented_observed = acked seen before reassembly (opt-in privileged observation) / "
        "of those in more than one fragment.",
    ),
    "v_split_drop": (
        f"""
SELECT
    s.session_id,
    o.ip_len::integer AS leading_ip_len,{PER_SIZE},{SPLIT_EXTRA}{SPLIT_NEW}
FROM probe_outcomes o
JOIN sessions s ON s.id = o.session_pk
WHERE o.phase = 'split'
GROUP BY s.session_id, o.ip_len
""",
        "Per session and leading-fragment IP length of 1500-byte split datagrams: sent (valid), "
        "acked, late, drop rate, acked with a fragment size observed; arrived_as_sent and "
        "largest_fragment_as_sent (the same number) = acked whose LARGEST fragment was as sent "
        "(IP_RECVFRAGSIZE: blind to swapped pieces); reassembly_invalid = lost while the "
        "client's kernel refused fragments (not in sent); fragments_observed = acked seen "
        "before reassembly (opt-in); leading_as_sent = of those, two fragments with the "
        "leading one as sent; leading_swapped = two fragments, pieces swapped (largest first).",
    ),
    "v_session_summary": (
        f"""
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
    r.split_drop_rate / nullif(r.whole_drop_rate, 0) AS split_to_whole_ratio,
    c.whole_invalid AS whole_reassembly_invalid,
    c.split_invalid AS split_reassembly_invalid,
    x.excess AS split_excess_drop,
    x.excess - x.half AS split_excess_low,
    x.excess + x.half AS split_excess_high,
    c.whole_fragmented AS whole_fragmented_on_arrival,
    c.split_largest_as_sent AS split_largest_fragment_as_sent,
    c.split_observed AS split_fragments_observed,
    c.split_leading_as_sent,
    c.split_leading_swapped,
    greatest(
        ({META} #>> '{{reassembly,server,refused}}')::bigint,
        ({META} #>> '{{reassembly,client,during,refused}}')::bigint
    ) AS reassembly_refused,
    greatest(
        ({META} #>> '{{reassembly,server,max_memory}}')::bigint,
        ({META} #>> '{{reassembly,client,during,max_memory}}')::bigint
    ) AS reassembly_max_memory,
    coalesce(
        ({META} #>> '{{reassembly,client,limits,high_thresh}}')::bigint,
        ({META} #>> '{{reassembly,announced,limits,high_thresh}}')::bigint
    ) AS reassembly_high_thresh
FROM sessions s
CROSS JOIN LATERAL (
    SELECT
        count(*) FILTER (WHERE o.phase = 'whole' AND {VALID}) AS whole_sent,
        count(*) FILTER (WHERE o.phase = 'whole' AND o.outcome = 'acked') AS whole_acked,
        count(*) FILTER (WHERE o.phase = 'split' AND {VALID}) AS split_sent,
        count(*) FILTER (WHERE o.phase = 'split' AND o.outcome = 'acked') AS split_acked,
        count(*) FILTER (WHERE o.phase = 'whole' AND {INVALID}) AS whole_invalid,
        count(*) FILTER (WHERE o.phase = 'split' AND {INVALID}) AS split_invalid,
        count(*) FILTER (
            WHERE o.phase = 'whole' AND o.outcome = 'acked' AND o.observed_frag_size > 0
        ) AS whole_fragmented,
        count(*) FILTER (
            WHERE o.phase = 'split' AND o.outcome = 'acked'
              AND o.observed_frag_size = greatest(o.ip_len, 1520 - o.ip_len)
        ) AS split_largest_as_sent,
        count(*) FILTER (
            WHERE o.phase = 'split' AND o.outcome = 'acked' AND o.observed_fragments IS NOT NULL
        ) AS split_observed,
        count(*) FILTER (
            WHERE o.phase = 'split' AND o.outcome = 'acked' AND o.observed_fragments = 2
              AND o.observed_leading_len = o.ip_len
        ) AS split_leading_as_sent,
        count(*) FILTER (
            WHERE o.phase = 'split' AND o.outcome = 'acked' AND o.observed_fragments = 2
              AND o.observed_leading_len = 1520 - o.ip_len AND o.ip_len <> 760
        ) AS split_leading_swapped
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
CROSS JOIN LATERAL (
    -- Agresti-Caffo rates for the variance: one more lost and delivered probe.
    SELECT
        (c.whole_sent - c.whole_acked + 1)::double precision / (c.whole_sent + 2) AS w,
        (c.split_sent - c.split_acked + 1)::double precision / (c.split_sent + 2) AS s
) a
CROSS JOIN LATERAL (
    -- kickass_core.verdict.excess: split drop minus 1 - (1 - whole)^2, and the
    -- half-width of its 95% interval (delta method).
    SELECT
        r.split_drop_rate - (1 - (1 - r.whole_drop_rate) ^ 2) AS excess,
        1.96 * sqrt(
            a.s * (1 - a.s) / nullif(c.split_sent, 0)
            + (2 * (1 - a.w)) ^ 2 * a.w * (1 - a.w) / nullif(c.whole_sent, 0)
        ) AS half
) x
""",
        "One row per session: state, verdict and pooled drop rates per phase (invalid probes "
        "left out). split_to_whole_ratio is NULL when the whole drop rate is 0 (the paper's "
        "bound is a ratio of at most about 2). 0007: probes invalid because the client's kernel "
        "refused fragments; split_excess_drop = split drop - (1 - (1 - whole drop)^2) with its "
        "95% interval (split_excess_low/high, kickass_core.verdict.excess); whole packets that "
        "arrived fragmented; splits whose largest fragment was as sent (IP_RECVFRAGSIZE) and, "
        "with the privileged observation, whose leading fragment was as sent or swapped; the "
        "client's reassembly memory (fragments refused, peak bytes in use, limit).",
    ),
    "v_size_drop_all": (
        f"""
SELECT
    o.ip_len::integer AS ip_len,
    count(DISTINCT o.session_pk) AS sessions,{PER_SIZE},{WHOLE_EXTRA}{WHOLE_NEW}
FROM probe_outcomes o
JOIN sessions s ON s.id = o.session_pk
WHERE o.phase = 'whole' AND s.state IN {FINAL_STATES}
GROUP BY o.ip_len
""",
        "Per whole-packet IP length, pooled over every finished session: the paper's drop rate "
        "by packet size (invalid probes left out, counted in reassembly_invalid).",
    ),
    "v_split_drop_all": (
        f"""
SELECT
    o.ip_len::integer AS leading_ip_len,
    count(DISTINCT o.session_pk) AS sessions,{PER_SIZE},{SPLIT_EXTRA}{SPLIT_NEW}
FROM probe_outcomes o
JOIN sessions s ON s.id = o.session_pk
WHERE o.phase = 'split' AND s.state IN {FINAL_STATES}
GROUP BY o.ip_len
""",
        "Per leading-fragment IP length, pooled over every finished session: the paper's drop "
        "rate by split (invalid probes left out); arrived_as_sent = largest_fragment_as_sent "
        "(the largest piece only); leading_as_sent / leading_swapped from the privileged "
        "observation.",
    ),
}

SPLIT_BY_SOURCE = """
SELECT
    'volunteer'::text AS source,
    v.leading_ip_len, v.sessions, v.sent, v.acked, v.late, v.drop_rate, v.frag_observed,
    v.arrived_as_sent, v.largest_fragment_as_sent, v.reassembly_invalid
FROM v_split_drop_all v
UNION ALL
SELECT
    'atlas'::text AS source,
    o.ip_len::integer AS leading_ip_len,
    count(DISTINCT (o.campaign_id, o.prb_id)) FILTER (WHERE o.outcome IN ('acked', 'lost', 'late'))
        AS sessions,
    count(*) FILTER (WHERE o.outcome IN ('acked', 'lost', 'late')) AS sent,
    count(*) FILTER (WHERE o.outcome = 'acked') AS acked,
    count(*) FILTER (WHERE o.outcome = 'late') AS late,
    count(*) FILTER (WHERE o.outcome IN ('lost', 'late'))::double precision
        / nullif(count(*) FILTER (WHERE o.outcome IN ('acked', 'lost', 'late')), 0) AS drop_rate,
    NULL::bigint AS frag_observed,
    NULL::bigint AS arrived_as_sent,
    NULL::bigint AS largest_fragment_as_sent,
    NULL::bigint AS reassembly_invalid
FROM atlas_outcomes o
WHERE o.phase = 'split' AND o.ip_len IS NOT NULL
GROUP BY o.ip_len
HAVING count(*) FILTER (WHERE o.outcome IN ('acked', 'lost', 'late')) > 0
"""
SPLIT_BY_SOURCE_COMMENT = (
    "v_split_drop_all for both sources: per source and leading-fragment IP length. Atlas "
    "probes report no fragment sizes (frag_observed, arrived_as_sent, largest_fragment_as_sent "
    "NULL) and no reassembly state (reassembly_invalid NULL). arrived_as_sent is the largest "
    "fragment as sent, under its old name."
)


def _create(name: str, query: str, comment: str, replace: bool = True) -> None:
    verb = "CREATE OR REPLACE VIEW" if replace else "CREATE VIEW"
    op.execute(f"{verb} {name} AS {query}")
    quoted = comment.replace("'", "''")
    op.execute(f"COMMENT ON VIEW {name} IS '{quoted}'")


def upgrade() -> None:
    op.add_column(
        "sessions",
        sa.Column(
            "client_metadata",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
    )
    op.add_column(
        "probe_outcomes",
        sa.Column(
            "reassembly_invalid", sa.Boolean(), server_default=sa.text("false"), nullable=False
        ),
    )
    op.add_column("probe_outcomes", sa.Column("observed_leading_len", sa.SmallInteger()))
    op.add_column("probe_outcomes", sa.Column("observed_fragments", sa.SmallInteger()))
    for name, (query, comment) in VIEWS.items():
        _create(name, query, comment)
    _create("v_split_drop_by_source", SPLIT_BY_SOURCE, SPLIT_BY_SOURCE_COMMENT)


def _migration(prefix: str) -> ModuleType:
    """An earlier migration module, for its view definitions."""
    (path,) = Path(__file__).parent.glob(f"{prefix}_*.py")
    spec = importlib.util.spec_from_file_location(f"_kickass_migration_{prefix}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def downgrade() -> None:
    # Views cannot lose columns in place: drop the dependants, then put back
    # 0002's and 0006's definitions.
    v0002 = _migration("0002").VIEWS
    v0006 = _migration("0006").VIEWS
    dependants = ("v_size_drop_by_source", "v_split_drop_by_source", "v_verdicts_by_source")
    for name in dependants:
        op.execute(f"DROP VIEW {name}")
    for name in VIEWS:
        op.execute(f"DROP VIEW {name}")
    for name in VIEWS:
        _create(name, *v0002[name], replace=False)
    for name in dependants:
        _create(name, *v0006[name], replace=False)
    op.drop_column("probe_outcomes", "observed_fragments")
    op.drop_column("probe_outcomes", "observed_leading_len")
    op.drop_column("probe_outcomes", "reassembly_invalid")
    op.drop_column("sessions", "client_metadata")
