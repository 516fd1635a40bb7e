"""`kickass atlas plan|create|fetch|import|status` against a local HTTPS
stand-in of the RIPE Atlas v2 API (tests/atlas/atlas_standin.py) and a real
PostgreSQL.

The stand-in speaks the real shapes: Cousteau builds the URLs, sends
``Authorization: Key``, verifies TLS against the stand-in's CA bundle. The
results here are synthetic but consistent with a reply log written through
the real store (what the responder would have logged); the namespace test
(test_atlas_evping_netns.py) makes them with the real probe firmware.
"""

from __future__ import annotations

import bz2
import io
import json
import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kickass_db as db
import pytest
import yaml
from atlas_standin import StandIn, envelope, ping_result, running
from kickass_atlas.campaign import Campaign
from kickass_atlas.responder_core import ReplyRecord
from kickass_atlas.store import AtlasStore
from kickass_core import cli
from sqlalchemy import text

WHOLE_ADDR, SPLIT_ADDR = "198.18.90.10", "198.18.90.11"
PROBES = {1001: "198.18.91.2", 1002: "198.18.92.2"}
PACKETS = 8
SPLITS = [44, 548, 1052, 1492]
KEY = "sekrit-KEY-7f3a9c"


def campaign_dict(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "name": "standin-study",
        "description": "Kick-Ass fragment study (stand-in)",
        "target": {"whole": WHOLE_ADDR, "split": SPLIT_ADDR},
        "probes": {"ids": sorted(PROBES)},
        "whole": {"sizes": [100, 1500], "sample": 2},
        "split": {"leading": SPLITS},
        "packets": PACKETS,
        "interval": 60,
        "packet_interval": 100,
        "duration": 3600,
        "credit_budget": 100_000,
        "responder": {"pps_per_address": 1000, "pps_per_prefix": 5000, "pps_global": 20000},
    }
    d.update(over)
    return d


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[StandIn]:
    with running(tmp_path, key=KEY) as s:
        s.add_probe(1001, PROBES[1001], 64500, "NL")
        s.add_probe(1002, PROBES[1002], 64501, "DE")
        yield s


@pytest.fixture
def campaign_file(tmp_path: Path) -> Path:
    path = tmp_path / "campaign.yaml"
    path.write_text(yaml.safe_dump(campaign_dict()))
    return path


@pytest.fixture
def env(
    monkeypatch: pytest.MonkeyPatch, standin: StandIn, database_url: str
) -> Iterator[dict[str, str]]:
    values = {
        "KICKASS_ATLAS_KEY": KEY,
        "KICKASS_ATLAS_SERVER": standin.server,
        "KICKASS_ATLAS_CA_BUNDLE": str(standin.ca_bundle),
        "KICKASS_DATABASE_URL": database_url,
    }
    for k, v in values.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("KICKASS_CONFIG", raising=False)
    yield values


def kickass(*argv: str | Path) -> int:
    return cli.main(["atlas", *map(str, argv)])


def rows(database_url: str, sql: str, **params: Any) -> list[dict[str, Any]]:
    e = db.make_engine(database_url)
    try:
        with e.connect() as conn:
            return [dict(r) for r in conn.execute(text(sql), params).mappings()]
    finally:
        e.dispose()


def play(
    standin: StandIn,
    database_url: str,
    msm_id: int,
    timestamps: list[int],
    lost: dict[int, set[int]] | None = None,
) -> None:
    """What would have happened, as the probe firmware does it: for each ping
    (probe, result time = the run's end) the responder answered every echo
    request and logged it; the replies at the packet indexes in
    ``lost[probe]`` never came back. Before the first reply a lost one is an
    x and the sequence number moves on; after it, it leaves no entry and the
    next request re-uses the sequence number (ping.c). Writes the reply log
    and the stand-in's results."""
    m = standin.measurements[msm_id]
    target, size = m["target"], m["size"]
    phase = "split" if target == SPLIT_ADDR else "whole"
    interval = m["packet_interval"] / 1000
    lost = lost or {}
    campaign = Campaign.from_dict(campaign_dict())
    records: list[ReplyRecord] = []
    lines = []
    with AtlasStore(database_url) as store:
        campaign_id = store.upsert_campaign(campaign)
        for prb_id, address in PROBES.items():
            seq, answered = 1, 0
            for ts in timestamps:
                entries: list[dict[str, Any]] = []
                got_reply, last_seq, attempt = False, -1, 0
                for k in range(PACKETS):
                    attempt = attempt + 1 if seq == last_seq else 0
                    last_seq = seq
                    ip_len = (
                        SPLITS[(answered + prb_id) % len(SPLITS)] if phase == "split" else size + 28
                    )
                    answered += 1
                    records.append(
                        ReplyRecord(
                            reply_no=len(records), responder_address=target,
                            dst_address=address, icmp_id=prb_id, icmp_seq=seq,
                            request_len=size + 28, phase=phase, ip_len=ip_len,
                            sent_at=ts - PACKETS * interval + k * interval + 0.01,
                            attempt=attempt,
                        )
                    )  # fmt: skip
                    if k not in lost.get(prb_id, set()):
                        entries.append({"rtt": 12.5 + k})
                        got_reply, seq = True, (seq + 1) % 256
                    elif not got_reply:
                        entries.append({"x": "*"})
                        seq = (seq + 1) % 256
                lines.append(
                    ping_result(
                        msm_id, prb_id, ts, dst=target, src="10.0.0.5", public=address,
                        size=size, entries=entries, sent=PACKETS,
                    )
                )  # fmt: skip
        store.write_reply_log(campaign_id, uuid.uuid4(), records)
    standin.add_results(msm_id, lines)


