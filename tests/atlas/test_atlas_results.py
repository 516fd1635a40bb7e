"""Real RIPE Atlas ping result lines parse, join to the reply log and store
correctly: timeouts, re-used sequence numbers, duplicates, late replies,
error entries, and the firmware differences (addr/name below 4460, ICMP size
8 more below 4570).

The lines are published Atlas results (measurement 1000192), as Sagan's own
test suite carries them (ripe.atlas.sagan 2.0.1 sdist, tests/test_ping.py),
and lines printed by the real probe firmware's ping (tests/atlas/data,
evping_records.py) with the reply log our responder would have written for
them.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from datetime import UTC, datetime
from typing import Any

import evping_records
import kickass_db as db
import pytest
from atlas_standin import api_result
from kickass_atlas.campaign import Campaign, PlannedMeasurement
from kickass_atlas.ingest import (
    ERROR,
    REPLY,
    TIMEOUT,
    MeasurementSpec,
    ResultIgnored,
    Slot,
    join,
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
        ('{"type": "ping", "msm_id": 1}', "no msm_id, prb_id or timestamp"),
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
    packets=3, packet_interval_ms=1000, size=12,
)  # fmt: skip


def replies(
    dst: str, end: int, seqs: list[int], icmp_id: int = 77, ip_len: int = 60, packets: int = 3
) -> list[LoggedReply]:
    """Our replies to a ping whose result time (its end) is ``end``: request
    k of ``packets`` sent a second apart, answered at once."""
    start = end - packets
    return [
        LoggedReply(dst, icmp_id, s, "whole", ip_len, start + 0.2 + k) for k, s in enumerate(seqs)
    ]


def outcomes(line: str | dict[str, Any], log: list[LoggedReply], spec: MeasurementSpec = SPEC):
    rows, outs = join([parse_result(line)], log, spec, {})
    assert len(rows) == 1
    return rows[0].join_status, [(o.outcome, o.icmp_seq) for o in outs]


def test_timeouts_before_the_first_reply_are_lost_replies_or_unanswered_requests() -> None:
    # Published line: x, x, rtt. The first request never reached us, the
    # second we answered and its reply was lost, the third came back.
    log = [LoggedReply("80.56.151.3", 9, s, "whole", 60, 1378271710 - 3 + 1.2 + i)
           for i, s in enumerate([6, 7])]  # fmt: skip
    status, out = outcomes(SAGAN["4550"], log)
    assert status == "exact"
    assert out == [("unanswered", None), ("lost", 6), ("acked", 7)]


def test_a_reused_sequence_number_after_the_first_reply_is_lost_replies() -> None:
    """After a first reply the firmware writes no entry for a lost reply and
    re-sends the same sequence number (ping.c noreply_callback): one rtt entry
    for eight requests is one reply that arrived and seven that did not."""
    line = json.loads(SAGAN["4610"]) | {
        "fw": 5120, "sent": 8, "result": [{"rtt": 20.0}], "timestamp": 1700000000,
    }  # fmt: skip
    spec = MeasurementSpec(1000192, 1, "whole", "62.2.16.24", 60, 8, 1000, 32)
    log = replies("188.195.181.120", 1700000000, [1] + [2] * 7, packets=8)
    status, out = outcomes(line, log, spec)
    assert status == "exact" and out == [("acked", 1)] + [("lost", 2)] * 7


def test_entries_x_x_rtt_against_log_offsets_0_2_3_never_stop_the_join() -> None:
    """The issue's reproduction: the old join's align() had no candidate and
    max() raised. Now any log is laid over any result, at worst as
    inconsistent, with one outcome per packet."""
    line = json.loads(SAGAN["4550"]) | {"fw": 5120, "timestamp": 1700000000}
    log = replies("80.56.151.3", 1700000000, [10, 12, 13])
    status, out = outcomes(line, log)
    assert status == "inconsistent" and len(out) == 3
    assert sum(o == "acked" for o, _ in out) == 1


def test_error_entries_take_a_packet_but_no_sequence_number() -> None:
    # The firmware: a failed send writes an error and leaves the sequence
    # number where it was, so the next send re-uses it.
    log = replies("109.190.83.40", 1700000000, [10, 11], packets=3)
    log[1] = LoggedReply("109.190.83.40", 77, 11, "whole", 60, 1700000000 - 3 + 2.2)
    status, out = outcomes(ERRORS, log)
    assert status == "exact"
    assert sorted(out, key=str) == sorted([("acked", 10), ("error", None), ("acked", 11)], key=str)


def test_late_and_duplicate_replies() -> None:
    # Published "late" line: x then two duplicates 1.6 s and 1.8 s late.
    log = [LoggedReply("62.195.143.53", 5, 40, "whole", 60, 1394745831 - 3 + 0.2)]
    status, out = outcomes(SAGAN["late"], log)
    assert status == "exact" and out[0] == ("late", 40)
    rows, outs = join([parse_result(SAGAN["late"])], log, SPEC, {})
    assert outs[0].ack_count == 2 and outs[0].rtt_ms == 1635.423


def test_the_result_time_is_the_end_of_its_run() -> None:
    """Two back-to-back runs of one probe (another ICMP id each, as two
    evping processes): the result ending at T takes the run that ended at T,
    not the one that began there."""
    end = 1700000000
    ok = [{"rtt": 5.0}] * 3
    line = {"type": "ping", "fw": 5120, "msm_id": 1000192, "prb_id": 9, "timestamp": end,
            "af": 4, "from": "198.51.100.1", "dst_addr": "62.2.16.24", "size": 32,
            "result": ok}  # fmt: skip
    earlier = replies("198.51.100.1", end, [1, 2, 3], icmp_id=1)
    later = replies("198.51.100.1", end + 3, [1, 2, 3], icmp_id=2)
    rows, outs = join([parse_result(line)], earlier + later, SPEC, {})
    assert rows[0].join_status == "exact"
    assert {o.replied_at.timestamp() for o in outs} == {r.sent_at for r in earlier}


def test_a_size_below_the_probes_record_is_joined_at_the_size_on_the_wire() -> None:
    # size 12 (IP 40) was planned; the probe sends 32 data bytes: 60 on the wire.
    assert SPEC.request_len == 60
    assert MeasurementSpec(1, 1, "whole", "x", 1500, 3, 1000, 1472).request_len == 1500


def test_counts_only_firmware_gets_aggregate_outcomes() -> None:
    spec = MeasurementSpec(1000192, 1, "whole", "62.2.16.12", 84, 3, 1000, 56)
    res = parse_result(SAGAN["fw1"])
    log = replies("194.85.27.7", 1340523908, [1, 2, 3], ip_len=84)
    rows, outs = join([res], log, spec, {})
    assert rows[0].join_status == "aggregate"
    assert [o.outcome for o in outs] == ["acked"] * 3 and {o.ip_len for o in outs} == {84}


def test_no_log_keeps_everything_out_of_the_drop_rates() -> None:
    rows, outs = join([parse_result(SAGAN["4610"])], [], SPEC, {})
    assert rows[0].join_status == "no-log"
    assert [o.outcome for o in outs] == ["acked"] * 3 and {o.ip_len for o in outs} == {None}


@pytest.mark.parametrize(
    "rec", evping_records.records(), ids=lambda r: f"{r['run']}-{r['scenario']}"
)
def test_every_recorded_probe_line_joins_to_its_reply_log(rec: dict[str, Any]) -> None:
    """The real firmware's lines against the log our responder would have
    written: one outcome per packet; every rtt entry is one acked reply of
    ours, every other reply of ours is lost or late, every request that never
    reached us is unanswered; exact wherever the capture tells which requests
    reached the responder."""
    n = evping_records.packets(rec)
    line = api_result(evping_records.probe_line(rec), msm_id=5001, prb_id=77,
                      public=evping_records.PROBE_ADDRESS, packets=n,
                      timestamp=int(rec["wall_end"]))  # fmt: skip
    spec = MeasurementSpec(
        5001, 1, "whole", evping_records.TARGET, evping_records.request_len(rec), n,
        evping_records.interval_ms(rec), evping_records.request_len(rec) - 28,
    )  # fmt: skip
    log = evping_records.reply_log(rec)
    rows, outs = join([parse_result(line)], log, spec, {})
    kinds = Counter(o.outcome for o in outs)
    entries = evping_records.probe_line(rec)["result"]
    rtts = sum(1 for e in entries if "rtt" in e and "dup" not in e)
    requests = sum(1 for r in log if not r.duplicate)
    assert len(outs) == n == len({o.packet_index for o in outs})
    if not log:  # -c 0: nothing was sent
        assert rows[0].join_status == "no-log" and not outs
        return
    assert rows[0].join_status in ("exact", "ambiguous")
    if evping_records.faithful(rec):
        assert rows[0].join_status == "exact", [o.outcome for o in outs]
        accepted = rtts if rec["scenario"] != "custom_responder" else kinds["acked"]
        assert kinds["acked"] == accepted == rtts
        assert kinds["lost"] + kinds["late"] == requests - rtts
        assert kinds["unanswered"] == n - requests


def test_recorded_late_replies_turn_lost_ones_late() -> None:
    by_run = {r["run"]: r for r in evping_records.records()}
    for run, late in ((65, 3), (68, 1)):
        rec = by_run[run]
        n = evping_records.packets(rec)
        line = api_result(evping_records.probe_line(rec), msm_id=5001, prb_id=77,
                          public=evping_records.PROBE_ADDRESS, packets=n)  # fmt: skip
        spec = MeasurementSpec(5001, 1, "whole", evping_records.TARGET, 60, n,
                               evping_records.interval_ms(rec), 32)  # fmt: skip
        _, outs = join([parse_result(line)], evping_records.reply_log(rec), spec, {})
        assert Counter(o.outcome for o in outs)["late"] == late, run


def _joined_at(rec: dict[str, Any], interval_ms: int) -> tuple[str, list[tuple[Any, ...]]]:
    """A recorded run joined as if its packets had been ``interval_ms``
    apart: the reply log's times and the RTTs scaled by the same factor."""
    n = evping_records.packets(rec)
    scale = interval_ms / evping_records.interval_ms(rec)
    end = int(rec["wall_end"])
    log = evping_records.reply_log(rec)
    if log:
        t0 = log[0].sent_at
        log = [dataclasses.replace(r, sent_at=end - 1 + (r.sent_at - t0) * scale) for r in log]
    probe_line = evping_records.probe_line(rec)
    probe_line["result"] = [
        {**e, "rtt": e["rtt"] * scale} if "rtt" in e else e for e in probe_line["result"]
    ]
    line = api_result(probe_line, msm_id=5001, prb_id=77, public=evping_records.PROBE_ADDRESS,
                      packets=n, timestamp=end)  # fmt: skip
    spec = MeasurementSpec(
        5001, 1, "whole", evping_records.TARGET, evping_records.request_len(rec), n,
        interval_ms, evping_records.request_len(rec) - 28,
    )  # fmt: skip
    rows, outs = join([parse_result(line)], log, spec, {})
    return rows[0].join_status, [(o.outcome, o.icmp_seq, o.attempt, o.ip_len) for o in outs]


