"""The fragment-viability study end to end: real server, real client, real
packets through network namespaces, real PostgreSQL.

Every test builds its own namespace internet (unique names) and tears it
down, also on failure. Traffic stays inside those namespaces.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest
from kickass_core import wire
from kickass_db.study_store import StudyStore
from kickass_testbed.internet import PROBE_PORT, SERVER_IP, parse_json_output, probe_internet
from support.schedule import wait_until

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces"),
    pytest.mark.skipif(not shutil.which("nft"), reason="needs nftables"),
]


@pytest.fixture
def internet(database_url: str, tmp_path) -> Iterator:  # noqa: ANN001
    with probe_internet(database_url, log_dir=tmp_path) as net:
        yield net


def _plan(rep: int, step: int = 8, window: int = 32) -> list[str]:
    return ["--repetitions", str(rep), "--step", str(step), "--window", str(window)]


def _pooled(rows: list[dict]) -> tuple[int, int]:
    return sum(r["sent"] for r in rows), sum(r["acked"] for r in rows)


def _run_json(net, kind: str, args: list[str], timeout: float = 240) -> dict:  # noqa: ANN001
    proc = net.run_client(kind, ["--json", *args], timeout=timeout)
    out = parse_json_output(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _http_json(
    net,
    kind: str,
    path: str,
    method: str = "GET",
    body: dict | None = None,  # noqa: ANN001
    source: str | None = None,
) -> tuple[int, dict]:
    """An HTTP request made from inside a client namespace (its source address)."""
    script = (
        "import json,sys,http.client\n"
        "src=sys.argv[4] or None\n"
        f"c=http.client.HTTPConnection('{SERVER_IP}',8080,timeout=10,"
        "source_address=(src,0) if src else None)\n"
        "c.request(sys.argv[1],sys.argv[2],body=sys.argv[3] or None,"
        "headers={'Content-Type':'application/json'})\n"
        "r=c.getresponse();print(json.dumps([r.status,json.loads(r.read())]))\n"
    )
    ns = net.clients[kind].ns
    proc = ns.run(
        ["python3", "-c", script, method, path, json.dumps(body) if body else "", source or ""]
    )
    status, data = json.loads(proc.stdout)
    return status, data


def test_clean_path_every_size_and_split_acknowledged(internet, database_url) -> None:  # noqa: ANN001
    out = _run_json(internet, "clean", _plan(2))
    assert out["verdict"] == "fragments-ok"
    assert len(out["whole"]) == 184 and len(out["split"]) == 182
    assert all(r["sent"] == 2 and r["acked"] == 2 for r in out["whole"]), out["whole"]
    assert all(r["sent"] == 2 and r["acked"] == 2 for r in out["split"]), out["split"]
    # What the client printed is what the database holds.
    db = StudyStore(database_url).session_results(out["session_id"])
    assert db is not None and db["state"] == "complete"
    for key, size_key in (("whole", "ip_len"), ("split", "leading_ip_len")):
        printed = {(r[size_key], r["sent"], r["acked"]) for r in out[key]}
        stored = {(r[size_key], r["sent"], r["acked"]) for r in db[key]}
        assert printed == stored
    # On a clean path every split arrives exactly as it was cut.
    for r in db["split"]:
        assert r["arrived_as_sent"] == r["acked"], r
    assert db["plan"]["total_probes"] == 2 * (184 + 182)
    assert db["client_version"] and db["server_version"]


def test_fragment_dropping_middlebox(internet) -> None:  # noqa: ANN001
    out = _run_json(internet, "fragdrop", _plan(2, step=16))
    whole_sent, whole_acked = _pooled(out["whole"])
    split_sent, split_acked = _pooled(out["split"])
    assert whole_acked == whole_sent > 0
    assert split_sent > 0 and split_acked == 0
    assert out["verdict"] == "fragment-intolerant"


def test_lossy_path_drop_rates(internet) -> None:  # noqa: ANN001
    """5% loss each way: whole ~ 1-0.95^2 (probe+ack), split ~ 1-0.95^3 (two
    fragments + ack). Bound: 4.5 binomial standard errors (a false failure
    about once in 150 000 runs)."""
    out = _run_json(internet, "lossy", _plan(10, window=32), timeout=400)
    ws, wa = _pooled(out["whole"])
    ss, sa = _pooled(out["split"])
    whole, split = 1 - wa / ws, 1 - sa / ss
    p_whole, p_split = 1 - 0.95**2, 1 - 0.95**3
    assert abs(whole - p_whole) <= 4.5 * math.sqrt(p_whole * (1 - p_whole) / ws), whole
    assert abs(split - p_split) <= 4.5 * math.sqrt(p_split * (1 - p_split) / ss), split
    # The paper's finding: the fragmented drop rate never exceeded twice the whole one.
    assert split / whole < 2.0
    assert out["verdict"] == "fragments-ok"


def test_client_behind_nat_completes(internet, database_url) -> None:  # noqa: ANN001
    out = _run_json(internet, "natted", _plan(2, step=32))
    assert out["verdict"] == "fragments-ok"
    db = StudyStore(database_url).session_results(out["session_id"])
    assert db["state"] == "complete"
    # The NAT's conntrack reassembles and re-fragments, yet every datagram arrives.
    assert all(r["acked"] == r["sent"] for r in db["split"])


# -- abuse ---------------------------------------------------------------------

SNIFFER = r"""
import socket, struct, sys, time, json
s = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(0x0800))
s.settimeout(0.2)
end = time.time() + float(sys.argv[1]); seen = []
while time.time() < end:
    try: data, addr = s.recvfrom(65535)
    except socket.timeout: continue
    if addr[2] == socket.PACKET_OUTGOING: continue
    if data[12:16] == socket.inet_aton(sys.argv[2]):
        seen.append(len(data))
