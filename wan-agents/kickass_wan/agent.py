"""`kickass-agent`: the remote receiver of the wide-area trials.

It runs at far-away sites and serves both kinds of flows:

* TCP flows (the baseline) on ``--tcp-port`` (``tcpflow.TcpReceiver``);
* Kick-Ass flows on ``--kickass-port`` through the Rust receiver
  (``ka-agent-recv``, which reads each datagram's leading fragment before
  reassembly), supervised here and restarted if it dies;

and a small control API on ``--listen`` (HTTP, JSON, on the server's
convention: ``kickass_core.httpjson``'s error shape, body parser and limits):

    GET  /v1/health    {"status", "receivers": {...}, "uptime_s"}: the Kick-Ass
                       receiver's entry says whether it is up ("ready": it said
                       it listens) and, if it is not, its last error
    GET  /v1/version   {"agent": version, "name", "token_version", "receiver"}
    GET  /v1/environment  this host's kernel, TCP settings, routes (signed)
    POST /v1/tokens    {"kind": "tcp"|"kickass", "count": N}  ->  {"tokens": [hex], ...}
                       signed with the agent secret's key (kickass_core.signing:
                       the secret never travels, a replayed request is refused)
    GET  /metrics      Prometheus text: flows by result, tokens issued, refused
                       requests, receiver restarts (only from --metrics-from networks)

The Kick-Ass receiver is required: an agent without one would serve only
the TCP half of a trial, so it refuses to start unless told so
(``--kickass-receiver none``). ``--check`` starts the receiver once, as the
agent would, and says whether it runs (the Debian package's postinst runs it
with the unit's privileges).

Flows are refused without a valid, unexpired, unused token. The secret comes
from ``--secret-file`` or ``KICKASS_AGENT_SECRET``; used tokens and the nonces
of signed requests are kept in ``--state-dir``, so a restart lets neither a
replayed token nor a replayed control request in.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Annotated, Any, Literal

from kickass_core import config, httpjson, signing
from kickass_core.cli import program
from kickass_core.errors import KickassError
from kickass_core.httpjson import ApiError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field

from . import __version__, environment
from . import token as tk
from .tcpflow import TcpReceiver

log = logging.getLogger("kickass.agent")

MAX_TOKENS_PER_CALL = 200
# Flows of each kind in progress at once (the trial runner's default cap too).
DEFAULT_MAX_FLOWS = 256
# Retry-After on a 503 (the state directory could not record a request).
RETRY_AFTER = httpjson.RetryAfter()


class Agent:
    def __init__(
        self,
        name: str,
        secret: bytes,
        state_dir: Path,
        listen: tuple[str, int],
        tcp_port: int,
        kickass_port: int | None,
        kickass_receiver: str | None,
        token_lifetime_s: float = 600.0,
        max_flows: int = DEFAULT_MAX_FLOWS,
        metrics_from: tuple[str, ...] = ("127.0.0.0/8", "::1/128"),
    ) -> None:
        if len(secret) < 16:
            raise KickassError("the agent secret is too short", hint="use at least 16 bytes")
        state_dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.secret = secret
        self.started = time.monotonic()
        self.token_lifetime_s = token_lifetime_s
        # Shared with ka-agent-recv (it appends in the same format), so a token
        # used for either kind of flow stays used across restarts of both.
        self.used_tokens = state_dir / "used-tokens"
        self.guard = tk.ReplayGuard(secret, state_file=self.used_tokens)
        # On disk too: a /v1/tokens request captured before a restart and
        # replayed after it, within its window, must not mint tokens.
        self.nonces = signing.NonceCache(state_file=state_dir / "signed-nonces")
        # The same cap for both kinds of flow: a comparison that admits more
        # Kick-Ass than TCP flows at once would not treat them alike.
        self.max_flows = max_flows
        self.tcp = TcpReceiver(self.guard, bind=(listen[0], tcp_port), max_flows=max_flows)
        self.kickass_port = kickass_port
        self.kickass_receiver = kickass_receiver
        self.kickass_restarts = 0
        # Whether the receiver said its sockets are up, and what it last
        # complained of (GET /v1/health; the runner's check reads both).
        self.kickass_ready = False
        self.kickass_error: str | None = None
        self.kickass_version = receiver_version(kickass_receiver) if kickass_receiver else None
        # For GET /metrics: tokens issued by kind, control requests refused.
        self.metrics_from = tuple(ipaddress.ip_network(n, strict=False) for n in metrics_from)
        self.tokens_issued = {"tcp": 0, "kickass": 0}
        self.refused = 0
        self._count_lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._stop = threading.Event()
        handler = type("Handler", (_Handler,), {"agent": self})
        self.http = ThreadingHTTPServer(listen, handler)
        self.http.daemon_threads = True

    # -- life cycle -------------------------------------------------------

    def start(self) -> Agent:
        self.tcp.start()
        if self.kickass_receiver and self.kickass_port is not None:
            threading.Thread(target=self._supervise, name="ka-recv", daemon=True).start()
        threading.Thread(target=self.http.serve_forever, name="control", daemon=True).start()
        log.info(
            "agent %s %s: control http://%s:%s, tcp %s, kickass udp %s",
            self.name,
            __version__,
            *self.http.server_address,
            self.tcp.address[1],
            self.kickass_port,
        )
        return self

    def stop(self) -> None:
        self._stop.set()
        self.http.shutdown()
        self.http.server_close()
        self.tcp.stop()
        if self._proc and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()

    def _supervise(self) -> None:
        """Keep the Rust Kick-Ass receiver running; it checks tokens with the same secret."""
        assert self.kickass_receiver is not None
        delay = 0.5
        while not self._stop.is_set():
            try:
                self._proc = _start_receiver(
                    self.kickass_receiver,
                    self.secret,
                    self.kickass_port or 0,
                    "--state-file",
                    str(self.used_tokens),
                    "--max-flows",
                    str(self.max_flows),
                )
            except OSError as exc:
                self.kickass_error = f"cannot start {self.kickass_receiver}: {exc.strerror}"
                log.error("Kick-Ass receiver: %s", self.kickass_error)
                rc: int | str = "unstarted"
                started = time.monotonic()
            else:
                started = time.monotonic()
                errors = threading.Thread(
                    target=self._pump_errors, args=(self._proc,), name="ka-recv-err", daemon=True
                )
                errors.start()
                assert self._proc.stdout is not None
                # Passed on as they come (the journal keeps them); the start
                # line says the receiver's sockets are up.
                for raw in self._proc.stdout:
                    if b'"type":"start"' in raw.replace(b" ", b""):
                        self.kickass_ready = True
                        self.kickass_error = None
                    sys.stdout.buffer.write(raw)
                    sys.stdout.flush()
                rc = self._proc.wait()
                errors.join(2)
            self.kickass_ready = False
            if self._stop.is_set():
                return
            self.kickass_restarts += 1
            log.warning("Kick-Ass receiver exited %s; restarting in %.1fs", rc, delay)
            delay = 0.5 if time.monotonic() - started > 30 else min(delay * 2, 10.0)
            self._stop.wait(delay)

    def _pump_errors(self, proc: subprocess.Popen[bytes]) -> None:
        """The receiver's stderr, passed on; its last error kept for /v1/health
        (the ``error:`` line, not the hint after it)."""
        assert proc.stderr is not None
        for raw in proc.stderr:
            sys.stderr.buffer.write(raw)
            sys.stderr.flush()
            line = raw.decode("utf-8", "replace").strip()
            if "error:" in line:
                self.kickass_error = line.split("error:", 1)[1].strip()[:300]
            elif line and self.kickass_error is None:
                self.kickass_error = line[:300]

    # -- control API ------------------------------------------------------

    def health(self) -> dict[str, Any]:
        ka = None
        if self.kickass_receiver:
            alive = self._proc is not None and self._proc.poll() is None
            ka = {
                "running": alive,
                "ready": alive and self.kickass_ready,
                "restarts": self.kickass_restarts,
                "port": self.kickass_port,
                "version": self.kickass_version,
                "error": None if alive and self.kickass_ready else self.kickass_error,
            }
        return {
            "status": "ok" if ka is None or ka["ready"] else "degraded",
            "name": self.name,
            "uptime_s": round(time.monotonic() - self.started, 1),
            "receivers": {"tcp": {"port": self.tcp.address[1], **self.tcp.counts}, "kickass": ka},
        }

    def environment(self) -> dict[str, Any]:
        """This host's environment record (kickass_wan.environment), with the
        agent's own settings; ``recorded_at`` lets the runner measure the
        clock offset."""
        return {
            **environment.local(),
            "agent": {"version": __version__, "name": self.name, "max_flows": self.max_flows},
        }

    def version(self) -> dict[str, Any]:
        """What this agent runs: its version, the flow tokens it issues, its
        Kick-Ass receiver's version (None: it has none)."""
        return {
            "agent": __version__,
            "name": self.name,
            "token_version": tk.VERSION,
            "receiver": self.kickass_version,
        }

    def issue(self, kind: str, count: int) -> dict[str, Any]:
        kinds = {"tcp": tk.KIND_TCP, "kickass": tk.KIND_KICKASS}
        if kind not in kinds:
            raise ValueError("kind must be 'tcp' or 'kickass'")
        if not 1 <= count <= MAX_TOKENS_PER_CALL:
            raise ValueError(f"count must be within 1..{MAX_TOKENS_PER_CALL}")
        now = time.time()
        tokens = [
            tk.issue(self.secret, kinds[kind], now, self.token_lifetime_s).hex()
            for _ in range(count)
        ]
        with self._count_lock:
            self.tokens_issued[kind] += count
        port = self.tcp.address[1] if kind == "tcp" else self.kickass_port
        return {"kind": kind, "tokens": tokens, "port": port, "expires_in_s": self.token_lifetime_s}

    def authorize(self, headers: Any, method: str, path: str, body: bytes) -> None:
        """Returns if the request is signed with this agent's key and not a
        replay; else raises the ApiError to refuse it with (401, or 503 when
        its nonce cannot be recorded)."""
        key = signing.key_from_secret(self.secret)
        try:
            signed = signing.check(
                headers,
                method,
                path,
                body,
                lambda kid: key if kid == signing.AGENT_KEY_ID else None,
            )
            replayed = self.nonces.seen(signed.nonce, signed.time)
        except signing.SignatureError as exc:
            self._refuse()
            raise ApiError(401, "unauthorized", str(exc)) from None
        except OSError as exc:
            # Unrecorded, the nonce would be forgotten by a restart: refuse.
            log.error("cannot record a signed request's nonce: %s", exc)
            self._refuse()
            raise httpjson.Unavailable(
                f"the agent cannot record the request in its state directory: {exc}"
            ) from None
        if replayed:
            self._refuse()
            raise ApiError(401, "unauthorized", "replayed request (its nonce was seen before)")

    def _refuse(self) -> None:
        with self._count_lock:
            self.refused += 1

    def metrics_text(self) -> bytes:
        """The agent's counters in the Prometheus text format."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_AgentCollector(self))
        return generate_latest(registry)

    def may_read_metrics(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in net for net in self.metrics_from)


class _AgentCollector(Collector):
    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def collect(self) -> Iterator[Metric]:
        a = self.agent
        flows = CounterMetricFamily(
            "kickass_agent_tcp_flows",
            "TCP flows received, by what became of them",
            labels=["result"],
        )
        for result, n in sorted(a.tcp.counts.items()):
            flows.add_metric([result], float(n))
        tokens = CounterMetricFamily(
            "kickass_agent_tokens_issued", "Flow tokens issued to runners", labels=["kind"]
        )
        with a._count_lock:
            for kind, n in sorted(a.tokens_issued.items()):
                tokens.add_metric([kind], float(n))
            refused = float(a.refused)
        ref = CounterMetricFamily(
            "kickass_agent_requests_refused",
            "Control requests refused: unsigned, bad or stale signature, replayed nonce",
        )
        ref.add_metric([], refused)
        restarts = CounterMetricFamily(
            "kickass_agent_kickass_receiver_restarts", "Restarts of the Kick-Ass receiver"
        )
        restarts.add_metric([], float(a.kickass_restarts))
        up = GaugeMetricFamily("kickass_agent_uptime_seconds", "Seconds since the agent started")
        up.add_metric([], time.monotonic() - a.started)
        yield from (flows, tokens, ref, restarts, up)


class TokenRequest(BaseModel):
    """``POST /v1/tokens``: strict types, unknown fields refused."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    kind: Literal["tcp", "kickass"]
    count: Annotated[int, Field(ge=1, le=MAX_TOKENS_PER_CALL)] = 1


