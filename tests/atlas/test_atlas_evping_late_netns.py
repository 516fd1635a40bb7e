"""Atlas at the 2 ms packet interval with late first replies, imported after
a garbled copy of every result, against the real probe firmware.

    p1 (198.18.85.2) ── d1 ──┐
                             ├── r ── srv (`kickass atlas responder`: whole
    p2 (198.18.86.2) ── d2 ──┘          198.18.84.10, split 198.18.84.11)

d1 and d2 are bridges this test runs in user space (the kernel here has no
netem): they pass every frame both ways at once but hold the echo replies
to chosen sequence numbers until the same run's request two sequence
numbers past the last held one goes by: the probe has timed them out by
then (it sends the next request only once a reply or its per-packet timer
came) and is still running, however late its event loop fires on a busy
machine (a fixed 8 ms hold was beaten by a late timer in CI, once in two
runs). evping starts every run at sequence number 1, so behind d1 the
first reply of every run comes back late ([x, {dup, rtt}, rtt, ...]: the
issue's run, every request having reached the responder), behind d2 the
first five of eight. Below MIN_TIMED_INTERVAL_S the join has no timing to
tell alignments apart with; the run's request count and the late replies
must tell.

Every result line reaches `kickass atlas import` first garbled (its entries
turned into text) and stored ``invalid``, then as the probe printed it: the
readable copies must replace the garbled ones.

The ground truth is tcpdump's, on both ends: the replies the responder put
on the wire (and how it cut each split), and the replies that arrived whole
at the probe, in the order they arrived, which is the order the probe wrote
their entries in (no reply is duplicated on these paths): an rtt entry's
reply was accepted (``acked``), a dup entry's came back after the probe's
timeout (``late``). Stored counts must equal it, per probe and whole size or
split, wherever a result's join is ``exact``; for an ``ambiguous`` one,
``late`` may be off by at most its dup entries (atlas/README.md). The
verdicts count late replies as delivered: behind d2, 5 of 8 whole replies
late is a path that delivers them all, not one too lossy to judge.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import struct
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import probe_oracle
import pytest
import yaml
from atlas_standin import api_result, running
from kickass_core import cli
from kickass_core.verdict import decide
from kickass_testbed.topology import Built, End, Host, Link, Route, Topology
from support.pcap_truth import read_ipv4
from test_atlas_evping_netns import Key, Probes, complete, datagrams, query, run_probes

pytestmark = [
    pytest.mark.netns,
    pytest.mark.slow,
    # Runs alone: its bridges are Python threads holding replies by sequence
    # number at a 2 ms interval. Beside both test streams (load 3) it failed
    # twice in about eight runs, each time one late reply short in the store
    # against the probe's printout (48 of 54; then 3 of 4 at one size, the
    # join 'exact'): not explained yet, so it is measured where no neighbour
    # moves its timing, and the next failure alone says more.
    pytest.mark.quiet,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces"),
]

WHOLE, SPLIT = "198.18.84.10", "198.18.84.11"
PROBES: Probes = {
    2001: ("p1", "198.18.85.2", "198.18.85.2", "the first reply of every run late"),
    2002: ("p2", "198.18.86.2", "198.18.86.2", "the first five replies of every run late"),
}
BRIDGE = {"p1": "d1", "p2": "d2"}
HELD = {"d1": frozenset({1}), "d2": frozenset({1, 2, 3, 4, 5})}
# A held reply nobody released (no later request came) goes after this.
HOLD_MAX_S = 0.5
# Runs of one measurement apart by more than the join's window around a
# result (its run's length, 3 s of clock slack each side), as on Atlas,
# where they are at least a minute apart.
PACKETS, PACKET_INTERVAL_MS, RUNS, GAP_S = 8, 2, 3, 8.0
WHOLE_SIZES = [60, 1500]
SPLITS = [300, 1052]
KEY = "evping-late-key"
ETH_P_ALL = 0x0003


def topology() -> Topology:
    links = [
        Link(
            End("srv", "e0", (f"{WHOLE}/24", f"{SPLIT}/24")),
            End("r", "srv", ("198.18.84.1/24",)),
        )
    ]
    routes = [Route("srv", "default", via="198.18.84.1")]
    for host, address, _, _ in PROBES.values():
        gateway = address.rsplit(".", 1)[0] + ".1"
        bridge = BRIDGE[host]
        links += [
            Link(End("r", host, (f"{gateway}/24",), ipv6=False), End(bridge, "up", ipv6=False)),
            Link(End(bridge, "dn", ipv6=False), End(host, "e0", (f"{address}/24",), ipv6=False)),
        ]
        routes.append(Route(host, "default", via=gateway))
    return Topology(
        name="kalt",
        hosts=(
            Host("srv"),
            Host("r", router=True),
            *(Host(b) for b in BRIDGE.values()),
            *(Host(p[0]) for p in PROBES.values()),
        ),
        links=tuple(links),
        routes=tuple(routes),
    )


def campaign() -> dict[str, Any]:
    return {
        "name": "evping-late",
        "target": {"whole": WHOLE, "split": SPLIT},
        "probes": {"ids": sorted(PROBES)},
        "whole": {"sizes": WHOLE_SIZES, "sample": len(WHOLE_SIZES)},
        "split": {"leading": SPLITS},
        "packets": PACKETS,
        "interval": 60,
        "packet_interval": PACKET_INTERVAL_MS,
        "duration": 3600,
        "credit_budget": 10**7,
        "responder": {"pps_per_address": 5000, "pps_per_prefix": 5000, "pps_global": 20000},
    }


class DelayBridge:
    """Every frame between the interfaces ``up`` and ``dn`` of ``host``,
    both ways, at once; an echo reply towards the probe to a sequence number
    in ``held`` (its leading fragment: the only piece with the ICMP header)
    is held until the probe's request with the same identifier and a
    sequence number two past the last held one has gone by (or HOLD_MAX_S);
    one that arrives after that request is passed on at once."""

    def __init__(self, net: Built, host: str, held: frozenset[int]) -> None:
        self.held, self.frames_held = held, 0
        self.release_seq = max(held) + 2
        net[host].ip("link set dev up promisc on", "link set dev dn promisc on")
        with net.in_netns(host):
            self.up = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            self.dn = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self.up.bind(("up", 0))
        self.dn.bind(("dn", 0))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"bridge-{host}", daemon=True)
        self.thread.start()

    @staticmethod
    def _echo(frame: bytes, icmp_type: int) -> tuple[int, int] | None:
        """(identifier, sequence) of an echo message's leading fragment."""
        if frame[12:14] != b"\x08\x00" or len(frame) < 14 + 20 + 8:
            return None
        ip = frame[14:]
        ihl = (ip[0] & 0xF) * 4
        offset = struct.unpack_from("!H", ip, 6)[0] & 0x1FFF
        if ip[9] != 1 or offset or len(ip) < ihl + 8 or ip[ihl] != icmp_type:
            return None
        ident, seq = struct.unpack_from("!HH", ip, ihl + 4)
        return ident, seq

    def _run(self) -> None:
        peer = {self.up: self.dn, self.dn: self.up}
        held: dict[int, list[tuple[float, bytes]]] = defaultdict(list)
        # The sequence number of each identifier's latest request: a reply
        # that reaches the bridge after the release request went by (a slow
        # responder on a busy machine) is late already and goes at once;
        # held until HOLD_MAX_S it came after the run, and was not counted.
        latest: dict[int, int] = {}
        while not self.stop.is_set():
            ready, _, _ = select.select([self.up, self.dn], [], [], 0.01)
            for sock in ready:
                frame, addr = sock.recvfrom(65535)
                if addr[2] == socket.PACKET_OUTGOING:  # our own send, seen again
                    continue
                reply = self._echo(frame, 0) if sock is self.up else None
                if (
                    reply is not None
                    and reply[1] in self.held
                    and latest.get(reply[0], 0) < self.release_seq
                ):
                    held[reply[0]].append((time.monotonic(), frame))
                    self.frames_held += 1
                    continue
                if reply is not None and reply[1] in self.held:
                    self.frames_held += 1
                peer[sock].send(frame)
                request = self._echo(frame, 8) if sock is self.dn else None
                if request is not None:
                    latest[request[0]] = request[1]
                if request is not None and request[1] >= self.release_seq:
                    for _, f in held.pop(request[0], []):
                        self.dn.send(f)
            now = time.monotonic()
            for ident in [i for i, fs in held.items() if now - fs[0][0] >= HOLD_MAX_S]:
                for _, f in held.pop(ident):
                    self.dn.send(f)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.up.close()
        self.dn.close()


