"""A RIPE Atlas campaign end to end against the real probe firmware.

    p1 (198.18.75.2) ─────────────┐
    p2 (198.18.76.2) ─────────────┤  r: fragments to p2 dropped;
    p3 (198.18.77.2) ─────────────┼─ r ── srv (`kickass atlas responder`: whole
    p4 (198.18.78.2) ─────────────┤         198.18.74.10, split 198.18.74.11;
    p5 (198.18.179.2) ── nat ─────┘         reply log in PostgreSQL)
                   (198.18.79.2)  r: 10% of p3's packets dropped each way;
                                  r: every echo reply to p4 dropped but the first of a run
                                  nat: masquerades p5 (conntrack reassembles fragments)

Each probe namespace (p5 behind a NAT, the responder sees the NAT's
address) runs the RIPE Atlas probe's own ping (``busybox
evping`` from ../shared/oracles, see tests/atlas/probe_oracle.py) for every
measurement `kickass atlas create` created on the HTTPS stand-in, run after
run, as Atlas schedules them. The stand-in serves what the probes printed as
the results API does (tests/atlas/atlas_standin.py, ``api_result``), and
`kickass atlas fetch` joins them to the responder's reply log.

The ground truth is tcpdump's, on both ends: which reply datagrams the
responder put on the wire (and how it cut each split), which of them
arrived whole at the probe, which requests left the probe and which reached
the server. Stored counts must equal it: exactly per whole size, and per
split wherever the join is exact; where a result's join is ``ambiguous``
(its run's first requests never reached the responder, so the log cannot
tell which of two sequence-number alignments the result had) the totals
are exact and each split's counts may be off by at most the replies of the
ambiguous results at that split — the stated bound. The verdicts must be
right: fragments fine on the clean path, intolerant behind the fragment
filter, and on the other paths what the volunteers' rule says of the true
counts.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import kickass_db as db
import probe_oracle
import pytest
import yaml
from atlas_standin import api_result, running
from kickass_core import cli
from kickass_core.verdict import decide
from kickass_testbed.topology import (
    Built,
    End,
    Host,
    Link,
    NftRule,
    Process,
    Route,
    Topology,
    build,
)
from sqlalchemy import text
from support.pcap_truth import Capture, read_ipv4

pytestmark = [
    pytest.mark.netns,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces"),
]

KICKASS = str(Path(sys.executable).with_name("kickass"))
WHOLE, SPLIT = "198.18.74.10", "198.18.74.11"
# prb_id -> (namespace, its address, the address the responder sees, path)
PROBES = {
    1001: ("p1", "198.18.75.2", "198.18.75.2", "clean"),
    1002: ("p2", "198.18.76.2", "198.18.76.2", "every fragment dropped"),
    1003: ("p3", "198.18.77.2", "198.18.77.2", "10% loss each way"),
    1004: ("p4", "198.18.78.2", "198.18.78.2", "replies after the first of each run dropped"),
    1005: ("p5", "198.18.179.2", "198.18.79.2", "clean, behind a NAT"),
}
DIRECT = {prb: p for prb, p in PROBES.items() if p[1] == p[2]}
# A second between packets, as Atlas's default: the end-of-run timestamp
# (whole seconds) then tells a run's alignments apart.
PACKETS, PACKET_INTERVAL_MS, RUNS, GAP_S = 8, 1000, 3, 3.0
WHOLE_SIZES = [60, 1000, 1500]  # 60: the smallest a 64-bit probe sends (32 data bytes)
SPLITS = [44, 300, 548, 804, 1052, 1492]
KEY = "evping-e2e-key"


def topology() -> Topology:
    links = [
        Link(
            End("srv", "e0", (f"{WHOLE}/24", f"{SPLIT}/24")),
            End("r", "srv", ("198.18.74.1/24",)),
        )
    ]
    routes = [Route("srv", "default", via="198.18.74.1")]
    for host, address, _, _ in DIRECT.values():
        gateway = address.rsplit(".", 1)[0] + ".1"
        links.append(Link(End(host, "e0", (f"{address}/24",)), End("r", host, (f"{gateway}/24",))))
        routes.append(Route(host, "default", via=gateway))
    links += [
        Link(End("nat", "wan", ("198.18.79.2/24",)), End("r", "nat", ("198.18.79.1/24",))),
        Link(End("p5", "e0", ("198.18.179.2/24",)), End("nat", "lan", ("198.18.179.1/24",))),
    ]
    routes += [
        Route("nat", "default", via="198.18.79.1"),
        Route("p5", "default", via="198.18.179.1"),
    ]
    return Topology(
        name="kaev",
        hosts=(
            Host("srv"),
            Host("r", router=True),
            Host("nat", router=True),
            *(Host(p[0]) for p in PROBES.values()),
        ),
        links=tuple(links),
        routes=tuple(routes),
        nft=(
            NftRule(
                "nat", 'oifname "wan" masquerade', hook="postrouting", kind="nat", priority="srcnat"
            ),
            NftRule("r", 'oifname "p2" ip frag-off & 0x3fff != 0 counter drop'),
            NftRule("r", 'oifname "p3" numgen random mod 100 < 10 counter drop'),
            NftRule("r", 'iifname "p3" numgen random mod 100 < 10 counter drop'),
            # evping starts every run at sequence number 1 and, after the
            # first reply, re-sends the next one until a reply comes: every
            # reply but the first of a run has a sequence number above 1.
            # Only fragments at offset 0 carry the ICMP header: nft reads
            # "icmp" bytes of a later fragment's data too (zeros: type 0,
            # sequence 0), so those are let through, and a split reply after
            # the first loses its leading fragment, never completing.
            NftRule(
                "r",
                'oifname "p4" ip frag-off & 0x1fff == 0 icmp type echo-reply '
                "icmp sequence != 1 counter drop",
            ),
        ),
    )


def campaign() -> dict[str, Any]:
    return {
        "name": "evping-e2e",
        "target": {"whole": WHOLE, "split": SPLIT},
        "probes": {"ids": sorted(PROBES)},
        "whole": {"sizes": WHOLE_SIZES, "sample": len(WHOLE_SIZES)},
        "split": {"leading": SPLITS},
        "packets": PACKETS,
        "interval": 60,
        "packet_interval": PACKET_INTERVAL_MS,
        "duration": 3600,
        "credit_budget": 10**7,
        "responder": {"pps_per_address": 2000, "pps_per_prefix": 5000, "pps_global": 20000},
    }


def query(url: str, sql: str) -> list[dict[str, Any]]:
    e = db.make_engine(url)
    try:
        with e.connect() as conn:
            return [dict(r) for r in conn.execute(text(sql)).mappings()]
    finally:
        e.dispose()


def test_real_probe_firmware_against_the_responder(
    tmp_path: Path, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe_oracle.busybox()  # fails, never skips, without the oracle
    path = tmp_path / "campaign.yaml"
    path.write_text(yaml.safe_dump(campaign()))
    for k, v in {"KICKASS_ATLAS_KEY": KEY, "KICKASS_DATABASE_URL": database_url}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("KICKASS_CONFIG", raising=False)
    with running(tmp_path, key=KEY) as standin:
        monkeypatch.setenv("KICKASS_ATLAS_SERVER", standin.server)
        monkeypatch.setenv("KICKASS_ATLAS_CA_BUNDLE", str(standin.ca_bundle))
        for prb_id, (_, _, public, _) in PROBES.items():
            standin.add_probe(prb_id, public, 64500 + prb_id % 100, "NL")
        assert cli.main(["atlas", "create", str(path), "--start-in", "0"]) == 0
        # One request: every measurement on the same probes.
        assert len(standin.requests_to("POST", "/api/v2/measurements")) == 1
        measurements = dict(standin.measurements)

        started = time.monotonic()
        printed = run_probes(tmp_path, path, database_url, measurements)
        took = time.monotonic() - started
        assert len(printed) == len(PROBES) * len(measurements) * RUNS

        # RIPE's back end: the lines the probes printed, as the results API serves them.
        for msm_id, prb_id, line in printed:
            standin.add_results(
                msm_id,
                [api_result(line, msm_id=msm_id, prb_id=prb_id, public=PROBES[prb_id][2],
                            packets=PACKETS)],
            )  # fmt: skip
        assert cli.main(["atlas", "fetch", str(path), "--settle", "0"]) == 0
        # The same lines from a file (NDJSON, as the archive dumps) add nothing.
        dump = tmp_path / "dump.ndjson"
        dump.write_text(
            "".join(
                json.dumps(
                    api_result(line, msm_id=m, prb_id=p, public=PROBES[p][2], packets=PACKETS)
                )
                + "\n"
                for m, p, line in printed
            )  # fmt: skip
        )
        before = query(database_url, "SELECT count(*) AS n FROM atlas_outcomes")[0]["n"]
        assert cli.main(["atlas", "import", str(path), str(dump)]) == 0
        assert query(database_url, "SELECT count(*) AS n FROM atlas_outcomes")[0]["n"] == before

    truth = ground_truth(tmp_path, measurements)
    stored = stored_counts(database_url)
    ambiguous = ambiguous_replies(database_url)
    print(f"probes ran {took:.1f} s; joins {join_statuses(database_url)}")
    for key in sorted(set(truth) | set(stored)):
        print(key, "truth", truth.get(key), "stored", stored.get(key))
    check_counts(truth, stored, ambiguous)
    check_verdicts(database_url, truth)
    check_resends(database_url)


Probes = dict[int, tuple[str, str, str, str]]


def run_probes(
    tmp_path: Path,
    path: Path,
    database_url: str,
    measurements: dict[int, dict[str, Any]],
    *,
    spec: Topology | None = None,
    probes: Probes = PROBES,
    packets: int = PACKETS,
    interval_ms: int = PACKET_INTERVAL_MS,
    runs: int = RUNS,
    gap_s: float = GAP_S,
    inside: Callable[[Built], AbstractContextManager[object]] | None = None,
) -> list[tuple[int, int, dict[str, Any]]]:
    """Every probe runs every measurement ``runs`` times, all at once, with
    tcpdump on both ends; returns what the probes printed. ``inside``: what
    else runs in the network while they do (entered once it is built)."""
    printed: list[tuple[int, int, dict[str, Any]]] = []
    errors: list[str] = []
    lock = threading.Lock()
    with build(spec or topology()) as net, inside(net) if inside else contextlib.nullcontext():
        captures = {"srv": Capture(net["srv"], "e0", tmp_path / "srv.pcap", "icmp")}
        for host, _, _, _ in probes.values():
            captures[host] = Capture(net[host], "e0", tmp_path / f"{host}.pcap", "icmp")
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

        def probe(prb_id: int, msm: dict[str, Any], offset: float) -> None:
            host = probes[prb_id][0]
            time.sleep(offset)
            env = [f"{k}={v}" for k, v in probe_oracle.ENV.items()]
            for run in range(runs):
                if run:
                    time.sleep(gap_s)
                argv = probe_oracle.argv(
                    msm["target"], msm["size"], packets, interval_ms, msm["id"]
                )
                p = net[host].run(
                    ["env", *env, *argv],
                    check=False,
                    timeout=packets * interval_ms / 1000 + 30,
                )
                try:
                    line = probe_oracle.result_line(p.stdout)
                except AssertionError as exc:
                    with lock:
                        errors.append(f"{host} msm {msm['id']}: {exc} {p.stderr[-300:]}")
                    return
                with lock:
                    printed.append((msm["id"], prb_id, line))

        jobs = [
            (p, m) for p in probes for m in sorted(measurements.values(), key=lambda m: m["id"])
        ]
        threads = [
            threading.Thread(target=probe, args=(prb_id, msm, 0.05 * i))
            for i, (prb_id, msm) in enumerate(jobs)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(1.0)  # the responder's last log batch
        code, _ = net.stop("responder")
        assert code == 0
        dropped = {host: c.stop() for host, c in captures.items()}
    assert not errors, errors
    assert dropped == dict.fromkeys(dropped, 0), dropped  # the truth is only truth at 0
    return printed


Key = tuple[int, str, int]  # (probe, phase, whole IP length | leading-fragment IP length)


def datagrams(pcap: Path, src: set[str]) -> dict[tuple[str, int], list[Any]]:
    """Pieces of the IPv4 datagrams from ``src``, per (destination, IP id)."""
    out: dict[tuple[str, int], list[Any]] = defaultdict(list)
    for p in read_ipv4(pcap):
        if p.proto == 1 and p.src in src:
            out[(p.dst, p.ip_id)].append(p)
    return out


def complete(pieces: list[Any]) -> bool:
    at, end = 0, None
    for p in sorted(pieces, key=lambda p: p.offset):
        if p.offset > at:
            return False
        at = max(at, p.offset + p.total_len - 20)
        if not p.more:
            end = p.offset + p.total_len - 20
    return end is not None and at >= end


def ground_truth(
    tmp_path: Path, measurements: dict[int, dict[str, Any]]
) -> dict[Key, Counter[str]]:
    """Per probe, phase and size or split, from tcpdump only: replies the
    responder sent (srv), replies that arrived whole (the probe's end), and
    for whole sizes the requests that left the probe but never reached srv."""
    prb_of = {public: prb for prb, (_, _, public, _) in PROBES.items()}
    sent = datagrams(tmp_path / "srv.pcap", {WHOLE, SPLIT})
    truth: dict[Key, Counter[str]] = defaultdict(Counter)
    # Per probe, the IP ids of the replies that arrived whole (a NAT keeps
    # them: the responder numbers its replies, ids never repeat here).
    arrived: dict[int, set[int]] = {}
    for prb_id, (host, _, _, _) in PROBES.items():
        at_probe = datagrams(tmp_path / f"{host}.pcap", {WHOLE, SPLIT})
        arrived[prb_id] = {ip_id for (_, ip_id), pieces in at_probe.items() if complete(pieces)}
    for (dst, ip_id), pieces in sent.items():
        lead = next(p for p in pieces if p.offset == 0)
        if lead.payload[0] != 0:  # echo replies only
            continue
        phase = "split" if lead.src == SPLIT else "whole"
        size = lead.total_len if phase == "split" else 20 + sum(p.total_len - 20 for p in pieces)
        key = (prb_of[dst], phase, size)
        truth[key]["sent"] += 1
        truth[key]["acked"] += ip_id in arrived[prb_of[dst]]
    # Whole requests: left the probe, never reached the responder.
    at_srv = Counter(
        (p.src, p.total_len)
        for p in read_ipv4(tmp_path / "srv.pcap")
        if p.proto == 1 and p.dst == WHOLE and p.offset == 0 and p.payload[0] == 8
    )
    for prb_id, (host, own, public, _) in PROBES.items():
        left = Counter(
            p.total_len
            for p in read_ipv4(tmp_path / f"{host}.pcap")
            if p.proto == 1 and p.src == own and p.dst == WHOLE and p.payload[0] == 8
        )
        for size, n in left.items():
            truth[(prb_id, "whole", size)]["unanswered"] += n - at_srv[(public, size)]
    assert measurements
    return truth


def stored_counts(url: str) -> dict[Key, Counter[str]]:
    stored: dict[Key, Counter[str]] = {}
    for r in query(url, "SELECT prb_id, ip_len, sent, acked, unanswered FROM v_atlas_whole_drop"):
        stored[(r["prb_id"], "whole", r["ip_len"])] = Counter(
            sent=r["sent"], acked=r["acked"], unanswered=r["unanswered"]
        )
    for r in query(url, "SELECT prb_id, leading_ip_len, sent, acked FROM v_atlas_split_drop"):
        stored[(r["prb_id"], "split", r["leading_ip_len"])] = Counter(
            sent=r["sent"], acked=r["acked"]
        )
    return stored


def ambiguous_replies(url: str) -> Counter[Key]:
    """Our replies in results joined ``ambiguous``, per probe and split."""
    rows = query(
        url,
        "SELECT o.prb_id, o.phase, o.ip_len, count(*) AS n FROM atlas_outcomes o "
        "JOIN atlas_results r USING (msm_id, prb_id, result_at) "
        "WHERE r.join_status = 'ambiguous' AND o.outcome IN ('acked', 'lost', 'late') "
        "GROUP BY 1, 2, 3",
    )
    return Counter({(r["prb_id"], r["phase"], r["ip_len"]): r["n"] for r in rows})


def join_statuses(url: str) -> dict[str, int]:
    rows = query(url, "SELECT join_status, count(*) AS n FROM atlas_results GROUP BY 1")
    return {r["join_status"]: r["n"] for r in rows}


def check_counts(
    truth: dict[Key, Counter[str]], stored: dict[Key, Counter[str]], ambiguous: Counter[Key]
) -> None:
    # Every whole size of every probe: replies sent, arrived and requests
    # that never reached us, exactly.
    whole_truth = {k: v for k, v in truth.items() if k[1] == "whole"}
    whole_stored = {k: v for k, v in stored.items() if k[1] == "whole"}
    assert whole_stored == whole_truth
    assert {k[2] for k in whole_truth} == set(WHOLE_SIZES)
    for prb_id in PROBES:
        split_truth = {k: v for k, v in truth.items() if k[0] == prb_id and k[1] == "split"}
        split_stored = {k: v for k, v in stored.items() if k[0] == prb_id and k[1] == "split"}
        # Totals exactly, on every path.
        for what in ("sent", "acked"):
            assert sum(v[what] for v in split_stored.values()) == sum(
                v[what] for v in split_truth.values()
            ), (prb_id, what)
        # Per split: exactly, up to the replies of ambiguous results there.
        for key in set(split_truth) | set(split_stored):
            t, s = split_truth.get(key, Counter()), split_stored.get(key, Counter())
            assert t["sent"] == s["sent"], key  # which split each reply had: the log's
            assert abs(t["acked"] - s["acked"]) <= ambiguous[key], (key, t, s)
        if prb_id != 1003:  # no request lost on the way in: nothing ambiguous
            assert split_stored == split_truth
    assert set(ambiguous) <= {k for k in truth if k[0] == 1003}, ambiguous


def check_resends(url: str) -> None:
    """Behind p4 every run is seq 1 answered, then seq 2 re-sent until the
    run ends: the responder answered each re-send as a new request (attempt
    0, 1, ... 6) with the next split, so the sweep never stuck on one."""
    rows = query(
        url,
        f"SELECT icmp_id, icmp_seq, attempt, ip_len, duplicate FROM atlas_reply_log "
        f"WHERE host(dst_address) = '{PROBES[1004][2]}' AND phase = 'split' "
        "ORDER BY sent_at",
    )
    runs: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        runs[r["icmp_id"]].append(r)
    assert len(runs) == RUNS
    for run in runs.values():
        assert [(r["icmp_seq"], r["attempt"]) for r in run] == [(1, 0)] + [
            (2, a) for a in range(PACKETS - 1)
        ], run
        assert {r["ip_len"] for r in run[1:]} == set(SPLITS)  # 7 re-sends, every split
        assert not any(r["duplicate"] for r in run)


def check_verdicts(url: str, truth: dict[Key, Counter[str]]) -> None:
    v = {
        r["prb_id"]: r
        for r in query(url, "SELECT * FROM v_verdicts_by_source WHERE source = 'atlas'")
    }
    for clean in (1001, 1005):  # behind the NAT too: conntrack reassembles, re-sends whole
        assert v[clean]["verdict"] == "fragments-ok"
        assert (v[clean]["whole_drop_rate"], v[clean]["split_drop_rate"]) == (0.0, 0.0)
    assert (v[1005]["asn"], v[1005]["country_code"]) == (64505, "NL")
    assert v[1002]["verdict"] == "fragment-intolerant"
    assert (v[1002]["whole_drop_rate"], v[1002]["split_drop_rate"]) == (0.0, 1.0)
    # Only the first reply of each run: 1 of 8 whole replies, more than half
    # lost, so nothing can be said about fragments.
    assert v[1004]["verdict"] == "inconclusive"
    assert v[1004]["whole_drop_rate"] == pytest.approx(1 - 1 / PACKETS)
    for prb_id in PROBES:
        counts = {
            phase: [
                sum(c[w] for k, c in truth.items() if k[:2] == (prb_id, phase))
                for w in ("sent", "acked")
            ]
            for phase in ("whole", "split")
        }
        expected = decide(*counts["whole"], *counts["split"]).verdict
        assert v[prb_id]["verdict"] == expected, (prb_id, counts, v[prb_id]["verdict_reason"])
    assert v[1003]["verdict"] != "fragment-intolerant"
