"""Fragment-intolerant paths (issue 16): every volunteer finishes, and what the
study reports is what the path did.

The paths are the ``wan`` kind of the study internet (ka-linkem: 50 ms each
way, no random loss here) with a middlebox in the router:

* ``wanfragdrop`` drops every fragment. The paper's 8.3% of clients. Before
  the split credit counted splits *in flight*, the client's limit was
  anchored at the highest probe it had received; on this path none of the
  splits ever arrives, so the limit stopped one credit past the last whole
  probe and the session ended "incomplete" after 512 of 18,200 splits.
* ``wanhalffrag`` drops each fragment with probability 1/2: a split arrives
  whole with probability 1/4, and leaves one piece in the client's
  reassembly memory (for 30 s) with probability 1/2.
* ``wanleadsmall`` drops only leading fragments (offset 0, MF set) shorter
  than 200 bytes; their trailing pieces wait in the memory.

tcpdump at the client's and the server's interfaces is the truth (see
test_study_validity_netns). Run with ``-s`` to see the measured numbers.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kickass_core.plan import ProbePlan
from kickass_core.verdict import decide
from kickass_testbed.binaries import rust_binary
from kickass_testbed.internet import SMALL_FRAGMENT_LEN, probe_internet
from test_study_validity_netns import BOUND, run_with_truth, split_truth

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces"),
    pytest.mark.skipif(not shutil.which("nft"), reason="needs nftables"),
    pytest.mark.skipif(not shutil.which("tcpdump"), reason="needs tcpdump (the truth)"),
]

RTT_MS = 100.0

# Why a fragment-dropping path may take longer than a clean one, and how much:
# the default plan's window is adaptive up to W = 64 probes in flight and the
# server paces a run to 8 Mbit/s (about 667 full-size probes a second). On
# the clean path a probe holds its window place one RTT (100 ms): 640 probes/s,
# both phases alike. On the fragment-dropping path a split is resolved only by
# its timeout, 2·SRTT + 4·RTTVAR ≈ 2.2 RTT, but gives its window place back at
# the window timeout, SRTT + 4·RTTVAR and at least 1.25·SRTT (kickass_server.
# rtt_estimator): about 1.25 RTT, 64 / 0.125 s ≈ 510 splits/s. The plan has
# 18,400 whole probes (same pace on both paths) and 18,200 splits: about
# 29 + 29 s clean against 29 + 36 s here, a ratio near 1.1 (it was 1.6, and
# 2.3 on a loaded CI machine, while a split held its place until its timeout).
# The bound is the issue's:
MAX_SLOWDOWN = 2.0


@pytest.fixture
def wan(database_url: str, tmp_path: Path) -> Iterator[Any]:
    try:
        rust_binary("ka-linkem")
    except Exception as exc:  # noqa: BLE001 - a missing binary is a skip, not a failure
        pytest.skip(str(exc))
    with probe_internet(
        database_url,
        kinds=("wan", "wanfragdrop", "wanhalffrag", "wanleadsmall"),
        wan_rtt_ms=RTT_MS,
        wan_loss=0.0,
        log_dir=tmp_path,
    ) as net:
        yield net


def _report(name: str, numbers: dict[str, Any]) -> None:
    print(f"\n{name}: {json.dumps(numbers)}")


def test_a_path_that_drops_every_fragment_runs_the_default_plan_to_the_end(
    wan: Any, tmp_path: Path
) -> None:
    clean, clean_truth, clean_extra = run_with_truth(wan, "wan", [], tmp_path)
    out, truth, extra = run_with_truth(wan, "wanfragdrop", [], tmp_path)
    plan = ProbePlan.from_json(out["plan"])
    assert plan == ProbePlan.build(window=64, adaptive=True), "not the default plan"
    n = split_truth(out, truth)
    ratio = extra["elapsed_s"] / clean_extra["elapsed_s"]
    _report(
        "default plan, every fragment dropped",
        {
            **n,
            **extra,
            "clean_elapsed_s": clean_extra["elapsed_s"],
            "ratio": round(ratio, 2),
            "whole_late": sum(r["late"] for r in out["whole"]),
        },
    )
    # The client finished (run_with_truth checked exit 0), with a verdict.
    assert out["state"] == "complete" and out["incomplete"] is False
    assert out["verdict"] == "fragment-intolerant", out["verdict_reason"]
    # Every probe of the plan was sent and accounted: no whole probe lost,
    # every split lost, none of them invalid (the memory was never touched).
    whole, split = out["pooled"]["whole"], out["pooled"]["split"]
    # A whole probe acknowledged after its timeout (a descheduled client on a
    # loaded machine) is lost by the paper's rule but was delivered: the path
    # lost none, so every whole probe not acknowledged in time came late.
    whole_late = sum(r["late"] for r in out["whole"])
    assert whole["sent"] == plan.split_from, whole
    assert whole["sent"] - whole["acked"] == whole_late, (whole, whole_late)
    assert split["sent"] == plan.total_probes - plan.split_from, split
    assert split["acked"] == 0 and split["drop_rate"] == 1.0, split
    assert out["reassembly_invalid"] == {"whole": 0, "split": 0}
    # The truth agrees: no piece of any split reached the client.
    assert n["delivered"] == 0 and n["true_loss"] == 1.0, n
    assert ratio <= MAX_SLOWDOWN, (extra, clean_extra)
    # And the clean path, at the same RTT, was clean.
    assert clean["verdict"] == "fragments-ok"
    assert split_truth(clean, clean_truth)["true_loss"] == 0.0


# The smaller plans below keep the study's leftovers inside its budget, so
# the time is the clean path's arithmetic (no wait for the memory to drain):
# the budget is half of ipfrag_high_thresh (2 MiB) at the cost of a leftover
# assumed until learnt (4096 bytes, the most ever assumed): 512 leftovers.
LEFTOVER_BUDGET = (4 * 1024 * 1024 // 2) // 4096


def test_half_the_fragments_dropped_at_random(wan: Any, tmp_path: Path) -> None:
    args = ["--repetitions", "20", "--step", "64"]  # 23 splits a repetition: 460
    out, truth, extra = run_with_truth(wan, "wanhalffrag", args, tmp_path)
    n = split_truth(out, truth)
    _report("half the fragments dropped", {**n, **extra})
    # Expected leftovers: one split in two leaves a piece (230 of 460), well
    # inside the budget: the memory never holds the run back.
    assert n["sent"] / 2 + 4 * math.sqrt(n["sent"] / 4) < LEFTOVER_BUDGET
    assert n["paused_s"] == 0.0 and n["refused"] == 0, n
    # The time is the adaptive window's: random fragment loss, measured
    # against the whole phase's loss baseline, reads as loss the window
    # causes, until the window reaches its floor of 2 (window.py); measured
    # 24 s. The bound: every split at the floor, a lost one holding its slot
    # one timeout (~2.2 RTT), an acknowledged one an RTT: 460 x 0.19 s / 2
    # = 44 s, plus a few seconds of whole phase.
    assert extra["elapsed_s"] <= 60.0, extra
    assert abs(n["reported_loss"] - n["true_loss"]) <= BOUND, n
    # The path: a split survives with probability 1/4, within 4.5 standard errors.
    se = math.sqrt(0.75 * 0.25 / n["sent"])
    assert abs(n["true_loss"] - 0.75) <= 4.5 * se, n
    whole, split = out["pooled"]["whole"], out["pooled"]["split"]
    assert whole["drop_rate"] == 0.0
    # The rule's verdict: far above the two-fragment bound, yet not the >= 90%
    # loss that means "blocks fragments": inconclusive.
    assert out["verdict"] == "inconclusive", out["verdict_reason"]
    assert decide(whole["sent"], whole["acked"], split["sent"], split["acked"]).verdict == (
        "inconclusive"
    )


def test_only_short_leading_fragments_dropped(wan: Any, tmp_path: Path) -> None:
    args = ["--repetitions", "20", "--step", "16"]
    out, truth, extra = run_with_truth(wan, "wanleadsmall", args, tmp_path)
    n = split_truth(out, truth)
    blocked = [r for r in out["split"] if r["leading_ip_len"] < SMALL_FRAGMENT_LEN]
    passing = [r for r in out["split"] if r not in blocked]
    _report("leading fragments < 200 B dropped", {**n, **extra, "blocked": len(blocked)})
    # Leftovers: the trailing piece of every blocked split (10 sizes x 20),
    # inside the budget: no wait. Blocked sizes are dead after their first
    # try (the window ignores them): 1820 + 1840 probes at up to 64 per RTT,
    # measured 9 s; bound as above, the floor window for every split.
    assert sum(r["sent"] for r in blocked) < LEFTOVER_BUDGET
    assert n["paused_s"] == 0.0 and n["refused"] == 0, n
    assert extra["elapsed_s"] <= 60.0, extra
    assert blocked and all(r["acked"] == 0 for r in blocked), blocked
    assert all(r["acked"] == r["sent"] for r in passing), [
        r for r in passing if r["acked"] != r["sent"]
    ]
    assert abs(n["reported_loss"] - n["true_loss"]) <= BOUND, n
    # The verdict is the rule's on these counts.
    whole, split = out["pooled"]["whole"], out["pooled"]["split"]
    expect = decide(whole["sent"], whole["acked"], split["sent"], split["acked"])
    assert out["verdict"] == expect.verdict
