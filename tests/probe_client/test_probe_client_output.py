"""Summary, JSON and argument handling of `kickass-probe`, without a network."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from kickass_core.plan import ProbePlan, expected_max_fragment
from kickass_core.verdict import drop_rate
from kickass_probe import cli
from kickass_probe.output import (
    PlainProgress,
    format_summary,
    local_rows,
    notable_sizes,
    pct,
    result_json,
    size_ranges,
    splits_as_sent,
)
from kickass_probe.runner import RunResult, describe_position
from kickass_probe.session import LocalCounts, SizeCounts

PLAN = ProbePlan.build(repetitions=10, step=64, window=8)
SID = "0123456789abcdef"


def server_result(state: str = "complete", lose: dict[int, int] | None = None) -> dict[str, Any]:
    lose = lose or {}
    whole = [
        {
            "ip_len": n,
            "sent": 10,
            "acked": 10 - lose.get(n, 0),
            "late": 0,
            "drop_rate": lose.get(n, 0) / 10,
        }
        for n in PLAN.whole
    ]
    split = [
        {
            "leading_ip_len": n,
            "sent": 10,
            "acked": 10,
            "late": 0,
            "drop_rate": 0.0,
            "frag_observed": 10,
            "arrived_as_sent": 10,
        }
        for n in PLAN.split
    ]
    return {
        "session_id": SID,
        "state": state,
        "verdict": "fragments-ok",
        "verdict_reason": "split drop 0.0% within two-fragment bound 2.0% (+1.0%)",
        "end_reason": "plan-finished",
        "plan": PLAN.to_json(),
        "whole": whole,
        "split": split,
        "server_version": "9.9",
    }


def local_counts(received_split_as_sent: bool = True) -> LocalCounts:
    c = LocalCounts()
    for n in PLAN.whole:
        c.whole[n] = SizeCounts(received=10)
    for n in PLAN.split:
        sc = SizeCounts(received=10)
        if received_split_as_sent:
            sc.as_sent = 10
        else:
            sc.reassembled = 10
        c.split[n] = sc
    c.received = 10 * (len(PLAN.whole) + len(PLAN.split))
    c.highest_seq = PLAN.total_probes - 1
    return c


def run_result(**kw: Any) -> RunResult:
    base: dict[str, Any] = {
        "server_url": "https://measure.example.org",
        "session_id": SID,
        "session_url": f"https://measure.example.org/api/v1/sessions/{SID}",
        "plan": PLAN,
        "total_probes": PLAN.total_probes,
        "server_result": server_result(),
        "last_state": "complete",
        "local": local_counts(),
        "outcome": "complete",
        "incomplete": False,
        "note": None,
        "exit_code": 0,
    }
    base.update(kw)
    return RunResult(**base)


# -- summary ------------------------------------------------------------------------------


def test_summary_complete() -> None:
    text = format_summary(run_result(server_result=server_result(lose={1500: 4})))
    assert text.startswith("Kick-Ass fragment viability\n")
    assert "Verdict: fragments-ok" in text
    assert "within two-fragment bound" in text
    whole_line = next(line for line in text.splitlines() if "whole packets " in line)
    n = len(PLAN.whole) * 10
    assert f"{n:>9,}" in whole_line and f"{n - 4:>9,}" in whole_line
    # IP_RECVFRAGSIZE sees only the largest fragment: the summary says that,
    # and never that a split "arrived as sent" (issue 11).
    assert "Largest fragment as sent: yes, in all" in text
    assert "cannot tell whether the pieces arrived swapped" in text
    assert "arrived as sent" not in text.lower()
    assert "notable drops: 1500 B 40.0%" in text
    assert f"Session {SID} (complete): https://measure.example.org/api/v1/sessions/{SID}" in text
    assert "INCOMPLETE" not in text
    assert max(len(line) for line in text.splitlines()) <= 100


def test_summary_is_compact_unless_verbose() -> None:
    short = format_summary(run_result())
    full = format_summary(run_result(), verbose=True)
    assert len(short.splitlines()) < len(full.splitlines())
    assert "    1500 B" in full and "-1500 B" in short


def test_summary_interrupted_is_marked() -> None:
    text = format_summary(
        run_result(
            server_result=server_result(state="ended"),
            last_state="ended",
            outcome="interrupted",
            incomplete=True,
            note="interrupted by Ctrl-C: partial result",
            exit_code=130,
        )
    )
    assert "INCOMPLETE (interrupted, state ended)" in text
    assert "interrupted by Ctrl-C" in text


def test_summary_without_server_uses_local_counts() -> None:
    c = local_counts()
    text = format_summary(
        run_result(server_result=None, last_state="probing", local=c, incomplete=True)
    )
    assert "Verdict: none" in text
    assert "Server unreachable" in text


def test_splits_as_sent_wording() -> None:
    assert splits_as_sent(LocalCounts()) == "no split datagram arrived"
    assert "reassembled on the way" in splits_as_sent(local_counts(received_split_as_sent=False))
    c = local_counts()
    c.frag_size_supported = False
    assert "cannot tell" in splits_as_sent(c)
    c = local_counts()
    c.split[PLAN.split[0]] = SizeCounts(received=10, as_sent=7, refragmented=3)
    text = splits_as_sent(c)
    assert "largest fragment as cut by the server" in text and "3 cut differently" in text


def test_pct() -> None:
    assert pct(None) == "-"
    assert pct(0.0) == "0.0%"
    assert pct(0.0004) == "<0.1%"
    assert pct(0.125) == "12.5%"


def test_size_ranges_pool_counts() -> None:
    rows = [{"ip_len": n, "sent": 10, "acked": 9, "drop_rate": 0.1} for n in (44, 52, 60, 68, 76)]
    ranges = size_ranges(rows, "whole", 2)
    assert [label for label, _ in ranges] == ["44-60 B", "68-76 B"]
    assert ranges[0][1] == {"sent": 30, "acked": 27, "drop_rate": drop_rate(30, 27)}
    assert len(size_ranges(rows, "whole", None)) == 5


def test_notable_sizes_ignore_noise() -> None:
    rows = [{"ip_len": n, "sent": 100, "acked": 99, "drop_rate": 0.01} for n in range(44, 500, 8)]
    assert notable_sizes(rows, "whole") == []
    rows[3] = {"ip_len": rows[3]["ip_len"], "sent": 100, "acked": 60, "drop_rate": 0.4}
    assert notable_sizes(rows, "whole") == [(rows[3]["ip_len"], 0.4)]


# -- JSON ---------------------------------------------------------------------------------


def test_json_shape() -> None:
    doc = result_json(run_result())
    json.dumps(doc)  # serialisable
    for key in ("session_id", "verdict", "state", "whole", "split", "incomplete"):
        assert key in doc
    assert doc["session_id"] == SID and doc["state"] == "complete"
    assert doc["incomplete"] is False and doc["source"] == "server"
    assert {"ip_len", "sent", "acked", "drop_rate"} <= doc["whole"][0].keys()
    assert {"leading_ip_len", "sent", "acked", "drop_rate"} <= doc["split"][0].keys()
    assert doc["server_version"] == "9.9"
    assert doc["local"]["split_as_sent"] == 10 * len(PLAN.split)
    assert doc["pooled"]["split"]["drop_rate"] == 0.0


def test_json_fills_missing_drop_rate() -> None:
    srv = server_result()
    for row in srv["whole"]:
        del row["drop_rate"]
    srv["whole"][0]["acked"] = 5
    doc = result_json(run_result(server_result=srv))
    assert doc["whole"][0]["drop_rate"] == 0.5


def test_local_rows_bound_sent_by_highest_seq() -> None:
    c = LocalCounts()
    for seq in (0, 1, 3):  # seq 2 lost; nothing after 3 known
        p = PLAN.probe(seq)
        c.whole.setdefault(p.ip_len, SizeCounts()).received += 1
    c.highest_seq = 3
    rows = local_rows(PLAN, c, "whole")
    assert [(r["ip_len"], r["sent"], r["acked"]) for r in rows] == [
        (PLAN.whole[0], 1, 1),
        (PLAN.whole[1], 1, 1),
        (PLAN.whole[2], 1, 0),
        (PLAN.whole[3], 1, 1),
    ]
    assert local_rows(PLAN, c, "split") == []


def test_json_when_server_vanished() -> None:
    c = LocalCounts(received=2, highest_seq=2)
    c.whole[PLAN.whole[0]] = SizeCounts(received=1)
    c.whole[PLAN.whole[2]] = SizeCounts(received=1)
    doc = result_json(
        run_result(
            server_result=None,
            local=c,
            last_state="probing",
            outcome="vanished",
            incomplete=True,
            exit_code=3,
        )
    )
    assert doc["source"] == "local" and doc["verdict"] is None and doc["incomplete"] is True
    assert doc["pooled"]["whole"] == {"sent": 3, "acked": 2, "drop_rate": drop_rate(3, 2)}


# -- progress -----------------------------------------------------------------------------


def test_plain_progress_prints_each_decile_once() -> None:
    buf = io.StringIO()
    p = PlainProgress(buf)
    for done in range(0, 101):
        p.update(done, 100, "x")
    lines = buf.getvalue().splitlines()
    assert lines[0] == "progress: 10% (10 of 100 probes)"
    assert lines[-1] == "progress: 100% (100 of 100 probes)"
    assert len(lines) == 10


def test_describe_position() -> None:
    assert describe_position(PLAN, -1, "hello") == "waiting for the server's challenge"
    assert describe_position(PLAN, 0, "probing") == "whole 44 B"
    split0 = PLAN.repetitions * len(PLAN.whole)
    assert describe_position(PLAN, split0, "probing") == "split, leading 44 B"


# -- command line -------------------------------------------------------------------------


def test_defaults_and_paper_plan_available() -> None:
    args = cli.build_parser().parse_args([])
    req, est = cli.plan_request(args)
    assert req == {"repetitions": 100, "step": 8, "window": cli.DEFAULT_WINDOW}
    assert est.total_probes == 100 * (len(est.whole) + len(est.split))
    args = cli.build_parser().parse_args(["--window", "1"])
    assert cli.plan_request(args)[0]["window"] == 1


def test_quick_plan_request() -> None:
    args = cli.build_parser().parse_args(["--quick"])
    req, est = cli.plan_request(args)
    assert req == {"quick": True} and est == ProbePlan.quick()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--quick", "--window", "4"], "cannot be combined"),
        (["--step", "12"], "multiple of 8"),
    ],
)
def test_bad_plans_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["--server", "http://127.0.0.1:9", "-y", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.startswith("ERROR: ")


def test_argparse_rejects_non_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--repetitions", "0"])
    assert info.value.code == 2


def test_notice_says_exactly_what_is_collected() -> None:
    text = cli.consent_notice("https://m.example.org", ProbePlan.quick(), "Linux")
    assert "your public IP address" in text
    assert "probe results" in text
    assert "client's version" in text and "OS name (Linux)" in text
    assert "Nothing else" in text
    assert "reassembly limits and counters" in text  # sent with the session request
    assert f"{ProbePlan.quick().total_probes:,} UDP probes" in text


def test_volume_estimate() -> None:
    plan = ProbePlan.build(repetitions=1, step=8)
    whole = sum(plan.whole)
    split = len(plan.split) * 1520
    assert cli.plan_volume_bytes(plan) == whole + split
    assert expected_max_fragment(44) == 1476  # a split of 1500 into 44 + 1476
