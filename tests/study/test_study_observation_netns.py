"""What each observation can tell (issue 11, parts 2 and 3), end to end in
namespaces with tcpdump at the client as the truth.

* A middlebox with connection tracking forwarding onto a VXLAN overlay
  reassembles every split and re-cuts it largest piece first: a 604 + 916
  split arrives as 916 + 604. Without privilege the client can only say
  "largest fragment as sent" (and must never say "as sent"); with
  ``--observe-fragments`` (root: AF_PACKET before reassembly) it sees, and
  stores, the swap of every split below 760 bytes.
* A 1400-byte MTU hop fragments the larger whole packets: the summary says so.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kickass_core.plan import ProbePlan
from kickass_db.study_store import StudyStore
from kickass_testbed.internet import (
    SERVER_IP,
    SMALL_MTU,
    capture_interface,
    parse_json_output,
    probe_internet,
)
from support.pcap_truth import Capture, probe_truth

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces"),
    pytest.mark.skipif(not shutil.which("nft"), reason="needs nftables"),
    pytest.mark.skipif(not shutil.which("tcpdump"), reason="needs tcpdump (the truth)"),
]

PLAN_ARGS = ["--repetitions", "3", "--step", "32", "--window", "8"]


@pytest.fixture
def swapped(database_url: str, tmp_path: Path) -> Iterator[Any]:
    with probe_internet(database_url, kinds=("swapped",), log_dir=tmp_path) as net:
        yield net


def _run(net: Any, args: list[str], tmp_path: Path, name: str) -> tuple[Any, Any]:
    client = net.clients["swapped"]
    pcap = tmp_path / f"{name}-client.pcap"
    spcap = tmp_path / f"{name}-server.pcap"
    cap = Capture(client.ns, capture_interface("swapped"), pcap, f"host {SERVER_IP}")
    scap = Capture(net.server, "uplink", spcap, f"udp and src host {client.address}")
    proc = net.run_client("swapped", args, timeout=300)
    assert (cap.stop(), scap.stop()) == (0, 0)
    return proc, (pcap, spcap)


def _kind(plan: ProbePlan, seq: int, lead: int, pieces: int) -> str:
    ip_len = plan.probe(seq).ip_len
    if pieces == 2 and lead == ip_len:
        return "as-sent"
    if pieces == 2 and lead == 1520 - ip_len and ip_len != 760:
        return "swapped"
    return "recut"


def test_swapped_splits_unprivileged_and_observed(swapped, database_url, tmp_path) -> None:  # noqa: ANN001
    net = swapped
    client = net.clients["swapped"]
    plan = ProbePlan.build(repetitions=3, step=32, window=8)
    splits = range(plan.split_from, plan.total_probes)
    # 1. Without the option: the summary (what the volunteer reads).
    proc, (pcap, spcap) = _run(net, PLAN_ARGS, tmp_path, "plain")
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    sid = text.split("Session ")[1].split()[0]
    truth = probe_truth(pcap, spcap, SERVER_IP, client.address, bytes.fromhex(sid))
    kinds = {s: _kind(plan, s, *truth.delivered[s]) for s in splits if s in truth.delivered}
    # The truth: the path swapped every split with a leading fragment under
    # 760 whose pieces fit the overlay (MTU 1450); it re-cut those that do not.
    assert {plan.probe(s).ip_len for s, k in kinds.items() if k == "swapped"} == {
        n for n in plan.split if 1520 - n <= 1450 and n < 760
    }
    assert {plan.probe(s).ip_len for s, k in kinds.items() if k == "recut"} == {
        n for n in plan.split if max(n, 1520 - n) > 1450
    }
    assert "Largest fragment as sent:" in text
    assert "with the largest fragment as cut by the server" in text
    assert "arrived as sent" not in text.lower()
    assert "Leading fragment" not in text  # nothing observed, nothing claimed
    store = StudyStore(database_url)
    rows = {r["leading_ip_len"]: r for r in store.session_results(sid)["split"]}
    for size, r in rows.items():
        # The old column keeps its meaning (largest fragment as sent): every
        # swapped split passes it; the new one says so by name.
        assert r["arrived_as_sent"] == r["largest_fragment_as_sent"]
        if size < 760 and 1520 - size <= 1450:
            assert r["largest_fragment_as_sent"] == r["acked"] > 0, r
        assert r["fragments_observed"] == 0 and r["leading_swapped"] == 0, r

    # 2. With --observe-fragments (this test runs as root): the swap is seen.
    proc, (pcap, spcap) = _run(
        net, ["--json", "--observe-fragments", *PLAN_ARGS], tmp_path, "observed"
    )
    out = parse_json_output(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    obs = out["fragment_observation"]
    assert obs is not None and obs["kernel_drops"] == 0
    truth = probe_truth(pcap, spcap, SERVER_IP, client.address, bytes.fromhex(out["session_id"]))
    kinds = {s: _kind(plan, s, *truth.delivered[s]) for s in splits if s in truth.delivered}
    n_swapped = sum(1 for k in kinds.values() if k == "swapped")
    assert obs["split_swapped"] == n_swapped > 0
    assert obs["split_leading_as_sent"] == sum(1 for k in kinds.values() if k == "as-sent")
    assert obs["split_recut"] == sum(1 for k in kinds.values() if k == "recut")
    # Per probe, what the client stored is what tcpdump saw on its interface.
    with store.engine.connect() as conn:
        stored = {
            seq: (lead, n)
            for seq, lead, n in conn.exec_driver_sql(
                "SELECT o.seq, o.observed_leading_len, o.observed_fragments FROM probe_outcomes o "
                "JOIN sessions s ON s.id = o.session_pk WHERE s.session_id = %(sid)s "
                "AND o.observed_fragments IS NOT NULL",
                {"sid": out["session_id"]},
            )
        }
    assert stored == truth.delivered
    res = store.session_results(out["session_id"])
    rows = {r["leading_ip_len"]: r for r in res["split"]}
    for size, r in rows.items():
        want = {k for s, k in kinds.items() if plan.probe(s).ip_len == size}
        assert len(want) == 1, (size, want)
        key = {"as-sent": "leading_as_sent", "swapped": "leading_swapped"}.get(want.pop())
        if key:
            assert r[key] == r["acked"] == r["fragments_observed"], r
    assert res["client_metadata"]["fragment_observation"]["split_swapped"] == n_swapped
    # And the summary names it.
    proc, _ = _run(net, ["--observe-fragments", *PLAN_ARGS], tmp_path, "summary")
    flat = " ".join(proc.stdout.split())  # the summary wraps its lines
    assert f"{n_swapped} SWAPPED, largest piece first (leading fragment 76-748 B)" in flat, flat


def test_observe_fragments_without_the_privilege_is_refused_before_anything() -> None:
    """Root without CAP_NET_RAW (as a volunteer without privilege): exit 2 with
    the reason and what to do, before the consent question and before any
    request (no server listens at the URL)."""
    exe = str(Path(sys.executable).parent / "kickass-probe")
    proc = subprocess.run(
        ["setpriv", "--bounding-set", "-net_raw", "--inh-caps", "-net_raw", exe,
         "--server", "http://127.0.0.1:9", "--observe-fragments", "--yes"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "ERROR: --observe-fragments needs root or CAP_NET_RAW" in proc.stderr
    assert "leave the option out" in proc.stderr
    assert "kickass-probe tests whether" not in proc.stderr  # no notice: nothing to agree to


@pytest.fixture
def smallmtu(database_url: str, tmp_path: Path) -> Iterator[Any]:
    with probe_internet(database_url, kinds=("smallmtu",), log_dir=tmp_path) as net:
        yield net


def test_small_mtu_hop_is_named_in_the_summary(smallmtu) -> None:  # noqa: ANN001
    proc = smallmtu.run_client("smallmtu", ["--repetitions", "2", "--step", "64"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    plan = ProbePlan.build(repetitions=2, step=64)
    above = [s for s in plan.whole if s > SMALL_MTU]
    assert f"Whole packets arrived fragmented: {2 * len(above)} of" in text, text
    assert f"(IP length {min(above)} B and up)" in text
    assert "Split loss beyond two whole-packet chances:" in text and "95% interval" in text
