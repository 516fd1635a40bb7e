"""The runner's check of a receiver before a round (kickass_wan.trials.receivers),
each failure named.

- Against a stand-in agent on loopback: an agent older than the check (no
  token_version), a clock 90 s off and no Kick-Ass receiver are each named,
  and `kickass trials run` refuses to start, naming them; a wrong secret is
  named as such, and `agents add` registers nothing then.
- With real packets (namespaces): runner -- router -- receiver host, the
  last link at MTU 1400, a real kickass-agent and ka-agent-recv there. The
  check finds the path MTU below 1500 (its 1500-byte DF HANDSHAKE is not
  answered, the 92-byte one is); with the link at 1500 the receiver is ready;
  with its UDP port dropped by a firewall, the check says the port does not
  answer. `agents add`, `agents check` and `run` are the real commands.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from support.schedule import wait_until

KICKASS = str(Path(sys.executable).parent / "kickass")
SECRET = "cd" * 32


def _kickass(*args: str, stdin: str = "", env: dict[str, str] | None = None) -> Any:
    return subprocess.run(
        [KICKASS, "trials", *args], input=stdin, capture_output=True, text=True, timeout=120,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


class _OldAgent(BaseHTTPRequestHandler):
    """An agent from before the check, 90 s ahead, serving TCP flows only."""

    status = 200

    def do_GET(self) -> None:  # noqa: N802
        replies = {
            "/v1/environment": {"recorded_at": time.time() + 90.0},
            "/v1/version": {"agent": "0.0.9", "name": "old"},
            "/v1/health": {"status": "ok", "receivers": {"tcp": {"port": 1}, "kickass": None}},
        }
        body = json.dumps(replies.get(self.path, {})).encode()
        status = 401 if self.status == 401 and self.path == "/v1/environment" else 200
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def old_agent() -> Iterator[tuple[str, type[_OldAgent]]]:
    handler = type("Handler", (_OldAgent,), {})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def test_each_thing_a_round_needs_from_the_agent_is_named(
    old_agent: tuple[str, type[_OldAgent]], tmp_path: Path
) -> None:
    url, handler = old_agent
    registry = tmp_path / "agents"
    added = _kickass("agents", "add", "far-old", url, "--secret-file", "-",
                     "--agents-dir", str(registry), stdin=SECRET + "\n")  # fmt: skip
    assert added.returncode == 2, added.stderr
    err = added.stderr
    assert "far-old" in err and "NOT READY" in err, err
    assert "does not say which flow tokens it issues: it predates this runner" in err, err
    assert "its clock is +90." in err and "run NTP on both hosts" in err, err
    assert "no Kick-Ass receiver: the agent serves only TCP flows" in err, err
    assert not registry.exists() or not any(registry.iterdir())  # nothing registered

    # Registered anyway (the agent was away), the round refuses to start, naming it.
    added = _kickass("agents", "add", "far-old", url, "--secret-file", "-", "--no-check",
                     "--agents-dir", str(registry), stdin=SECRET)  # fmt: skip
    assert added.returncode == 0, added.stderr
    assert (registry / "far-old").stat().st_mode & 0o777 == 0o600
    assert (registry / "far-old").read_text() == SECRET + "\n"
    run = _kickass("run", "--agent", "far-old", "--agents-dir", str(registry), "--pairs", "1",
                   "--period", "1", "--spool-dir", str(tmp_path / "spool"))  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert "ERROR: not ready for a round: agent far-old: " in run.stderr, run.stderr
    assert "no Kick-Ass receiver" in run.stderr and not (tmp_path / "spool").exists()
    listed = _kickass("agents", "list", "--agents-dir", str(registry))
    assert listed.stdout.split() == ["far-old", url], listed

    handler.status = 401
    checked = _kickass("agents", "check", "--agents-dir", str(registry), "--json")
    assert checked.returncode == 1, checked.stderr
    (agent,) = json.loads(checked.stdout)["agents"]
    assert agent["ok"] is False and len(agent["problems"]) == 1, agent
    assert "the runner's secret for far-old is not the agent's" in agent["problems"][0], agent


def test_an_unregistered_agent_is_a_clear_error(tmp_path: Path) -> None:
    run = _kickass("run", "--agent", "nowhere", "--agents-dir", str(tmp_path))
    assert run.returncode == 2
    assert f"ERROR: agent 'nowhere' is not registered in {tmp_path}" in run.stderr, run.stderr
    empty = _kickass("agents", "add", "far-1", "http://127.0.0.1:9", "--secret-file", "-",
                     "--agents-dir", str(tmp_path), stdin="\n")  # fmt: skip
    assert empty.returncode == 2 and "no agent secret on standard input" in empty.stderr


@pytest.mark.netns
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces")
def test_the_check_finds_a_small_path_mtu_and_a_closed_port_with_real_packets(
    tmp_path: Path,
) -> None:
    from kickass_testbed.binaries import rust_binary
    from kickass_testbed.topology import End, Host, Link, Process, Route, Topology, build

    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET)
    spec = Topology(
        name="rchk",
        hosts=(Host("run"), Host("mid", router=True), Host("far")),
        links=(
            Link(End("run", "eth0", ("10.77.1.2/24",)), End("mid", "a", ("10.77.1.1/24",))),
            # A hop with a smaller MTU than Kick-Ass datagrams need.
            Link(
                End("mid", "b", ("10.77.2.1/24",)), End("far", "eth0", ("10.77.2.2/24",)), mtu=1400
            ),  # fmt: skip
        ),
        routes=(Route("run", "default", via="10.77.1.1"), Route("far", "default", via="10.77.2.1")),
        processes=(
            Process(
                name="agent",
                host="far",
                argv=(
                    str(Path(sys.executable).parent / "kickass-agent"),
                    "--name",
                    "far-1",
                    "--listen",
                    "10.77.2.2:8700",
                    "--tcp-port",
                    "8701",
                    "--kickass-port",
                    "8702",
                    "--kickass-receiver",
                    str(rust_binary("ka-agent-recv")),
                    "--secret-file",
                    str(secret_file),
                    "--state-dir",
                    str(tmp_path / "state"),
                ),
                ready_text="ready on",
            ),  # fmt: skip
        ),
    )
    registry = tmp_path / "agents"
    with build(spec) as built:
        run = built["run"]

        def trials(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
            return run.run([KICKASS, "trials", *args], input=stdin, check=False, timeout=120)

        added = trials("agents", "add", "far-1", "http://10.77.2.2:8700", "--secret-file", "-",
                       "--agents-dir", str(registry), stdin=SECRET)  # fmt: skip
        assert added.returncode == 2, added.stderr
        assert (
            "1500-byte datagrams with DF set do not reach its Kick-Ass receiver, 92-byte ones do"
            in added.stderr
        ), added.stderr
        assert "(the kernel's path MTU: 1400)" in added.stderr, added.stderr

        # The hop at 1500 (and the MTU the runner's kernel learned forgotten): ready.
        built["mid"].ip("link set dev b mtu 1500")
        built["far"].ip("link set dev eth0 mtu 1500")
        run.ip("route flush cache")
        added = trials("agents", "add", "far-1", "http://10.77.2.2:8700", "--secret-file", "-",
                       "--agents-dir", str(registry), stdin=SECRET)  # fmt: skip
        assert added.returncode == 0, added.stderr
        assert "far-1            ok  agent 0.1.0, ka-agent-recv 0.1.0, clock offset" in (
            added.stderr
        ), added.stderr
        assert "path MTU >= 1500" in added.stderr

        # A firewall drops the Kick-Ass port: the control API still answers.
        built["far"].nft(
            "table inet rchk {\n chain input {\n  type filter hook input priority 0;\n"
            "  udp dport 8702 drop\n }\n}\n"
        )
        checked = trials("agents", "check", "--agents-dir", str(registry))
        assert checked.returncode == 1, checked.stdout + checked.stderr
        assert "its Kick-Ass receiver does not answer on 10.77.2.2:8702/udp" in checked.stdout, (
            checked.stdout
        )


def test_a_receiver_that_does_not_come_up_is_named_with_its_error(tmp_path: Path) -> None:
    """A real kickass-agent whose receiver exits at once, saying why (as
    ka-agent-recv does without CAP_NET_RAW): /v1/health shows it down with
    that error, and the check names it; a TCP-only round does not need it."""
    receiver = tmp_path / "ka-agent-recv"
    receiver.write_text(
        "#!/bin/sh\n[ \"$1\" = --version ] && { echo 'ka-agent-recv 0.1.0'; exit 0; }\n"
        "echo 'ka-agent-recv: error: cannot open the AF_PACKET socket: Operation not "
        "permitted' >&2\nexit 1\n"
    )
    receiver.chmod(0o755)
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "kickass-agent"), "--listen", "127.0.0.1:0",
         "--tcp-port", "0", "--kickass-port", "9", "--kickass-receiver", str(receiver),
         "--state-dir", str(tmp_path / "state"), "--name", "far-1"],
        env={**os.environ, "KICKASS_AGENT_SECRET": SECRET}, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        port = next(int(ln.rsplit(" ", 1)[1]) for ln in proc.stderr if "ready on" in ln)
        threading.Thread(target=proc.stderr.read, daemon=True).start()
        from kickass_wan.trials.receivers import AgentCheck, check_agent
        from kickass_wan.trials.runner import AgentRef

        ref = AgentRef("far-1", f"http://127.0.0.1:{port}", SECRET)

        def failed() -> AgentCheck | None:
            check = check_agent(ref)
            return check if any("AF_PACKET" in p for p in check.problems) else None

        check = wait_until(failed, 10, "the receiver to start and fail")
        assert len(check.problems) == 1, check.problems
        assert check.problems[0].startswith(
            "its Kick-Ass receiver is not up (cannot open the AF_PACKET socket: Operation not "
            "permitted; "
        ), check.problems
        assert check_agent(ref, kickass=False).ok  # TCP flows only: the receiver is not needed
    finally:
        proc.terminate()
        proc.wait(10)
