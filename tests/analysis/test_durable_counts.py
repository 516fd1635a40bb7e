"""Durable per-session counts (issue 28 part 1, tests 1 and 2).

On the seeded study (tests/support/seed.py: three days, one session still
probing, one expired; router runs, an Atlas campaign, paired trials):

- every final session's counts (``unit_counts``) equal an aggregation of its
  raw rows by 0007's rules, computed here in Python, count for count, also
  after a client report marks probes invalid and adds observations after
  the finish, and for an orphan the server marks incomplete; and the
  rollups folded from them equal the raw rows pooled per day and in all;
- nothing a researcher sees depends on raw rows: with every final session's
  raw rows gone, every ``v_*`` view, the API's session JSON, the volunteer
  page, ``kickass report`` and every Grafana panel are what they were; the
  pooled RTT medians are within the histogram's bound of the exact ones.
"""

from __future__ import annotations

import io
import json
import math
import re
import secrets
from collections import defaultdict
from collections.abc import Iterator
from contextlib import redirect_stdout
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from kickass_analysis import rollups
from kickass_core import cli
from kickass_core.verdict import decide
from kickass_db.study_store import StudyStore
from kickass_server.api import ApiConfig, create_app
from kickass_server.engine import ProbeEngine
from kickass_server.policy import Policy
from kickass_server.volunteer_page import PageConfig, page_path
from kickass_testbed.pg import create_database, drop_database
from support.durable import (
    COUNTERS,
    MEDIAN_BOUND,
    assert_views_equal,
    connect,
    durable_counts,
    final_session_ids,
    percentile_cont_median,
    raw_counts,
    seed_issue_28,
    views,
)
from support.grafana import TimeRange, expand, panel_interval, panel_queries

# The seed's addresses (RFC 5737 prefixes) in two countries and three networks.
NETWORK_TABLE = (
    "192.0.2.0\t192.0.2.255\t64500\tXA\tTEST-NET-1\n"
    "198.51.100.0\t198.51.100.255\t64501\tXA\tTEST-NET-2\n"
    "203.0.113.0\t203.0.113.255\t64502\tXB\tTEST-NET-3\n"
)


@pytest.fixture(scope="module")
def seeded_template(pg_server_url: str, _migrated_template: str) -> Iterator[str]:
    """The issue's data, seeded once: each test gets a copy."""
    name = f"durable_template_{secrets.token_hex(4)}"
    url = create_database(pg_server_url, name, template=_migrated_template)
    try:
        seed_issue_28(url)
        yield name
    finally:
        drop_database(pg_server_url, name)


@pytest.fixture
def seeded(pg_server_url: str, seeded_template: str) -> Iterator[str]:
    name = f"durable_{secrets.token_hex(4)}"
    url = create_database(pg_server_url, name, template=seeded_template)
    try:
        yield url
    finally:
        drop_database(pg_server_url, name)


def assert_durable_equals_raw(url: str, session_ids: list[str]) -> None:
    raw = raw_counts(url, session_ids)
    durable = {k: v for k, v in durable_counts(url).items() if k[0] in set(session_ids)}
    assert set(durable) == set(raw)
    for key, r in raw.items():
        d = durable[key]
        assert {c: d[c] for c in (*COUNTERS, "rtt_ms_n")} == {
            c: r[c] for c in (*COUNTERS, "rtt_ms_n")
        }, key
        assert d["rtt_ms_median"] == r["rtt_ms_median"], key
        if r["rtt_ms_sum"] is None:
            assert d["rtt_ms_sum"] is None, key
        else:
            assert math.isclose(d["rtt_ms_sum"], r["rtt_ms_sum"], rel_tol=1e-12), key
    # The per-phase totals are the sums of the sizes (v_session_summary reads them).
    with connect(url) as conn:
        totals = {
            (t["unit"], t["phase"]): t
            for t in conn.execute(
                f"SELECT unit, phase, {', '.join(COUNTERS)} FROM unit_counts "
                "WHERE source = 'volunteer' AND unit = ANY(%s)",
                (session_ids,),
            )
        }
    assert {k for k in totals} == {(s, p) for s in session_ids for p in ("whole", "split")}
    for (sid, phase), t in totals.items():
        for c in COUNTERS:
            assert t[c] == sum(r[c] for k, r in raw.items() if k[:2] == (sid, phase)), (sid, c)


