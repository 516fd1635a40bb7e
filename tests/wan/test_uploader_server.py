"""The runner's uploader against a real `kickass server` (issue 16): one bad
record never poisons its batch, a batch over the body cap is split, and a
conflicting replay is set aside once, never retried forever."""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from pathlib import Path

import kickass_db as db
import pytest
from kickass_db.trial_store import TrialStore
from kickass_wan.trials import uploader
from kickass_wan.trials.spool import Spool
from kickass_wan.trials.uploader import Uploader
from sqlalchemy import create_engine, text
from support.live_server import free_port, server
from support.slow_relay import SlowRelay
from support.trial_records import flow, trial

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the server's probe engine needs root")


def _stored(database_url: str) -> dict[str, dict]:
    engine = create_engine(db.sqlalchemy_url(database_url))
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT flow_id, fct_ms, error FROM flows")).mappings()
            return {r["flow_id"]: dict(r) for r in rows}
    finally:
        engine.dispose()


def _spool_trial(spool: Spool, tid: str) -> None:
    spool.put("trial", tid, trial(tid))


def _spool_flows(spool: Spool, tid: str, flows: list[dict]) -> None:
    for f in flows:
        spool.put("flow", f["flow_id"], {**f, "trial_id": tid})


def _rejected(spool_dir: Path) -> dict[str, str]:
    return {
        p.name: json.loads(p.read_text())["rejected_because"]
        for p in (spool_dir / "rejected").glob("*.json")
    }


@pytest.fixture
def live(database_url: str):  # noqa: ANN201
    store = TrialStore(database_url)
    token = store.add_runner("edge-up")
    store.close()
    http = free_port(socket.SOCK_STREAM)
    with server(database_url, free_port(socket.SOCK_DGRAM), http):
        yield f"http://127.0.0.1:{http}", token


def test_one_bad_flow_is_set_aside_alone(live, database_url: str, tmp_path: Path) -> None:  # noqa: ANN001
    url, token = live
    spool_dir = tmp_path / "spool"
    spool = Spool(spool_dir)
    tid = secrets.token_hex(16)
    _spool_trial(spool, tid)
    flows = [flow(tid, i, "tcp", 10, 100.0 + i, None) for i in range(100)]
    flows[37]["ka_mode_fraction"] = 1.5  # out of its bounds: this one alone is refused
    _spool_flows(spool, tid, flows)
    report = Uploader(url, token, spool).flush()
    stored = _stored(database_url)
    assert len(stored) == 99 and flows[37]["flow_id"] not in stored
    assert report.sent == 100 and report.rejected == 1  # 99 flows and the trial; 1 aside
    (reason,) = _rejected(spool_dir).values()
    assert reason.startswith("bad-flow:") and "ka_mode_fraction" in reason, reason
    assert spool.count() == 0


def test_a_batch_over_the_body_cap_is_split_and_stored_whole(
    live,  # noqa: ANN001
    database_url: str,
    tmp_path: Path,
) -> None:
    url, token = live
    spool = Spool(tmp_path / "spool")
    tid = secrets.token_hex(16)
    _spool_trial(spool, tid)
    # 100 records of ~5.5 KB (a long error and transport counters): a batch
    # of 100 is twice the server's 256 KiB cap.
    flows = [
        {
            **flow(tid, i, "tcp", 10, None, None),
            "error": f"flow {i} failed: " + "x" * 1900,
            "extra": {f"note_{k}": "y" * 190 for k in range(16)},
        }
        for i in range(100)
    ]
    assert len(json.dumps({"flows": flows})) > 256 * 1024
    _spool_flows(spool, tid, flows)
    report = Uploader(url, token, spool).flush()
    assert report.rejected == 0 and report.pending == 0, report
    assert len(_stored(database_url)) == 100


def test_batches_stay_under_the_cap_in_order() -> None:
    """Batches are cut before their JSON passes BATCH_BYTES (a record alone
    over it goes alone) and BATCH records; nothing is lost or reordered."""
    sizes = [100] * 250 + [5_000] * 90 + [300_000] + [10] * 3
    recs = [{"id": str(i), "record": {"x": "y" * n}} for i, n in enumerate(sizes)]
    batches = uploader._batches(recs)
    assert [r["id"] for b in batches for r in b] == [r["id"] for r in recs]
    for b in batches:
        assert len(b) <= uploader.BATCH
        body = len(json.dumps([r["record"] for r in b]))
        assert body <= uploader.BATCH_BYTES or len(b) == 1, (len(b), body)
    # 100 + 100, then 50 small and 38 large (196,006 bytes), 39 large, the
    # last 13, the giant alone, the 3 small after it.
    assert [len(b) for b in batches] == [100, 100, 88, 39, 13, 1, 3]


def test_a_conflicting_replay_is_set_aside_not_retried_forever(
    live,  # noqa: ANN001
    database_url: str,
    tmp_path: Path,
) -> None:
    url, token = live
    spool_dir = tmp_path / "spool"
    spool = Spool(spool_dir)
    tid = secrets.token_hex(16)
    _spool_trial(spool, tid)
    original = flow(tid, 0, "tcp", 10, 120.0, None)
    _spool_flows(spool, tid, [original, flow(tid, 1, "tcp", 10, 130.0, None)])
    assert Uploader(url, token, spool).flush().ok
    # The same id again with other content (a runner bug, or a tampered spool).
    _spool_flows(spool, tid, [{**original, "fct_ms": 999.0}])
    report = Uploader(url, token, spool).flush()
    assert report.rejected == 1 and report.pending == 0
    (reason,) = _rejected(spool_dir).values()
    assert reason.startswith("conflict:"), reason
    assert _stored(database_url)[original["flow_id"]]["fct_ms"] == 120.0  # kept as stored
    # Nothing left to retry: the next flush sends nothing.
    again = Uploader(url, token, spool).flush()
    assert again.sent == 0 and again.rejected == 0 and again.pending == 0


def test_a_pass_with_a_deadline_stops_there_and_loses_nothing(
    live,  # noqa: ANN001
    database_url: str,
    tmp_path: Path,
) -> None:
    """Between two periods the runner gives a pass a deadline. Through a
    relay that holds every answer 2 s, a pass with 0.5 s returns at its
    deadline (not after the answer), says it was deferred, not failed, and
    keeps every record spooled, though the server may have stored the first
    request's; the next pass, straight to the server, stores each record
    once (a re-sent record is a no-op)."""
    url, token = live
    spool = Spool(tmp_path / "spool")
    tid = secrets.token_hex(16)
    _spool_trial(spool, tid)
    flows = [flow(tid, i, "tcp", 10, 100.0 + i, None) for i in range(20)]
    _spool_flows(spool, tid, flows)
    port = int(url.rsplit(":", 1)[1])
    with SlowRelay(port, delay_s=2.0) as relay:
        began = time.monotonic()
        report = Uploader(f"http://127.0.0.1:{relay.port}", token, spool).flush(began + 0.5)
        took = time.monotonic() - began
    assert 0.45 <= took < 1.0, took
    assert report.deferred and report.errors == [] and report.rejected == 0, report
    assert report.pending == spool.count() == 21
    final = Uploader(url, token, spool).flush()
    assert final.ok and not final.deferred, final
    stored = _stored(database_url)
    assert set(stored) == {f["flow_id"] for f in flows}
