"""No secret on the wire (issue 16): a real trial round on loopback, runner to
agent and runner to server, captured with tcpdump. The capture holds the
requests the round makes and none of the agent secret, the runner token, the
token's secret part alone, or the signing keys derived from them, raw, hex or
base64; the same search finds a secret planted in each of those forms (the
positive control); and a captured signed request, replayed byte for byte
within its time window, is refused: an upload by the server, a token request
by the agent, also by the agent restarted on the same state directory."""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
from kickass_core import signing
from kickass_db.trial_store import TrialStore
from scapy.layers.inet import IP, TCP
from scapy.utils import rdpcap
from support.live_server import free_port, server
from support.pcap_truth import wait_listening
from test_wan_agent import SECRET, agent, start_agent

KICKASS = str(Path(sys.executable).parent / "kickass")

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the server's probe engine and tcpdump need root"),
    pytest.mark.skipif(not shutil.which("tcpdump"), reason="needs tcpdump"),
]


def _forms(secret: str | bytes) -> list[bytes]:
    raw = secret.encode() if isinstance(secret, str) else secret
    return [
        raw,
        raw.hex().encode(),
        raw.hex().upper().encode(),
        base64.b64encode(raw),
        base64.urlsafe_b64encode(raw),
        base64.b64encode(raw).rstrip(b"="),
    ]


def _streams(pcap: Path, port: int) -> list[bytes]:
    """The client-to-server bytes of every TCP connection to ``port``, in order."""
    chunks: dict[tuple[int, int], dict[int, bytes]] = defaultdict(dict)
    for pkt in rdpcap(str(pcap)):
        if IP in pkt and TCP in pkt and pkt[TCP].dport == port and bytes(pkt[TCP].payload):
            chunks[(pkt[TCP].sport, pkt[TCP].dport)][pkt[TCP].seq] = bytes(pkt[TCP].payload)
    return [b"".join(v for _, v in sorted(c.items())) for c in chunks.values()]


def _request_lines(streams: list[bytes]) -> list[str]:
    return sorted(s.split(b"\r\n", 1)[0].decode("latin-1") for s in streams if s)


def _replay(port: int, request: bytes) -> bytes:
    """Send captured request bytes again on a new connection; the whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(request)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return answer


def _refused_as_replay(answer: bytes) -> None:
    status = answer.split(b"\r\n", 1)[0]
    assert b" 401 " in status, answer[:300]
    assert b"replayed" in answer, answer[-300:]


def test_a_trial_round_sends_no_secret_and_a_replay_is_refused(
    database_url: str, tmp_path: Path
) -> None:
    store = TrialStore(database_url)
    token = store.add_runner("wire-1")
    store.close()
    token_file = tmp_path / "runner-token"
    token_file.write_text(token)
    http = free_port(socket.SOCK_STREAM)
    pcap = tmp_path / "wire.pcap"
    planted = "PLANTED-" + os.urandom(12).hex()
    with (
        agent(tmp_path / "agent") as (agent_port, _),
        server(database_url, free_port(socket.SOCK_DGRAM), http),
    ):
        dump = subprocess.Popen(
            # --immediate-mode: each packet is handed over at once (libpcap
            # otherwise waits for a block to fill or time out).
            ["tcpdump", "-i", "lo", "-U", "--immediate-mode", "-s", "0", "-w", str(pcap),
             f"tcp port {agent_port} or tcp port {http}"],
            stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            wait_listening(dump)
            run = subprocess.run(
                [KICKASS, "trials", "run", "--agent", f"far-1=http://127.0.0.1:{agent_port}",
                 "--protocols", "tcp", "--pairs", "1", "--period", "1.5", "--mean-gap", "0.2",
                 "--max-packets", "50", "--mean-packets", "10", "--seed", "3",
                 "--server", f"http://127.0.0.1:{http}", "--runner-token-file", str(token_file),
                 "--spool-dir", str(tmp_path / "spool"), "--json"],
                env={**os.environ, "KICKASS_AGENT_SECRET": SECRET},
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert run.returncode == 0, run.stderr
            result = json.loads(run.stdout)
            # The positive control: a secret sent the way none of ours is,
            # in each form searched for below.
            planted_forms = b" ".join(_forms(planted))
            with socket.create_connection(("127.0.0.1", http), timeout=5) as s:
                s.sendall(
                    f"GET /api/v1/health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {planted}"
                    "\r\nConnection: close\r\nX-Planted: ".encode()
                    + planted_forms
                    + b"\r\n\r\n"
                )
                s.recv(4096)
            # The control's request is the last packet of interest: wait until
            # it is on disk before stopping the capture.
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline and planted.encode() not in pcap.read_bytes():
                time.sleep(0.1)
        finally:
            dump.terminate()
            dump.wait(10)
        capture = pcap.read_bytes()
        for form in _forms(planted):
            assert form in capture, f"the search cannot see {form[:12]!r}..."
        secret_part = token.rpartition(".")[2]
        assert len(secret_part) >= 32  # token_urlsafe(32): the part a runner must keep
        for name, secret in (
            ("agent secret", SECRET),
            ("runner token", token),
            ("runner token's secret part", secret_part),
            ("agent's signing key", signing.key_from_secret(SECRET)),
            ("runner's signing key", signing.key_from_secret(token)),
        ):
            for form in _forms(secret):
                assert form not in capture, f"the {name} is on the wire ({form[:12]!r}...)"
        # The requests of the round, and only those (the check before it: the
        # agent's health, version and environment; the round's own health and
        # environment; one period of TCP flows under 100: one token request,
        # one batch of flows; the trial twice, at its start and with its end).
        flows = len(result["summary"]["far-1"]["tcp:cubic"]) + result["failed_flows"]
        assert 0 < flows < 100, result
        to_agent = _request_lines(_streams(pcap, agent_port))
        to_server = _request_lines(_streams(pcap, http))
        assert to_agent == [
            "GET /v1/environment HTTP/1.1",  # signed too: a host's settings are not public
            "GET /v1/environment HTTP/1.1",
            "GET /v1/health HTTP/1.1",
            "GET /v1/health HTTP/1.1",
            "GET /v1/version HTTP/1.1",
            "POST /v1/tokens HTTP/1.1",
        ], to_agent
        tid = result["trials"]["far-1"]
        assert [ln for ln in to_server if "/trials/" in ln] == [
            f"POST /api/v1/trials/{tid}/flows HTTP/1.1",
            f"PUT /api/v1/trials/{tid} HTTP/1.1",
            f"PUT /api/v1/trials/{tid} HTTP/1.1",
        ], to_server
        # A captured upload, replayed byte for byte within its window: refused.
        (upload,) = [s for s in _streams(pcap, http) if b"/flows HTTP/1.1" in s.split(b"\r\n")[0]]
        _refused_as_replay(_replay(http, upload))
        # The same for the round's token request to the agent, which would
        # otherwise mint flow tokens for whoever captured it.
        (minting,) = [
            s for s in _streams(pcap, agent_port) if s.startswith(b"POST /v1/tokens HTTP/1.1")
        ]
        _refused_as_replay(_replay(agent_port, minting))
    # And by the agent restarted on the same state directory, still within
    # the request's window (the round took seconds; the window is 120 s).
    port, proc = start_agent(tmp_path / "agent")
    try:
        _refused_as_replay(_replay(port, minting))
    finally:
        proc.terminate()
        proc.wait(10)
