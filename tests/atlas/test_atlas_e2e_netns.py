"""A RIPE Atlas campaign end to end with real packets.

    p1 (198.18.71.2) ─────────────┐  r: fragments to p1 dropped (the middlebox),
    nat (198.18.72.2) ── p2 ──────┼─ r ── srv (responder: whole 198.18.70.10,
      masquerades 198.18.172.0/24 │        split 198.18.70.11)
    p3 (198.18.73.2) ─────────────┘  r: 10% of p3's packets dropped each way

`kickass atlas create` creates the measurements on the HTTPS stand-in; three
simulated Atlas probes (tests/atlas_simprobe.py) send real ICMP echo requests
of the planned sizes from their namespaces to `kickass atlas responder`
(a real process in srv, raw sockets, nftables, reply log in PostgreSQL);
the stand-in turns what each probe received into Atlas results; `kickass
atlas fetch` joins them to the reply log. The stored counts must equal what
really happened — each probe's own record of which replies came back, and
the reply log's record of which requests were answered — and the verdicts
must name the fragment filter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import kickass_db as db
import pytest
import yaml
from atlas_standin import ping_result, running
from kickass_core import cli
from kickass_testbed.topology import End, Host, Link, NftRule, Process, Route, Topology, build
from sqlalchemy import text

pytestmark = [
    pytest.mark.netns,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces"),
]

HERE = Path(__file__).resolve().parent
KICKASS = str(Path(sys.executable).with_name("kickass"))
WHOLE, SPLIT = "198.18.70.10", "198.18.70.11"
# prb_id -> (namespace, its own address, the address the server sees, ASN, country)
PROBES = {
    1001: ("p1", "198.18.71.2", "198.18.71.2", 64501, "NL"),
    1002: ("p2", "198.18.172.2", "198.18.72.2", 64502, "DE"),
    1003: ("p3", "198.18.73.2", "198.18.73.2", 64503, "FR"),
}
# A timeout of 100 ms: scheduling hiccups on a busy machine must not read as loss.
PACKETS, PACKET_INTERVAL_MS, RUNS, SPACING_S = 16, 100, 3, 3.0
LOSS_PERCENT = 10
KEY = "e2e-key"


def topology() -> Topology:
    return Topology(
        name="kaat",
        hosts=(
            Host("srv"),
            Host("r", router=True),
            Host("p1"),
            Host("nat", router=True),
            Host("p2"),
            Host("p3"),
        ),  # fmt: skip
        links=(
            Link(
                End("srv", "e0", (f"{WHOLE}/24", f"{SPLIT}/24")),
                End("r", "srv", ("198.18.70.1/24",)),
            ),
            Link(End("p1", "e0", ("198.18.71.2/24",)), End("r", "p1", ("198.18.71.1/24",))),
            Link(End("nat", "wan", ("198.18.72.2/24",)), End("r", "nat", ("198.18.72.1/24",))),
            Link(End("p2", "e0", ("198.18.172.2/24",)), End("nat", "lan", ("198.18.172.1/24",))),
            Link(End("p3", "e0", ("198.18.73.2/24",)), End("r", "p3", ("198.18.73.1/24",))),
        ),  # fmt: skip
        routes=(
            Route("srv", "default", via="198.18.70.1"),
            Route("p1", "default", via="198.18.71.1"),
            Route("nat", "default", via="198.18.72.1"),
            Route("p2", "default", via="198.18.172.1"),
            Route("p3", "default", via="198.18.73.1"),
        ),
        nft=(
            NftRule("r", 'oifname "p1" ip frag-off & 0x3fff != 0 counter drop'),
            NftRule("r", f'oifname "p3" numgen random mod 100 < {LOSS_PERCENT} counter drop'),
            NftRule("r", f'iifname "p3" numgen random mod 100 < {LOSS_PERCENT} counter drop'),
            NftRule(
                "nat", 'oifname "wan" masquerade', hook="postrouting", kind="nat", priority="srcnat"
            ),
        ),
    )


def campaign() -> dict[str, Any]:
    return {
        "name": "e2e-netns",
        "target": {"whole": WHOLE, "split": SPLIT},
        "probes": {"ids": sorted(PROBES)},
        "whole": {"sizes": [100, 1000, 1500], "sample": 3},
        "split": {"step": 64},  # 44, 108, ..., 1452: 23 splits
        "packets": PACKETS,
        "interval": 60,
        "packet_interval": PACKET_INTERVAL_MS,
        "duration": 3600,
        "credit_budget": 1_000_000,
        "responder": {"pps_per_address": 2000, "pps_per_prefix": 5000, "pps_global": 20000},
    }


def query(url: str, sql: str) -> list[dict[str, Any]]:
    e = db.make_engine(url)
    try:
        with e.connect() as conn:
            return [dict(r) for r in conn.execute(text(sql)).mappings()]
    finally:
        e.dispose()


def test_atlas_campaign_with_real_packets(
    tmp_path: Path, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "campaign.yaml"
    path.write_text(yaml.safe_dump(campaign()))
    with running(tmp_path, key=KEY) as standin, build(topology()) as net:
        for prb_id, (_, _, public, asn, cc) in PROBES.items():
            standin.add_probe(prb_id, public, asn, cc)
        for k, v in {
            "KICKASS_ATLAS_KEY": KEY,
            "KICKASS_ATLAS_SERVER": standin.server,
            "KICKASS_ATLAS_CA_BUNDLE": str(standin.ca_bundle),
            "KICKASS_DATABASE_URL": database_url,
        }.items():
            monkeypatch.setenv(k, v)
        assert cli.main(["atlas", "create", str(path)]) == 0

        net.start(
            Process(
                "responder",
                "srv",
                (KICKASS, "atlas", "responder", str(path), "--database-url", database_url),
                env={"KICKASS_CONFIG": ""},
                ready_text="responder ready",
                ready_timeout=60,
            )
        )
        tables = net["srv"].run(["nft", "list", "tables"]).stdout
        assert "kickass_icmp_responder" in tables

        # Every probe runs every measurement at once, as Atlas schedules them.
        start = time.time() + 1.0
        procs = {}
        for i, (prb_id, (host, _, _, _, _)) in enumerate(PROBES.items()):
            spec = {
                "icmp_id": 0x4000 + prb_id,
                "measurements": [
                    {
                        "msm_id": msm_id,
                        "target": m["target"],
                        "size": m["size"],
                        "packets": PACKETS,
                        "packet_interval_ms": PACKET_INTERVAL_MS,
                        "runs": RUNS,
                        "spacing_s": SPACING_S,
                        "start": start + 0.013 * (j + 4 * i),
                    }
                    for j, (msm_id, m) in enumerate(sorted(standin.measurements.items()))
                ],
            }
            spec_path = tmp_path / f"probe-{prb_id}.json"
            spec_path.write_text(json.dumps(spec))
            procs[prb_id] = net[host].popen(
                [sys.executable, str(HERE / "atlas_simprobe.py"), str(spec_path)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        outputs: dict[int, list[dict[str, Any]]] = {}
        for prb_id, p in procs.items():
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err.decode()
            outputs[prb_id] = [json.loads(line) for line in out.splitlines()]
        time.sleep(1.0)  # the responder's last log batch
        net.stop("responder")
        assert "kickass_icmp_responder" not in net["srv"].run(["nft", "list", "tables"]).stdout
        # With the table gone the kernel answers again (it was silenced, not broken).
        assert net["p1"].run(["ping", "-c", "1", "-W", "2", WHOLE], check=False).returncode == 0

        # The stand-in turns what each probe received into Atlas results.
        for prb_id, lines in outputs.items():
            _, own, public, _, _ = PROBES[prb_id]
            for r in lines:
                standin.add_results(
                    r["msm_id"],
                    [
                        ping_result(
                            r["msm_id"], prb_id, r["timestamp"], dst=r["dst_addr"], src=own,
                            public=public, size=r["size"], entries=r["result"],
                        )
                    ],
                )  # fmt: skip
        for m in standin.measurements.values():
            m["start_time"] = int(start) - 5
        assert cli.main(["atlas", "fetch", str(path), "--settle", "0"]) == 0
        assert cli.main(["atlas", "status", str(path)]) == 0

    truth = ground_truth(database_url, outputs, standin.measurements)
    check_counts(database_url, truth)
    check_verdicts(database_url)


def ground_truth(
    url: str, outputs: dict[int, list[dict[str, Any]]], measurements: dict[int, dict[str, Any]]
) -> dict[tuple[int, str, int], list[int]]:
    """(probe, phase, ip_len) -> [replies sent, acked in time], from the probes'
    own records and the reply log's sequence numbers — not through the join."""
    log = query(
        url,
        "SELECT host(dst_address) AS dst, host(responder_address) AS responder, icmp_seq, "
        "request_len, phase, ip_len, extract(epoch FROM sent_at)::float AS t FROM atlas_reply_log",
    )
    index: dict[tuple[str, str, int, int], list[dict[str, Any]]] = defaultdict(list)
    for row in log:
        index[(row["dst"], row["responder"], row["request_len"], row["icmp_seq"])].append(row)
    truth: dict[tuple[int, str, int], list[int]] = defaultdict(lambda: [0, 0])
    run_len = PACKETS * PACKET_INTERVAL_MS / 1000
    for prb_id, lines in outputs.items():
        public = PROBES[prb_id][2]
        for r in lines:
            target, size = r["dst_addr"], r["size"]
            for t in r["truth"]:
                rows = [
                    x
                    for x in index[(public, target, size + 28, t["seq"])]
                    if r["start"] - 0.1 <= x["t"] <= r["start"] + run_len + 0.5
                ]
                if not rows:
                    continue  # the request never reached the responder
                key = (prb_id, rows[0]["phase"], rows[0]["ip_len"])
                truth[key][0] += 1
                truth[key][1] += int(t["acked"])
        assert measurements  # (the stand-in kept them)
    return truth


