"""The default plan with the default, adaptive window (issue 11 part 4) over a
long, lossy path, with the real server and client, and tcpdump as the truth.

The path (study internet kind ``wan``): ka-linkem adds 50 ms each way and
loses 1% of the packets each way. A volunteer who types no flags runs the
paper's plan (36,600 probes); stop-and-wait would take about an hour here,
the old default window of 8 about eight minutes. The adaptive window must
finish in about a minute, and what it reports must be what the path did:
per phase, the reported drop rate against the truth from captures at the
client's interface (a probe is delivered when every piece reached it) and at
the server's (which ACKs got back). The two differ only where the study
itself got something wrong: a probe delivered but not acknowledged in time
(a queue the window built, a client that could not keep up) or refused by
the client's kernel.

Run with ``-s`` to see the measured numbers.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kickass_core.plan import ProbePlan
from kickass_db.study_store import StudyStore
from kickass_testbed.binaries import rust_binary
from kickass_testbed.internet import probe_internet
from support.pcap_truth import ProbeTruth
from test_study_validity_netns import BOUND, run_with_truth, split_truth

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces"),
    pytest.mark.skipif(not shutil.which("tcpdump"), reason="needs tcpdump (the truth)"),
]

RTT_MS = 100.0
LOSS = 0.01
# The paper's plan at a window of 64 needs 36,600 / 64 round trips of 100 ms
# (57 s); the start (the loss baseline, slow start), the end (the last
# timeouts, the client's final report) and this shared 2-core machine add
# some. Measured: 66 to 70 s. The old default (a fixed 8) took 7.6 minutes.
DURATION_BOUND_S = 90.0


@pytest.fixture
def wan(database_url: str, tmp_path: Path) -> Iterator[Any]:
    try:
        rust_binary("ka-linkem")
    except Exception as exc:  # noqa: BLE001 - a missing binary is a skip, not a failure
        pytest.skip(str(exc))
    with probe_internet(
        database_url, kinds=("wan",), wan_rtt_ms=RTT_MS, wan_loss=LOSS, log_dir=tmp_path
    ) as net:
        yield net


def whole_truth(out: dict, truth: ProbeTruth) -> dict[str, Any]:
    """True whole-packet loss against what the study reported (as split_truth)."""
    plan = ProbePlan.from_json(out["plan"])
    wholes = set(range(plan.split_from))
    sent = out["pooled"]["whole"]["sent"] + out["reassembly_invalid"]["whole"]
    delivered = wholes & set(truth.delivered)
    survival = truth.acked_fraction(delivered)
    return {
        "sent": sent,
        "delivered": len(delivered),
        "ack_survival": round(survival, 4),
        "true_loss": round(1 - len(delivered) / sent * survival, 4),
        "reported_loss": round(out["pooled"]["whole"]["drop_rate"], 4),
    }


def window_record(server_log: Path, session_id: str) -> dict[str, Any]:
    pat = re.compile(rf"session {session_id} window (\{{.*\}})$")
    for line in server_log.read_text(errors="replace").splitlines():
        m = pat.search(line)
        if m:
            return json.loads(m.group(1))
    raise AssertionError(f"the server logged no window record for {session_id}")


def test_the_default_plan_takes_about_a_minute_and_measures_the_path(
    wan: Any, database_url: str, tmp_path: Path
) -> None:
    out, truth, extra = run_with_truth(wan, "wan", [], tmp_path, timeout=600)
    plan = ProbePlan.from_json(out["plan"])
    assert plan == ProbePlan.build(window=64, adaptive=True), "not the default plan"
    window = window_record(wan.server_log, out["session_id"])
    whole, split = whole_truth(out, truth), split_truth(out, truth)
    print(
        "\ndefault plan, 100 ms, 1%/1%: "
        + json.dumps({**extra, "window": window, "whole": whole, "split": split})
    )
    assert extra["elapsed_s"] <= DURATION_BOUND_S, extra
    # The window grew to its maximum and stayed near it: the path's random
    # loss was measured, not taken for congestion.
    # (A false alarm of the excess-loss test, about one in three full plans,
    # costs about a second; this bound allows several.)
    assert window["max_reached"] == 64 and window["mean_window"] >= 48, window
    # What the study reported is what the path did (as in the validity tests:
    # nothing refused, so only a probe delivered but not acknowledged in
    # time could make them differ).
    for n in (whole, split):
        assert abs(n["reported_loss"] - n["true_loss"]) <= BOUND, (whole, split)
    assert out["reassembly_invalid"] == {"whole": 0, "split": 0}
    assert split["refused"] == 0, split
    # And the path is the one configured: 1 - 0.99^2 whole, 1 - 0.99^3 split,
    # within 4.5 binomial standard errors.
    for n, packets in ((whole, 2), (split, 3)):
        p = 1 - (1 - LOSS) ** packets
        assert abs(n["true_loss"] - p) <= 4.5 * math.sqrt(p * (1 - p) / n["sent"]), n
    assert out["verdict"] == "fragments-ok"
    # The window's record is stored with the session.
    stored = StudyStore(database_url).session_results(out["session_id"])
    assert stored is not None and stored["client_metadata"]["window"] == window
