"""Live counts (migration 0029): a live session's counts kept as its rows are
written equal a recount of its raw rows after every kind of write, and the
finish stores from them what a recount stores.

Every write path of a live session's rows is exercised on one session: the
store's COPY of a new batch, its upsert of a batch that repeats stored seqs
(lost becoming late, acked becoming lost, an RTT changed, a seq twice in a
batch, reassembly_invalid kept once set), a client report before the finish
(invalid ranges, observations), a plain DELETE; then the finish, a replayed
batch of the final session (no live counts), and an orphan marked incomplete.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kickass_core.plan import ProbePlan
from kickass_core.study_events import ClockAnchor, OutcomeBatch, OutcomeEntry, RunFinished
from kickass_db.study_store import StudyStore
from support.durable import COUNTERS, _row_counters, connect, real

PLAN = ProbePlan.build(repetitions=6, step=256)  # 8 whole sizes, 6 splits: 84 probes
ANCHOR = ClockAnchor(datetime.now(UTC).timestamp(), 0.0)
# RTTs from a few values only, so sizes hold equal RTTs (a multiset, not a set).
RTTS_MS = (18.5, 20.25, 20.25, 31.0, 47.125)


def entry(seq: int, outcome: str, rtt_ms: float | None = None, **kw: Any) -> OutcomeEntry:
    p = PLAN.probe(seq)
    sent = 0.01 * seq
    acked = None if rtt_ms is None else sent + rtt_ms / 1000
    frag = kw.pop("frag", 0 if p.phase == "whole" else max(p.ip_len, 1520 - p.ip_len))
    return OutcomeEntry(
        seq, p.phase, p.ip_len, outcome, sent, acked, int(acked is not None), None,
        frag if outcome == "acked" else None, **kw,
    )  # fmt: skip


def first_pass(rng: random.Random) -> list[OutcomeEntry]:
    out = []
    for seq in range(PLAN.total_probes):
        r = rng.random()
        if r < 0.25:
            out.append(entry(seq, "lost", reassembly_invalid=rng.random() < 0.3))
        elif r < 0.3:
            out.append(entry(seq, "late"))
        else:
            out.append(entry(seq, "acked", rng.choice(RTTS_MS), frag=rng.choice((0, 576, 1480))))
    return out


def apply(store: StudyStore, sid: str, rows: list[OutcomeEntry]) -> None:
    assert store.apply(OutcomeBatch(sid, tuple(rows), ANCHOR))


def new_session(store: StudyStore, sid: str) -> int:
    store.create_session(
        session_id=sid, cookie_hash=bytes(32), plan=PLAN.to_json(), source_address="192.0.2.7",
        expires_at=datetime.now(UTC) + timedelta(hours=1), server_version="test",
    )  # fmt: skip
    with connect(store.database_url) as conn:
        row = conn.execute("SELECT id FROM sessions WHERE session_id = %s", (sid,)).fetchone()
    assert row is not None
    return int(row["id"])


def live_counts(url: str, sid: str) -> dict[tuple[str, int], dict[str, Any]]:
    with connect(url) as conn:
        return {
            (r["phase"], r["ip_len"]): r
            for r in conn.execute(
                "SELECT t.* FROM live_counts t JOIN sessions s ON s.id = t.session_pk "
                "WHERE s.session_id = %s",
                (sid,),
            )
        }


def assert_live_equals_raw(url: str, sid: str) -> int:
    """Size by size, over the session's rows below its mark (the rows
    ``live_counts`` holds): the rows, every counter, the RTT count and sum,
    and the whole phase's RTTs as a multiset, as a recount of them has them.
    Returns the mark."""
    with connect(url) as conn:
        (mark,) = conn.execute(
            "SELECT m.counted_below FROM live_count_marks m JOIN sessions s "
            "ON s.id = m.session_pk WHERE s.session_id = %s",
            (sid,),
        ).fetchall()
        rows = conn.execute(
            "SELECT o.* FROM probe_outcomes o JOIN sessions s ON s.id = o.session_pk "
            "WHERE s.session_id = %s AND o.seq < %s",
            (sid, mark["counted_below"]),
        ).fetchall()
    raw: dict[tuple[str, int], dict[str, Any]] = {}
    for r in rows:
        want = raw.setdefault(
            (r["phase"], r["ip_len"]),
            {**dict.fromkeys((*COUNTERS, "probes", "rtt_ms_n"), 0), "rtts": []},
        )
        want["probes"] += 1
        for name, hit in _row_counters(r).items():
            want[name] += hit
        if r["outcome"] == "acked" and r["rtt_ms"] is not None:
            want["rtt_ms_n"] += 1
            want["rtts"].append(real(r["rtt_ms"]))
    live = live_counts(url, sid)
    # A size whose rows are all gone keeps a row of zeros; none goes negative.
    for key, t in live.items():
        if key not in raw:
            assert t["probes"] == 0 and t["rtt_ms_n"] == 0 and not t["rtts"], key
            assert all(t[c] == 0 for c in COUNTERS), key
    assert set(raw) <= set(live)
    for key, r in raw.items():
        t = live[key]
        assert {c: t[c] for c in (*COUNTERS, "probes", "rtt_ms_n")} == {
            c: r[c] for c in (*COUNTERS, "probes", "rtt_ms_n")
        }, key
        # exact: float4 RTTs of one size add exactly in double precision
        assert t["rtt_ms_sum"] == math.fsum(r["rtts"]), key
        kept = sorted(r["rtts"]) if key[0] == "whole" else []
        assert sorted(real(v) for v in t["rtts"] or []) == kept, key
    return int(mark["counted_below"])


def fold(url: str, pk: int, below: int) -> None:
    with connect(url) as conn:
        conn.execute("SELECT fold_live_counts(%s, %s, 0)", (pk, below))


UNIT_COLUMNS = (
    "unit", "phase", "day", "client_key", *COUNTERS, "rtt_ms_sum", "rtt_ms_n", "ip_lens",
    *(f"{c}_by_size" for c in (*COUNTERS, "rtt_ms_sum", "rtt_ms_n", "rtt_ms_median")),
)  # fmt: skip


def unit_counts(conn: Any, sid: str) -> dict[str, Any]:
    rows = conn.execute(
        f"SELECT {', '.join(UNIT_COLUMNS)} FROM unit_counts "
        "WHERE source = 'volunteer' AND unit = %s",
        (sid,),
    ).fetchall()
    return {r["phase"]: r for r in rows}


def changes(conn: Any, sid: str) -> list[dict[str, Any]]:
    return conn.execute(
        "SELECT * FROM unit_count_changes WHERE unit = %s ORDER BY id", (sid,)
    ).fetchall()


def assert_finish_equals_recount(url: str, sid: str, pk: int) -> None:
    """What the finish stored from the live counts is what a recount of the
    raw rows (``write_unit_counts``) stores: the recount changes no column
    and queues no change. Its live counts are gone."""
    assert live_counts(url, sid) == {}
    with connect(url) as conn:
        marks = conn.execute("SELECT * FROM live_count_marks WHERE session_pk = %s", (pk,))
        assert marks.fetchall() == []
        stored, queued = unit_counts(conn, sid), changes(conn, sid)
        assert set(stored) == {"whole", "split"}
        assert len(queued) == 2  # its first write: a change per phase
        conn.execute("SELECT count(*) FROM write_unit_counts(ARRAY[%s]::bigint[])", (pk,))
        assert unit_counts(conn, sid) == stored
        assert changes(conn, sid) == queued
        conn.rollback()


@pytest.fixture
def study(database_url: str) -> Iterator[StudyStore]:
    s = StudyStore(database_url, instance="live-counts-test")
    yield s
    s.close()


def test_live_counts_follow_every_write_and_the_finish_stores_a_recount(
    study: StudyStore,
) -> None:
    url = study.database_url
    rng = random.Random(29)
    sid, other = "29a0000000000001", "29a0000000000002"
    pk = new_session(study, sid)
    other_pk = new_session(study, other)
    first = first_pass(rng)

    # New batches: COPY. Nothing is folded yet (a fold waits for 8,192 seqs).
    # A few probes' outcomes come later (a timeout after later acks).
    mark = PLAN.total_probes // 2
    held = [e for e in first if e.seq in (5, 17, mark + 3)]
    sent = [e for e in first if e not in held]
    for start in range(0, len(sent), 30):
        apply(study, sid, sent[start : start + 30])
    apply(study, other, first_pass(rng))
    assert assert_live_equals_raw(url, sid) == 0 and live_counts(url, sid) == {}
    # Folded up to half the plan: the writes below change rows on both sides of the mark.
    fold(url, pk, mark)
    fold(url, other_pk, PLAN.total_probes // 3)
    assert assert_live_equals_raw(url, sid) == mark
    assert_live_equals_raw(url, other)
    apply(study, sid, held)  # new rows below the mark and above it
    assert_live_equals_raw(url, sid)

    # A batch repeating stored seqs: the upsert, the last word winning.
    lost = [e.seq for e in first if e.outcome == "lost"]
    acked = [e.seq for e in first if e.outcome == "acked"]
    again = [
        *(entry(s, "late") for s in lost[:3]),  # an ack turned up after all
        *(entry(s, "lost") for s in acked[:3]),  # an acked probe recorded lost
        *(entry(s, "acked", 99.5, frag=1480) for s in acked[3:6]),  # another RTT
        entry(lost[3], "lost", reassembly_invalid=False),  # invalid stays set
        entry(acked[6], "acked", 18.5),
        entry(acked[6], "late"),  # the same seq twice: the last wins
        entry(acked[-5], "lost"),  # above the mark
    ]
    apply(study, sid, again)
    assert_live_equals_raw(url, sid)
    apply(study, sid, again)  # re-sent unchanged
    assert_live_equals_raw(url, sid)

    # The client's report before the finish: invalid ranges, observations.
    still_lost = [s for s in lost[3:] if s not in {e.seq for e in again}]
    split_acked = [s for s in acked[7:] if PLAN.probe(s).phase == "split"]
    leads = [
        PLAN.probe(s).ip_len if i % 2 else 1520 - PLAN.probe(s).ip_len
        for i, s in enumerate(split_acked)
    ]
    assert study.record_client_report(
        sid,
        invalid_ranges=[(s, s + 1) for s in still_lost[:4]],
        observations=(split_acked, leads, [2] * len(split_acked)),
    )
    assert_live_equals_raw(url, sid)

    # A delete (no writer does this; a trigger counts it all the same).
    gone = [*acked[-3:], lost[-1], *acked[8:11], lost[5]]
    assert min(gone) < mark <= max(gone)
    with connect(url) as conn:
        conn.execute(
            "DELETE FROM probe_outcomes WHERE session_pk = %s AND seq = ANY(%s)", (pk, gone)
        )
    assert_live_equals_raw(url, sid)
    # A batch of a stored seq and a deleted one, both below the mark: an upsert
    # that replaces one row and inserts the other.
    apply(study, sid, [entry(acked[12], "late"), entry(min(gone), "acked", 31.0)])
    assert acked[12] < mark and acked[12] not in gone
    assert_live_equals_raw(url, sid)

    # The finish: counts from the live counts, equal to a recount.
    assert study.apply(RunFinished(sid, "complete", "fragments-ok", "test", None))
    assert_finish_equals_recount(url, sid, pk)

    # A batch replayed for the final session: counted from its raw rows, no live counts.
    apply(study, sid, [entry(lost[0], "acked", 20.25)])
    assert live_counts(url, sid) == {}
    with connect(url) as conn:
        stored = unit_counts(conn, sid)
        assert len(changes(conn, sid)) == 3  # the replay's, in one phase
        conn.execute("SELECT count(*) FROM write_unit_counts(ARRAY[%s]::bigint[])", (pk,))
        assert unit_counts(conn, sid) == stored and len(changes(conn, sid)) == 3
        conn.rollback()

    # The other session left live: the server's next start marks it incomplete.
    assert study.mark_orphans_incomplete() == [other]
    assert_finish_equals_recount(url, other, other_pk)


def test_a_session_live_across_the_upgrade_is_counted_from_its_rows(
    study: StudyStore,
) -> None:
    """A session live when 0029 arrives has no mark: its finish folds all its rows."""
    from kickass_core import cli

    url = study.database_url
    sid = "29a0000000000003"
    pk = new_session(study, sid)
    apply(study, sid, first_pass(random.Random(3)))
    assert cli.main(["db", "downgrade", "0028", "--database-url", url]) == 0
    with connect(url) as conn:
        assert conn.execute("SELECT to_regclass('live_counts') AS t").fetchone() == {"t": None}
    assert cli.main(["db", "upgrade", "--database-url", url]) == 0
    assert study.apply(RunFinished(sid, "complete", "fragments-ok", "test", None))
    assert_finish_equals_recount(url, sid, pk)