def check_counts(url: str, truth: dict[tuple[int, str, int], list[int]]) -> None:
    stored: dict[tuple[int, str, int], list[int]] = {}
    for r in query(url, "SELECT prb_id, ip_len, sent, acked FROM v_atlas_whole_drop"):
        stored[(r["prb_id"], "whole", r["ip_len"])] = [r["sent"], r["acked"]]
    for r in query(url, "SELECT prb_id, leading_ip_len, sent, acked FROM v_atlas_split_drop"):
        stored[(r["prb_id"], "split", r["leading_ip_len"])] = [r["sent"], r["acked"]]
    # Every whole size of every probe, exactly.
    whole = {k: v for k, v in truth.items() if k[1] == "whole"}
    assert {k: v for k, v in stored.items() if k[1] == "whole"} == whole
    # Split per leading length, exactly, where the join is exact by construction
    # (no request lost on the way in); on the lossy path a lost first request
    # leaves two equally good alignments 100 ms apart that a whole-second
    # timestamp cannot tell apart: the totals are exact there, per split not.
    for prb_id in (1001, 1002):
        split = {k: v for k, v in truth.items() if k[0] == prb_id and k[1] == "split"}
        assert {k: v for k, v in stored.items() if k[0] == prb_id and k[1] == "split"} == split
        assert len(split) == 23  # one ping per probe covers the whole sweep... thrice
    lossy_truth = [
        sum(v[i] for k, v in truth.items() if k[0] == 1003 and k[1] == "split") for i in (0, 1)
    ]
    lossy_stored = [
        sum(v[i] for k, v in stored.items() if k[0] == 1003 and k[1] == "split") for i in (0, 1)
    ]
    assert lossy_stored == lossy_truth
    joins = {
        r["join_status"]: r["n"]
        for r in query(url, "SELECT join_status, count(*) AS n FROM atlas_results GROUP BY 1")
    }
    assert set(joins) <= {"exact", "ambiguous"}, joins
    assert query(url, "SELECT count(*) AS n FROM atlas_results")[0]["n"] == 3 * 4 * RUNS