def created(standin: StandIn) -> dict[str, int]:
    """Measurement key -> id, from what the stand-in was asked to create."""
    return {
        m["description"].rsplit("[", 1)[1].rstrip("]"): i for i, m in standin.measurements.items()
    }


def backdate(standin: StandIn, seconds: int) -> int:
    """Start every measurement ``seconds`` ago; returns that start."""
    start = int(time.time()) - seconds
    for m in standin.measurements.values():
        m["start_time"] = start
    return start


# -- plan ---------------------------------------------------------------------------


def test_plan_is_a_dry_run_that_prices_every_measurement(
    campaign_file: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KICKASS_ATLAS_KEY", raising=False)
    assert kickass("plan", campaign_file) == 0
    out = capsys.readouterr().out
    assert "split-1500" in out and "whole-100" in out and "whole-1500" in out
    assert kickass("plan", campaign_file, "--json") == 0
    plan = json.loads(capsys.readouterr().out)
    # 60 results per probe (an hour every minute), 2 probes, 8 packets below 1500 bytes.
    assert [m["credits"] for m in plan["measurements"]] == [8 * 2 * 60] * 3
    assert plan["total_credits"] == 3 * 960 and plan["within_budget"] is True


def test_plan_samples_whole_sizes_and_refuses_above_the_budget(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "big.yaml"
    path.write_text(
        yaml.safe_dump(campaign_dict(whole={"step": 8, "sample": 4}, credit_budget=5000))
    )
    # The cheap default: the split sweep in one measurement, a sample of 4 whole sizes.
    assert kickass("plan", path) == 0
    out = capsys.readouterr().out
    assert out.count("whole-") == 4 and "whole-1500" in out and "whole-1480" in out
    assert "total 4800 credits, within the budget of 5000" in out
    # Every whole size (60..1500 by 8, and 1480): far above the budget, refused.
    assert kickass("plan", path, "--all-sizes", "--json") == 2
    captured = capsys.readouterr()
    plan = json.loads(captured.out)
    assert len(plan["measurements"]) == 1 + 182 and plan["within_budget"] is False
    assert captured.err.startswith(f"ERROR: the plan costs {183 * 960} credits, above")
    assert "\nhint: " in captured.err


# -- create, fetch, status ------------------------------------------------------------------


def test_create_fetch_status_work_end_to_end(
    env: dict[str, str], standin: StandIn, campaign_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = env["KICKASS_DATABASE_URL"]
    assert kickass("create", campaign_file) == 0
    posts = standin.requests_to("POST", "/api/v2/measurements")
    assert len(posts) == 1 and posts[0].headers["Authorization"] == f"Key {KEY}"
    # One request: the split sweep and every whole size on one probe allocation.
    body = posts[0].body
    assert body["probes"] == [{"type": "probes", "value": "1001,1002", "requested": 2}]
    assert [d["description"].rsplit("[")[1] for d in body["definitions"]] == [
        "split-1500]", "whole-100]", "whole-1500]",
    ]  # fmt: skip
    d = body["definitions"][0]
    assert (d["type"], d["af"], d["target"], d["size"], d["packets"]) == (
        "ping", 4, SPLIT_ADDR, 1472, PACKETS,
    )  # fmt: skip
    assert d["tags"] == [Campaign.from_dict(campaign_dict()).tag]
    # They start later than they were created: time to check their price.
    assert body["start_time"] >= time.time() + 100
    stored = rows(url, "SELECT key, credits_per_result, status_name FROM atlas_measurements")
    assert sorted(r["key"] for r in stored) == ["split-1500", "whole-100", "whole-1500"]
    assert {r["credits_per_result"] for r in stored} == {PACKETS}  # read back from Atlas
    # Created twice is created once: the second run finds everything there.
    assert kickass("create", campaign_file) == 0
    assert len(standin.requests_to("POST", "/api/v2/measurements")) == 1
    capsys.readouterr()

    start = backdate(standin, 1000)
    split = created(standin)["split-1500"]
    for msm_id in standin.measurements:
        standin.set_status(msm_id, 2)
        # Probe 1002 sits behind a fragment filter: no split reply ever arrives.
        lost = {1002: set(range(PACKETS))} if msm_id == split else {}
        play(standin, url, msm_id, [start + 100, start + 160, start + 220], lost=lost)
    assert kickass("fetch", campaign_file, "--settle", "0", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["results_new"] == 3 * 2 * 3 and report["join"] == {"exact": 18}
    assert report["outcomes"] == {"acked": 15 * PACKETS, "lost": 3 * PACKETS}

    verdicts = {
        r["prb_id"]: r
        for r in rows(url, "SELECT * FROM v_verdicts_by_source WHERE source = 'atlas'")
    }
    assert verdicts[1001]["verdict"] == "fragments-ok"
    assert verdicts[1002]["verdict"] == "fragment-intolerant"
    assert (verdicts[1002]["asn"], verdicts[1002]["country_code"]) == (64501, "DE")
    assert verdicts[1002]["split_drop_rate"] == 1.0 and verdicts[1002]["whole_drop_rate"] == 0.0
    by_split = rows(url, "SELECT * FROM v_split_drop_by_source WHERE source = 'atlas'")
    assert sorted(r["leading_ip_len"] for r in by_split) == SPLITS
    assert all(r["drop_rate"] == pytest.approx(0.5, abs=0.2) for r in by_split)

    # Fetching again brings nothing new and asks only for the time since.
    served_before = len(standin.served)
    assert kickass("fetch", campaign_file, "--settle", "0", "--json") == 0
    assert json.loads(capsys.readouterr().out)["results_new"] == 0
    assert all(n == 0 for _, _, _, n in standin.served[served_before:])

    assert kickass("status", campaign_file) == 0
    out = capsys.readouterr().out
    assert "Ongoing" in out and f"credits spent {18 * PACKETS} of" in out
    assert "fragment-intolerant 1" in out and "fragments-ok 1" in out


def test_fetch_resumes_after_an_interruption_and_fetches_nothing_twice(
    env: dict[str, str], standin: StandIn, campaign_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = env["KICKASS_DATABASE_URL"]
    assert kickass("create", campaign_file) == 0
    start = backdate(standin, 2000)
    timestamps = [start + 30 + 60 * i for i in range(20)]
    for msm_id in standin.measurements:
        play(standin, url, msm_id, timestamps)
    total = 3 * 2 * len(timestamps)
    capsys.readouterr()

    # Atlas fails the third window: an error, the first two windows kept.
    original = standin._results
    calls = {"n": 0}

    def flaky(msm_id: int, query: dict[str, str]) -> tuple[int, Any]:
        calls["n"] += 1
        if calls["n"] == 3:
            return 503, envelope(503, "Service Unavailable", "Maintenance, back soon", 0)
        return original(msm_id, query)

    standin._results = flaky  # type: ignore[method-assign]
    assert kickass("fetch", campaign_file, "--settle", "0", "--chunk", "600") == 2
    err = capsys.readouterr().err
    assert "503 Service Unavailable" in err
    assert "run the same command again" in err and "Traceback" not in err
    partial = rows(url, "SELECT count(*) AS n FROM atlas_results")[0]["n"]
    assert 0 < partial < total
    [failed] = rows(url, "SELECT last_error FROM atlas_measurements WHERE last_error IS NOT NULL")
    assert "503" in failed["last_error"]

    assert kickass("fetch", campaign_file, "--settle", "0", "--chunk", "600") == 0
    assert rows(url, "SELECT count(*) AS n FROM atlas_results")[0]["n"] == total
    assert rows(url, "SELECT sum(results_fetched) AS n FROM atlas_measurements")[0]["n"] == total
    # Nothing was fetched twice: the windows served never overlap, and the
    # results they carried add up to what is stored.
    served = list(standin.served)
    by_msm: dict[int, list[tuple[int, int]]] = {}
    for msm_id, lo, hi, _ in served:
        by_msm.setdefault(msm_id, []).append((lo, hi))
    for windows in by_msm.values():
        windows.sort()
        assert all(a[1] < b[0] for a, b in zip(windows, windows[1:], strict=False))
    assert sum(n for *_, n in served) == total
    assert (
        rows(url, "SELECT count(*) AS n FROM atlas_measurements WHERE last_error IS NOT NULL")[0][
            "n"
        ]
        == 0
    )


def test_late_uploads_are_read_once_more_at_the_horizon_without_duplicates(
    env: dict[str, str], standin: StandIn, campaign_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The results API filters by the result's time, probes upload late: a
    probe offline for an hour uploads its results after the first read of
    their window has passed. The window is read once more when it is
    --late-horizon old; what the first read stored is not stored again."""
    url = env["KICKASS_DATABASE_URL"]
    assert kickass("create", campaign_file) == 0
    start = backdate(standin, 3000)
    for msm_id in standin.measurements:
        play(standin, url, msm_id, [start + 100, start + 700, start + 1300])
    # Probe 1002 was offline: its results reach Atlas's store an hour late.
    offline = [
        r for lines in standin.results.values() for r in lines if r["prb_id"] == 1002
    ]  # fmt: skip
    for r in offline:
        r["stored_timestamp"] = r["timestamp"] + 3600 + 3000
    capsys.readouterr()
    assert kickass("fetch", campaign_file, "--settle", "0", "--json") == 0
    first = json.loads(capsys.readouterr().out)
    assert first["results_new"] == 3 * 3 and first["results_late"] == 0
    # The hour passes (on Atlas's clock, which decides what it serves).
    standin.clock = lambda: time.time() + 7200
    assert kickass("fetch", campaign_file, "--settle", "0", "--late-horizon", "0", "--json") == 0
    second = json.loads(capsys.readouterr().out)
    assert second["results_new"] == 3 * 3 == second["results_late"]
    assert kickass("fetch", campaign_file, "--settle", "0", "--late-horizon", "0", "--json") == 0
    assert json.loads(capsys.readouterr().out)["results_new"] == 0
    total = rows(url, "SELECT count(*) AS n, count(DISTINCT (msm_id, prb_id, result_at)) AS d "
                      "FROM atlas_results")[0]  # fmt: skip
    assert total == {"n": 18, "d": 18}
    late = rows(url, "SELECT sum(results_late) AS n, bool_and(rechecked_until IS NOT NULL) AS r "
                     "FROM v_atlas_measurements")[0]  # fmt: skip
    assert late == {"n": 9, "r": True}
    stored = rows(url, "SELECT min(extract(epoch FROM stored_at - result_at)) AS d "
                       "FROM atlas_results WHERE prb_id = 1002")[0]  # fmt: skip
    assert stored["d"] == 6600


def test_a_bad_result_is_recorded_and_the_window_still_commits(
    env: dict[str, str], standin: StandIn, campaign_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = env["KICKASS_DATABASE_URL"]
    assert kickass("create", campaign_file) == 0
    start = backdate(standin, 1000)
    split = created(standin)["split-1500"]
    play(standin, url, split, [start + 100])
    good = standin.results[split][0]
    standin.add_results(
        split,
        [
            good | {"timestamp": start + 200, "result": "garbage"},
            good | {"timestamp": start + 300, "result": [{"rtt": "fast"}]},
            good | {"timestamp": start + 400, "type": "traceroute"},  # not ours to judge
        ],
    )
    capsys.readouterr()
    assert kickass("fetch", campaign_file, "--settle", "0", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["join"]["invalid"] == 2
    assert report["ignored"] == {"not a ping result (type 'traceroute')": 1}
    bad = rows(url, "SELECT join_error FROM atlas_results WHERE join_status = 'invalid' "
                    "ORDER BY result_at")  # fmt: skip
    assert all(b["join_error"].startswith("unreadable result: ") for b in bad)
    assert "fast" in bad[1]["join_error"]
    m = rows(url, f"SELECT fetched_until, results_invalid FROM v_atlas_measurements "
                  f"WHERE msm_id = {split}")[0]  # fmt: skip
    assert m["results_invalid"] == 2 and m["fetched_until"].timestamp() > start + 400


def test_a_result_its_columns_cannot_hold_is_refused_and_the_window_still_commits(
    env: dict[str, str], standin: StandIn, campaign_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An RTT of 1e308 or NaN (as Cousteau parses the API's JSON), a sent past
    smallint, a source that is no address: the window's write failed on each
    (a column overflow, then its CHECK) and fetch stopped there for good, or
    stored the NaN for every reader to trip on. Now each is refused, counted
    and logged (ingest.check_result, as import's lines), the rest stored."""
    url = env["KICKASS_DATABASE_URL"]
    assert kickass("create", campaign_file) == 0
    start = backdate(standin, 1000)
    split = created(standin)["split-1500"]
    play(standin, url, split, [start + 100])
    good = standin.results[split][0]
    hostile = [
        {"result": [{"rtt": 1e308}]},
        {"result": [{"rtt": float("nan")}]},
        {"sent": 99_999},
        {"from": "not-an-ip"},
    ]
    standin.add_results(
        split, [good | {"timestamp": start + 200 + 10 * i} | h for i, h in enumerate(hostile)]
    )
    capsys.readouterr()
    assert kickass("fetch", campaign_file, "--settle", "0", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ignored"] == {"refused: out of its columns' bounds or unstorable": len(hostile)}
    assert rows(url, "SELECT count(*) AS n FROM atlas_results")[0]["n"] == len(PROBES)
    m = rows(url, f"SELECT fetched_until FROM v_atlas_measurements WHERE msm_id = {split}")[0]
    assert m["fetched_until"].timestamp() > start + 300


def test_import_stores_files_as_fetch_does_idempotently(
    env: dict[str, str], standin: StandIn, campaign_file: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The API's JSON list, NDJSON, and an hourly archive dump (one result per
    line, every public measurement mixed, bzip2; error lines without ``af``),
    plain, compressed or on stdin: the same rows as fetch, nothing twice."""
    url = env["KICKASS_DATABASE_URL"]
    assert kickass("create", campaign_file) == 0
    start = backdate(standin, 1000)
    for msm_id in standin.measurements:
        play(standin, url, msm_id, [start + 100, start + 160])
    lines = [r for msm_id in sorted(standin.results) for r in standin.results[msm_id]]
    d = campaign_file.parent
    (d / "api.json").write_text(json.dumps(lines[:4]))
    (d / "api.ndjson").write_text("".join(json.dumps(r) + "\n" for r in lines[4:8]))
    other = dict(lines[0], msm_id=5009, prb_id=99)  # another user's measurement
    no_af = {"fw": 5120, "msm_id": lines[8]["msm_id"], "prb_id": 1001, "timestamp": start + 400,
             "type": "ping", "result": [{"error": "dns resolution failed"}]}  # fmt: skip
    dump = [other, *lines[8:], no_af, other]
    (d / "ping-dump.bz2").write_bytes(
        bz2.compress("".join(json.dumps(r) + "\n" for r in dump).encode())
    )
    capsys.readouterr()
    assert kickass("import", campaign_file, d / "api.json", d / "api.ndjson", "--json") == 0
    assert json.loads(capsys.readouterr().out)["results_new"] == 8
    stdin = io.BytesIO((d / "ping-dump.bz2").read_bytes())
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(stdin))
    assert kickass("import", campaign_file, "-", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["results_new"] == len(lines) - 8 + 1
    assert report["ignored"] == {"another measurement's result": 2}
    # The error line names no address: no reply of ours to join it to.
    assert report["join"] == {"exact": len(lines) - 8, "no-log": 1}
    kinds = rows(url, "SELECT join_status, origin, count(*) AS n FROM atlas_results GROUP BY 1, 2")
    assert {(k["join_status"], k["origin"]): k["n"] for k in kinds} == {
        ("exact", "import"): len(lines),
        ("no-log", "import"): 1,
    }
    imported = rows(url, "SELECT count(*) AS n FROM atlas_outcomes")[0]["n"]
    # Again, and through the API: nothing new.
    for f in ("api.json", "api.ndjson", "ping-dump.bz2"):
        assert kickass("import", campaign_file, d / f, "--json") == 0
        assert json.loads(capsys.readouterr().out)["results_new"] == 0
    assert kickass("fetch", campaign_file, "--settle", "0", "--json") == 0
    assert json.loads(capsys.readouterr().out)["results_new"] == 0
    assert rows(url, "SELECT count(*) AS n FROM atlas_outcomes")[0]["n"] == imported
    assert kickass("import", campaign_file, d / "missing.json") == 2
    err = capsys.readouterr().err
    _no_traceback(err)
    assert "cannot read" in err


# -- errors Atlas really returns --------------------------------------------------------------


def _no_traceback(err: str) -> None:
    assert err.startswith("ERROR: ") and "\nhint: " in err and "Traceback" not in err


def test_missing_and_bad_keys(
    env: dict[str, str],
    standin: StandIn,
    campaign_file: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KICKASS_ATLAS_KEY")
    assert kickass("create", campaign_file) == 2
    err = capsys.readouterr().err
    _no_traceback(err)
    assert "needs a RIPE Atlas API key" in err and not standin.requests_to("POST", "/api")

    monkeypatch.setenv("KICKASS_ATLAS_KEY", "not-the-key-123")
    assert kickass("create", campaign_file) == 2
    err = capsys.readouterr().err
    _no_traceback(err)
    assert "refused the API key" in err and "403" in err and "not-the-key-123" not in err
    url = env["KICKASS_DATABASE_URL"]
    assert rows(url, "SELECT count(*) AS n FROM atlas_measurements")[0]["n"] == 0

    key_file = campaign_file.parent / "atlas.key"
    key_file.write_text(KEY + "\n")
    monkeypatch.delenv("KICKASS_ATLAS_KEY")
    assert kickass("create", campaign_file, "--key-file", key_file) == 0  # resumable
    assert rows(url, "SELECT count(*) AS n FROM atlas_measurements")[0]["n"] == 3


BARE_429 = "<html><head><title>429 Too Many Requests</title></head><body>nginx</body></html>"
THROTTLED = envelope(
    429, "Too Many Requests", "Request was throttled. Expected available in 60 seconds.", 0
)  # noqa: E501


def test_rate_limited_resumes_without_creating_twice(
    env: dict[str, str], standin: StandIn, campaign_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = env["KICKASS_DATABASE_URL"]
    standin.fail("POST", "/api/v2/measurements", 429, THROTTLED, times=1)
    assert kickass("create", campaign_file) == 2
    err = capsys.readouterr().err
    _no_traceback(err)
    assert "rate-limiting" in err and "wait" in err
    assert rows(url, "SELECT count(*) AS n FROM atlas_measurements")[0]["n"] == 0

    # A proxy's bare 429 page, without Atlas's envelope: still rate limiting.
    standin.fail("POST", "/api/v2/measurements", 429, BARE_429)
    assert kickass("create", campaign_file) == 2
    err = capsys.readouterr().err
    _no_traceback(err)
    assert "rate-limiting" in err and "unexpected" not in err
    assert rows(url, "SELECT count(*) AS n FROM atlas_measurements")[0]["n"] == 0

    assert kickass("create", campaign_file) == 0
    keys = sorted(r["key"] for r in rows(url, "SELECT key FROM atlas_measurements"))
    assert keys == ["split-1500", "whole-100", "whole-1500"] and len(standin.measurements) == 3


def test_a_creation_whose_answer_is_lost_is_adopted_not_repeated(
    env: dict[str, str], standin: StandIn, campaign_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The stand-in carries the creation out, then drops the connection: the
    client never learns the ids. `create` looks the campaign's measurements
    up by its tag before creating again: one set of measurements."""
    url = env["KICKASS_DATABASE_URL"]
    standin.fail("POST", "/api/v2/measurements", 201, None, commit=True)
    assert kickass("create", campaign_file) == 0
    assert len(standin.requests_to("POST", "/api/v2/measurements")) == 1
    assert len(standin.measurements) == 3
    lookups = standin.requests_to("GET", "/api/v2/measurements/my")
    tag = Campaign.from_dict(campaign_dict()).tag
    assert lookups and lookups[-1].query["tags"] == tag
    stored = rows(url, "SELECT msm_id FROM atlas_measurements ORDER BY msm_id")
    assert [r["msm_id"] for r in stored] == sorted(standin.measurements)
    assert kickass("create", campaign_file) == 0  # and again: nothing new
    assert len(standin.requests_to("POST", "/api/v2/measurements")) == 1

    # A connection dropped *before* Atlas acted: the lookup finds nothing,
    # the one retry creates (here: a second campaign, same stand-in).
    other = campaign_file.parent / "other.yaml"
    other.write_text(yaml.safe_dump(campaign_dict(name="other-study")))
    standin.fail("POST", "/api/v2/measurements", 0, None)
    capsys.readouterr()
    assert kickass("create", other) == 0
    assert len(standin.requests_to("POST", "/api/v2/measurements")) == 3
    assert len(standin.measurements) == 6


def test_atlas_prices_above_the_budget_stop_the_measurements_before_they_start(
    env: dict[str, str], standin: StandIn, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The documented rule says 8 credits per result; RIPE Atlas charges more
    (archived measurement objects: 256 for 5 x 1480 bytes). `create` reads
    credits_per_result back while the measurements have not started yet and
    stops them when they would overrun the budget."""
    url = env["KICKASS_DATABASE_URL"]
    path = tmp_path / "pricey.yaml"
    path.write_text(yaml.safe_dump(campaign_dict(credit_budget=5000)))  # rule: 3 x 960
    standin.price = lambda packets, size: 256 * packets // 5
    assert kickass("create", path) == 2
    err = capsys.readouterr().err
    _no_traceback(err)
    assert "above its credit_budget of 5000" in err and "nothing was spent" in err
    assert "credits_per_result" in err
    deleted = {
        int(s.path.rstrip("/").rsplit("/", 1)[1]) for s in standin.requests_to("DELETE", "/api")
    }
    assert deleted == set(standin.measurements)
    assert {m["status"]["name"] for m in standin.measurements.values()} == {"Stopped"}
    assert rows(url, "SELECT count(*) AS n FROM atlas_measurements")[0]["n"] == 0

    # With a budget that pays Atlas's price: created afresh (the stopped ones
    # are not adopted).
    path.write_text(yaml.safe_dump(campaign_dict(credit_budget=200_000)))
    assert kickass("create", path) == 0
    live = [m for m in standin.measurements.values() if m["status"]["id"] == 1]
    assert len(live) == 3
    stored = rows(url, "SELECT msm_id, credits_per_result FROM atlas_measurements")
    assert {r["msm_id"] for r in stored} == {m["id"] for m in live}
    assert {r["credits_per_result"] for r in stored} == {256 * PACKETS // 5}


def test_more_sizes_later_are_priced_at_atlas_prices_before_creating(
    env: dict[str, str], standin: StandIn, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = env["KICKASS_DATABASE_URL"]
    path = tmp_path / "grow.yaml"
    path.write_text(
        yaml.safe_dump(campaign_dict(whole={"sizes": [100, 1500], "sample": 1}, credit_budget=5000))
    )
    assert kickass("create", path) == 0  # the split sweep and whole-1500
    assert len(standin.measurements) == 2
    # Atlas turns out to charge five times the rule for them.
    for m in standin.measurements.values():
        m["credits_per_result"] = 5 * PACKETS
    assert kickass("status", path) == 0  # reads the real price back
    capsys.readouterr()
    assert kickass("create", path, "--all-sizes") == 2
    err = capsys.readouterr().err
    _no_traceback(err)
    assert "at RIPE Atlas's prices" in err and "nothing was created" in err
    assert len(standin.requests_to("POST", "/api/v2/measurements")) == 1
    # At the rule's price it would have fitted: so the whole-size batch is
    # priced with Atlas's figures, before spending. With room for it, it is
    # created from the probes the running measurements have.
    path.write_text(
        yaml.safe_dump(
            campaign_dict(whole={"sizes": [100, 1500], "sample": 1}, credit_budget=50_000)
        )
    )
    assert kickass("create", path, "--all-sizes") == 0
    posts = standin.requests_to("POST", "/api/v2/measurements")
    assert len(posts) == 2
    split = rows(url, "SELECT msm_id FROM atlas_measurements WHERE key = 'split-1500'")[0]
    assert posts[1].body["probes"] == [{"type": "msm", "value": split["msm_id"], "requested": 2}]


def test_not_enough_credits(
    env: dict[str, str], standin: StandIn, campaign_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    standin.credits = 10
    assert kickass("create", campaign_file) == 2
    err = capsys.readouterr().err
    _no_traceback(err)
    assert "not enough RIPE Atlas credits" in err and "enough credit" in err and "top up" in err


def test_rejected_definition_names_the_field(
    env: dict[str, str], standin: StandIn, campaign_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    errors = [{"source": {"pointer": "/definitions/0/target"}, "detail": "Invalid target"}]
    standin.fail(
        "POST",
        "/api/v2/measurements",
        400,
        envelope(400, "Bad Request", "Invalid input", 101, errors),
    )
    assert kickass("create", campaign_file) == 2
    err = capsys.readouterr().err
    _no_traceback(err)
    assert "/definitions/0/target: Invalid target" in err


def test_unreachable_and_failing_server(
    env: dict[str, str],
    standin: StandIn,
    campaign_file: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert kickass("create", campaign_file) == 0
    backdate(standin, 500)
    standin.fail(
        "GET", "/api/v2/measurements/", 502, envelope(502, "Bad Gateway", "upstream down", 0)
    )
    assert kickass("fetch", campaign_file, "--settle", "0") == 2
    err = capsys.readouterr().err
    _no_traceback(err)
    assert "502" in err and "later" in err
    monkeypatch.setenv("KICKASS_ATLAS_SERVER", "127.0.0.1:9")  # nothing listens on discard
    assert kickass("fetch", campaign_file, "--settle", "0") == 2
    err = capsys.readouterr().err
    _no_traceback(err)
    assert "cannot reach RIPE Atlas" in err


@pytest.mark.parametrize(
    ("status_id", "words"),
    [(4, None), (5, "forced measurement"), (6, "found no suitable probes"), (7, "reports")],
)
def test_measurement_status_problems_are_warnings_with_hints(
    env: dict[str, str],
    standin: StandIn,
    campaign_file: Path,
    capsys: pytest.CaptureFixture[str],
    status_id: int,
    words: str | None,
) -> None:
    url = env["KICKASS_DATABASE_URL"]
    assert kickass("create", campaign_file) == 0
    start = backdate(standin, 500)
    split = created(standin)["split-1500"]
    for msm_id in standin.measurements:
        play(standin, url, msm_id, [start + 100])
    standin.set_status(split, status_id)
    capsys.readouterr()
    assert kickass("fetch", campaign_file, "--settle", "0") == 0
    err = capsys.readouterr().err
    if words is None:
        assert "WARNING" not in err
    else:
        assert f"WARNING: RIPE Atlas {words}" in err and "\nhint: " in err
    # Its results so far are stored all the same.
    assert (
        rows(url, "SELECT count(*) AS n FROM atlas_results WHERE msm_id = :m", m=split)[0]["n"] == 2
    )
    assert kickass("status", campaign_file) == 0
    captured = capsys.readouterr()
    assert standin.measurements[split]["status"]["name"] in captured.out


@pytest.mark.parametrize(("status", "words"), [(2, "disconnected"), (3, "abandoned")])
def test_disconnected_and_abandoned_probes_are_named(
    env: dict[str, str],
    standin: StandIn,
    campaign_file: Path,
    capsys: pytest.CaptureFixture[str],
    status: int,
    words: str,
) -> None:
    url = env["KICKASS_DATABASE_URL"]
    assert kickass("create", campaign_file) == 0
    start = backdate(standin, 500)
    for msm_id in standin.measurements:
        play(standin, url, msm_id, [start + 100])
    standin.add_probe(1002, PROBES[1002], 64501, "DE", status=status)
    capsys.readouterr()
    assert kickass("fetch", campaign_file, "--settle", "0") == 0
    err = capsys.readouterr().err
    assert f"WARNING: probe 1002 is {words}" in err and "\nhint: " in err
    assert err.count("probe 1002") == 1  # once per fetch, not per measurement


def test_explicit_probes_none_connected_refuses_before_paying(
    env: dict[str, str], standin: StandIn, campaign_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    standin.add_probe(1001, PROBES[1001], 64500, "NL", status=3)
    standin.add_probe(1002, PROBES[1002], 64501, "DE", status=2)
    assert kickass("create", campaign_file) == 2
    err = capsys.readouterr().err
    assert "WARNING: probe 1001 is abandoned" in err and "none of the campaign's probes" in err
    assert not standin.requests_to("POST", "/api")


def test_the_key_is_never_printed_logged_or_stored(
    env: dict[str, str],
    standin: StandIn,
    campaign_file: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    url = env["KICKASS_DATABASE_URL"]
    assert kickass("create", campaign_file, "--json") == 0
    start = backdate(standin, 500)
    for msm_id in standin.measurements:
        play(standin, url, msm_id, [start + 100])
    standin.fail("GET", "/api/v2/measurements/", 429, THROTTLED)
    assert kickass("fetch", campaign_file, "--settle", "0") == 2
    assert kickass("fetch", campaign_file, "--settle", "0") == 0
    assert kickass("status", campaign_file, "--json") == 0
    captured = capsys.readouterr()
    assert KEY not in captured.out + captured.err + caplog.text
    for table in (
        "atlas_campaigns", "atlas_measurements", "atlas_probes", "atlas_results",
        "atlas_outcomes", "atlas_reply_log", "atlas_verdicts",
    ):  # fmt: skip
        dump = rows(url, f"SELECT coalesce(string_agg(t::text, ''), '') AS s FROM {table} t")
        assert KEY not in dump[0]["s"], table