def test_below_the_timing_resolution_the_join_stores_what_the_times_tell() -> None:
    """At a packet interval below MIN_TIMED_INTERVAL_S the request times say
    nothing about packet slots, so every alignment of a run ties on timing;
    the sequence evidence (a run sends one request per packet; a late reply
    answers a reply of ours the probe gave up on) must pick what the times
    pick at the recorded interval. Every recorded run, compressed to 2 ms."""
    differ = {}
    for rec in evping_records.records():
        timed, untimed = _joined_at(rec, evping_records.interval_ms(rec)), _joined_at(rec, 2)
        if timed != untimed:
            differ[f"{rec['run']}-{rec['scenario']}"] = (timed, untimed)
    assert not differ, differ


def _recorded(line: dict[str, Any], log: list[tuple[int, int, float]], first: float):
    """A line the real firmware printed (evping against a user-space
    responder that delayed chosen replies) and its responder's log: (ICMP
    id, sequence number, ms after the first request)."""
    rows, last, attempt = [], None, 0
    for icmp_id, seq, ms in log:
        attempt = attempt + 1 if seq == last else 0
        last = seq
        rows.append(LoggedReply("10.77.0.2", icmp_id, seq, "whole", 60, first + ms / 1000,
                                attempt=attempt))  # fmt: skip
    line = {**line, "type": "ping", "fw": 5120, "msm_id": 5001, "prb_id": 77,
            "timestamp": line["time"], "from": "10.77.0.2"}  # fmt: skip
    return parse_result(line), rows


