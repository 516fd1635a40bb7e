"""The StudyStore on a real PostgreSQL: round trips, idempotence, orphans, restarts."""

from __future__ import annotations

import json
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import kickass_db as db
import psycopg
import pytest
from kickass_core.errors import KickassError
from kickass_core.plan import ProbePlan
from kickass_core.study_events import (
    ClockAnchor,
    Heartbeat,
    OutcomeBatch,
    OutcomeEntry,
    RunFinished,
    RunProbing,
)
from kickass_core.verdict import decide
from kickass_db.retry import DatabaseUnavailable
from kickass_db.study_store import StudyStore, UnknownSession
from kickass_testbed.pg import EmbeddedPostgres
from sqlalchemy import text

SID = "0123456789abcdef"
COOKIE = bytes(range(32))
T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
AT_T0 = ClockAnchor(T0.timestamp(), 0.0)  # the batches' monotonic clock reads 0 at T0


def create(store: StudyStore, session_id: str = SID, **overrides: Any) -> None:
    kwargs: dict[str, Any] = {
        "session_id": session_id,
        "cookie_hash": COOKIE,
        "plan": ProbePlan.quick().to_json(),
        "source_address": "203.0.113.9",
        "expires_at": T0 + timedelta(minutes=10),
        "server_version": "0.1.0",
        "client_version": "0.1.0",
        "platform": "linux",
        "install_id": "install-1",
    }
    kwargs.update(overrides)
    store.create_session(**kwargs)


def outcomes(
    phase: str, n: int, acked: int, start: int = 0, ip_len: int = 1500
) -> list[OutcomeEntry]:
    """``n`` probes sent 1 ms apart from T0, the first ``acked`` acked 30 ms later."""
    return [
        OutcomeEntry(
            seq=start + i,
            phase=phase,
            ip_len=ip_len,
            outcome="acked" if i < acked else "lost",
            sent_at=i / 1000,
            acked_at=(i + 30) / 1000 if i < acked else None,
            ack_count=1 if i < acked else 0,
            received_len=1472 if i < acked else None,
            observed_frag_size=None,
        )
        for i in range(n)
    ]


def batch(entries: list[OutcomeEntry], session_id: str = SID) -> OutcomeBatch:
    return OutcomeBatch(session_id, tuple(entries), AT_T0)


def at(mono: float | None) -> datetime | None:
    """The UTC time of a monotonic reading of the batches' clock."""
    return None if mono is None else T0 + timedelta(seconds=mono)


def query(store: StudyStore, sql: str, **params: Any) -> list[dict[str, Any]]:
    with store.engine.connect() as conn:
        return [dict(r) for r in conn.execute(text(sql), params).mappings()]


def test_ping_on_a_migrated_database(store: StudyStore) -> None:
    store.ping()


def test_create_session_round_trip(store: StudyStore) -> None:
    create(store)
    assert store.cookie_hash(SID) == COOKIE
    r = store.session_results(SID)
    assert r is not None
    json.dumps(r)  # served as is by the HTTP API
    plan = ProbePlan.quick().to_json()
    assert r["session_id"] == SID
    assert r["state"] == "created"
    assert (r["verdict"], r["verdict_reason"], r["end_reason"]) == (None, None, None)
    assert (r["started_at"], r["finished_at"]) == (None, None)
    assert datetime.fromisoformat(r["created_at"]).utcoffset() == timedelta(0)
    assert (r["client_version"], r["server_version"]) == ("0.1.0", "0.1.0")
    assert r["plan"] == plan
    assert r["total_probes"] == plan["total_probes"]
    assert (r["sent"], r["acked"], r["rtt_ms"], r["whole"], r["split"]) == (0, 0, None, [], [])
    row = query(store, "SELECT host(source_address) AS a, expires_at FROM sessions")[0]
    assert row == {"a": "203.0.113.9", "expires_at": T0 + timedelta(minutes=10)}


