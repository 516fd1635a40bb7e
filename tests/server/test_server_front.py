"""The HTTP front under hostile clients (issue 7, defects 5, 6, 7), on loopback.

The real FrontServer (waitress) serves a WSGI app that reports the client
address it was given; clients are real sockets from several loopback
addresses (127.0.0.0/8 is all ours), and the reverse proxy is a real second
HTTP hop that appends X-Forwarded-For as nginx's $proxy_add_x_forwarded_for does.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kickass_server.front import FrontLimits, FrontServer, create_front


def _app(environ: dict, start_response) -> list[bytes]:  # noqa: ANN001
    size = int(environ.get("CONTENT_LENGTH") or 0)
    environ["wsgi.input"].read(size)
    body = json.dumps({"remote": environ.get("REMOTE_ADDR")}).encode()
    start_response("200 OK", [("Content-Type", "application/json")])
    return [body]


@contextmanager
def front(host: str = "127.0.0.1", **kw) -> Iterator[FrontServer]:  # noqa: ANN003
    server = create_front(_app, host, 0, threads=4, **kw)
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    try:
        yield server
    finally:
        server.close()
        server.task_dispatcher.shutdown(timeout=5)


def _get(host: str, port: int, source: str = "127.0.0.1", headers: dict | None = None) -> dict:
    conn = http.client.HTTPConnection(host, port, timeout=5, source_address=(source, 0))
    try:
        conn.request("GET", "/", headers=headers or {})
        resp = conn.getresponse()
        assert resp.status == 200, resp.status
        return json.loads(resp.read())
    finally:
        conn.close()


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _open_slow(host: str, port: int, source: str) -> socket.socket:
    s = socket.create_connection((host, port), timeout=5, source_address=(source, 0))
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # headers never finished
    return s


def _is_refused(s: socket.socket) -> bool:
    """True when the server closed the connection without answering."""
    s.settimeout(2)
    try:
        return s.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_large_bodies_are_refused_before_they_are_spooled(monkeypatch: pytest.MonkeyPatch) -> None:
    spool = tempfile.mkdtemp(prefix="kickass-front-")
    monkeypatch.setenv("TMPDIR", spool)
    tempfile.tempdir = None  # pick TMPDIR up again
    try:
        with front() as server:
            port = server.effective_port
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(
                b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000000000\r\n\r\n"  # under waitress's 1 GiB default
            )
            sent = 0
            try:
                for _ in range(64):  # up to 4 MiB of body
                    s.sendall(b"x" * 65536)
                    sent += 65536
            except (BrokenPipeError, ConnectionResetError):
                pass
            # waitress spools into an unlinked temporary file: look for open ones.
            spooled = [
                link
                for fd in os.listdir("/proc/self/fd")
                if (link := _readlink(f"/proc/self/fd/{fd}")).startswith(spool)
            ]
            s.settimeout(5)
            try:
                answer = s.recv(200)
            except ConnectionResetError:
                answer = b""
            s.close()
            assert answer == b"" or answer.startswith(b"HTTP/1.1 413"), answer
            assert spooled == [] and os.listdir(spool) == [], f"body spooled to disk: {spooled}"
            # And the server still serves.
            assert _get("127.0.0.1", port)["remote"] == "127.0.0.1"
    finally:
        tempfile.tempdir = None
        os.rmdir(spool)


def test_slow_connections_from_one_address_do_not_take_the_api_down() -> None:
    limits = FrontLimits(per_address=8, request_timeout=1.5)
    with front(limits=limits) as server:
        port = server.effective_port
        attackers = [_open_slow("127.0.0.1", port, "127.0.0.9") for _ in range(120)]
        try:
            time.sleep(0.3)
            refused = sum(_is_refused(s) for s in attackers[8:20])
            assert refused == 12, "connections past the per-address cap were kept"
            # Everyone else is served at once.
            for i in range(5):
                assert _get("127.0.0.1", port, source=f"127.0.1.{i + 1}")["remote"] == (
                    f"127.0.1.{i + 1}"
                )
            # The 8 kept ones trickle too slowly and are closed at the request deadline.
            time.sleep(limits.request_timeout + 2 * limits.sweep_interval + 0.5)
            assert all(_is_refused(s) for s in attackers[:8])
            assert _get("127.0.0.1", port, source="127.0.0.9")["remote"] == "127.0.0.9"
        finally:
            for s in attackers:
                s.close()


class _Proxy(BaseHTTPRequestHandler):
    """A reverse-proxy hop: forwards to the upstream and appends the peer to X-Forwarded-For."""

    upstream: tuple[str, int]

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        xff = self.headers.get("X-Forwarded-For")
        peer = self.client_address[0]
        conn = http.client.HTTPConnection(
            *self.upstream, timeout=5, source_address=("127.0.0.3", 0)
        )
        conn.request(
            "GET", self.path, headers={"X-Forwarded-For": f"{xff}, {peer}" if xff else peer}
        )
        resp = conn.getresponse()
        body = resp.read()
        self.send_response(resp.status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        conn.close()

    def log_message(self, *args: object) -> None:
        pass


def test_trusted_proxy_gives_the_address_it_appended_never_the_clients_own() -> None:
    with front(trusted_proxy="127.0.0.3") as server:
        handler = type("P", (_Proxy,), {"upstream": ("127.0.0.1", server.effective_port)})
        proxy = ThreadingHTTPServer(("127.0.0.2", 0), handler)
        t = threading.Thread(target=proxy.serve_forever, daemon=True)
        t.start()
        try:
            pport = proxy.server_address[1]
            # Through the proxy: the client's forged entry is ignored.
            got = _get(
                "127.0.0.2", pport, source="127.0.0.4", headers={"X-Forwarded-For": "6.6.6.6"}
            )
            assert got["remote"] == "127.0.0.4"
            got = _get("127.0.0.2", pport, source="127.0.0.5")
            assert got["remote"] == "127.0.0.5"
            # Straight to the server, not from the proxy: the header is not believed.
            got = _get(
                "127.0.0.1",
                server.effective_port,
                source="127.0.0.6",
                headers={"X-Forwarded-For": "6.6.6.6"},
            )
            assert got["remote"] == "127.0.0.6"
        finally:
            proxy.shutdown()
            proxy.server_close()


def test_the_trusted_proxy_is_not_held_to_the_per_address_cap() -> None:
    """All volunteers arrive from the proxy's address: capping it at 8 would
    cap the whole API at 8 requests in flight. Others are still capped."""
    limits = FrontLimits(per_address=8, request_timeout=5.0)
    with front(trusted_proxy="127.0.0.3", limits=limits) as server:
        port = server.effective_port
        from_proxy = [_open_slow("127.0.0.1", port, "127.0.0.3") for _ in range(20)]
        others = [_open_slow("127.0.0.1", port, "127.0.0.9") for _ in range(12)]
        try:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and server.refused["127.0.0.9"] < 4:
                time.sleep(0.05)
            time.sleep(0.2)  # the last accepts are done
            held = Counter(ch.addr[0] for ch in server.active_channels.values())
            assert (held["127.0.0.3"], held["127.0.0.9"]) == (20, 8)
            assert server.refused["127.0.0.9"] == 4 and server.refused["127.0.0.3"] == 0
        finally:
            for s in from_proxy + others:
                s.close()


def test_without_a_trusted_proxy_the_header_is_ignored() -> None:
    with front() as server:
        got = _get("127.0.0.1", server.effective_port, headers={"X-Forwarded-For": "6.6.6.6"})
        assert got["remote"] == "127.0.0.1"
