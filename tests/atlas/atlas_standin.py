"""A local HTTPS stand-in for the RIPE Atlas v2 API: the part `kickass atlas` uses.

It speaks the real request and response shapes — measurement creation
(``POST /api/v2/measurements/`` with ``definitions`` sharing one ``probes``
allocation, ``start_time``/``stop_time``, answered ``{"measurements":
[ids]}``), measurement status (with ``credits_per_result``: by default the
documented rule, or a price a test sets, as the real API charges more),
the key owner's measurements by tag (``/api/v2/measurements/my/?tags=``,
paginated), stopping one (``DELETE``, 204), results (``start``/``stop``
filters on ``timestamp`` only, a JSON list of result lines; a line is served
only once its ``stored_timestamp`` has passed on the stand-in's clock, as
probes upload late), probe metadata (paginated, ``id__in``) — and Atlas's
error envelope ``{"error": {"status", "code", "title", "detail", "errors":
[{"source": {"pointer"}, "detail"}]}}``. Creation, listing one's own and
stopping need ``Authorization: Key <key>``, as Cousteau sends it.

``api_result`` plays RIPE's back end for a line the probe printed (the real
``evping``'s ``RESULT {...}``): it adds what the back end adds (``msm_id``,
``prb_id``, ``timestamp`` from the probe's ``time``, ``from``, ``sent`` /
``rcvd`` / ``dup`` / ``min`` / ``avg`` / ``max``, ``stored_timestamp``, ...).

TLS with a throwaway CA and a certificate for 127.0.0.1 made here with the
``cryptography`` package; the client trusts it through a CA bundle path
(requests' ``verify``), so nothing turns verification off.

Tests drive it: register probes, inject failures (``fail``: an error
answer, a bare text answer, no answer, or — ``commit`` — carry the request
out and then drop the connection), add result lines, set a measurement's
status; every request is recorded.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

STATUS_NAMES = {
    0: "Specified", 1: "Scheduled", 2: "Ongoing", 4: "Stopped", 5: "Forced to stop",
    6: "No suitable probes", 7: "Failed",
}  # fmt: skip
PROBE_STATUS = {0: "Never Connected", 1: "Connected", 2: "Disconnected", 3: "Abandoned"}


def make_tls(directory: Path) -> tuple[Path, Path, Path]:
    """(CA bundle, server certificate chain, server key) for 127.0.0.1."""
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kickass test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    bundle = directory / "standin-ca.pem"
    chain = directory / "standin-cert.pem"
    key_path = directory / "standin-key.pem"
    bundle.write_bytes(ca.public_bytes(pem))
    chain.write_bytes(cert.public_bytes(pem) + ca.public_bytes(pem))
    key_path.write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return bundle, chain, key_path


def envelope(
    status: int, title: str, detail: str, code: int = 0, errors: list | None = None
) -> dict:
    return {
        "error": {
            "status": status,
            "code": code,
            "title": title,
            "detail": detail,
            "errors": errors or [],
        }
    }


@dataclass
class Seen:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: Any


@dataclass
class Failure:
    method: str
    path_prefix: str
    status: int
    body: dict[str, Any] | str | None  # None: drop the connection; str: a bare text page
    times: int = 1
    commit: bool = False  # carry the request out, then drop the connection


def rule_price(packets: int, size: int) -> int:
    """Credits per result by the documented rule."""
    return packets * (size // 1500 + 1)


@dataclass
class StandIn:
    directory: Path
    key: str = "test-key-not-secret"
    credits: int = 10**9
    measurements: dict[int, dict[str, Any]] = field(default_factory=dict)
    results: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    probes: dict[int, dict[str, Any]] = field(default_factory=dict)
    participants: dict[int, list[int]] = field(default_factory=dict)  # probes per measurement
    served: list[tuple[int, int, int, int]] = field(default_factory=list)  # msm, start, stop, n
    seen: list[Seen] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    next_id: int = 70_000_001
    page_size: int = 2
    on_create: Callable[[dict[str, Any]], None] | None = None
    price: Callable[[int, int], int] = rule_price  # credits per result (packets, size)
    clock: Callable[[], float] = time.time  # when results count as uploaded

    def __post_init__(self) -> None:
        self.lock = threading.Lock()
        self.gates: list[tuple[str, str, threading.Event]] = []
        self.ca_bundle, chain, key = make_tls(self.directory)
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(chain, key)
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.socket = self.ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.httpd.daemon_threads = True
        # A short poll: shutdown() waits for it (0.5 s by default, per test).
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def server(self) -> str:
        return f"127.0.0.1:{self.httpd.server_address[1]}"

    def start(self) -> StandIn:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- what tests set up -----------------------------------------------------------

    def add_probe(
        self,
        prb_id: int,
        address: str,
        asn: int,
        country: str,
        status: int = 1,
    ) -> None:
        net = ipaddress.ip_network(f"{address}/24", strict=False)
        self.probes[prb_id] = {
            "id": prb_id,
            "address_v4": address,
            "address_v6": None,
            "asn_v4": asn,
            "asn_v6": None,
            "country_code": country,
            "description": f"stand-in probe {prb_id}",
            "first_connected": 1_600_000_000,
            "geometry": {"type": "Point", "coordinates": [4.9, 52.4]},
            "is_anchor": False,
            "is_public": True,
            "last_connected": int(time.time()),
            "prefix_v4": str(net),
            "prefix_v6": None,
            "status": {"id": status, "name": PROBE_STATUS[status], "since": "2026-01-01T00:00:00Z"},
            "status_since": 1_700_000_000,
            "tags": [{"name": "system-ipv4-works", "slug": "system-ipv4-works"}],
            "total_uptime": 12345678,
            "type": "Probe",
        }

    def fail(
        self,
        method: str,
        path_prefix: str,
        status: int,
        body: dict | str | None,
        times: int = 1,
        commit: bool = False,
    ) -> None:
        with self.lock:
            self.failures.append(Failure(method, path_prefix, status, body, times, commit))

    def gate(self, method: str, path_prefix: str) -> threading.Event:
        """Requests matching are held (unanswered) until the returned event is
        set: a fetch caught in the middle, for a test to kill it there."""
        ev = threading.Event()
        with self.lock:
            self.gates.append((method, path_prefix, ev))
        return ev

    def set_status(self, msm_id: int, status_id: int) -> None:
        with self.lock:
            self.measurements[msm_id]["status"] = {
                "id": status_id,
                "name": STATUS_NAMES[status_id],
                "when": int(time.time()),
            }

    def add_results(self, msm_id: int, lines: list[dict[str, Any]]) -> None:
        with self.lock:
            self.results.setdefault(msm_id, []).extend(lines)

    def requests_to(self, method: str, prefix: str) -> list[Seen]:
        return [s for s in self.seen if s.method == method and s.path.startswith(prefix)]

    # -- the API -------------------------------------------------------------------------

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                # Headers and body go out in separate writes: without this,
                # Nagle and the client's delayed ACK hold every answer 40 ms.
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def log_message(self, *args: object) -> None:
                pass

            def _answer(self, status: int, body: Any) -> None:
                if status == 204:
                    self.send_response(status)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if isinstance(body, str):  # a proxy's page, not the API's envelope
                    data, kind = body.encode(), "text/html"
                else:
                    data, kind = json.dumps(body).encode(), "application/json"
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                url = urlparse(self.path)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = raw.decode(errors="replace")
                with standin.lock:
                    standin.seen.append(Seen(method, url.path, query, dict(self.headers), body))
                    failure = next(
                        (
                            f
                            for f in standin.failures
                            if f.times > 0
                            and f.method == method
                            and url.path.startswith(f.path_prefix)
                        ),
                        None,
                    )
                    if failure is not None:
                        failure.times -= 1
                held = [
                    ev
                    for m, prefix, ev in list(standin.gates)
                    if m == method and url.path.startswith(prefix)
                ]
                for ev in held:
                    ev.wait(120)
                if failure is not None and failure.commit:
                    standin.route(method, url.path, query, dict(self.headers), body)
                if failure is not None:
                    if failure.body is None:
                        self.close_connection = True
                        self.connection.close()
                        return
                    self._answer(failure.status, failure.body)
                    return
                status, answer = standin.route(method, url.path, query, dict(self.headers), body)
                self._answer(status, answer)

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                self._handle("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._handle("POST")

            def do_DELETE(self) -> None:  # noqa: N802
                self._handle("DELETE")

        return Handler

    def route(
        self, method: str, path: str, query: dict[str, str], headers: dict[str, str], body: Any
    ) -> tuple[int, Any]:
        parts = [p for p in path.split("/") if p]
        if parts[:2] != ["api", "v2"]:
            return 404, envelope(404, "Not Found", "No such endpoint", 104)
        rest = parts[2:]
        with self.lock:
            if method == "POST" and rest == ["measurements"]:
                return self._create(headers, body)
            if method == "GET" and rest in (["measurements", "my"], ["measurements"]):
                return self._list(rest, query, headers)
            if method == "DELETE" and len(rest) == 2 and rest[0] == "measurements":
                return self._stop(_int(rest[1]), headers)
            if method == "GET" and len(rest) == 2 and rest[0] == "measurements":
                m = self.measurements.get(_int(rest[1]))
                return (200, m) if m else (404, envelope(404, "Not Found", "Not found.", 104))
            if (
                method == "GET"
                and len(rest) == 3
                and rest[0] == "measurements"
                and rest[2] == "results"
            ):
                return self._results(_int(rest[1]), query)
            if method == "GET" and rest == ["probes"]:
                return self._probe_list(query)
            if method == "GET" and len(rest) == 2 and rest[0] == "probes":
                p = self.probes.get(_int(rest[1]))
                return (200, p) if p else (404, envelope(404, "Not Found", "Not found.", 104))
        return 404, envelope(404, "Not Found", "No such endpoint", 104)

    def _refused(self, headers: dict[str, str]) -> tuple[int, Any] | None:
        auth = headers.get("Authorization", "")
        if auth == f"Key {self.key}":
            return None
        detail = (
            "Authentication credentials were not provided."
            if not auth
            else "The provided API key does not exist"
        )
        return 403, envelope(403, "Forbidden", detail, 102)

    def _list(
        self, rest: list[str], query: dict[str, str], headers: dict[str, str]
    ) -> tuple[int, Any]:
        """The measurement list, filtered by ``tags`` (all of them), paginated."""
        if rest[-1] == "my":
            refused = self._refused(headers)
            if refused is not None:
                return refused
        wanted = {t for t in query.get("tags", "").split(",") if t}
        chosen = [
            m for _, m in sorted(self.measurements.items()) if wanted <= set(m.get("tags") or [])
        ]
        page = int(query.get("page", 1))
        size = int(query.get("page_size", self.page_size))
        nxt = None
        if page * size < len(chosen):
            tags = query.get("tags", "")
            nxt = (
                f"https://{self.server}/api/v2/{'/'.join(rest)}/?tags={tags}"
                f"&page_size={size}&page={page + 1}"
            )
        results = chosen[(page - 1) * size : page * size]
        return 200, {"count": len(chosen), "next": nxt, "previous": None, "results": results}

    def _stop(self, msm_id: int, headers: dict[str, str]) -> tuple[int, Any]:
        refused = self._refused(headers)
        if refused is not None:
            return refused
        m = self.measurements.get(msm_id)
        if m is None:
            return 404, envelope(404, "Not Found", "Not found.", 104)
        now = int(time.time())
        m["status"] = {"id": 4, "name": "Stopped", "when": now}
        m["stop_time"] = now
        return 204, None

    def _create(self, headers: dict[str, str], body: Any) -> tuple[int, Any]:
        refused = self._refused(headers)
        if refused is not None:
            return refused
        if not isinstance(body, dict) or not body.get("definitions") or not body.get("probes"):
            return 400, envelope(400, "Bad Request", "Invalid input", 101)
        errors = []
        for i, d in enumerate(body["definitions"]):
            if d.get("type") != "ping":
                errors.append(_err(f"/definitions/{i}/type", "only ping here"))
            if d.get("af") != 4:
                errors.append(_err(f"/definitions/{i}/af", "af must be 4 or 6"))
            if not 1 <= int(d.get("packets", 3)) <= 16:
                errors.append(
                    _err(
                        f"/definitions/{i}/packets",
                        "Ensure this value is less than or equal to 16.",
                    )
                )
            if not 1 <= int(d.get("size", 48)) <= 2048:
                errors.append(
                    _err(
                        f"/definitions/{i}/size", "Ensure this value is less than or equal to 2048."
                    )
                )
            if not d.get("description"):
                errors.append(_err(f"/definitions/{i}/description", "This field is required."))
            if int(d.get("interval", 240)) < 60:
                errors.append(
                    _err(
                        f"/definitions/{i}/interval",
                        "Ensure this value is greater than or equal to 60.",
                    )
                )
        stop = body.get("stop_time")
        if body.get("is_oneoff") is False and (not isinstance(stop, int) or stop <= time.time()):
            errors.append(_err("/stop_time", "The stop time must be in the future."))
        source = body["probes"][0]
        chosen = self._select(source)
        if chosen is None:
            errors.append(
                _err("/probes/0/value", f"Measurement {source.get('value')} does not exist")
            )
        if errors:
            return 400, envelope(400, "Bad Request", "Invalid input", 101, errors)
        cost = 0
        for d in body["definitions"]:
            per_result = self.price(int(d.get("packets", 3)), int(d.get("size", 48)))
            cost += per_result * int(source.get("requested", 1))
        if cost > self.credits:
            return 400, envelope(
                400,
                "Bad Request",
                "You do not have enough credit to schedule this measurement.",
                104,
            )
        self.credits -= cost
        ids: list[int] = []
        now = int(time.time())
        for d in body["definitions"]:
            msm_id = self.next_id
            self.next_id += 1
            per_result = self.price(int(d.get("packets", 3)), int(d.get("size", 48)))
            self.measurements[msm_id] = {
                "id": msm_id,
                "af": 4,
                "type": "ping",
                "description": d["description"],
                "target": d["target"],
                "target_ip": d["target"],
                "target_asn": None,
                "interval": d.get("interval", 240),
                "packets": d.get("packets", 3),
                "size": d.get("size", 48),
                "packet_interval": d.get("packet_interval", 1000),
                "is_oneoff": False,
                "is_public": True,
                "resolve_on_probe": d.get("resolve_on_probe", False),
                "creation_time": now,
                "start_time": body.get("start_time", now),
                "stop_time": stop,
                "status": {"id": 1, "name": "Scheduled", "when": now},
                "participant_count": len(chosen or []),
                "probes_requested": source.get("requested"),
                "probes_scheduled": len(chosen or []),
                "credits_per_result": per_result,
                "estimated_results_per_day": 0,
                "group_id": ids[0] if ids else msm_id,
                "tags": list(d.get("tags") or []),
                "result": f"https://{self.server}/api/v2/measurements/{msm_id}/results/",
            }
            self.participants[msm_id] = list(chosen or [])
            ids.append(msm_id)
            if self.on_create is not None:
                self.on_create(self.measurements[msm_id])
        return 201, {"measurements": ids}

    def _select(self, source: dict[str, Any]) -> list[int] | None:
        kind, value, n = source.get("type"), source.get("value"), int(source.get("requested", 1))
        connected = [p for p, d in sorted(self.probes.items()) if d["status"]["id"] == 1]
        if kind == "probes":
            return [int(x) for x in str(value).split(",")][:n]
        if kind == "msm":
            m = self.measurements.get(_int(value))
            return None if m is None else list(self.participants[_int(value)])[:n]
        if kind == "country":
            return [p for p in connected if self.probes[p]["country_code"] == value][:n]
        if kind == "asn":
            return [p for p in connected if str(self.probes[p]["asn_v4"]) == str(value)][:n]
        return connected[:n]  # area: the stand-in's whole world

    def _results(self, msm_id: int, query: dict[str, str]) -> tuple[int, Any]:
        if msm_id not in self.measurements:
            return 404, envelope(404, "Not Found", "Not found.", 104)
        start = int(query.get("start", 0))
        stop = int(query.get("stop", 2**62))
        uploaded = self.clock()
        lines = [
            r
            for r in self.results.get(msm_id, [])
            if start <= r["timestamp"] <= stop and r.get("stored_timestamp", 0) <= uploaded
        ]
        self.served.append((msm_id, start, stop, len(lines)))
        return 200, sorted(lines, key=lambda r: (r["timestamp"], r["prb_id"]))

    def _probe_list(self, query: dict[str, str]) -> tuple[int, Any]:
        ids = [int(x) for x in query.get("id__in", "").split(",") if x]
        chosen = (
            [self.probes[i] for i in sorted(ids) if i in self.probes]
            if ids
            else list(self.probes.values())
        )
        page = int(query.get("page", 1))
        size = self.page_size
        results = chosen[(page - 1) * size : page * size]
        nxt = None
        if page * size < len(chosen):
            ids_param = query.get("id__in", "")
            nxt = f"https://{self.server}/api/v2/probes/?id__in={ids_param}&page={page + 1}"
        return 200, {"count": len(chosen), "next": nxt, "previous": None, "results": results}


def _err(pointer: str, detail: str) -> dict[str, Any]:
    return {"source": {"pointer": pointer}, "detail": detail}


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


@contextmanager
def running(directory: Path, **kw: Any) -> Iterator[StandIn]:
    s = StandIn(directory, **kw).start()
    try:
        yield s
    finally:
        s.stop()


def ping_result(
    msm_id: int,
    prb_id: int,
    timestamp: int,
    *,
    dst: str,
    src: str,
    public: str,
    size: int,
    entries: list[dict[str, Any]],
    fw: int = 5080,
    sent: int | None = None,
) -> dict[str, Any]:
    """An Atlas ping result line in the current firmware's format (``sent``:
    the measurement's packets; by default one per non-duplicate entry)."""
    rtts = [e["rtt"] for e in entries if "rtt" in e and "dup" not in e]
    dups = sum(1 for e in entries if "dup" in e)
    if sent is None:
        sent = sum(1 for e in entries if "dup" not in e)
    return {
        "af": 4,
        "avg": round(sum(rtts) / len(rtts), 6) if rtts else -1,
        "dst_addr": dst,
        "dst_name": dst,
        "dup": dups,
        "from": public,
        "fw": fw,
        "group_id": msm_id,
        "lts": 17,
        "max": max(rtts) if rtts else -1,
        "min": min(rtts) if rtts else -1,
        "msm_id": msm_id,
        "msm_name": "Ping",
        "prb_id": prb_id,
        "proto": "ICMP",
        "rcvd": len(rtts),
        "result": entries,
        "sent": sent,
        "size": size,
        "src_addr": src,
        "step": 240,
        "stored_timestamp": timestamp + 3,
        "timestamp": timestamp,
        "ttl": 61,
        "type": "ping",
    }


