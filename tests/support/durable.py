"""What the study's readers see, and the counts its raw rows hold (issue 28).

``raw_counts`` aggregates ``probe_outcomes`` in Python by migration 0007's
rules (not by the SQL under test); ``durable_counts`` reads ``unit_counts``
back per size. ``views`` is every ``v_*`` view's rows, sorted, with floats
to 10 significant digits (a sum of floats depends on the order PostgreSQL
adds them in; nothing else is rounded); ``pooled_medians`` the pooled RTT
medians, which come from a histogram and are compared within its bound.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import math
import struct
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import kickass_db as db
import psycopg
from kickass_core.states import FINAL_STATES
from psycopg.rows import dict_row

COUNTERS = (
    "sent", "acked", "late", "reassembly_invalid", "frag_observed", "largest_fragment_as_sent",
    "fragments_observed", "fragmented_observed", "leading_as_sent", "leading_swapped",
)  # fmt: skip
# The histogram's bound on a pooled median (migration 0020, db/README.md).
MEDIAN_BOUND = 0.01 / 2.01
# Views whose rtt_ms_median pools sessions: from the histogram, not exact.
POOLED_MEDIANS = ("v_size_drop_all", "v_size_drop_by_source")

Key = tuple[str, str, int]  # session_id, phase, ip_len


def seed_issue_28(url: str) -> None:
    """The issue's data: the seeded study over three days with one session
    still probing, one expired and one final on the live session's day,
    router runs, an Atlas campaign, paired trials and scheduled runs
    (tests/support/seed.py)."""
    from datetime import timedelta

    from kickass_db.study_store import StudyStore

    from support.seed import (
        seed_atlas,
        seed_item_runs,
        seed_paired_trials,
        seed_router,
        seed_study,
    )

    study = StudyStore(url)
    try:
        seed_study(study, n_clients=14, rng=28, spread=timedelta(days=3), live=True)
        # One final session on the live session's UTC day, seeded straight
        # after it: the backdated ones may all fall on earlier days (the run
        # that starts just past midnight), and the test needs that day's
        # partition to hold final rows beside the live session's.
        # (spread 0: dated by the seed's clock, as the rest, which some tests move.)
        seed_study(study, n_clients=1, rng=128, spread=timedelta(0))
    finally:
        study.close()
    seed_router(url, seconds=5.0)
    seed_atlas(url, results_per_probe=1)
    seed_paired_trials(url, pairs=1, flows_per_period=6)
    seed_item_runs(url)


def connect(url: str) -> psycopg.Connection[dict[str, Any]]:
    return psycopg.connect(db.libpq_url(url), row_factory=dict_row)


def _row_counters(r: dict[str, Any]) -> dict[str, bool]:
    """0007's rules for one probe row (a NULL compares as false, as in SQL)."""
    acked = r["outcome"] == "acked"
    invalid = bool(r["reassembly_invalid"]) and r["outcome"] == "lost"
    split = r["phase"] == "split"
    frag, pieces, lead = r["observed_frag_size"], r["observed_fragments"], r["observed_leading_len"]
    ip_len = r["ip_len"]
    two = acked and pieces == 2
    return {
        "sent": not invalid,
        "acked": acked,
        "late": r["outcome"] == "late",
        "reassembly_invalid": invalid,
        "frag_observed": acked and frag is not None and frag > 0,
        "largest_fragment_as_sent": split and acked and frag == max(ip_len, 1520 - ip_len),
        "fragments_observed": acked and pieces is not None,
        "fragmented_observed": acked and pieces is not None and pieces > 1,
        "leading_as_sent": split and two and lead == ip_len,
        "leading_swapped": split and two and lead == 1520 - ip_len and ip_len != 760,
    }


def real(x: float) -> float:
    """A ``real`` column's value as PostgreSQL computes with it: the float4
    itself (psycopg reads it back as its shortest decimal)."""
    return float(struct.unpack("f", struct.pack("f", x))[0])