def _verdict_from_raw(url: str, session_id: str) -> tuple[str, str]:
    """The verdict its raw rows support (late counts as delivered, invalid is not sent)."""
    counts = {p: [0, 0, 0] for p in ("whole", "split")}
    late = 0
    for (_, phase, _), r in raw_counts(url, [session_id]).items():
        counts[phase][0] += r["sent"]
        counts[phase][1] += r["acked"] + r["late"]
        counts[phase][2] += r["reassembly_invalid"]
        late += r["late"]
    v = decide(
        counts["whole"][0], counts["whole"][1], counts["split"][0], counts["split"][1],
        whole_invalid=counts["whole"][2], split_invalid=counts["split"][2], late=late,
    )  # fmt: skip
    return v.verdict, v.reason


def _session(url: str, session_id: str) -> dict[str, Any]:
    with connect(url) as conn:
        row = conn.execute("SELECT * FROM sessions WHERE session_id = %s", (session_id,)).fetchone()
    assert row is not None
    return row


def test_durable_counts_equal_the_raw_rows(seeded: str) -> None:
    url = seeded
    finals = final_session_ids(url)
    assert len(finals) > 14  # repeat runs and the expired one
    assert_durable_equals_raw(url, finals)

    # A client report after the finish: lost splits invalid, splits observed.
    with connect(url) as conn:
        target = conn.execute(
            """SELECT s.session_id, s.id,
                      array_agg(o.seq ORDER BY o.seq) FILTER (WHERE o.outcome = 'lost') AS lost,
                      array_agg(o.seq ORDER BY o.seq) FILTER (WHERE o.outcome = 'acked') AS acked,
                      array_agg(o.ip_len ORDER BY o.seq) FILTER (WHERE o.outcome = 'acked') AS lens
               FROM sessions s JOIN probe_outcomes o ON o.session_pk = s.id
               WHERE s.state = 'complete' AND o.phase = 'split'
               GROUP BY s.session_id, s.id
               ORDER BY least(count(*) FILTER (WHERE o.outcome = 'lost'),
                              count(*) FILTER (WHERE o.outcome = 'acked')) DESC
               LIMIT 1"""
        ).fetchone()
    assert target is not None and len(target["lost"]) >= 3
    sid = target["session_id"]
    ranges = [(seq, seq + 1) for seq in target["lost"][: len(target["lost"]) // 2]]
    seqs = target["acked"][:10]
    leading = [ln if i % 3 else 1520 - ln for i, ln in enumerate(target["lens"][:10])]
    store = StudyStore(url)
    try:
        assert store.record_client_report(
            sid, invalid_ranges=ranges, observations=(seqs, leading, [2] * len(seqs))
        )
    finally:
        store.close()
    assert_durable_equals_raw(url, [sid])
    after = raw_counts(url, [sid])
    assert sum(r["reassembly_invalid"] for r in after.values()) == len(ranges)
    assert sum(r["leading_as_sent"] + r["leading_swapped"] for r in after.values()) > 0
    s = _session(url, sid)
    assert (s["verdict"], s["verdict_reason"]) == _verdict_from_raw(url, sid)

    # The session left probing: the server's next start marks it incomplete.
    with connect(url) as conn:
        (live,) = conn.execute("SELECT session_id FROM sessions WHERE state = 'probing'").fetchall()
    store = StudyStore(url)
    try:
        assert store.mark_orphans_incomplete() == [live["session_id"]]
    finally:
        store.close()
    assert_durable_equals_raw(url, [live["session_id"]])
    s = _session(url, live["session_id"])
    assert s["state"] == "incomplete"
    assert (s["verdict"], s["verdict_reason"]) == _verdict_from_raw(url, live["session_id"])

    # Folded in (one refresh): the rollups pool the raw rows, per day and in all.
    rollups.refresh(url)
    assert_rollups_equal_the_raw_rows(url)


def assert_rollups_equal_the_raw_rows(url: str) -> None:
    finals = final_session_ids(url)
    raw = raw_counts(url, finals)
    with connect(url) as conn:
        meta = {
            r["session_id"]: r
            for r in conn.execute(
                "SELECT session_id, (created_at AT TIME ZONE 'UTC')::date AS day, "
                "client_key(source_address) AS client FROM sessions"
            )
        }
        daily = {
            (r["day"], r["phase"], r["ip_len"]): r
            for r in conn.execute("SELECT * FROM unit_counts_daily WHERE source = 'volunteer'")
        }
        total = {
            (r["phase"], r["ip_len"]): r
            for r in conn.execute("SELECT * FROM unit_counts_total WHERE source = 'volunteer'")
        }
        pending = conn.execute("SELECT count(*) AS n FROM unit_count_changes").fetchone()
    assert pending == {"n": 0}
    want_day: dict[tuple[date, str, int], dict[str, Any]] = defaultdict(
        lambda: dict.fromkeys(("units", *COUNTERS, "rtt_ms_n"), 0)
    )
    want_all: dict[tuple[str, int], dict[str, Any]] = defaultdict(
        lambda: {**dict.fromkeys(("units", *COUNTERS, "rtt_ms_n"), 0), "clients": set(), "rtts": []}
    )
    for (sid, phase, ip_len), r in raw.items():
        for want in (want_day[(meta[sid]["day"], phase, ip_len)], want_all[(phase, ip_len)]):
            want["units"] += 1
            for c in (*COUNTERS, "rtt_ms_n"):
                want[c] += r[c]
        if meta[sid]["client"] is not None:
            want_all[(phase, ip_len)]["clients"].add(meta[sid]["client"])
        want_all[(phase, ip_len)]["rtts"] += r["rtts"]
    assert set(daily) == set(want_day) and set(total) == set(want_all)
    for day_key, want in want_day.items():
        assert {c: daily[day_key][c] for c in want} == want, day_key
    for size, want in want_all.items():
        got = total[size]
        assert {c: got[c] for c in ("units", *COUNTERS, "rtt_ms_n")} == {
            c: want[c] for c in ("units", *COUNTERS, "rtt_ms_n")
        }, size
        assert got["clients"] == len(want["clients"]), size
    # The pooled medians: within the histogram's bound of the exact ones.
    with connect(url) as conn:
        medians = {
            r["ip_len"]: r["rtt_ms_median"]
            for r in conn.execute("SELECT ip_len, rtt_ms_median FROM v_size_drop_all")
        }
    for (phase, ip_len), want in want_all.items():
        if phase == "whole" and want["rtts"]:
            exact = percentile_cont_median(want["rtts"])
            assert exact is not None
            assert abs(medians[ip_len] - exact) <= MEDIAN_BOUND * exact, (ip_len, exact)


# -- test 2: nothing a researcher sees depends on raw rows -------------------------------


def _api_and_pages(url: str, tmp: Path) -> dict[str, Any]:
    """Every session's API JSON and volunteer page (a fresh app: nothing cached)."""
    table = tmp / "ip2asn.tsv"
    table.write_text(NETWORK_TABLE)
    store = StudyStore(url)
    engine = ProbeEngine(store, Policy(), probe_port=9000, server_version="test")
    page = PageConfig(client_dir=tmp / "empty", network_table=table, min_clients=2, cache_s=0)
    out: dict[str, Any] = {}
    try:
        client = create_app(engine, store, ApiConfig(probe_host="probe.example"), page=page)
        http = client.test_client()
        with connect(url) as conn:
            sessions = conn.execute("SELECT session_id, cookie_hash FROM sessions").fetchall()
        for s in sessions:
            r = http.get(f"/api/v1/sessions/{s['session_id']}")
            assert r.status_code == 200
            out[f"api {s['session_id']}"] = r.get_json()
            r = http.get(page_path(s["session_id"], bytes(s["cookie_hash"])))
            assert r.status_code == 200
            out[f"page {s['session_id']}"] = r.get_data(as_text=True)
    finally:
        engine.stop()
        store.close()
    return out


def _report(url: str, out: Path) -> dict[str, Any]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli.main(["report", "--database-url", url, "-o", str(out), "--json"]) == 0
    result = json.loads(buf.getvalue())
    html = re.sub(r'<p class="meta">Generated .*?</p>', "", out.read_text(), flags=re.S)
    return {k: result[k] for k in ("sections", "figures", "summary")} | {"html": html}


# Panels that say how long ago something happened (now() - ...): no study data.
CLOCKED = ("v_item_health", "v_rollup_status")


def _panels(url: str, window: TimeRange) -> dict[str, Any]:
    from test_grafana import DASHBOARDS, reader, variable_values

    out = {}
    with reader(url) as conn:
        for path in DASHBOARDS:
            variables = variable_values(conn, path, window, {}, choose_all=True)
            for q in panel_queries([path]):
                if any(view in q.raw_sql for view in CLOCKED):
                    continue
                sql = expand(q.raw_sql, window, panel_interval(window, q.min_interval), variables)
                rows = conn.execute(sql).fetchall()
                out[q.name] = sorted(json.dumps([str(v) for v in r]) for r in rows)
    return out


def test_nothing_a_researcher_sees_depends_on_raw_rows(seeded: str, tmp_path: Path) -> None:
    url = seeded
    rollups.refresh(url)
    window = TimeRange(datetime.now(UTC) - timedelta(days=30), datetime.now(UTC))

    def everything(tag: str) -> dict[str, Any]:
        return {
            "views": views(url),
            "app": _api_and_pages(url, tmp_path),
            "report": _report(url, tmp_path / f"report-{tag}.html"),
            "panels": _panels(url, window),
        }

    before = everything("before")
    # Every probe_outcomes partition of final sessions dropped; from the one
    # that also holds the session still probing, the final sessions' rows.
    with connect(url) as conn:
        conn.autocommit = True
        parts = conn.execute(
            """SELECT c.relname AS name,
                      EXISTS (SELECT 1 FROM sessions s
                              WHERE s.state IN ('created', 'probing')
                                AND c.relname = 'probe_outcomes_p'
                                    || to_char(s.created_at AT TIME ZONE 'UTC', 'YYYYMMDD')
                      ) AS live
               FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
               WHERE i.inhparent = 'probe_outcomes'::regclass"""
        ).fetchall()
        for p in parts:
            if not p["live"]:
                conn.execute(f"ALTER TABLE probe_outcomes DETACH PARTITION {p['name']}")
                conn.execute(f"DROP TABLE {p['name']}")
        gone = conn.execute(
            "DELETE FROM probe_outcomes o USING sessions s WHERE s.id = o.session_pk "
            "AND o.session_created_at = s.created_at AND s.state NOT IN ('created', 'probing')"
        ).rowcount
        left = conn.execute("SELECT count(*) AS n FROM probe_outcomes").fetchone()
    assert sum(not p["live"] for p in parts) >= 3 and gone > 0  # three days before today's
    assert left is not None and left["n"] > 0  # the live session's
    after = everything("after")
    assert_views_equal(before["views"], after["views"])
    assert before["app"] == after["app"]
    assert before["report"] == after["report"]
    assert before["panels"] == after["panels"]