class _Handler(BaseHTTPRequestHandler):
    """The control API on ``kickass_core.httpjson``'s convention: every answer
    JSON, every refusal ``{"error", "message"}``, a bug a 500 that says no more."""

    agent: Agent
    server_version = f"kickass-agent/{__version__}"
    timeout = 10  # a slow client cannot hold a thread

    def _reply(
        self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _serve(self, route: Callable[[], None]) -> None:
        try:
            route()
        except ApiError as exc:
            log.info("%d %s %s %r: %s", exc.status, exc.code, self.command, self.path[:80],
                     httpjson.one_line(exc.message))  # fmt: skip
            retry = RETRY_AFTER.header(exc.retry)
            # A refused request's body may be unread: the connection ends with it.
            self.close_connection = True
            self._reply(
                exc.status,
                httpjson.error_body(exc.code, exc.message),
                {"Retry-After": retry} if retry else None,
            )
        except Exception:
            # Not bad input (4xx) and not an outage (503): a bug.
            log.exception("500 %s %r", self.command, self.path[:80])
            self.close_connection = True
            self._reply(500, httpjson.error_body(*httpjson.INTERNAL))

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (a bad request line, an unsupported
        method, an unknown path) in the same shape as every other error."""
        status = HTTPStatus(code)
        self.close_connection = True
        self._reply(
            code,
            httpjson.error_body(
                status.phrase.lower().replace(" ", "-"), message or status.description
            ),
        )

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._serve(self._get)

    def do_POST(self) -> None:  # noqa: N802
        self._serve(self._post)

    def _get(self) -> None:
        if self.path == "/v1/health":
            self._reply(200, self.agent.health())
        elif self.path == "/v1/version":
            self._reply(200, self.agent.version())
        elif self.path == "/metrics":
            # Prometheus cannot sign: only the networks of --metrics-from may read it.
            if not self.agent.may_read_metrics(self.client_address[0]):
                self.send_error(404)
                return
            data = self.agent.metrics_text()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif self.path == "/v1/environment":
            # Signed: a host's kernel and settings are a runner's business.
            self.agent.authorize(self.headers, "GET", self.path, b"")
            self._reply(200, self.agent.environment())
        else:
            self.send_error(404)

    def _post(self) -> None:
        if self.path != "/v1/tokens":
            self.send_error(404)
            return
        length = httpjson.body_length(self.headers.get("Content-Length"))
        raw = self.rfile.read(length)
        # The signature covers the body as sent: checked before it is parsed.
        self.agent.authorize(self.headers, "POST", self.path, raw)
        req = httpjson.parse_json(raw, TokenRequest)
        self._reply(200, self.agent.issue(req.kind, req.count))

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("%s " + fmt, self.client_address[0], *args)


# How long the receiver may take to say its sockets are up (``--check``).
RECEIVER_START_S = 5.0


def _start_receiver(path: str, secret: bytes, port: int, *args: str) -> subprocess.Popen[bytes]:
    """ka-agent-recv on ``port``, checking tokens with ``secret`` (given in its
    environment, never on the command line); stdout and stderr piped."""
    env = {**os.environ, "KICKASS_AGENT_SECRET_HEX": secret.hex()}
    return subprocess.Popen(
        [path, "--port", str(port), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def receiver_version(path: str) -> str | None:
    """``ka-agent-recv --version`` (e.g. "ka-agent-recv 0.1.0"), or None if it does not answer."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip()[:100] or None if out.returncode == 0 else None


def find_receiver() -> str | None:
    """ka-agent-recv next to this program (the Debian package's layout, a
    virtual environment's bin), else on PATH."""
    for folder in (Path(sys.argv[0]).resolve().parent, Path(sys.executable).parent):
        here = folder / "ka-agent-recv"
        if here.is_file():
            return str(here)
    return shutil.which("ka-agent-recv")


def check_receiver(path: str, timeout_s: float = RECEIVER_START_S) -> str:
    """Start the Kick-Ass receiver once as the agent does (a free UDP port, a
    throwaway secret, these privileges), wait for it to say its sockets are
    up, stop it. Its version; KickassError saying why it cannot run."""
    hint = (
        "the receiver needs Linux on x86-64 and CAP_NET_RAW (it reads leading fragments "
        "with an AF_PACKET socket): the systemd unit grants exactly that; a container "
        "needs --cap-add NET_RAW"
    )
    version = receiver_version(path)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("0.0.0.0", 0))
        port = s.getsockname()[1]
    try:
        proc = _start_receiver(path, secrets.token_bytes(32), port)
    except OSError as exc:
        raise KickassError(
            f"the Kick-Ass receiver {path} cannot be started: {exc.strerror}", hint
        ) from None
    assert proc.stdout is not None and proc.stderr is not None
    ready = threading.Event()

    def read_start() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            if b'"type":"start"' in raw.replace(b" ", b""):
                ready.set()

    reader = threading.Thread(target=read_start, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    while not ready.is_set() and proc.poll() is None and time.monotonic() < deadline:
        ready.wait(0.05)
    ran = ready.is_set()
    still_starting = proc.poll() is None
    if still_starting:
        proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    said = proc.stderr.read().decode("utf-8", "replace").strip()
    reader.join(2)
    if not ran:
        lines = [ln.strip() for ln in said.splitlines() if ln.strip()]
        errors = [ln.split("error:", 1)[1].strip() for ln in lines if "error:" in ln]
        why = (errors or lines or [f"exit status {proc.returncode}"])[0]
        if still_starting:
            why = f"it did not start within {timeout_s:g} s"
        raise KickassError(f"the Kick-Ass receiver {path} does not run: {why}", hint)
    return version or path


def _secret(args: argparse.Namespace) -> bytes:
    hint = "pass --secret-file FILE or set KICKASS_AGENT_SECRET"
    raw = config.read_secret(args.secret_file, "KICKASS_AGENT_SECRET", "agent secret", hint)
    if not raw:
        raise KickassError(
            "no agent secret",
            hint="pass --secret-file FILE or set KICKASS_AGENT_SECRET "
            "(make one: python3 -c 'import secrets; print(secrets.token_hex(32))')",
        )
    return raw.encode()


def build_parser() -> argparse.ArgumentParser:
    p = program(
        "kickass-agent",
        __version__,
        description="Remote receiver for Kick-Ass vs TCP trials: serves TCP and Kick-Ass "
        "flows to runners holding a token from its control API. Settings: flag > "
        "KICKASS_AGENT_* environment > [agent] table of the --config TOML file.",
    )
    p.add_argument("--config", help="TOML configuration file (env KICKASS_CONFIG)")
    p.add_argument("--name", help="this agent's name in results (default: the host name)")
    p.add_argument("--listen", help="control API HOST:PORT (default 0.0.0.0:8700)")
    p.add_argument("--tcp-port", type=int, help="TCP flow port (default 8701)")
    p.add_argument("--kickass-port", type=int, help="Kick-Ass UDP port (default 8702)")
    p.add_argument(
        "--kickass-receiver",
        help="path of the ka-agent-recv binary (default: found next to this program or on "
        "PATH; 'none' serves TCP flows only: without it the agent refuses to start)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="start the Kick-Ass receiver once as the agent would (with this process's "
        "privileges), stop it, and exit: 0 when it runs, 1 saying why not",
    )
    p.add_argument("--secret-file", help="file holding the agent secret (env KICKASS_AGENT_SECRET)")
    p.add_argument(
        "--state-dir",
        help="where used flow tokens and signed requests' nonces are kept "
        "(default /var/lib/kickass-agent)",
    )
    p.add_argument(
        "--max-flows",
        type=int,
        help="flows of each kind (TCP, Kick-Ass) in progress at once "
        f"(default {DEFAULT_MAX_FLOWS})",
    )
    p.add_argument(
        "--metrics-from",
        help="comma-separated networks that may read GET /metrics (default loopback only)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(message)s",
    )
    try:
        file = config.load_file(args.config)

        def get(name: str, default: Any, parse: Any = None) -> Any:
            return config.resolve(
                name,
                getattr(args, name),
                default=default,
                file=file,
                section="agent",
                parse=parse,
                prefix="KICKASS_AGENT_",
            )

        listen = str(get("listen", "0.0.0.0:8700"))
        host, _, port = listen.rpartition(":")
        receiver = get("kickass_receiver", None)
        if receiver is None:
            receiver = find_receiver()
            if receiver is None:
                raise KickassError(
                    "no Kick-Ass receiver: ka-agent-recv is neither next to kickass-agent "
                    "nor on PATH",
                    hint="install the kickass-agent package (make agent-deb), pass "
                    "--kickass-receiver PATH, or --kickass-receiver none to serve TCP flows only",
                )
        if receiver == "none":
            receiver = None
        if args.check:
            if receiver is None:
                raise KickassError("--check: there is no Kick-Ass receiver to check")
            try:
                said = check_receiver(receiver)
            except KickassError as exc:
                print(exc.render(), file=sys.stderr)
                return 1
            print(f"kickass-agent: the Kick-Ass receiver runs ({said})")
            return 0
        agent = Agent(
            name=str(get("name", os.uname().nodename)),
            secret=_secret(args),
            state_dir=Path(get("state_dir", "/var/lib/kickass-agent")),
            listen=(host or "0.0.0.0", int(port)),
            tcp_port=int(get("tcp_port", 8701, int)),
            max_flows=int(get("max_flows", DEFAULT_MAX_FLOWS, int)),
            kickass_port=int(get("kickass_port", 8702, int)),
            kickass_receiver=receiver,
            metrics_from=tuple(
                n.strip()
                for n in str(get("metrics_from", "127.0.0.0/8,::1/128")).split(",")
                if n.strip()
            ),
        )
    except KickassError as exc:
        print(exc.render(), file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"ERROR: cannot start the agent: {exc}", file=sys.stderr)
        return 2
    if receiver is None:
        log.warning("no Kick-Ass receiver (--kickass-receiver none): serving TCP flows only")
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    agent.start()
    print(
        f"kickass-agent {agent.name} ready on {agent.http.server_address[1]}",
        file=sys.stderr,
        flush=True,
    )
    done.wait()
    log.info("stopping")
    agent.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
