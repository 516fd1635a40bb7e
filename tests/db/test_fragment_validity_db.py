"""Migration 0007 and the end-of-session report (issue 11), on a real PostgreSQL:
invalid probes leave the drop rates, the client's reassembly memory lands in
the session's metadata, privileged fragment observations land on every probe,
the excess over the two-fragment bound is the same in SQL and in Python, and
the report endpoint refuses what it must."""

from __future__ import annotations

import base64
import hashlib
import zlib
from array import array
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import kickass_db as db
import pytest
from flask.testing import FlaskClient
from kickass_core import cli
from kickass_core.plan import ProbePlan
from kickass_core.study_events import ClockAnchor, OutcomeBatch, OutcomeEntry, RunFinished
from kickass_core.verdict import decide, excess
from kickass_db.study_store import StudyStore
from kickass_server.api import ApiConfig, create_app
from kickass_server.engine import ProbeEngine
from kickass_server.policy import Policy
from sqlalchemy import inspect, text

T0 = datetime(2026, 1, 1, tzinfo=UTC)
AT_T0 = ClockAnchor(T0.timestamp(), 0.0)  # the batches' monotonic clock reads 0 at T0
SID = "abcdefabcdefabcd"
COOKIE = bytes(range(16))
PLAN = ProbePlan.build(repetitions=10, step=256, window=4)  # 8 whole, 6 split sizes


def seed(store: StudyStore, *, lost_splits: int = 20, state: str = "complete") -> None:
    """Whole: all acked. Split: the first ``lost_splits`` lost, the rest acked."""
    store.create_session(
        session_id=SID,
        cookie_hash=hashlib.sha256(COOKIE).digest(),
        plan=PLAN.to_json(),
        source_address="198.51.100.7",
        expires_at=T0 + timedelta(hours=1),
        server_version="t",
        client_metadata={"reassembly": {"announced": {"split_credit": 512}}},
    )
    rows = []
    for seq in range(PLAN.total_probes):
        p = PLAN.probe(seq)
        lost = p.phase == "split" and seq - PLAN.split_from < lost_splits
        rows.append(
            OutcomeEntry(
                seq=seq,
                phase=p.phase,
                ip_len=p.ip_len,
                outcome="lost" if lost else "acked",
                sent_at=0.0,
                acked_at=None if lost else 0.001,
                ack_count=0 if lost else 1,
                received_len=None,
                observed_frag_size=0 if p.phase == "whole" else max(p.ip_len, 1520 - p.ip_len),
            )
        )
    store.apply(OutcomeBatch(SID, tuple(rows), AT_T0))
    if state != "probing":
        store.apply(RunFinished(SID, state, "inconclusive", "seeded", None, {"reports": 3}))


def summary(store: StudyStore) -> dict[str, Any]:
    with store.engine.connect() as conn:
        return dict(
            conn.execute(
                text("SELECT * FROM v_session_summary WHERE session_id = :s"), {"s": SID}
            ).mappings().one()
        )  # fmt: skip


def test_invalid_probes_leave_the_drop_rates(store: StudyStore) -> None:
    seed(store)
    before = summary(store)
    assert (before["split_sent"], before["split_acked"]) == (60, 40)
    # The client's kernel refused fragments while seqs of the first 12 splits
    # were in flight (and a range over acked ones: those arrived, stay valid).
    first = PLAN.split_from
    assert store.record_client_report(
        SID, invalid_ranges=[(first, first + 12), (first + 30, first + 40)]
    )
    after = summary(store)
    assert (after["split_sent"], after["split_acked"]) == (48, 40)
    assert after["split_reassembly_invalid"] == 12
    assert after["split_drop_rate"] == pytest.approx(8 / 48)
    res = store.session_results(SID)
    assert res["reassembly_invalid"] == {"whole": 0, "split": 12}
    rows = {r["leading_ip_len"]: r for r in res["split"]}
    assert sum(r["reassembly_invalid"] for r in rows.values()) == 12
    assert sum(r["sent"] for r in rows.values()) == 48
    # The verdict was decided again, from the valid probes.
    v = decide(80, 80, 48, 40, split_invalid=12)
    assert (res["verdict"], res["verdict_reason"]) == (v.verdict, v.reason)
    assert "refused fragments" in res["verdict_reason"]
    # Idempotent: the same report again changes nothing.
    store.record_client_report(SID, invalid_ranges=[(first, first + 12)])
    assert summary(store)["split_reassembly_invalid"] == 12