def test_timestamps_are_utc_whatever_the_server_zone(database_url: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        name = conn.execute("SELECT current_database()").fetchone()
        assert name is not None
        conn.execute(f"ALTER DATABASE \"{name[0]}\" SET timezone = 'America/New_York'")
    with StudyStore(database_url) as store:
        create(store)
        r = store.session_results(SID)
        assert r is not None and r["created_at"].endswith("+00:00")


def test_unknown_session(store: StudyStore) -> None:
    assert store.session_results(SID) is None
    assert store.cookie_hash(SID) is None
    assert store.apply(RunProbing(SID, "203.0.113.9", 1234, None)) is False
    assert store.apply(Heartbeat(SID, 1, 1)) is False
    assert store.apply(RunFinished(SID, "expired", None, None, None)) is False
    with pytest.raises(UnknownSession):
        store.apply(batch(outcomes("whole", 1, 1)))


def test_a_run_is_written_only_through_apply() -> None:
    """One write form: the engine's events go through ``apply``, which has a
    case per event type; no store method takes the same write another way."""
    public = {name for name in vars(StudyStore) if not name.startswith("_")}
    assert not public & {"mark_probing", "record_outcomes", "heartbeat", "finish_session"}


def test_clients_are_upserted_by_install_id(store: StudyStore) -> None:
    create(store, "1111111111111111", platform="linux")
    create(
        store,
        "2222222222222222",
        source_address="198.51.100.1",
        client_version="0.2.0",
        platform=None,
    )
    create(store, "3333333333333333", install_id=None)
    create(store, "4444444444444444", install_id=None)
    clients = query(
        store,
        "SELECT install_id, host(last_address) AS addr, client_version, platform, "
        "last_seen >= first_seen AS ordered FROM clients ORDER BY id",
    )
    assert clients == [
        # the newest address and version win; a missing platform keeps the old one
        {"install_id": "install-1", "addr": "198.51.100.1", "client_version": "0.2.0",
         "platform": "linux", "ordered": True},
        {"install_id": None, "addr": "203.0.113.9", "client_version": "0.1.0",
         "platform": "linux", "ordered": True},
        {"install_id": None, "addr": "203.0.113.9", "client_version": "0.1.0",
         "platform": "linux", "ordered": True},
    ]  # fmt: skip
    per_client = query(store, "SELECT count(*) AS n FROM sessions GROUP BY client_id ORDER BY n")
    assert [r["n"] for r in per_client] == [1, 1, 2]


def test_create_session_is_idempotent_for_the_same_cookie(store: StudyStore) -> None:
    create(store)
    create(store)  # a retried call
    assert query(store, "SELECT count(*) AS n FROM sessions") == [{"n": 1}]
    assert query(store, "SELECT count(*) AS n FROM clients") == [{"n": 1}]
    with pytest.raises(KickassError, match="already exists"):
        create(store, cookie_hash=b"\xff" * 32)


@pytest.mark.parametrize("bad", ["0123456789ABCDEF", "0123", "0123456789abcdef0", "xyz"])
def test_session_ids_are_16_lowercase_hex(store: StudyStore, bad: str) -> None:
    with pytest.raises(ValueError, match="16 lowercase hex"):
        create(store, bad)


def test_naive_datetimes_are_refused(store: StudyStore) -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        create(store, expires_at=datetime(2026, 1, 1))
    create(store)
    # An outcome's times are monotonic: only its batch's anchor makes them
    # UTC, so a batch without one is refused, never stored in some zone.
    with pytest.raises(ValueError, match="without a clock anchor"):
        store.apply(OutcomeBatch(SID, tuple(outcomes("whole", 1, 1))))


def test_mark_probing(store: StudyStore) -> None:
    create(store)
    assert store.apply(RunProbing(SID, "203.0.113.9", 40123, 31.5)) is True
    r = store.session_results(SID)
    assert r is not None and r["state"] == "probing" and r["rtt_ms"] == pytest.approx(31.5)
    started = r["started_at"]
    assert started is not None
    # NAT rebinding: the client proves a new port; the start time stays.
    assert store.apply(RunProbing(SID, "203.0.113.9", 40999, 30.0)) is True
    row = query(store, "SELECT host(probe_address) AS a, probe_port, started_at FROM sessions")[0]
    assert (row["a"], row["probe_port"]) == ("203.0.113.9", 40999)
    assert row["started_at"].isoformat() == started
    # A finished session is never brought back.
    store.apply(RunFinished(SID, "expired", "inconclusive", "too few probes", None))
    assert store.apply(RunProbing(SID, "203.0.113.9", 1, None)) is False
    assert query(store, "SELECT state FROM sessions") == [{"state": "expired"}]


def test_record_outcomes_round_trip(store: StudyStore) -> None:
    create(store)
    rows = outcomes("whole", 3, 2) + outcomes("split", 2, 1, start=3, ip_len=500)
    rows[3] = rows[3]._replace(observed_frag_size=1020)
    rows[0] = rows[0]._replace(ack_count=2)
    store.apply(batch(rows))
    stored = query(
        store,
        "SELECT seq, phase, ip_len, sent_at, outcome, acked_at, rtt_ms, ack_count, "
        "received_len, observed_frag_size FROM probe_outcomes ORDER BY seq",
    )
    assert stored == [
        {
            "seq": o.seq, "phase": o.phase, "ip_len": o.ip_len, "sent_at": at(o.sent_at),
            "outcome": o.outcome, "acked_at": at(o.acked_at),
            "rtt_ms": None if o.acked_at is None else 30.0, "ack_count": o.ack_count,
            "received_len": o.received_len, "observed_frag_size": o.observed_frag_size,
        }
        for o in rows
    ]  # fmt: skip


def test_a_resent_batch_changes_nothing(store: StudyStore) -> None:
    create(store)
    sent = batch(outcomes("whole", 50, 40))
    store.apply(sent)
    before = store.session_results(SID)
    store.apply(sent)
    assert store.session_results(SID) == before
    assert query(store, "SELECT count(*) AS n FROM probe_outcomes") == [{"n": 50}]


def test_late_ack_updates_a_lost_probe(store: StudyStore) -> None:
    create(store)
    store.apply(batch(outcomes("whole", 10, 7)))
    late = outcomes("whole", 10, 7)[9]
    late = late._replace(outcome="late", acked_at=late.sent_at + 3, ack_count=1)
    store.apply(batch([late]))
    r = store.session_results(SID)
    assert r is not None
    assert r["whole"] == [
        {
            "ip_len": 1500,
            "sent": 10,
            "acked": 7,  # late still counts as lost
            "late": 1,
            "drop_rate": pytest.approx(0.3),
            "rtt_ms_median": pytest.approx(30.0),
            "fragmented_on_arrival": 0,
            # 0007 columns: nothing invalid or observed before reassembly
            "reassembly_invalid": 0,
            "fragments_observed": 0,
            "fragmented_observed": 0,
        }
    ]
    row = query(store, "SELECT outcome, rtt_ms, acked_at FROM probe_outcomes WHERE seq = 9")
    assert row == [{"outcome": "late", "rtt_ms": 3000.0, "acked_at": at(late.acked_at)}]


def test_the_last_word_on_a_seq_wins_within_a_batch(store: StudyStore) -> None:
    create(store)
    first, again = outcomes("whole", 1, 0)[0], outcomes("whole", 1, 1)[0]
    store.apply(batch([first, again]))
    assert query(store, "SELECT outcome FROM probe_outcomes") == [{"outcome": "acked"}]


def test_invalid_outcomes_are_refused(store: StudyStore) -> None:
    create(store)
    bad = outcomes("whole", 1, 1)[0]._replace(phase="fragmented")
    with pytest.raises(ValueError, match="phase"):
        store.apply(batch([bad]))
    bad = outcomes("whole", 1, 1)[0]._replace(outcome="maybe")
    with pytest.raises(ValueError, match="outcome"):
        store.apply(batch([bad]))
    store.apply(batch([]))  # nothing to do is fine


def test_a_full_paper_plan_is_one_quick_batch(store: StudyStore) -> None:
    plan = ProbePlan.build()  # the paper's N=100: 36,600 probes
    create(store, plan=plan.to_json())
    entries = [
        OutcomeEntry(
            seq=p.seq, phase=p.phase, ip_len=p.ip_len, outcome="acked", sent_at=0.0,
            acked_at=0.02, ack_count=1, received_len=p.udp_payload_len, observed_frag_size=0,
        )
        for p in map(plan.probe, range(plan.total_probes))
    ]  # fmt: skip
    started = time.monotonic()
    store.apply(batch(entries))
    elapsed = time.monotonic() - started
    r = store.session_results(SID)
    assert r is not None and r["sent"] == r["acked"] == plan.total_probes
    assert len(r["whole"]) == len(plan.whole) and len(r["split"]) == len(plan.split)
    # Generous for a shared 2-core machine; row-at-a-time inserts take minutes.
    assert elapsed < 10, f"{plan.total_probes} outcomes took {elapsed:.1f} s"


def test_heartbeat_counters_until_outcomes_exist(store: StudyStore) -> None:
    create(store)
    store.apply(RunProbing(SID, "203.0.113.9", 4000, 20.0))
    assert store.apply(Heartbeat(SID, 120, 118)) is True
    r = store.session_results(SID)
    assert r is not None and (r["sent"], r["acked"]) == (120, 118)
    store.apply(batch(outcomes("whole", 10, 9)))
    r = store.session_results(SID)
    assert r is not None and (r["sent"], r["acked"]) == (10, 9)


def test_finish_session_first_final_state_wins(store: StudyStore) -> None:
    create(store)
    assert store.apply(RunFinished(SID, "complete", "fragments-ok", "fine", "done")) is True
    assert store.apply(RunFinished(SID, "expired", "inconclusive", "late timer", None)) is False
    r = store.session_results(SID)
    assert r is not None
    assert (r["state"], r["verdict"], r["verdict_reason"], r["end_reason"]) == (
        "complete",
        "fragments-ok",
        "fine",
        "done",
    )
    assert datetime.fromisoformat(r["finished_at"]).utcoffset() == timedelta(0)


def test_finish_session_validates(store: StudyStore) -> None:
    create(store)
    with pytest.raises(ValueError, match="state"):
        store.apply(RunFinished(SID, "probing", None, None, None))
    with pytest.raises(ValueError, match="verdict"):
        store.apply(RunFinished(SID, "complete", "fine", None, None))


def test_orphans_become_incomplete_with_a_verdict_from_their_data(store: StudyStore) -> None:
    create(store, "000000000000000a")  # created, never probed
    create(store, "000000000000000b")
    store.apply(RunProbing("000000000000000b", "203.0.113.9", 4000, 20.0))
    store.apply(
        batch(outcomes("whole", 40, 39) + outcomes("split", 30, 29, start=40), "000000000000000b")
    )
    create(store, "000000000000000c")
    store.apply(RunFinished("000000000000000c", "complete", "fragments-ok", "fine", "done"))

    assert store.mark_orphans_incomplete() == ["000000000000000a", "000000000000000b"]
    a, b, c = (store.session_results(s) for s in ("000000000000000a", "000000000000000b",
                                                  "000000000000000c"))  # fmt: skip
    assert a is not None and b is not None and c is not None
    expected_a = decide(0, 0, 0, 0)
    assert (a["state"], a["verdict"], a["verdict_reason"]) == (
        "incomplete",
        expected_a.verdict,
        expected_a.reason,
    )
    expected_b = decide(40, 39, 30, 29)
    assert (b["state"], b["verdict"], b["verdict_reason"]) == (
        "incomplete",
        expected_b.verdict,
        expected_b.reason,
    )
    assert a["end_reason"] == b["end_reason"] == "server-restart"
    assert a["finished_at"] is not None
    assert (c["state"], c["verdict"], c["end_reason"]) == ("complete", "fragments-ok", "done")
    assert store.mark_orphans_incomplete() == []


def test_store_is_shared_by_threads(store: StudyStore) -> None:
    ids = [f"{i:016x}" for i in range(4)]
    for sid in ids:
        create(store, sid)
    errors: list[BaseException] = []

    def worker(sid: str) -> None:
        try:
            for k in range(10):
                store.apply(batch(outcomes("whole", 5, 4, start=5 * k), sid))
                store.apply(Heartbeat(sid, 5 * (k + 1), 4 * (k + 1)))
                assert store.session_results(sid) is not None
        except BaseException as exc:  # surfaced in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(sid,)) for sid in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for sid in ids:
        r = store.session_results(sid)
        assert r is not None and (r["sent"], r["acked"]) == (50, 40)


# -- the database goes away and comes back -----------------------------------


def test_killed_connections_are_survived(store: StudyStore, database_url: str) -> None:
    create(store)
    store.apply(batch(outcomes("whole", 5, 5)))
    # What a restart does to the pool: every server-side backend is gone.
    with psycopg.connect(database_url, autocommit=True) as conn:
        killed = conn.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchone()
    assert killed is not None and killed[0] >= 1  # the store's pooled connection
    store.apply(batch(outcomes("whole", 5, 4, start=5)))
    r = store.session_results(SID)
    assert r is not None and (r["sent"], r["acked"]) == (10, 9)


@pytest.fixture
def restartable_pg() -> Iterator[EmbeddedPostgres]:
    with (
        tempfile.TemporaryDirectory(prefix="kickass-pg-restart-") as tmp,
        EmbeddedPostgres(Path(tmp) / "pgdata") as pg,
    ):
        yield pg


def test_a_database_restart_loses_nothing(restartable_pg: EmbeddedPostgres) -> None:
    url = restartable_pg.url
    db.upgrade(url)
    with StudyStore(url) as store:
        create(store)
        store.apply(RunProbing(SID, "203.0.113.9", 4000, 20.0))
        first = batch(outcomes("whole", 20, 18))
        store.apply(first)

        restartable_pg.stop()
        second = batch(outcomes("whole", 20, 20, start=20))
        with pytest.raises(DatabaseUnavailable):
            store.apply(second)  # the engine keeps the batch and retries
        restartable_pg.start()

        store.apply(second)
        store.apply(Heartbeat(SID, 40, 38))
        r = store.session_results(SID)
        assert r is not None
        assert (r["state"], r["sent"], r["acked"]) == ("probing", 40, 38)
        store.ping()