# evping -c 8 -i 2, the first reply held 4 ms: x, then that reply as a
# duplicate, then every other reply in time. Every request reached us.
FIRST_LATE_AT_2_MS = (
    {"time": 1795866176, "dst_addr": "10.77.0.1", "af": 4, "src_addr": "10.77.0.2",
     "proto": "ICMP", "ttl": 64, "size": 32,
     "result": [{"x": "*"}, {"dup": 1, "rtt": 4.365642, "ttl": 64}, {"rtt": 0.204161},
                {"rtt": 0.113245}, {"rtt": 0.102653}, {"rtt": 0.083345}, {"rtt": 0.079639},
                {"rtt": 0.079887}, {"rtt": 0.076646}]},
    [(37381, s, ms) for s, ms in ((1, 0.0), (2, 4.167), (3, 8.487), (4, 12.742), (5, 16.97),
                                  (6, 19.118), (7, 23.328), (8, 27.537))],
    1795866176.525097,
)  # fmt: skip
# evping -c 6 -i 200, the 3rd request's reply held 300 ms and the 4th's (a
# re-send of sequence number 3) 150 ms: the probe accepted the first, the
# second came back as a duplicate with an RTT under the interval.
RESEND_LATE_AT_200_MS = (
    {"time": 1795866171, "dst_addr": "10.77.0.1", "af": 4, "src_addr": "10.77.0.2",
     "proto": "ICMP", "ttl": 64, "size": 32,
     "result": [{"rtt": 0.245769}, {"rtt": 0.266624}, {"rtt": 300.969038},
                {"dup": 1, "rtt": 151.09019}, {"rtt": 0.133547}, {"rtt": 0.106183}]},
    [(40195, s, ms) for s, ms in ((1, 0.0), (2, 200.555), (3, 401.081), (3, 601.323),
                                  (4, 800.569), (5, 1000.94))],
    1795866170.76638,
)  # fmt: skip