def test_a_late_engine_write_keeps_the_flag(store: StudyStore) -> None:
    seed(store)
    first = PLAN.split_from
    store.record_client_report(SID, invalid_ranges=[(first, first + 1)])
    # The engine re-writes the row (a duplicate timeout record): the flag stays.
    lost = OutcomeEntry(first, "split", PLAN.split[0], "lost", 0.0, None, 0, None, None)
    store.apply(OutcomeBatch(SID, (lost,), AT_T0))
    assert summary(store)["split_reassembly_invalid"] == 1


def test_metadata_before_during_after(store: StudyStore) -> None:
    seed(store)
    store.record_client_report(SID, metadata={"reassembly": {"client": {"after": {"fails": 7}}}})
    meta = store.session_results(SID)["client_metadata"]["reassembly"]
    # announced (session request), server (the engine at finish), client (report)
    assert meta == {
        "announced": {"split_credit": 512},
        "server": {"reports": 3},
        "client": {"after": {"fails": 7}},
    }


def test_excess_in_sql_matches_python(store: StudyStore) -> None:
    seed(store, lost_splits=7)
    row = summary(store)
    x = excess(row["whole_sent"], row["whole_acked"], row["split_sent"], row["split_acked"])
    assert x is not None
    assert row["split_excess_drop"] == pytest.approx(x.estimate)
    assert row["split_excess_low"] == pytest.approx(x.low)
    assert row["split_excess_high"] == pytest.approx(x.high)
    assert store.session_results(SID)["excess"] == pytest.approx(x.to_json())


def _arrays(leading: dict[int, int], fragments: dict[int, int]) -> dict[str, str]:
    lead = array("H", bytes(2 * PLAN.total_probes))
    frags = bytearray(PLAN.total_probes)
    for seq, v in leading.items():
        lead[seq] = v
    for seq, v in fragments.items():
        frags[seq] = v
    lead.byteswap()  # big-endian (this machine is little-endian)
    return {
        "encoding": "zlib-base64-v1",
        "leading": base64.b64encode(zlib.compress(lead.tobytes())).decode(),
        "fragments": base64.b64encode(zlib.compress(bytes(frags))).decode(),
    }


# -- the endpoint ---------------------------------------------------------------------------


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def api(store: StudyStore) -> Iterator[FlaskClient]:
    engine = ProbeEngine(store, Policy(), probe_port=9000, server_version="t", clock=Clock())
    try:
        yield create_app(engine, store, ApiConfig(health_cache_s=0)).test_client()
    finally:
        engine.stop()


def post(api: FlaskClient, body: Any, cookie: str = COOKIE.hex()) -> Any:
    return api.post(
        f"/api/v1/sessions/{SID}/report", json=body, headers={"X-Kickass-Cookie": cookie}
    )