# RIPE Atlas software probe version of the oracle's snapshot (its README).
PROBE_FIRMWARE = 5120


def api_result(
    probe_line: dict[str, Any],
    *,
    msm_id: int,
    prb_id: int,
    public: str,
    packets: int,
    interval: int = 240,
    stored_delay: int = 3,
    fw: int = PROBE_FIRMWARE,
    timestamp: int | None = None,
) -> dict[str, Any]:
    """A line the probe printed (``RESULT {...}``, parsed) as the results API
    serves it: what RIPE's back end adds, and nothing of the probe's changed.

    The back end's ``sent`` is the measurement's packet count (the probe
    sends that many requests whatever happens; its own line has no count),
    ``rcvd``/``dup`` count the rtt and dup entries, ``min``/``avg``/``max``
    are over the non-duplicate RTTs (-1 without any), ``timestamp`` is the
    probe's ``time`` (the end of the run), and ``fw`` is the probe's version
    (the standalone evping prints -1: it has no version file). Without
    ``-A`` the probe prints no ``time``: give ``timestamp``."""
    line = {k: v for k, v in probe_line.items() if k not in ("id", "time", "fw")}
    entries = line.get("result") or []
    rtts = [e["rtt"] for e in entries if "rtt" in e and "dup" not in e]
    if timestamp is None:
        timestamp = int(probe_line["time"])
    line.update(
        fw=fw,
        msm_id=msm_id,
        prb_id=prb_id,
        timestamp=timestamp,
        msm_name="Ping",
        type="ping",
        group_id=msm_id,
        step=interval,
        stored_timestamp=timestamp + stored_delay,
        sent=packets,
        rcvd=len(rtts),
        dup=sum(1 for e in entries if "dup" in e),
        min=min(rtts) if rtts else -1,
        max=max(rtts) if rtts else -1,
        avg=round(sum(rtts) / len(rtts), 6) if rtts else -1,
    )
    line["from"] = public
    return line