print(json.dumps(seen))
"""

RAW_SENDER = r"""
import socket, struct, sys
src, dst = sys.argv[1], sys.argv[2]
sport, dport, payload = int(sys.argv[3]), int(sys.argv[4]), bytes.fromhex(sys.argv[5])
udp = struct.pack('!HHHH', sport, dport, 8 + len(payload), 0) + payload
ip = struct.pack('!BBHHHBBH4s4s', 0x45, 0, 20 + len(udp), 1, 0, 64, 17, 0,
                 socket.inet_aton(src), socket.inet_aton(dst))
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
s.sendto(ip + udp, (dst, 0))
"""


def _new_session(net, kind: str = "clean", plan: dict | None = None) -> dict:  # noqa: ANN001
    status, data = _http_json(
        net,
        kind,
        "/api/v1/sessions",
        "POST",
        {"plan": plan or {"repetitions": 1, "step": 64, "window": 4}, "client_version": "test"},
    )
    assert status == 201, data
    return data


def _stats(net, kind: str = "clean") -> dict:  # noqa: ANN001
    return _http_json(net, kind, "/api/v1/stats")[1]["counters"]


def test_wrong_cookie_gets_nothing(internet) -> None:  # noqa: ANN001
    sess = _new_session(internet)
    tag = bytes.fromhex(sess["session_id"])
    hello = wire.Hello(tag, b"\x00" * 16).encode()
    script = (
        "import socket,sys\n"
        "s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM);s.settimeout(1.5)\n"
        f"s.sendto(bytes.fromhex(sys.argv[1]),('{SERVER_IP}',{PROBE_PORT}))\n"
        "try:\n print(len(s.recv(2048)))\nexcept socket.timeout:\n print('none')\n"
    )
    out = internet.clients["clean"].ns.run(["python3", "-c", script, hello.hex()]).stdout
    assert out.strip() == "none"
    assert _stats(internet)["bad_cookie"] >= 1


def test_spoofed_hello_costs_victim_one_small_packet(internet) -> None:  # noqa: ANN001
    """The attacker (clean client) holds a valid cookie and forges a HELLO from
    the victim's address (lossy client's ns, loss disabled by the ratio of a
    single packet being rare). The victim sees exactly one CHALLENGE, no probe."""
    victim = internet.clients["clean"]
    attacker = internet.clients["fragdrop"]
    sess = _new_session(internet, "fragdrop", {"repetitions": 5, "step": 8, "window": 64})
    tag = bytes.fromhex(sess["session_id"])
    hello = wire.Hello(tag, bytes.fromhex(sess["cookie"])).encode()
    sniff = victim.ns.popen(
        ["python3", "-c", SNIFFER, "4", SERVER_IP], stdout=subprocess.PIPE, start_new_session=True
    )
    time.sleep(0.5)
    attacker.ns.run(
        [
            "python3",
            "-c",
            RAW_SENDER,
            victim.address,
            SERVER_IP,
            "40000",
            str(PROBE_PORT),
            hello.hex(),
        ]
    )
    # A forged ECHO with a guessed token must not start probes either.
    echo = wire.Echo(tag, b"\x55" * 16).encode()
    attacker.ns.run(
        [
            "python3",
            "-c",
            RAW_SENDER,
            victim.address,
            SERVER_IP,
            "40000",
            str(PROBE_PORT),
            echo.hex(),
        ]
    )
    seen = json.loads(sniff.communicate(timeout=10)[0])
    challenge_ip_len = 20 + 8 + len(wire.Challenge(tag, b"\0" * 16).encode())
    assert seen == [challenge_ip_len], seen
    assert challenge_ip_len < 20 + 8 + len(hello)
    assert _stats(internet)["probes_sent"] == 0
    assert _stats(internet)["bad_echo"] >= 1


def test_session_flood_hits_address_and_prefix_limits(internet) -> None:  # noqa: ANN001
    ns = internet.clients["clean"].ns
    extra = [f"198.18.1.{i}" for i in range(10, 20)]
    for a in extra:
        ns.run(["ip", "addr", "add", f"{a}/24", "dev", "uplink"])
    statuses = [
        _http_json(
            internet,
            "clean",
            "/api/v1/sessions",
            "POST",
            {"plan": {"quick": True}},
            source=extra[0],
        )[0]
        for _ in range(3)
    ]
    assert statuses == [201, 201, 429]  # 2 concurrent sessions per address
    codes = []
    for a in extra[1:]:
        codes.append(
            _http_json(
                internet, "clean", "/api/v1/sessions", "POST", {"plan": {"quick": True}}, source=a
            )[0]
        )
    # 8 concurrent per /24, two of which extra[0] already holds.
    assert codes.count(201) == 6 and codes[6:] == [429, 429, 429], codes
    # Another /24 is unaffected.
    assert _new_session(internet, "lossy", {"quick": True})["session_id"]


def test_garbage_is_counted_and_ignored(internet) -> None:  # noqa: ANN001
    script = (
        "import socket,os\n"
        "s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
        "for i in range(300):\n"
        f" s.sendto(os.urandom(i % 90), ('{SERVER_IP}',{PROBE_PORT}))\n"
        f"s.sendto(b'KA'+bytes([1,1])+bytes(8)+bytes(52), ('{SERVER_IP}',{PROBE_PORT}))\n"
    )
    internet.clients["clean"].ns.run(["python3", "-c", script])
    time.sleep(0.5)
    c = _stats(internet)
    assert c["malformed"] + c["unknown_session"] >= 299  # os.urandom(0) etc. all rejected
    assert c["probes_sent"] == 0
    out = _run_json(internet, "clean", ["--quick"])  # still serving
    assert out["verdict"] == "fragments-ok"


def test_server_killed_mid_session(internet, database_url) -> None:  # noqa: ANN001
    proc = internet.popen_client(
        "clean", ["--json", *_plan(100, window=1)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    store = StudyStore(database_url)
    sid = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        rows = store.engine.connect().exec_driver_sql("select session_id, sent from sessions").all()
        if rows and rows[0][1] > 300:
            sid = rows[0][0]
            break
        time.sleep(0.2)
    assert sid, "the session never got going"
    internet.stop_server(signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err.decode()[-2000:]
    printed = json.loads(out)
    assert printed.get("incomplete") is True or printed.get("state") == "incomplete"
    assert "incomplete" in err.decode().lower()
    stored = (
        store.engine.connect()
        .exec_driver_sql(
            "select count(*) from probe_outcomes o join sessions s on s.id = o.session_pk "
            "where s.session_id = %(sid)s",
            {"sid": sid},
        )
        .scalar()
    )
    assert stored >= 300  # what was measured before the kill is kept
    internet.start_server()  # a restarted server marks the orphan incomplete
    res = store.session_results(sid)
    assert res["state"] == "incomplete" and res["verdict"] == "inconclusive"
    assert res["sent"] >= 300


def test_probe_rate_limit_per_address(database_url, tmp_path) -> None:  # noqa: ANN001
    env = {"KICKASS_POLICY_PPS_PER_ADDRESS": "300"}
    with probe_internet(database_url, kinds=("clean",), server_env=env, log_dir=tmp_path) as net:
        out = _run_json(net, "clean", _plan(1, step=8, window=64))
        store = StudyStore(database_url)
        with store.engine.connect() as conn:
            span = conn.exec_driver_sql(
                "select extract(epoch from max(sent_at) - min(sent_at)), count(*) "
                "from probe_outcomes o join sessions s on s.id = o.session_pk "
                "where s.session_id = %(sid)s",
                {"sid": out["session_id"]},
            ).one()
        seconds, count = float(span[0]), span[1]
        assert count == 366
        assert count / seconds <= 300 * 1.15, (count, seconds)


def test_unproven_session_expires(database_url, tmp_path) -> None:  # noqa: ANN001
    env = {"KICKASS_POLICY_HANDSHAKE_TIMEOUT_S": "1.5"}
    with probe_internet(database_url, kinds=("clean",), server_env=env, log_dir=tmp_path) as net:
        sess = _new_session(net)

        def ended() -> tuple[int, dict] | None:
            got = _http_json(net, "clean", f"/api/v1/sessions/{sess['session_id']}")
            return None if got[0] == 200 and got[1]["state"] == "created" else got

        # The handshake timeout (1.5 s) and the server's next timer.
        status, res = wait_until(ended, 10, "the session to leave created", step=0.25)
        assert status == 200 and res["state"] == "expired"
        assert res["verdict"] == "inconclusive"