def check_verdicts(url: str) -> None:
    v = {
        r["prb_id"]: r
        for r in query(url, "SELECT * FROM v_verdicts_by_source WHERE source = 'atlas'")
    }
    # Behind the fragment filter: every split reply lost, every whole one through.
    assert v[1001]["verdict"] == "fragment-intolerant"
    assert (v[1001]["whole_drop_rate"], v[1001]["split_drop_rate"]) == (0.0, 1.0)
    # Behind a NAT (conntrack reassembles and re-sends the pieces): fragments fine.
    assert v[1002]["verdict"] == "fragments-ok"
    assert (v[1002]["whole_drop_rate"], v[1002]["split_drop_rate"]) == (0.0, 0.0)
    assert (v[1002]["asn"], v[1002]["country_code"]) == (64502, "DE")
    # The lossy path: loss, but fragments within the two-fragment bound.
    assert v[1003]["verdict"] == "fragments-ok", v[1003]["verdict_reason"]
    assert 0.0 < v[1003]["whole_drop_rate"] < 0.3 and v[1003]["split_drop_rate"] < 0.5
    by_source = query(
        url, "SELECT source, ip_len, sessions FROM v_size_drop_by_source WHERE source = 'atlas'"
    )
    assert sorted((r["ip_len"], r["sessions"]) for r in by_source) == [
        (100, 3),
        (1000, 3),
        (1500, 3),
    ]
