"""`kickass server`: the measurement server (HTTP API + raw-socket probe engine)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from kickass_core.errors import KickassError

from . import __version__

log = logging.getLogger("kickass.server")


def _env(name: str, default: str) -> str:
    return os.environ.get(f"KICKASS_{name}", default)


def parse_hostport(value: str, default_host: str = "0.0.0.0") -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep:
        host, port = default_host, value
    try:
        p = int(port)
    except ValueError:
        raise KickassError(f"bad HOST:PORT {value!r}") from None
    if not 0 <= p <= 65535:
        raise KickassError(f"port {p} out of range")
    return host or default_host, p


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "server",
        help="run the measurement server (HTTP API + probe engine)",
        description="Run the fragment-viability measurement server: the HTTP API that volunteers'"
        " probe clients talk to, and the raw-socket probe engine (needs root or CAP_NET_RAW)."
        " Every option can also be set as a KICKASS_* environment variable; policy limits as"
        " KICKASS_POLICY_<NAME> (see server/README.md).",
    )
    p.add_argument(
        "--listen",
        default=_env("LISTEN", "0.0.0.0:8080"),
        help="HTTP API address (env KICKASS_LISTEN; default %(default)s)",
    )
    p.add_argument(
        "--probe-port",
        type=int,
        default=int(_env("PROBE_PORT", "9000")),
        help="UDP port for the probe protocol (env KICKASS_PROBE_PORT; default 9000)",
    )
    p.add_argument(
        "--probe-bind",
        default=_env("PROBE_BIND", "0.0.0.0"),
        help="address the probe UDP socket binds (env KICKASS_PROBE_BIND)",
    )
    p.add_argument(
        "--probe-host",
        default=os.environ.get("KICKASS_PROBE_HOST") or None,
        help="host clients should send UDP to, if not the API's host (env KICKASS_PROBE_HOST)",
    )
    p.add_argument(
        "--database-url", default=None, help="postgresql:// URL (env KICKASS_DATABASE_URL)"
    )
    p.add_argument(
        "--trust-proxy",
        action="store_true",
        default=_env("TRUST_PROXY", "") not in ("", "0"),
        help="take the client address from X-Forwarded-For (behind a reverse proxy)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=int(_env("HTTP_THREADS", "8")),
        help="HTTP worker threads (default 8)",
    )
    p.add_argument(
        "--log-level",
        default=_env("LOG_LEVEL", "info"),
        choices=["debug", "info", "warning", "error"],
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kickass_db.store import Store
    from waitress import create_server

    from .api import create_app
    from .engine import ProbeEngine
    from .policy import Policy

    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    host, port = parse_hostport(args.listen)
    store = Store(args.database_url)
    store.ping()
    orphans = store.mark_orphans_incomplete()
    if orphans:
        log.warning("marked %d sessions of an earlier server run incomplete", len(orphans))
    engine = ProbeEngine(
        store,
        Policy.from_env(),
        bind_host=args.probe_bind,
        probe_port=args.probe_port,
        server_version=__version__,
    )
    try:
        engine.open_sockets()
    except PermissionError:
        raise KickassError(
            "the probe engine needs a raw socket",
            hint="run as root or give the interpreter CAP_NET_RAW",
        ) from None
    except OSError as exc:
        raise KickassError(
            f"cannot open the probe socket on UDP {args.probe_port}: {exc}"
        ) from None
    app = create_app(
        engine, store, {"PROBE_HOST": args.probe_host or None, "TRUST_PROXY": args.trust_proxy}
    )
    try:
        http = create_server(app, host=host, port=port, threads=args.threads, ident="kickass")
    except OSError as exc:
        engine.stop()
        raise KickassError(f"cannot listen on {args.listen}: {exc}") from None

    def _term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    engine.start()
    log.info(
        "kickass server %s: HTTP on %s:%s, probes on UDP %s:%s",
        __version__,
        host,
        http.effective_port,
        args.probe_bind,
        engine.probe_port,
    )
    print(
        f"listening http://{host}:{http.effective_port} probe-port {engine.probe_port}",
        file=sys.stderr,
        flush=True,
    )
    try:
        http.run()
    except KeyboardInterrupt:
        log.info("shutting down: live sessions are recorded as incomplete")
    finally:
        http.close()
        engine.stop()
    return 0