def percentile_cont_median(values: list[float]) -> float | None:
    """PostgreSQL's percentile_cont(0.5): the two middle values, interpolated
    as it does (first + (second - first) * fraction)."""
    if not values:
        return None
    v = sorted(values)
    pos = 0.5 * (len(v) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def raw_counts(url: str, session_ids: Iterable[str] | None = None) -> dict[Key, dict[str, Any]]:
    """Per session, phase and IP length: 0007's counters, the RTT sum and count
    of acked probes, and (whole) the exact median RTT, from ``probe_outcomes``."""
    where, params = "", {}
    if session_ids is not None:
        where, params = "WHERE s.session_id = ANY(%(ids)s)", {"ids": list(session_ids)}
    rows: dict[Key, list[dict[str, Any]]] = defaultdict(list)
    with connect(url) as conn:
        for r in conn.execute(
            f"SELECT s.session_id, o.* FROM probe_outcomes o "
            f"JOIN sessions s ON s.id = o.session_pk {where}",
            params,
        ):
            rows[(r["session_id"], r["phase"], r["ip_len"])].append(r)
    out = {}
    for key, probes in rows.items():
        counts: dict[str, Any] = dict.fromkeys(COUNTERS, 0)
        for p in probes:
            for name, hit in _row_counters(p).items():
                counts[name] += hit
        rtts = [
            real(p["rtt_ms"]) for p in probes if p["outcome"] == "acked" and p["rtt_ms"] is not None
        ]
        counts["rtt_ms_n"] = len(rtts)
        counts["rtt_ms_sum"] = math.fsum(rtts) if rtts else None
        counts["rtt_ms_median"] = percentile_cont_median(rtts) if key[1] == "whole" else None
        counts["rtts"] = rtts
        out[key] = counts
    return out


def durable_counts(url: str) -> dict[Key, dict[str, Any]]:
    """``unit_counts`` per session, phase and IP length (zeros where an array is NULL)."""
    arrays = ", ".join(f"u.{c}_by_size" for c in (*COUNTERS, "rtt_ms_sum", "rtt_ms_n"))
    out: dict[Key, dict[str, Any]] = {}
    with connect(url) as conn:
        for u in conn.execute(
            f"SELECT u.unit, u.phase, u.ip_lens, {arrays}, u.rtt_ms_median_by_size "
            "FROM unit_counts u WHERE u.source = 'volunteer'"
        ):
            for i, ip_len in enumerate(u["ip_lens"]):
                counts = {
                    c: (u[f"{c}_by_size"] or [0] * len(u["ip_lens"]))[i]
                    for c in (*COUNTERS, "rtt_ms_n")
                }
                counts["rtt_ms_sum"] = (u["rtt_ms_sum_by_size"] or [None] * len(u["ip_lens"]))[i]
                medians = u["rtt_ms_median_by_size"] or [None] * len(u["ip_lens"])
                counts["rtt_ms_median"] = medians[i]
                out[(u["unit"], u["phase"], ip_len)] = counts
    return out


def final_session_ids(url: str) -> list[str]:
    with connect(url) as conn:
        return [
            r["session_id"]
            for r in conn.execute(
                "SELECT session_id FROM sessions WHERE state = ANY(%s) ORDER BY id",
                (list(FINAL_STATES),),
            )
        ]


def norm(v: Any) -> Any:
    if isinstance(v, float):
        return float(f"{v:.10g}") if math.isfinite(v) else repr(v)
    if isinstance(v, dt.datetime | dt.date | dt.time | dt.timedelta):
        return str(v)
    if isinstance(v, decimal.Decimal):
        return str(v)
    if isinstance(v, bytes | memoryview):
        return bytes(v).hex()
    if isinstance(v, list | dict):
        return json.dumps(v, sort_keys=True, default=str)
    return v if v is None or isinstance(v, int | str | bool) else str(v)


# Views whose rows say when they were read.
_CLOCKED = {"v_rollup_status": "age_s", "v_item_health": "since_ok_s"}


def view_columns(url: str) -> dict[str, list[str]]:
    """Every ``v_*`` view's columns, in order."""
    out: dict[str, list[str]] = {}
    with psycopg.connect(db.libpq_url(url)) as conn:
        for view, column in conn.execute(
            "SELECT table_name, column_name FROM information_schema.columns "
            "WHERE table_schema = 'public' AND table_name LIKE 'v\\_%' "
            "ORDER BY table_name, ordinal_position"
        ):
            out.setdefault(view, []).append(column)
    return out


def views(
    url: str, names: Iterable[str] | None = None, columns: dict[str, list[str]] | None = None
) -> dict[str, list[list[Any]]]:
    """Every ``v_*`` view's rows (or ``names``; of ``columns`` only, where
    given: a view gains columns, never loses them), normalised and sorted; a
    pooled median as ``("median", value)`` so callers can compare it within
    its bound."""
    out = {}
    with psycopg.connect(db.libpq_url(url)) as conn:
        if names is None:
            names = [
                r[0]
                for r in conn.execute(
                    "SELECT viewname FROM pg_views WHERE schemaname = 'public' "
                    "AND viewname LIKE 'v\\_%' ORDER BY 1"
                )
            ]
        for name in names:
            chosen = ", ".join(columns[name]) if columns and name in columns else "*"
            cur = conn.execute(f"SELECT {chosen} FROM {name}")
            cols = [c.name for c in cur.description or ()]
            rows = []
            for r in cur.fetchall():
                row = []
                for col, v in zip(cols, r, strict=True):
                    if col == _CLOCKED.get(name):
                        continue
                    if name in POOLED_MEDIANS and col == "rtt_ms_median" and v is not None:
                        row.append(["median", v])
                    else:
                        row.append(norm(v))
                rows.append(row)
            out[name] = sorted(rows, key=lambda r: json.dumps(r, default=str))
    return out


def _without_medians(rows: list[list[Any]]) -> list[list[Any]]:
    return [[None if isinstance(v, list) and v[:1] == ["median"] else v for v in r] for r in rows]


def assert_views_equal(
    before: dict[str, list[list[Any]]], after: dict[str, list[list[Any]]]
) -> None:
    """Every view equal row for row; pooled medians within the histogram's
    bound of each other (both sides may be exact or from the histogram)."""
    assert set(before) == set(after)
    for name in before:
        a, b = before[name], after[name]
        if name not in POOLED_MEDIANS:
            assert a == b, name
            continue
        assert _without_medians(a) == _without_medians(b), name
        for ra, rb in zip(a, b, strict=True):
            for va, vb in zip(ra, rb, strict=True):
                if isinstance(va, list) and va[:1] == ["median"]:
                    assert math.isclose(va[1], vb[1], rel_tol=2 * MEDIAN_BOUND), (name, ra, rb)