@contextlib.contextmanager
def bridges(net: Built) -> Iterator[dict[str, DelayBridge]]:
    running_bridges = {host: DelayBridge(net, host, held) for host, held in HELD.items()}
    try:
        yield running_bridges
    finally:
        for b in running_bridges.values():
            b.close()
        # Every run held a reply behind each bridge.
        for host, b in running_bridges.items():
            assert b.frames_held >= RUNS, (host, b.frames_held)


def garbled(line: dict[str, Any]) -> dict[str, Any]:
    """The line with every entry turned into text (a mangled dump's copy)."""
    return {**line, "result": [json.dumps(e) for e in line["result"]]}


def test_late_first_replies_at_2_ms_and_a_garbled_copy_first(
    tmp_path: Path,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
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
        measurements = dict(standin.measurements)
    printed = run_probes(
        tmp_path, path, database_url, measurements, spec=topology(), probes=PROBES,
        packets=PACKETS, interval_ms=PACKET_INTERVAL_MS, runs=RUNS, gap_s=GAP_S, inside=bridges,
    )  # fmt: skip
    assert len(printed) == len(PROBES) * len(measurements) * RUNS
    lines = [
        api_result(line, msm_id=m, prb_id=p, public=PROBES[p][2], packets=PACKETS)
        for m, p, line in printed
    ]
    # The run, from the real firmware: x, then the first reply as a
    # late duplicate among the others, in time.
    p1 = [x["result"] for x in lines if x["prb_id"] == 2001]
    assert all(
        "x" in r[0] and any("dup" in e and e["rtt"] >= PACKET_INTERVAL_MS for e in r) for r in p1
    ), p1
    capsys.readouterr()

    # Every line garbled first: stored invalid, nothing of it counted.
    bad = tmp_path / "garbled.ndjson"
    bad.write_text("".join(json.dumps(garbled(x)) + "\n" for x in lines))
    assert cli.main(["atlas", "import", str(path), str(bad), "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["results_new"] == len(lines) and first["join"] == {"invalid": len(lines)}
    assert query(database_url, "SELECT count(*) AS n FROM atlas_outcomes")[0]["n"] == 0
    reasons = query(database_url, "SELECT DISTINCT join_error FROM atlas_results")
    assert {r["join_error"] for r in reasons} == {
        'unreadable result: entry 1 of "result" is the text "{\\"x\\": \\"*\\"}", not an object'
    }
    # Then as the probes printed them: each replaces its garbled copy.
    good = tmp_path / "results.ndjson"
    good.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert cli.main(["atlas", "import", str(path), str(good), "--json"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["results_new"] == second["results_replaced"] == len(lines)
    assert "invalid" not in second["join"]

    truth = ground_truth(tmp_path, measurements, printed)
    stored = stored_counts(database_url)
    bound = late_bound(database_url)
    statuses = query(
        database_url, "SELECT join_status, count(*) AS n FROM atlas_results GROUP BY 1"
    )
    print(f"joins {statuses}")
    for key in sorted(set(truth) | set(stored)):
        print(key, "truth", dict(truth.get(key, {})), "stored", dict(stored.get(key, {})))
    assert set(stored) == set(truth)
    for key, t in truth.items():
        s = stored[key]
        assert (s["sent"], s["acked"] + s["late"]) == (t["sent"], t["acked"] + t["late"]), key
        assert abs(s["late"] - t["late"]) <= bound[key], (key, t, s, bound[key])
        if not bound[key]:  # every result there exact: exactly the truth
            assert s == t, key
    # With every request at the responder, no alignment but the true one fits.
    assert statuses == [{"join_status": "exact", "n": len(lines)}]
    assert sum(t["late"] for t in truth.values()) >= RUNS * len(measurements) * (1 + 5)
    check_verdicts(database_url, truth)


def ground_truth(
    tmp_path: Path,
    measurements: dict[int, dict[str, Any]],
    printed: list[tuple[int, int, dict[str, Any]]],
) -> dict[Key, Counter[str]]:
    """Per probe, phase and whole size or split: replies the responder sent
    (srv), and of those the ones that arrived whole at the probe, each as
    the probe's entry for it says (rtt: acked, dup: late), matched in the
    order they arrived; whole requests that never reached srv (unanswered)."""
    key_of: dict[tuple[str, int], Key] = {}
    truth: dict[Key, Counter[str]] = defaultdict(Counter)
    prb_of = {public: prb for prb, (_, _, public, _) in PROBES.items()}
    for (dst, ip_id), sent in datagrams(tmp_path / "srv.pcap", {WHOLE, SPLIT}).items():
        lead = next(p for p in sent if p.offset == 0)
        if lead.payload[0] != 0:  # echo replies only
            continue
        phase = "split" if lead.src == SPLIT else "whole"
        size = lead.total_len if phase == "split" else 20 + sum(p.total_len - 20 for p in sent)
        key_of[(dst, ip_id)] = key = (prb_of[dst], phase, size)
        truth[key]["sent"] += 1
    msm_of = {(m["target"], m["size"]): m["id"] for m in measurements.values()}
    for prb_id, (host, own, public, _) in PROBES.items():
        # Runs by ICMP id, in the order they began; the requests' target and
        # length name the measurement.
        runs: dict[int, int] = {}
        arrived: dict[int, list[int]] = defaultdict(list)  # ICMP id -> reply IP ids, in order
        pieces: dict[int, list[Any]] = defaultdict(list)
        whole: set[int] = set()
        left: Counter[int] = Counter()
        for p in read_ipv4(tmp_path / f"{host}.pcap"):
            if p.proto != 1:
                continue
            if p.src == own and p.offset == 0 and p.payload[0] == 8:
                icmp_id = struct.unpack_from("!H", p.payload, 4)[0]
                runs.setdefault(icmp_id, msm_of[(p.dst, p.total_len - 28)])
                if p.dst == WHOLE:
                    left[p.total_len] += 1
            elif p.src in (WHOLE, SPLIT) and p.dst == own:
                pieces[p.ip_id].append(p)
                if p.ip_id not in whole and complete(pieces[p.ip_id]):
                    whole.add(p.ip_id)
                    lead = next(x for x in pieces[p.ip_id] if x.offset == 0)
                    arrived[struct.unpack_from("!H", lead.payload, 4)[0]].append(p.ip_id)
        lines: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for msm_id, prb, line in printed:
            if prb == prb_id:
                lines[msm_id].append(line)
        nth: Counter[int] = Counter()
        for icmp_id, msm_id in runs.items():
            entries = lines[msm_id][nth[msm_id]]["result"]
            nth[msm_id] += 1
            replies = [e for e in entries if "rtt" in e]
            got = arrived.get(icmp_id, [])
            assert len(got) >= len(replies), (host, icmp_id, entries, got)
            for ip_id, entry in zip(got, replies, strict=False):
                truth[key_of[(public, ip_id)]]["late" if "dup" in entry else "acked"] += 1
        at_srv = Counter(
            p.total_len
            for p in read_ipv4(tmp_path / "srv.pcap")
            if p.proto == 1 and p.src == public and p.dst == WHOLE and p.offset == 0
        )
        for size, n in left.items():
            truth[(prb_id, "whole", size)]["unanswered"] += n - at_srv[size]
    return truth


def stored_counts(url: str) -> dict[Key, Counter[str]]:
    stored: dict[Key, Counter[str]] = {}
    for r in query(
        url, "SELECT prb_id, ip_len, sent, acked, late, unanswered FROM v_atlas_whole_drop"
    ):
        stored[(r["prb_id"], "whole", r["ip_len"])] = Counter(
            sent=r["sent"], acked=r["acked"], late=r["late"], unanswered=r["unanswered"]
        )
    for r in query(url, "SELECT prb_id, leading_ip_len, sent, acked, late FROM v_atlas_split_drop"):
        stored[(r["prb_id"], "split", r["leading_ip_len"])] = Counter(
            sent=r["sent"], acked=r["acked"], late=r["late"]
        )
    return stored


def late_bound(url: str) -> Counter[Key]:
    """The stated bound on ``late``: the dup entries of the results joined
    ``ambiguous``, at every key one of their replies has."""
    rows = query(
        url,
        "SELECT DISTINCT r.prb_id, o.phase, o.ip_len, r.result_at, r.msm_id, "
        "(SELECT count(*) FROM jsonb_array_elements(r.raw -> 'result') e WHERE e ? 'dup') AS dups "
        "FROM atlas_results r JOIN atlas_outcomes o USING (msm_id, prb_id, result_at) "
        "WHERE r.join_status = 'ambiguous' AND o.ip_len IS NOT NULL",
    )
    bound: Counter[Key] = Counter()
    for r in rows:
        bound[(r["prb_id"], r["phase"], r["ip_len"])] += r["dups"]
    return bound


def check_verdicts(url: str, truth: dict[Key, Counter[str]]) -> None:
    """The volunteers' rule on the true counts, late replies delivered."""
    v = {
        r["prb_id"]: r
        for r in query(url, "SELECT * FROM v_verdicts_by_source WHERE source = 'atlas'")
    }
    for prb_id in PROBES:
        counts = {
            phase: [
                sum(c[w] for k, c in truth.items() if k[:2] == (prb_id, phase))
                for w in ("sent", "acked", "late")
            ]
            for phase in ("whole", "split")
        }
        (ws, wa, wl), (ss, sa, sl) = counts["whole"], counts["split"]
        expected = decide(ws, wa + wl, ss, sa + sl, late=wl + sl)
        assert (v[prb_id]["verdict"], v[prb_id]["verdict_reason"]) == (
            expected.verdict,
            expected.reason,
        ), (prb_id, counts)
        # Drop rates keep the paper's rule: late is lost.
        assert v[prb_id]["whole_drop_rate"] == pytest.approx(1 - wa / ws)
    # Five of eight replies held late on every path: delivered, nothing
    # lost. (At least five: on a busy machine the responder can answer a
    # request not held after the probe's timer, and that reply is late too,
    # in the truth as in the store; the equality above is the claim.)
    assert v[2002]["verdict"] == "fragments-ok", v[2002]["verdict_reason"]
    assert v[2002]["whole_drop_rate"] >= 5 / 8 - 1e-9