def test_a_first_reply_late_at_the_2_ms_interval_is_late() -> None:
    """The issue's run: both alignments tie on timing below the resolution;
    the one that starts a sequence number earlier makes the first x an
    unanswered request, nine requests in an eight-packet run, and leaves the
    late reply nothing to answer. It is no rival: exact, the late reply
    late, every other one acked."""
    res, log = _recorded(*FIRST_LATE_AT_2_MS)
    spec = MeasurementSpec(5001, 1, "whole", "10.77.0.1", 60, 8, 2, 32)
    rows, outs = join([res], log, spec, {})
    assert rows[0].join_status == "exact"
    assert [(o.outcome, o.icmp_seq) for o in outs] == [("late", 1)] + [
        ("acked", s) for s in range(2, 9)
    ]
    assert outs[0].rtt_ms == pytest.approx(4.366)  # Sagan keeps 3 decimals


def test_a_duplicate_after_a_reply_accepted_late_is_the_resends_late_reply() -> None:
    """The probe accepted sequence number 3's first reply 301 ms late, after
    it had re-sent 3; the re-send's reply came back 151 ms after it, a
    duplicate with an RTT under the interval: a late reply of ours, not a
    copy of the accepted one (whose RTT was 301 ms)."""
    res, log = _recorded(*RESEND_LATE_AT_200_MS)
    spec = MeasurementSpec(5001, 1, "whole", "10.77.0.1", 60, 6, 200, 32)
    rows, outs = join([res], log, spec, {})
    assert rows[0].join_status == "exact"
    assert [(o.outcome, o.icmp_seq, o.attempt, o.ack_count) for o in outs] == [
        ("acked", 1, 0, 1), ("acked", 2, 0, 1), ("acked", 3, 0, 1), ("late", 3, 1, 1),
        ("acked", 4, 0, 1), ("acked", 5, 0, 1),
    ]  # fmt: skip


def test_joined_rows_store_once(database_url: str) -> None:
    campaign = Campaign.from_dict(
        {
            "name": "sagan-lines",
            "target": {"whole": "62.2.16.24", "split": "62.2.16.25"},
            "probes": {"ids": [202, 1216]},
            "whole": {"sizes": [60]},
            "packets": 3,
            "duration": 3600,
            "credit_budget": 10_000,
        }
    )
    planned = PlannedMeasurement("whole-60", "whole", "62.2.16.24", 60, 3, 240, 1000, 2, 15)
    lines = [SAGAN["late"], SAGAN["duplicate"], ERRORS]
    log = [LoggedReply("62.195.143.53", 5, 40, "whole", 60, 1394745831 - 3 + 0.2)]
    log += replies("109.190.83.40", 1395277728, [3, 4], icmp_id=6)
    # The second send failed (an error entry): seq 11 went out a packet later.
    log += [LoggedReply("109.190.83.40", 77, s, "whole", 60, 1700000000 - 3 + t)
            for s, t in ((10, 0.2), (11, 2.2))]  # fmt: skip
    with AtlasStore(database_url) as store:
        campaign_id = store.upsert_campaign(campaign)
        store.record_measurement(campaign_id, 1000192, planned, {"size": 32}, None)
        spec = MeasurementSpec(1000192, campaign_id, "whole", "62.2.16.24", 60, 3, 1000, 32)
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
                text("SELECT raw, join_status, stored_at FROM atlas_results ORDER BY result_at")
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
        (202, 1, "unanswered", 0, None),
        (202, 2, "unanswered", 0, None),
        (1216, 0, "lost", 0, None),
        (1216, 1, "acked", 3, None),
        (1216, 2, "unanswered", 0, None),
        (1216, 0, "acked", 1, None),
        (1216, 1, "error", 0, "sendto failed: Network is unreachable"),
        (1216, 2, "acked", 1, None),
    ]
    assert stored[0].raw == json.loads(SAGAN["late"])
    # x, dup, dup, rtt against replies to seq 3 and 4: seq 3 lost and 4
    # acked, or the run began with an unanswered seq 2 and 3 was acked, 4
    # lost at the end. The counts are the same; the end time picks the first.
    assert [s.join_status for s in stored] == ["exact", "ambiguous", "exact"]
    assert fetched == 3
    # late counts as lost, errors count nowhere: 202 sent 1 acked 0; 1216 sent 4 acked 3.
    assert [(w["prb_id"], w["sent"], w["acked"], w["late"]) for w in whole] == [
        (202, 1, 0, 1),
        (1216, 4, 3, 0),
    ]
