"""The real `kickass-probe` against a scripted server on 127.0.0.1.

The peer below speaks the real UDP wire format (kickass_core.wire) and the
HTTP contract of the measurement server, and can misbehave on purpose:
duplicate, reorder or drop probes, inject another session's probes, never
challenge, vanish mid-session, rate-limit, answer HTML. It does not use the
server package: these tests pin the client to the contract, not to one
implementation of it.
"""

from __future__ import annotations

import io
import json
import os
import resource
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from kickass_core import wire
from kickass_core.plan import ProbePlan
from kickass_core.verdict import decide, drop_rate
from kickass_probe import cli, runner
from kickass_probe.api import ApiClient
from kickass_probe.errors import ProbeError
from kickass_probe.session import MAX_PLAN_PROBES

pytestmark = pytest.mark.timeout(60)

ACK_WAIT_S = 0.3


class _QuietHTTPServer(ThreadingHTTPServer):
    errors: list[str]

    def handle_error(self, request: Any, client_address: Any) -> None:
        self.errors.append(f"{client_address}: {sys.exc_info()[1]!r}")


class ScriptedServer:
    """A measurement server in miniature: HTTP API + UDP probe engine."""

    def __init__(
        self,
        *,
        plan: ProbePlan | None = None,
        challenge: bool = True,
        duplicate: frozenset[int] = frozenset(),
        drop: frozenset[int] = frozenset(),
        reorder: bool = False,
        foreign: bool = False,
        probe_gap: float = 0.0,
        vanish_after: int | None = None,
        stop_after: int | None = None,
        stop_state: str | None = None,
        create_replies: list[tuple[int, dict[str, str], bytes]] | None = None,
        http_delay: float = 0.0,
    ) -> None:
        self.plan = plan or ProbePlan.build(repetitions=3, step=256, window=4)
        self.challenge = challenge
        self.duplicate = duplicate
        self.drop = drop
        self.reorder = reorder
        self.foreign = foreign
        self.probe_gap = probe_gap
        self.vanish_after = vanish_after
        self.stop_after = stop_after
        self.stop_state = stop_state
        self.create_replies = list(create_replies or [])
        self.http_delay = http_delay

        self.sid = secrets.token_hex(8)
        self.cookie = secrets.token_hex(16)
        self.tag = bytes.fromhex(self.sid)
        self.state = "created"
        self.end_reason: str | None = None
        self.sent: list[int] = []  # seqs counted as sent (dropped ones too)
        self.acks: list[wire.Ack] = []  # every ACK, duplicates included
        self.hellos = 0
        self.echoes = 0
        self.requests: list[tuple[str, str]] = []
        self.end_cookies: list[str | None] = []
        # X-Kickass-Cookie of every GET of the session (the client's polls).
        self.poll_cookies: list[str | None] = []
        self.create_bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self._stop = threading.Event()

        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.udp.settimeout(0.05)
        self._closing = threading.Event()
        # Errors of request threads (a client that left before its answer),
        # kept here: printed, a traceback parses source (3.11's carets), and
        # on 3.11.7 that races with another thread's ast.parse (the SystemError of gh-106905).
        self.http_errors: list[str] = []
        self.httpd = _QuietHTTPServer(("127.0.0.1", 0), self._handler_class())
        self.httpd.errors = self.http_errors
        # Request threads are joined when the server closes (a delayed
        # answer is cut short by then): none outlives its test.
        self.httpd.daemon_threads = False
        self._http_thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._udp_thread = threading.Thread(target=self._udp_main, daemon=True)
        self._http_closed = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def start(self) -> ScriptedServer:
        self._http_thread.start()
        self._udp_thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._closing.set()
        self._close_http()
        self._udp_thread.join(timeout=5)
        self.udp.close()

    def _close_http(self) -> None:
        with self.lock:
            if self._http_closed:
                return
            self._http_closed = True
        self._closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- the session as the API shows it ----------------------------------------------

    def acked_seqs(self) -> set[int]:
        with self.lock:
            return {a.seq for a in self.acks}

    def result(self) -> dict[str, Any]:
        acked = self.acked_seqs()
        with self.lock:
            sent = list(self.sent)
        rows: dict[str, dict[int, list[int]]] = {"whole": {}, "split": {}}
        for phase in ("whole", "split"):
            for size in self.plan.sizes(phase):
                rows[phase][size] = [0, 0]
        for seq in sent:
            p = self.plan.probe(seq)
            rows[p.phase][p.ip_len][0] += 1
            rows[p.phase][p.ip_len][1] += seq in acked
        whole: list[dict[str, Any]] = [
            {"ip_len": k, "sent": s, "acked": a, "late": 0, "drop_rate": drop_rate(s, a)}
            for k, (s, a) in rows["whole"].items()
        ]
        split: list[dict[str, Any]] = [
            {
                "leading_ip_len": k,
                "sent": s,
                "acked": a,
                "late": 0,
                "drop_rate": drop_rate(s, a),
                "frag_observed": 0,
                "arrived_as_sent": 0,
            }
            for k, (s, a) in rows["split"].items()
        ]
        ws, wa = sum(r["sent"] for r in whole), sum(r["acked"] for r in whole)
        ss, sa = sum(r["sent"] for r in split), sum(r["acked"] for r in split)
        v = decide(ws, wa, ss, sa) if self.state not in ("created", "probing") else None
        return {
            "session_id": self.sid,
            "state": self.state,
            "verdict": v.verdict if v else None,
            "verdict_reason": v.reason if v else None,
            "end_reason": self.end_reason,
            "sent": len(sent),
            "acked": len(acked),
            "total_probes": self.plan.total_probes,
            "plan": self.plan.to_json(),
            "whole": whole,
            "split": split,
            "client_version": "0.1.0",
            "server_version": "scripted",
        }

    # -- HTTP -------------------------------------------------------------------------

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        peer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _reply(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
                raw = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                ctype = "application/json" if not isinstance(body, bytes) else "text/html"
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(raw)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self) -> None:
                peer.requests.append(("GET", self.path))
                peer._closing.wait(peer.http_delay)
                if self.path == f"/api/v1/sessions/{peer.sid}":
                    peer.poll_cookies.append(self.headers.get("X-Kickass-Cookie"))
                    self._reply(200, peer.result())
                elif self.path == "/api/v1/health":
                    self._reply(200, {"status": "ok", "server_version": "scripted"})
                else:
                    self._reply(404, {"error": "not-found", "message": "no such thing"})

            def do_POST(self) -> None:
                peer.requests.append(("POST", self.path))
                peer._closing.wait(peer.http_delay)
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                if self.path == "/api/v1/sessions":
                    peer.create_bodies.append(body)
                    if peer.create_replies:
                        status, headers, raw = peer.create_replies.pop(0)
                        self._reply(status, raw, headers)
                        return
                    self._reply(
                        201,
                        {
                            "session_id": peer.sid,
                            "cookie": peer.cookie,
                            "probe_host": None,
                            "probe_port": peer.udp.getsockname()[1],
                            "plan": peer.plan.to_json(),
                            "total_probes": peer.plan.total_probes,
                            "expires_in_s": 600,
                        },
                    )
                elif self.path == f"/api/v1/sessions/{peer.sid}/end":
                    cookie = self.headers.get("X-Kickass-Cookie")
                    peer.end_cookies.append(cookie)
                    if cookie != peer.cookie:
                        self._reply(403, {"error": "bad-cookie", "message": "wrong cookie"})
                        return
                    if peer.state in ("created", "probing"):
                        peer.state = "ended"
                        peer.end_reason = "client"
                    peer._stop.set()
                    self._reply(200, peer.result())
                else:
                    self._reply(404, {"error": "not-found", "message": "no such thing"})

        return Handler

    # -- UDP --------------------------------------------------------------------------

    def _recv(self) -> tuple[bytes, tuple[str, int]] | None:
        try:
            return self.udp.recvfrom(4096)
        except (TimeoutError, OSError):
            return None

    def _handle(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            msg = wire.decode(data)
        except wire.WireError:
            return
        if isinstance(msg, wire.Hello) and msg.session_tag == self.tag:
            with self.lock:
                self.hellos += 1
            if self.challenge and msg.cookie == bytes.fromhex(self.cookie):
                self.client = addr
                self.token = secrets.token_bytes(wire.CHALLENGE_LEN)
                self.udp.sendto(wire.Challenge(self.tag, self.token).encode(), addr)
        elif isinstance(msg, wire.Echo) and msg.session_tag == self.tag:
            if getattr(self, "token", None) == msg.token and addr == self.client:
                with self.lock:
                    self.echoes += 1
        elif isinstance(msg, wire.Ack):
            assert msg.session_tag == self.tag, "client acknowledged a foreign probe"
            with self.lock:
                self.acks.append(msg)

    def _pump(self, seconds: float, until: Any = None) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and not self._stop.is_set():
            if until is not None and until():
                return
            got = self._recv()
            if got:
                self._handle(*got)

    def _udp_main(self) -> None:
        while not self._stop.is_set() and self.echoes == 0:
            got = self._recv()
            if got:
                self._handle(*got)
        if self._stop.is_set():
            return
        self.state = "probing"
        plan = self.plan
        seqs = list(range(plan.total_probes))
        for i in range(0, len(seqs), plan.window):
            if self._stop.is_set():
                return
            batch = seqs[i : i + plan.window]
            if self.foreign:
                other = wire.probe_payload(b"\xee" * 8, batch[0], 100)
                self.udp.sendto(other, self.client)
            for seq in reversed(batch) if self.reorder else batch:
                with self.lock:
                    self.sent.append(seq)
                if seq in self.drop:
                    continue
                payload = wire.probe_payload(self.tag, seq, plan.probe(seq).udp_payload_len)
                self.udp.sendto(payload, self.client)
                if seq in self.duplicate:
                    self.udp.sendto(payload, self.client)
            want = {s for s in batch if s not in self.drop}
            self._pump(ACK_WAIT_S, until=lambda w=want: w <= self.acked_seqs())
            if self.vanish_after is not None and len(self.sent) >= self.vanish_after:
                self._close_http()
                self._stop.set()
                return
            if self.stop_after is not None and len(self.sent) >= self.stop_after:
                # Stop probing but keep answering HTTP (and, if asked, end
                # the session the way a server-side timeout would).
                if self.stop_state:
                    self.state = self.stop_state
                    self.end_reason = "server-side"
                self._pump(3600)
                return
            if self.probe_gap:
                self._pump(self.probe_gap)
        if self._stop.is_set():
            return
        self._pump(0.05)  # trailing ACKs
        self.udp.sendto(wire.Done(self.tag).encode(), self.client)
        self.state = "complete"
        self.end_reason = "plan-finished"
        self._pump(0.2)


@pytest.fixture
def make_peer() -> Iterator[Any]:
    peers: list[ScriptedServer] = []

    def make(**kw: Any) -> ScriptedServer:
        peer = ScriptedServer(**kw).start()
        peers.append(peer)
        return peer

    yield make
    for p in peers:
        p.close()


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- happy path and protocol quirks -------------------------------------------------------


def test_happy_path_json(make_peer: Any, capsys: pytest.CaptureFixture[str]) -> None:
    peer = make_peer()
    code, out, err = run_cli(capsys, "--server", peer.url, "--yes", "--json", "--timeout", "2")
    assert code == 0, err
    doc = json.loads(out)  # exactly one JSON object
    assert out.count("\n") == 1
    assert doc["session_id"] == peer.sid
    assert doc["state"] == "complete" and doc["incomplete"] is False
    assert doc["verdict"] in ("fragments-ok", "inconclusive", "fragment-intolerant")
    assert {r["ip_len"] for r in doc["whole"]} == set(peer.plan.whole)
    assert {r["leading_ip_len"] for r in doc["split"]} == set(peer.plan.split)
    for row in doc["whole"]:
        assert {"ip_len", "sent", "acked", "drop_rate"} <= row.keys()
    for row in doc["split"]:
        assert {"leading_ip_len", "sent", "acked", "drop_rate"} <= row.keys()
    assert doc["pooled"]["whole"]["drop_rate"] == 0.0
    assert doc["local"]["received"] == peer.plan.total_probes
    assert doc["local"]["done_received"] is True
    assert doc["server"] == peer.url
    # What was sent to the server is exactly what the notice announced.
    (body,) = peer.create_bodies
    assert set(body) == {"plan", "client_version", "platform", "install_id", "reassembly"}
    assert body["install_id"] is None
    # The reassembly memory (announced in the notice): limits, counters, credit.
    assert set(body["reassembly"]) == {"limits", "before", "split_credit", "credit_mode"}
    assert body["reassembly"]["credit_mode"] == "in-flight"  # a protocol mode, not data
    assert "reassembly limits and counters" in err
    # By default the server adapts the window (issue 11 part 4).
    assert body["plan"] == {"repetitions": 100, "step": 8, "window": "auto"}
    # ACKs carry the received length of each probe.
    for ack in peer.acks:
        assert ack.received_len == peer.plan.probe(ack.seq).udp_payload_len
    assert "what is collected" not in out and "public IP address" in err


def test_happy_path_summary(make_peer: Any, capsys: pytest.CaptureFixture[str]) -> None:
    peer = make_peer(drop=frozenset({0, 5}))
    code, out, err = run_cli(capsys, "--server", peer.url, "-y", "--quick", "--timeout", "2")
    assert code == 0, err
    assert peer.create_bodies[0]["plan"] == {"quick": True}
    assert "Verdict:" in out
    assert "whole packets" in out and "split datagrams" in out
    assert f"Session {peer.sid} (complete)" in out
    assert f"{peer.url}/api/v1/sessions/{peer.sid}" in out
    # Seqs 0 and 5 are whole probes the peer never sent: 2 lost.
    n_whole = peer.plan.repetitions * len(peer.plan.whole)
    whole_line = next(line for line in out.splitlines() if "whole packets " in line)
    assert whole_line.split()[2:4] == [f"{n_whole:,}", f"{n_whole - 2:,}"]


def test_polls_carry_the_session_cookie(
    make_peer: Any, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    # The server counts a GET as the client's sign of life only with the
    # cookie; the client sends it the way it authenticates /end.
    monkeypatch.setattr(runner, "POLL_INTERVAL_S", 0.1)
    plan = ProbePlan.build(repetitions=10, step=256, window=2)
    peer = make_peer(plan=plan, probe_gap=0.01)
    code, out, err = run_cli(capsys, "--server", peer.url, "-y", "--json", "--timeout", "2")
    assert code == 0, err
    assert len(peer.poll_cookies) >= 2
    assert peer.poll_cookies == [peer.cookie] * len(peer.poll_cookies)


def test_duplicates_and_reordering_all_acked(
    make_peer: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    dups = frozenset({1, 2, 9})
    peer = make_peer(duplicate=dups, reorder=True)
    code, out, err = run_cli(capsys, "--server", peer.url, "-y", "--json", "--timeout", "2")
    assert code == 0, err
    doc = json.loads(out)
    # Every copy is acknowledged: the server counts duplicates.
    assert len(peer.acks) == peer.plan.total_probes + len(dups)
    assert doc["local"]["duplicates"] == len(dups)
    assert doc["local"]["reordered"] > 0
    assert doc["local"]["received"] == peer.plan.total_probes
    assert doc["local"]["corrupted"] == 0


def test_foreign_session_probes_ignored(make_peer: Any, capsys: pytest.CaptureFixture[str]) -> None:
    peer = make_peer(foreign=True)
    code, out, err = run_cli(capsys, "--server", peer.url, "-y", "--json", "--timeout", "2")
    assert code == 0, err
    doc = json.loads(out)
    # The peer asserts on any ACK with a foreign tag; none may exist.
    assert all(a.session_tag == peer.tag for a in peer.acks)
    assert doc["local"]["foreign"] >= 1
    assert len(peer.acks) == peer.plan.total_probes


# -- failures ----------------------------------------------------------------------------


def test_no_challenge_is_a_clear_error(make_peer: Any, capsys: pytest.CaptureFixture[str]) -> None:
    peer = make_peer(challenge=False)
    t0 = time.monotonic()
    code, out, err = run_cli(capsys, "--server", peer.url, "-y", "--timeout", "1")
    assert code == 1
    assert time.monotonic() - t0 < 8
    assert "ERROR: no challenge from the server's UDP port" in err
    assert "blocked" in err and "Traceback" not in err
    assert out == ""
    assert peer.hellos >= 2  # retried every 0.5 s
    assert peer.end_cookies == [peer.cookie]  # the session was released


def test_server_vanishes_mid_session(make_peer: Any, capsys: pytest.CaptureFixture[str]) -> None:
    plan = ProbePlan.build(repetitions=10, step=256, window=2)
    peer = make_peer(plan=plan, vanish_after=20, probe_gap=0.01)
    code, out, err = run_cli(capsys, "--server", peer.url, "-y", "--json", "--timeout", "0.7")
    assert code == 3, err
    doc = json.loads(out)
    assert doc["incomplete"] is True
    assert doc["outcome"] == "vanished"
    assert doc["source"] == "local"
    assert doc["verdict"] is None
    assert doc["local"]["received"] == 20
    assert sum(r["acked"] for r in doc["whole"]) == 20
    assert "WARNING: measurement incomplete" in err and "Traceback" not in err


def test_server_vanishes_summary_says_incomplete(
    make_peer: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = ProbePlan.build(repetitions=10, step=256, window=2)
    peer = make_peer(plan=plan, vanish_after=10)
    code, out, err = run_cli(capsys, "--server", peer.url, "-y", "--timeout", "0.7")
    assert code == 3
    assert "INCOMPLETE (vanished" in out
    assert "Server unreachable" in out


def test_server_ends_session_early(
    make_peer: Any, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    monkeypatch.setattr(runner, "POLL_INTERVAL_S", 0.2)
    plan = ProbePlan.build(repetitions=10, step=256, window=2)
    peer = make_peer(plan=plan, stop_after=10, stop_state="incomplete")
    code, out, err = run_cli(capsys, "--server", peer.url, "-y", "--json", "--timeout", "2")
    assert code == 3, err
    doc = json.loads(out)
    assert doc["state"] == "incomplete" and doc["outcome"] == "server-ended"
    assert doc["incomplete"] is True and doc["source"] == "server"
    assert "ended the session early (incomplete: server-side)" in err
    assert peer.end_cookies == []


def test_server_stuck_is_ended(
    make_peer: Any, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    monkeypatch.setattr(runner, "POLL_INTERVAL_S", 0.2)
    monkeypatch.setattr(runner, "STUCK_MIN_S", 1.0)
    monkeypatch.setattr(runner, "STUCK_TIMEOUTS", 1)
    plan = ProbePlan.build(repetitions=10, step=256, window=2)
    peer = make_peer(plan=plan, stop_after=10)
    code, out, err = run_cli(capsys, "--server", peer.url, "-y", "--json", "--timeout", "1")
    assert code == 3, err
    doc = json.loads(out)
    assert doc["outcome"] == "stuck" and doc["state"] == "ended"
    assert peer.end_cookies == [peer.cookie]
    assert "no progress" in err


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_server_down(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    code, out, err = run_cli(capsys, "--server", url, "-y", "--timeout", "1")
    assert code == 1
    assert "ERROR: cannot connect to the server" in err and "connection refused" in err
    assert "hint:" in err and "Traceback" not in err
    assert out == ""


def test_non_json_reply(make_peer: Any, capsys: pytest.CaptureFixture[str]) -> None:
    peer = make_peer(create_replies=[(200, {}, b"<html>captive portal</html>")])
    code, out, err = run_cli(capsys, "--server", peer.url, "-y", "--timeout", "1")
    assert code == 1
    assert "is not JSON" in err and "captive portal" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "window"), [((), "auto"), (("-w", "auto"), "auto"), (("--window", "1"), 1)]
)
def test_the_window_asked_for(
    make_peer: Any, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], window: object
) -> None:
    peer = make_peer()
    code, _, err = run_cli(capsys, "--server", peer.url, "-y", "--json", "--timeout", "2", *argv)
    assert code == 0, err
    assert [b["plan"]["window"] for b in peer.create_bodies] == [window]


def test_an_older_server_without_adaptive_windows_gets_the_old_default(
    make_peer: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    refusal = json.dumps(
        {"error": "bad-plan", "message": "plan.window must be an integer, got str"}
    ).encode()
    peer = make_peer(create_replies=[(400, {}, refusal)])
    code, _, err = run_cli(capsys, "--server", peer.url, "-y", "--json", "--timeout", "2")
    assert code == 0, err
    assert [b["plan"]["window"] for b in peer.create_bodies] == ["auto", 8]
    assert "does not adapt the window" in err
    # A fixed window the server refuses is the user's to fix: no second try.
    peer = make_peer(create_replies=[(400, {}, refusal)])
    code, _, err = run_cli(capsys, "--server", peer.url, "-y", "--timeout", "2", "-w", "99")
    assert code == 1 and "rejected" in err
    assert len(peer.create_bodies) == 1


def test_a_bad_window_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--server", "http://127.0.0.1:9", "-y", "--window", "fast"])
    assert exc.value.code == 2
    assert "'auto'" in capsys.readouterr().err


def _created(peer: ScriptedServer, **over: Any) -> bytes:
    """The peer's own create reply with some fields replaced."""
    body = {
        "session_id": peer.sid,
        "cookie": peer.cookie,
        "probe_host": None,
        "probe_port": peer.udp.getsockname()[1],
        "plan": peer.plan.to_json(),
        "total_probes": peer.plan.total_probes,
        "expires_in_s": 600,
    }
    body.update(over)
    return json.dumps(body).encode()


@pytest.mark.parametrize("total", ["lots", -5, 2.5, [1]])
def test_malformed_total_probes_is_a_clear_error(
    make_peer: Any, capsys: pytest.CaptureFixture[str], total: Any
) -> None:
    # "lots" used to end in "ERROR: internal error: ValueError".
    peer = make_peer()
    peer.create_replies.append((201, {}, _created(peer, total_probes=total)))
    code, out, err = run_cli(capsys, "--server", peer.url, "-y", "--json", "--timeout", "2")
    assert code == 1, err
    assert "ERROR: the server sent a malformed reply: total_probes is not a whole number" in err
    assert "hint:" in err
    assert "internal error" not in err and "Traceback" not in err
    assert out == ""
    assert peer.end_cookies == [peer.cookie]  # the unusable session was released
    assert peer.hellos == 0  # nothing was measured


# Enough for the client (threads included), far less than a byte per probe
# of a billion-probe plan.
CLIENT_DATA_LIMIT = 256 << 20


def test_huge_plan_is_refused_without_allocating_it(make_peer: Any) -> None:
    # A plan of a billion probes used to take a gigabyte of the volunteer's
    # memory (a byte per probe). Under a 256 MB data limit the old client
    # died of MemoryError ("internal error"); it must refuse the plan.
    peer = make_peer()
    n_sizes = len(peer.plan.whole) + len(peer.plan.split)
    reps = 10**9 // n_sizes + 1
    total = reps * n_sizes
    plan = {**peer.plan.to_json(), "repetitions": reps, "total_probes": total}
    peer.create_replies.append((201, {}, _created(peer, plan=plan, total_probes=total)))

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (CLIENT_DATA_LIMIT, CLIENT_DATA_LIMIT))

    proc = subprocess.run(
        [_console_script(), "--server", peer.url, "--yes", "--json", "--timeout", "2"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=limit_memory,
    )
    assert proc.returncode == 1, proc.stderr
    assert (
        f"ERROR: the server's plan has {total:,} probes, more than this client accepts "
        f"({MAX_PLAN_PROBES:,})"
    ) in proc.stderr
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""
    assert peer.end_cookies == [peer.cookie]


def test_rate_limited_shows_server_message(
    make_peer: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    msg = json.dumps({"error": "rate-limited", "message": "one session per hour"}).encode()
    peer = make_peer(create_replies=[(429, {"Retry-After": "3600"}, msg)])
    code, out, err = run_cli(capsys, "--server", peer.url, "-y", "--timeout", "1")
    assert code == 1
    assert "rate-limited by the server: one session per hour" in err
    assert "try again in about 3600 s" in err
    assert len(peer.create_bodies) == 1  # an hour is not waited for


def test_rate_limited_short_retry_after_is_honoured(make_peer: Any) -> None:
    msg = json.dumps({"error": "busy", "message": "all probe slots taken"}).encode()
    peer = make_peer(create_replies=[(503, {"Retry-After": "2"}, msg)])
    waits: list[float] = []
    notes: list[str] = []
    api = ApiClient(peer.url, timeout=1, sleep=waits.append, notify=notes.append)
    created = api.create_session({"quick": True}, platform="Linux")
    assert created["session_id"] == peer.sid
    assert waits == [2.0]
    assert notes == ["the server is busy: all probe slots taken; retrying in 2 s as asked"]


def test_http_timeouts_retry_with_backoff(make_peer: Any) -> None:
    peer = make_peer(http_delay=0.5)
    waits: list[float] = []
    api = ApiClient(peer.url, timeout=0.1, tries=3, backoff=0.05, sleep=waits.append)
    with pytest.raises(ProbeError) as info:
        api.health()
    assert "did not reply within 0.1 s (3 attempts)" in info.value.message
    assert waits == [0.05, 0.1]


def test_bad_server_url(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "--server", "measure.example.org", "-y")
    assert code == 2 and "http:// or https://" in err


def test_no_server_given(capsys: pytest.CaptureFixture[str], monkeypatch: Any) -> None:
    monkeypatch.delenv("KICKASS_SERVER", raising=False)
    code, _, err = run_cli(capsys, "-y")
    assert code == 2 and "KICKASS_SERVER" in err


def test_server_from_environment(
    make_peer: Any, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    peer = make_peer()
    monkeypatch.setenv("KICKASS_SERVER", peer.url)
    code, out, err = run_cli(capsys, "-y", "--json", "--timeout", "2")
    assert code == 0, err
    assert json.loads(out)["session_id"] == peer.sid


# -- consent --------------------------------------------------------------------------------


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_consent_refused_without_tty(
    make_peer: Any, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    peer = make_peer()
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))  # not a terminal
    code, out, err = run_cli(capsys, "--server", peer.url)
    assert code == 2
    assert "consent needed" in err and "--yes" in err
    assert "your public IP address" in err
    assert peer.requests == []  # nothing was sent
    assert out == ""


def test_consent_declined_on_tty(
    make_peer: Any, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    peer = make_peer()
    monkeypatch.setattr(sys, "stdin", _Tty("n\n"))
    code, _, err = run_cli(capsys, "--server", peer.url)
    assert code == 2 and "not agreed" in err and "Continue? [y/N]" in err
    assert peer.requests == []


def test_consent_given_on_tty(
    make_peer: Any, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    peer = make_peer()
    monkeypatch.setattr(sys, "stdin", _Tty("yes\n"))
    code, out, err = run_cli(capsys, "--server", peer.url, "--json", "--timeout", "2")
    assert code == 0, err
    assert json.loads(out)["state"] == "complete"


# -- Ctrl-C on the real console script ------------------------------------------------------


def _console_script() -> str:
    script = Path(sys.executable).parent / "kickass-probe"
    if not script.exists():
        pytest.skip("kickass-probe console script not installed next to this python")
    return str(script)


def test_ctrl_c_ends_session_and_prints_partial(make_peer: Any) -> None:
    plan = ProbePlan.build(repetitions=20, step=64, window=1)
    peer = make_peer(plan=plan, probe_gap=0.02)
    proc = subprocess.Popen(
        [_console_script(), "--server", peer.url, "--yes", "--json", "--timeout", "3"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 15
        while len(peer.acks) < 5 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        assert len(peer.acks) >= 5, "the client never started acknowledging probes"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "Traceback" not in err.decode()
    assert peer.end_cookies == [peer.cookie]
    doc = json.loads(out)
    assert doc["state"] == "ended" and doc["incomplete"] is True
    assert doc["outcome"] == "interrupted"
    assert doc["session_id"] == peer.sid
    assert 5 <= doc["local"]["received"] < plan.total_probes
    assert sum(r["sent"] for r in doc["whole"]) >= 5