def test_report_endpoint_stores_observations(api: FlaskClient, store: StudyStore) -> None:
    seed(store)
    # Split seqs: the first 10 acked splits swapped, the next 10 as sent.
    acked_splits = [s for s in range(PLAN.split_from + 20, PLAN.total_probes)]
    leading, fragments = {}, {}
    for i, seq in enumerate(acked_splits[:20]):
        ip_len = PLAN.probe(seq).ip_len
        leading[seq] = 1520 - ip_len if i < 10 else ip_len
        fragments[seq] = 2
    r = post(
        api,
        {
            "reassembly": {"during": {"refused": 0, "max_memory": 123}},
            "invalid_ranges": [],
            "fragment_observation": {
                "summary": {"split_swapped": 10},
                **_arrays(leading, fragments),
            },
        },
    )
    assert r.status_code == 200, r.get_json()
    res = r.get_json()
    assert res["client_metadata"]["fragment_observation"] == {"split_swapped": 10}
    assert res["client_metadata"]["reassembly"]["client"]["during"]["max_memory"] == 123
    swapped_sizes = {PLAN.probe(s).ip_len for s in acked_splits[:10]}
    rows = {r["leading_ip_len"]: r for r in res["split"]}
    # The split at 760 cannot be swapped visibly (its two pieces are equal).
    expect_swapped = sum(1 for s in acked_splits[:10] if PLAN.probe(s).ip_len != 760)
    assert sum(r["leading_swapped"] for r in rows.values()) == expect_swapped
    assert sum(r["fragments_observed"] for r in rows.values()) == 20
    assert sum(r["leading_as_sent"] for r in rows.values()) == 10
    assert swapped_sizes
    row = summary(store)
    assert (row["split_fragments_observed"], row["split_leading_as_sent"]) == (20, 10)
    assert row["split_largest_fragment_as_sent"] == 40  # IP_RECVFRAGSIZE: blind to the swap


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"invalid_ranges": [[5, 3]]}, 400),
        ({"invalid_ranges": [[0, PLAN.total_probes + 1]]}, 400),
        ({"invalid_ranges": "all"}, 400),
        ({"reassembly": {"x": float("nan")}}, 400),
        ({"reassembly": {"x": "a" * 500}}, 400),
        ({"reassembly": {"x": list(range(3000))}}, 400),
        (
            {
                "fragment_observation": {
                    "leading": "@@@",
                    "fragments": "",
                    "encoding": "zlib-base64-v1",
                }
            },
            400,
        ),
        # A decompression bomb: far more than the plan's length.
        (
            {
                "fragment_observation": {
                    "encoding": "zlib-base64-v1",
                    "leading": base64.b64encode(zlib.compress(bytes(50_000_000))).decode(),
                    "fragments": base64.b64encode(zlib.compress(bytes(PLAN.total_probes))).decode(),
                }
            },
            400,
        ),
    ],
)
def test_report_endpoint_refuses_bad_input(
    api: FlaskClient, store: StudyStore, body: dict, status: int
) -> None:
    seed(store)
    if "nan" in repr(body):
        r = api.post(
            f"/api/v1/sessions/{SID}/report",
            data='{"reassembly": {"x": NaN}}',
            content_type="application/json",
            headers={"X-Kickass-Cookie": COOKIE.hex()},
        )
    else:
        r = post(api, body)
    assert r.status_code == status, r.get_json()
    assert summary(store)["split_reassembly_invalid"] == 0


def test_report_endpoint_needs_the_cookie_and_a_finished_session(
    api: FlaskClient, store: StudyStore
) -> None:
    seed(store, state="probing")
    assert post(api, {}, cookie="00" * 16).status_code == 403
    assert post(api, {}, cookie="zz").status_code == 403
    assert post(api, {}).status_code == 409
    assert (
        api.post(
            "/api/v1/sessions/0000000000000000/report", json={}, headers={"X-Kickass-Cookie": "00"}
        ).status_code
        == 404
    )


def test_downgrade_to_0006_restores_the_old_views(empty_database_url: str) -> None:
    url = empty_database_url
    assert cli.main(["db", "upgrade", "--database-url", url]) == 0
    assert cli.main(["db", "downgrade", "0006", "--database-url", url]) == 0
    e = db.make_engine(url)
    try:
        insp = inspect(e)
        cols = [c["name"] for c in insp.get_columns("v_split_drop")]
        assert cols[-1] == "arrived_as_sent" and "largest_fragment_as_sent" not in cols
        assert "client_metadata" not in [c["name"] for c in insp.get_columns("sessions")]
        by_source = [c["name"] for c in insp.get_columns("v_split_drop_by_source")]
        assert by_source[-1] == "arrived_as_sent"
    finally:
        e.dispose()
    assert cli.main(["db", "upgrade", "--database-url", url]) == 0
