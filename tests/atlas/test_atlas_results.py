"""Real RIPE Atlas ping result lines parse, join to the reply log and store
correctly: timeouts, duplicates, late replies, error entries, and the
firmware differences (addr/name below 4460, ICMP size 8 more below 4570).

The lines are published Atlas results (measurement 1000192), as Sagan's own
test suite carries them (ripe.atlas.sagan 2.0.1 sdist, tests/test_ping.py),
plus error entries in the form the probe firmware prints them
(``{"error": "sendto failed: ..."}``, eperd/ping.c).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import kickass_db as db
import pytest
from kickass_atlas.campaign import Campaign, PlannedMeasurement
from kickass_atlas.ingest import (
    ERROR,
    REPLY,
    TIMEOUT,
    LoggedRun,
    MeasurementSpec,
    ResultIgnored,
    Slot,
    align,
    group_runs,
    join,
    match_runs,
    parse_result,
)
from kickass_atlas.store import AtlasStore, LoggedReply
from sqlalchemy import text

SAGAN = {
    "fw1": '{"addr":"62.2.16.12","avg":124.572,"dup":0,"from":"194.85.27.7","fw":1,"max":125.44499999999999,"min":123.89400000000001,"msm_id":1000192,"name":"hsi.cablecom.ch","prb_id":165,"rcvd":3,"sent":3,"size":56,"timestamp":1340523908,"type":"ping"}',  # noqa: E501
    "4460": '{"addr":"62.2.16.12","af":4,"avg":48.388333333333328,"dst_addr":"62.2.16.12","dst_name":"hsi.cablecom.ch","dup":0,"from":"188.194.234.136","fw":4460,"max":56.948999999999998,"min":43.869999999999997,"msm_id":1000192,"name":"hsi.cablecom.ch","prb_id":270,"proto":"ICMP","rcvd":3,"result":[{"rtt":43.869999999999997},{"rtt":56.948999999999998},{"rtt":44.345999999999997}],"sent":3,"size":20,"src_addr":"192.168.178.21","timestamp":1340524626,"ttl":52,"type":"ping"}',  # noqa: E501
    "4550": '{"af":4,"avg":27.300999999999998,"dst_addr":"62.2.16.12","dst_name":"hsi.cablecom.ch","dup":0,"from":"80.56.151.3","fw":4550,"lts":365,"max":27.300999999999998,"min":27.300999999999998,"msm_id":1000192,"msm_name":"Ping","prb_id":202,"proto":"ICMP","rcvd":1,"result":[{"srcaddr":"192.168.1.229","x":"*"},{"x":"*"},{"rtt":27.300999999999998,"ttl":54}],"sent":3,"size":20,"src_addr":"192.168.1.229","step":360,"timestamp":1378271710,"ttl":54,"type":"ping"}',  # noqa: E501
    "4570": '{"af":4,"avg":36.608333333333327,"dst_addr":"62.2.16.12","dst_name":"hsi.cablecom.ch","dup":0,"from":"62.195.143.53","fw":4570,"lts":-1,"max":36.741,"min":36.423999999999999,"msm_id":1000192,"msm_name":"Ping","prb_id":202,"proto":"ICMP","rcvd":3,"result":[{"rtt":36.741},{"rtt":36.659999999999997},{"rtt":36.423999999999999}],"sent":3,"size":12,"step":360,"timestamp":1384500425, "type":"ping"}',  # noqa: E501
    "4610": '{"af":4,"avg":57.140666666666668,"dst_addr":"62.2.16.24","dst_name":"hsi.cablecom.ch","dup":0,"from":"188.195.181.120","fw":4610,"group_id":1000192,"lts":93,"max":63.213000000000001,"min":47.941000000000003,"msm_id":1000192,"msm_name":"Ping","prb_id":270,"proto":"ICMP","rcvd":3,"result":[{"rtt":63.213000000000001},{"rtt":47.941000000000003,"ttl":51},{"rtt":60.268000000000001,"ttl":50}],"sent":3,"size":12,"src_addr":"192.168.178.21","step":360,"timestamp":1395416383,"ttl":50,"type":"ping"}',  # noqa: E501
    "duplicate": '{"af":4,"avg":27.768000000000001,"dst_addr":"62.2.16.24","dst_name":"hsi.cablecom.ch","dup":2,"from":"109.190.83.40","fw":4610,"lts":38,"max":27.768000000000001,"min":27.768000000000001,"msm_id":1000192,"msm_name":"Ping","prb_id":1216,"proto":"ICMP","rcvd":1,"result":[{"srcaddr":"192.168.103.130","x":"*"},{"dup":1,"rtt":36.454000000000001,"ttl":54},{"dup":1,"rtt":37.756},{"rtt":27.768000000000001}],"sent":2,"size":12,"src_addr":"192.168.103.130","step":360,"timestamp":1395277728,"ttl":54,"type":"ping"}',  # noqa: E501
    "late": '{"af":4,"avg":-1,"dst_addr":"62.2.16.24","dst_name":"hsi.cablecom.ch","dup":2,"from":"62.195.143.53","fw":4600,"lts":130,"max":-1,"min":-1,"msm_id":1000192,"msm_name":"Ping","prb_id":202,"proto":"ICMP","rcvd":0,"result":[{"srcaddr":"192.168.1.229","x":"*"},{"dup":1,"rtt":1635.423,"ttl":55},{"dup":1,"rtt":1800.4939999999999}],"sent":1,"size":12,"src_addr":"192.168.1.229","step":360,"timestamp":1394745831,"ttl":55,"type":"ping"}',  # noqa: E501
}
# The firmware's error entries (eperd/ping.c prints "sendto failed: <strerror>").
ERRORS = '{"af":4,"avg":20.5,"dst_addr":"62.2.16.24","dst_name":"62.2.16.24","dup":0,"from":"109.190.83.40","fw":5080,"lts":12,"max":21.0,"min":20.0,"msm_id":1000192,"msm_name":"Ping","prb_id":1216,"proto":"ICMP","rcvd":2,"result":[{"rtt":20.0},{"error":"sendto failed: Network is unreachable"},{"rtt":21.0}],"sent":3,"size":12,"src_addr":"192.168.103.130","step":240,"timestamp":1700000000,"ttl":54,"type":"ping"}'  # noqa: E501


def kinds(slots: list[Slot] | None) -> list[str] | None:
    return None if slots is None else [s.kind for s in slots]


def test_firmware_differences_are_evened_out() -> None:
    old = parse_result(SAGAN["fw1"])  # below 4460: addr/name, no per-packet entries
    assert (old.dst_address, old.firmware, old.from_address) == ("62.2.16.12", 1, "194.85.27.7")
    assert old.slots is None and (old.sent, old.rcvd) == (3, 3) and old.size is None
    below_4570 = parse_result(SAGAN["4460"])  # size counted the 8-byte ICMP header
    assert below_4570.size == 12 and kinds(below_4570.slots) == [REPLY] * 3
    assert parse_result(SAGAN["4570"]).size == 12
    assert [s.rtt_ms for s in parse_result(SAGAN["4610"]).slots or []] == [63.213, 47.941, 60.268]


def test_timeouts_errors_duplicates_and_late_replies_are_told_apart() -> None:
    # Sagan alone gives each of these a packet with no RTT; the raw entry tells.
    r = parse_result(SAGAN["4550"])
    assert kinds(r.slots) == [TIMEOUT, TIMEOUT, REPLY]
    e = parse_result(ERRORS)
    assert kinds(e.slots) == [REPLY, ERROR, REPLY]
    assert e.slots is not None and e.slots[1].error == "sendto failed: Network is unreachable"
    d = parse_result(SAGAN["duplicate"])
    assert kinds(d.slots) == [TIMEOUT, REPLY] and d.dups == [(1, 36.454), (1, 37.756)]
    late = parse_result(SAGAN["late"])
    assert kinds(late.slots) == [TIMEOUT] and late.dups == [(1, 1635.423), (1, 1800.494)]


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (
            '{"type": "traceroute", "msm_id": 1, "prb_id": 2, "timestamp": 3, "fw": 4790}',
            "not a ping",
        ),
        ("not json", "not JSON"),
        ('{"type": "ping", "msm_id": 1}', "Sagan cannot parse"),
        (
            '{"af":6,"dst_addr":"2001:db8::1","fw":5080,"msm_id":1,"prb_id":2,"timestamp":3,'
            '"type":"ping","result":[]}',
            "IPv6",
        ),
    ],
)
def test_unusable_lines_are_ignored_with_a_reason(line: str, reason: str) -> None:
    with pytest.raises(ResultIgnored, match=reason):
        parse_result(line)


# -- the join ---------------------------------------------------------------------------

SPEC = MeasurementSpec(
    msm_id=1000192, campaign_id=1, phase="whole", target="62.2.16.24", ip_len=40,
    packets=3, packet_interval_ms=1000,
)  # fmt: skip


def replies(
    dst: str, ts: int, seqs: list[int], icmp_id: int = 77, ip_len: int = 40
) -> list[LoggedReply]:
    """Our replies to a ping that started at ``ts``: request k answered ~k s later."""
    return [LoggedReply(dst, icmp_id, s, "whole", ip_len, ts + 0.2 + k) for k, s in enumerate(seqs)]


def joined(
    name: str | None, log: list[LoggedReply], line: str | None = None
) -> list[dict[str, Any]]:
    res = parse_result(line or SAGAN[name or ""])
    rows, outs = join([res], log, SPEC, {})
    assert len(rows) == 1
    return [
        {"outcome": o.outcome, "ack_count": o.ack_count, "rtt": o.rtt_ms, "seq": o.icmp_seq}
        for o in outs
    ]


def test_join_timeouts_split_into_lost_replies_and_unanswered_requests() -> None:
    # The first request never reached us; the second we answered, it was lost.
    log = [
        LoggedReply("80.56.151.3", 9, s, "whole", 40, 1378271710 + 1.2 + i)
        for i, s in enumerate([6, 7])
    ]
    out = joined("4550", log)
    assert [o["outcome"] for o in out] == ["unanswered", "lost", "acked"]
    assert [o["seq"] for o in out] == [None, 6, 7]


def test_join_late_reply_and_duplicates() -> None:
    out = joined("late", replies("62.195.143.53", 1394745831, [40]))
    assert out == [{"outcome": "late", "ack_count": 2, "rtt": 1635.423, "seq": 40}]
    out = joined("duplicate", replies("109.190.83.40", 1395277728, [3, 4]))
    assert [(o["outcome"], o["ack_count"]) for o in out] == [("lost", 0), ("acked", 3)]


def test_join_error_entries_are_neither_sent_nor_lost() -> None:
    # The probe could not send its second request: no reply of ours belongs there.
    log = [
        LoggedReply("109.190.83.40", 5, s, "whole", 40, 1700000000.3 + 2 * i)
        for i, s in enumerate([10, 12])
    ]
    out = joined(None, log, ERRORS)
    assert [o["outcome"] for o in out] == ["acked", "error", "acked"]
    assert [o["seq"] for o in out] == [10, None, 12]


def test_counts_only_firmware_gets_aggregate_outcomes() -> None:
    spec = MeasurementSpec(1000192, 1, "whole", "62.2.16.12", 84, 3, 1000)
    res = parse_result(SAGAN["fw1"])
    rows, outs = join([res], replies("194.85.27.7", 1340523908, [1, 2, 3], ip_len=84), spec, {})
    assert rows[0].join_status == "aggregate"
    assert [o.outcome for o in outs] == ["acked"] * 3 and {o.ip_len for o in outs} == {84}


def test_align_exact_ambiguous_inconsistent() -> None:
    t, r, e = Slot(TIMEOUT), Slot(REPLY), Slot(ERROR)
    assert align([t, r, r], [0, 1]) == (1, "exact")  # the first request was lost on the way in
    assert align([r, e, r], [0, 2]) == (0, "exact")
    assert align([t, t, t], [0])[1] == "ambiguous"
    # Timing decides: a row 2 s into the ping is its third request.
    assert align([t, t, t], [0], times=[100.2 + 2], timestamp=100) == (2, "ambiguous")
    assert align([r, r], [0])[1] == "inconsistent"  # a reply arrived we never logged


def test_runs_of_probes_behind_one_nat_and_sequence_wrap() -> None:
    spec = MeasurementSpec(1, 1, "whole", "198.18.90.10", 100, 4, 1000)
    nat = "198.51.100.1"
    log = replies(nat, 1000, [254, 255, 0, 1], icmp_id=1, ip_len=100)  # wraps at 256
    log += replies(nat, 1000, [7, 8, 9, 10], icmp_id=2, ip_len=100)
    log += replies(nat, 1240, [2, 3, 4, 5], icmp_id=1, ip_len=100)  # the next ping, 4 min on
    runs = group_runs(log, spec)
    assert sorted((r.icmp_id, r.start) for r in runs) == [(1, 1000.2), (1, 1240.2), (2, 1000.2)]
    assert all(r.offsets() == [0, 1, 2, 3] for r in runs)

    def result(prb: int, ts: int, entries: list[dict[str, Any]]) -> Any:
        return parse_result(
            {"type": "ping", "fw": 5080, "msm_id": 1, "prb_id": prb, "timestamp": ts, "af": 4,
             "from": nat, "dst_addr": "198.18.90.10", "size": 72, "result": entries}
        )  # fmt: skip

    ok = [{"rtt": 5.0}] * 4
    some_lost = [{"rtt": 5.0}, {"x": "*"}, {"x": "*"}, {"rtt": 5.0}]
    results = [result(11, 1000, ok), result(12, 1000, some_lost), result(11, 1240, ok)]
    chosen = match_runs(results, runs, spec, {})
    assert len(chosen) == 3 and len({id(r) for r in chosen.values()}) == 3
    assert isinstance(chosen[2], LoggedRun) and chosen[2].start == 1240.2


def test_joined_rows_store_once(database_url: str) -> None:
    campaign = Campaign.from_dict(
        {
            "name": "sagan-lines",
            "target": {"whole": "62.2.16.24", "split": "62.2.16.25"},
            "probes": {"ids": [202, 1216]},
            "whole": {"sizes": [40 + 24]},
            "packets": 3,
            "duration": 3600,
            "credit_budget": 10_000,
        }
    )
    planned = PlannedMeasurement("whole-40", "whole", "62.2.16.24", 40, 3, 240, 1000, 2, 15)
    lines = [SAGAN["late"], SAGAN["duplicate"], ERRORS]
    log = replies("62.195.143.53", 1394745831, [40])
    log += replies("109.190.83.40", 1395277728, [3, 4])
    log += [
        LoggedReply("109.190.83.40", 5, s, "whole", 40, 1700000000.3 + 2 * i)
        for i, s in enumerate([10, 12])
    ]
    with AtlasStore(database_url) as store:
        campaign_id = store.upsert_campaign(campaign)
        store.record_measurement(campaign_id, 1000192, planned, {"size": 12}, None)
        spec = MeasurementSpec(1000192, campaign_id, "whole", "62.2.16.24", 40, 3, 1000)
        rows, outs = join([parse_result(x) for x in lines], log, spec, {})
        until = datetime(2026, 1, 1, tzinfo=UTC)
        assert store.store_chunk(1000192, rows, outs, until) == 3
        assert store.store_chunk(1000192, rows, outs, until) == 0  # a re-fetch adds nothing
        store.refresh_verdicts(campaign_id)
    e = db.make_engine(database_url)
    try:
        with e.connect() as conn:
            got = conn.execute(
                text(
                    "SELECT prb_id, packet_index, outcome, ack_count, error FROM atlas_outcomes "
                    "ORDER BY result_at, packet_index"
                )
            ).all()
            stored = conn.execute(
                text("SELECT raw, join_status FROM atlas_results ORDER BY result_at")
            ).all()
            whole = (
                conn.execute(text("SELECT * FROM v_atlas_whole_drop ORDER BY prb_id"))
                .mappings()
                .all()
            )
            fetched = conn.execute(text("SELECT results_fetched FROM atlas_measurements")).scalar()
    finally:
        e.dispose()
    assert [tuple(g) for g in got] == [
        (202, 0, "late", 2, None),
        (1216, 0, "lost", 0, None),
        (1216, 1, "acked", 3, None),
        (1216, 0, "acked", 1, None),
        (1216, 1, "error", 0, "sendto failed: Network is unreachable"),
        (1216, 2, "acked", 1, None),
    ]
    assert stored[0].raw == json.loads(SAGAN["late"]) and {s.join_status for s in stored} == {
        "exact"
    }
    assert fetched == 3
    # late counts as lost, errors count nowhere: 202 sent 1 acked 0; 1216 sent 4 acked 3.
    assert [(w["prb_id"], w["sent"], w["acked"], w["late"]) for w in whole] == [
        (202, 1, 0, 1),
        (1216, 4, 3, 0),
    ]
