"""The one topology builder (kickass_testbed.topology) does what a spec says,
with real packets, and leaves nothing behind.

    a (198.18.61.2) ──┐
    b (198.18.62.2) ──┼── r (router; nft: a -> c udp/9999 dropped)
    c (198.18.63.2) ──┘   c routes only to a's subnet (no default route)

c runs a UDP echo server on ports 9998 and 9999 (a spec Process).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from kickass_core.errors import KickassError
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

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces"),
]

A, B, C = "198.18.61.2", "198.18.62.2", "198.18.63.2"
ECHO_PORT, DROPPED_PORT = 9998, 9999

ECHO = r"""
import selectors, socket
sel = selectors.DefaultSelector()
for port in (9998, 9999):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", port))
    sel.register(s, selectors.EVENT_READ)
print("echo ready", flush=True)
while True:
    for key, _ in sel.select():
        data, peer = key.fileobj.recvfrom(2048)
        key.fileobj.sendto(data, peer)
"""


def spec(processes: tuple[Process, ...] | None = None) -> Topology:
    echo = Process("echo", "c", (sys.executable, "-c", ECHO), ready_text="echo ready")
    return Topology(
        name="kt",
        hosts=(Host("a"), Host("b"), Host("c"), Host("r", router=True)),
        links=(
            # r's end first: an interface named like an `ip` keyword ("a" is
            # "address") must still work on either side of a pair.
            Link(End("r", "a", ("198.18.61.1/24",)), End("a", "e0", (f"{A}/24",))),
            Link(End("b", "e0", (f"{B}/24",)), End("r", "b", ("198.18.62.1/24",)), mtu=1400),
            Link(End("c", "e0", (f"{C}/24",)), End("r", "c", ("198.18.63.1/24",))),
        ),
        routes=(
            Route("a", "default", via="198.18.61.1"),
            Route("b", "default", via="198.18.62.1"),
            Route("c", "198.18.61.0/24", via="198.18.63.1"),
        ),
        nft=(NftRule("r", f"ip saddr {A} ip daddr {C} udp dport {DROPPED_PORT} counter drop"),),
        processes=(echo,) if processes is None else processes,
    )


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _root_links() -> set[str]:
    out = subprocess.run(["ip", "-j", "link"], capture_output=True, text=True).stdout
    return {link["ifname"] for link in json.loads(out)}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _ping(net: Built, host: str, dst: str) -> subprocess.CompletedProcess[str]:
    return net[host].run(["ping", "-c", "1", "-W", "1", dst], check=False)


def _udp_echo(net: Built, host: str, dst: str, port: int) -> bytes | None:
    """One datagram from ``host`` to ``dst:port``; the echo, or None after 1 s."""
    with net.in_netns(host):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with s:
        s.settimeout(1.0)
        s.sendto(b"hello %d" % port, (dst, port))
        try:
            return s.recv(2048)
        except TimeoutError:
            return None


def _check_paths(net: Built) -> None:
    assert _ping(net, "a", B).returncode == 0, "a reaches b through the router"
    assert _ping(net, "a", C).returncode == 0, "c's one route leads back to a"
    # c has no route to b's subnet: it cannot even send.
    to_b = _ping(net, "c", B)
    assert to_b.returncode != 0 and "unreachable" in to_b.stderr.lower(), to_b
    assert _udp_echo(net, "a", C, ECHO_PORT) == b"hello 9998"
    assert _udp_echo(net, "a", C, DROPPED_PORT) is None, "the nft rule drops a -> c:9999"


def test_routes_rule_and_settings_do_what_the_spec_says() -> None:
    with build(spec()) as net:
        _check_paths(net)
        # The rule dropped the one datagram to 9999, not the pings nor 9998.
        rules = net["r"].run(["nft", "list", "ruleset"]).stdout
        assert f"udp dport {DROPPED_PORT} counter packets 1 " in rules, rules
        for host, dev in (("b", "e0"), ("r", "b")):
            link = json.loads(net[host].run(["ip", "-j", "link", "show", dev]).stdout)[0]
            assert link["mtu"] == 1400
        fwd = net["r"].run(["sysctl", "-n", "net.ipv4.ip_forward"]).stdout.strip()
        assert fwd == "1"
        assert net["a"].run(["sysctl", "-n", "net.ipv4.ip_forward"]).stdout.strip() == "0"
        gro = net["r"].run(["ethtool", "-k", "a"]).stdout
        assert "generic-receive-offload: off" in gro


def test_teardown_removes_everything_when_the_body_raises() -> None:
    before_ns, before_links = _netns(), _root_links()
    pids: list[int] = []
    names: set[str] = set()
    stray: subprocess.Popen[bytes] | None = None
    with pytest.raises(RuntimeError, match="boom"), build(spec()) as net:
        names = {net.ns_name(h.name) for h in net.spec.hosts}
        assert names <= _netns()
        pids.append(net.procs["echo"].pid)
        pids.append(net["a"].popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid)
        # Started behind the builder's back: killed when its namespace goes.
        stray = subprocess.Popen(
            ["ip", "netns", "exec", net.ns_name("b"), sys.executable, "-c", "input()"],
            stdin=subprocess.PIPE,
            start_new_session=True,
        )
        pids.append(stray.pid)
        # veths are made inside their namespaces: none ever shows in the root one.
        assert _root_links() == before_links
        raise RuntimeError("boom")
    assert stray is not None
    stray.wait(5)  # reap it (it is our child): a zombie is not a leak
    assert not names & _netns()
    assert _netns() == before_ns
    assert _root_links() == before_links
    assert [p for p in pids if _alive(p)] == []


def test_a_failing_build_leaves_nothing() -> None:
    before = _netns()
    echo = spec().processes[0]
    # No readiness text: it must merely survive its first half second.
    argv = (sys.executable, "-c", "print('bad flag'); raise SystemExit(3)")
    dies = Process("dies", "c", argv, settle=0.5)
    with (
        pytest.raises(KickassError, match=r"dies exited \(3\)[\s\S]*bad flag"),
        build(spec(processes=(echo, dies))),
    ):
        pass
    assert _netns() == before


def test_bad_specs_are_refused_before_anything_is_built() -> None:
    before = _netns()
    bad = Topology(
        name="kt",
        hosts=(Host("a"),),
        links=(Link(End("a", "an-interface-name-too-long"), End("nowhere", "e0")),),
    )
    with (
        pytest.raises(KickassError, match="at most 15 characters[\\s\\S]*unknown host"),
        build(bad),
    ):
        pass
    assert _netns() == before


CHILD = """
import json, sys
from kickass_testbed.edge import edge_path
from kickass_testbed.topology import Process, build
sleeper = Process("sleeper", "rcv", (sys.executable, "-c", "import time; time.sleep(600)"))
with build(edge_path(processes=(sleeper,))) as net:
    names = [net.ns_name(h.name) for h in net.spec.hosts]
    print(json.dumps({"names": names, "pid": net.procs["sleeper"].pid}), flush=True)
    sys.stdin.read()
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_tears_the_topology_down(sig: signal.Signals) -> None:
    before = _netns()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line, child.communicate(timeout=30)[1]
    built = json.loads(line)
    assert set(built["names"]) <= _netns()
    child.send_signal(sig)
    _, err = child.communicate(timeout=60)
    assert "KeyboardInterrupt" in err, err
    assert _netns() == before
    assert not _alive(built["pid"])


def test_two_builds_of_one_spec_in_parallel_do_not_collide() -> None:
    before = _netns()
    barrier = threading.Barrier(2, timeout=60)
    seen: dict[int, set[str]] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            with build(spec()) as net:
                seen[i] = {net.ns_name(h.name) for h in net.spec.hosts}
                barrier.wait()  # both exist at once from here
                _check_paths(net)
                barrier.wait()
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(seen) == 2 and not seen[0] & seen[1]
    assert _netns() == before
