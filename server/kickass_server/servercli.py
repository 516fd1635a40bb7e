"""`kickass server`: the measurement server (HTTP API + raw-socket probe engine)."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kickass_core import config
from kickass_core.errors import KickassError

from . import __version__

if TYPE_CHECKING:
    from .volunteer_page import PageConfig

log = logging.getLogger("kickass.server")


def parse_hostport(value: str, default_host: str = "0.0.0.0") -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep:
        host, port = default_host, value
    return host or default_host, parse_port(port)


def parse_port(value: str | int) -> int:
    try:
        p = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"not a port number: {value!r}") from None
    if not 0 <= p <= 65535:
        raise ValueError(f"port {p} out of range 0-65535")
    return p


def _positive_int(value: str | int) -> int:
    n = int(value)
    if n < 1:
        raise ValueError(f"must be at least 1, got {n}")
    return n


def _trusted_proxy(value: str) -> str | None:
    """The reverse proxy's address; "1"/"true" mean one on this host, "0"/"" none."""
    v = value.strip().lower()
    if v in ("", "0", "false", "no", "off"):
        return None
    if v in ("1", "true", "yes", "on"):
        return "127.0.0.1"
    if v != "*":
        ipaddress.ip_address(v)  # ValueError names the bad value
    return v


# (setting, default, parser): every option is a flag, a KICKASS_<SETTING>
# environment variable, or a key in the [server] table of the config file,
# in that order (kickass_core.config). Parsed at run time, so a bad
# environment value is an ERROR line, not a traceback in `kickass --help`.
SETTINGS: tuple[tuple[str, object, Callable[[str], object] | None], ...] = (
    ("listen", "0.0.0.0:8080", str),
    ("probe_port", 9000, parse_port),
    ("probe_bind", "0.0.0.0", str),
    ("probe_host", None, str),
    ("database_url", None, str),
    ("trust_proxy", None, _trusted_proxy),
    ("http_threads", 8, _positive_int),
    ("log_level", "info", str.lower),
    ("instance_id", None, str),
    ("journal_dir", ".kickass/journal", str),
    # The volunteer-facing pages (volunteer_page.py).
    ("client_dir", None, str),
    ("network_table", None, str),
    ("page_min_clients", 5, _positive_int),
    ("public_url", None, str),
    # The schedule runner hosts' claims are judged by (schedule_api.py).
    ("schedule_file", None, str),
)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "server",
        help="run the measurement server (HTTP API + probe engine)",
        description="Run the fragment-viability measurement server: the HTTP API that volunteers'"
        " probe clients talk to, and the raw-socket probe engine (needs root or CAP_NET_RAW)."
        " Every option can also be set as a KICKASS_* environment variable or in the [server]"
        " table of the TOML file named by --config / KICKASS_CONFIG (flag > environment > file);"
        " policy limits as KICKASS_POLICY_<NAME> (see server/README.md).",
    )
    p.add_argument("--config", help="TOML configuration file (env KICKASS_CONFIG)")
    p.add_argument("--listen", help="HTTP API address HOST:PORT (env KICKASS_LISTEN; 0.0.0.0:8080)")
    p.add_argument(
        "--probe-port", help="UDP port for the probe protocol (env KICKASS_PROBE_PORT; 9000)"
    )
    p.add_argument(
        "--probe-bind", help="address the probe UDP socket binds (env KICKASS_PROBE_BIND)"
    )
    p.add_argument(
        "--probe-host",
        help="host clients should send UDP to, if not the API's host (env KICKASS_PROBE_HOST)",
    )
    p.add_argument("--database-url", help="postgresql:// URL (env KICKASS_DATABASE_URL)")
    p.add_argument(
        "--trust-proxy",
        nargs="?",
        const="127.0.0.1",
        metavar="PROXY_ADDR",
        help="behind a reverse proxy at PROXY_ADDR (default 127.0.0.1): take the client "
        "address from the X-Forwarded-For entry that proxy appended; requests from any "
        "other address have the header removed (env KICKASS_TRUST_PROXY)",
    )
    p.add_argument(
        "--threads", dest="http_threads", help="HTTP worker threads (env KICKASS_HTTP_THREADS; 8)"
    )
    p.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        help="log level (env KICKASS_LOG_LEVEL; info)",
    )
    p.add_argument(
        "--instance-id",
        help="name of this server process in the database (env KICKASS_INSTANCE_ID; default "
        "HOSTNAME:PROBE_PORT): at start it marks only its own orphaned sessions incomplete, "
        "so several servers can share one database",
    )
    p.add_argument(
        "--journal-dir",
        help="where writes the database has not confirmed are kept across a shutdown or "
        "crash, and stored at the next start (env KICKASS_JOURNAL_DIR; .kickass/journal)",
    )
    p.add_argument(
        "--client-dir",
        help="folder holding kickass-probe.pyz, served at /kickass-probe.pyz (env "
        "KICKASS_CLIENT_DIR; default this Python's share/kickass, where `make zipapp` puts it)",
    )
    p.add_argument(
        "--network-table",
        help="ip2asn TSV file: volunteers' country and network by address, for the groups "
        "their pages compare them with (env KICKASS_NETWORK_TABLE; default none)",
    )
    p.add_argument(
        "--page-min-clients",
        help="a volunteer's page shows a group (all, country, network) only with at least "
        "this many other clients in it (env KICKASS_PAGE_MIN_CLIENTS; 5)",
    )
    p.add_argument(
        "--public-url",
        help="the URL volunteers reach this server at, shown in the pages' run command (env "
        "KICKASS_PUBLIC_URL; default the URL a request came in on)",
    )
    p.add_argument(
        "--schedule-file",
        help="the schedule file (TOML, operations/README.md) trial runner hosts' claims are "
        "judged by: which items each runner may run, their due times, when a run is dead; "
        "read again when it changes (env KICKASS_SCHEDULE_FILE; default none: no runner may "
        "claim a scheduled run)",
    )
    p.set_defaults(func=run)


def resolve_settings(args: argparse.Namespace) -> argparse.Namespace:
    """The effective settings (flag > environment > file > default), validated."""
    file = config.load_file(getattr(args, "config", None))
    out: dict[str, Any] = {}
    for name, default, parse in SETTINGS:
        flag = getattr(args, name, None)
        if flag is not None and parse is not None:
            try:
                flag = parse(flag)
            except (TypeError, ValueError) as exc:
                raise KickassError(
                    f"bad --{name.replace('_', '-')} {flag!r}: {exc}",
                    hint="see: kickass server --help",
                ) from None
        out[name] = config.resolve(
            name, flag, default=default, file=file, section="server", parse=parse
        )
    if out["log_level"] not in ("debug", "info", "warning", "error"):
        raise KickassError(
            f"bad log level {out['log_level']!r}", hint="debug, info, warning or error"
        )
    if out["instance_id"] is None:
        out["instance_id"] = f"{socket.gethostname()}:{out['probe_port']}"
    try:
        out["listen_host"], out["listen_port"] = parse_hostport(out["listen"])
    except ValueError as exc:
        raise KickassError(f"bad listen address {out['listen']!r}: {exc}") from None
    if out["schedule_file"]:
        from kickass_operations.schedule_file import load

        load(out["schedule_file"])  # a bad file stops the server before it binds anything
    return argparse.Namespace(**out)


def run(args: argparse.Namespace) -> int:
    from kickass_core import study_events
    from kickass_db import journal
    from kickass_db.schedule_store import ScheduleStore
    from kickass_db.study_store import StudyStore
    from kickass_db.trial_store import TrialStore

    from .api import create_app
    from .engine import ProbeEngine
    from .front import create_front
    from .policy import Policy

    args = resolve_settings(args)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    host, port = args.listen_host, args.listen_port
    store = StudyStore(args.database_url, instance=args.instance_id)
    store.ping()
    engine = ProbeEngine(
        store,
        Policy.from_env(),
        bind_host=args.probe_bind,
        probe_port=args.probe_port,
        server_version=__version__,
        journal_dir=args.journal_dir,
    )
    engine.open_sockets()  # KickassError with a hint: busy port, no raw-socket permission
    # Only once this process owns the probe port: a second server started by
    # mistake fails above and never touches the first one's live sessions.
    # First what an earlier run journaled but could not store (its final
    # states included), then the orphans that are still live after that.
    replayed = journal.replay(
        args.journal_dir, study_events.from_json, store.apply, skip=engine.writer.journal_path
    )
    if replayed["replayed"] or replayed["failed"]:
        log.warning(
            "stored %d writes an earlier run had journaled (%d refused, set aside in %s)",
            replayed["replayed"],
            replayed["failed"],
            args.journal_dir,
        )
    orphans = store.mark_orphans_incomplete()
    if orphans:
        log.warning(
            "marked %d sessions of this instance's (%s) earlier run incomplete",
            len(orphans),
            args.instance_id,
        )
    # Trial runners upload to the same app: the same database, their own tables.
    app = create_app(
        engine,
        store,
        {"PROBE_HOST": args.probe_host or None, "SCHEDULE_FILE": args.schedule_file},
        page=_page_config(args),
        trials=TrialStore(args.database_url),
        # Trial runner hosts claim their scheduled rounds here (schedule_api).
        schedule=ScheduleStore(args.database_url),
    )
    try:
        # The front resolves X-Forwarded-For itself (only from the trusted
        # proxy), so the app reads the client address from REMOTE_ADDR alone.
        http = create_front(
            app, host, port, threads=args.http_threads, trusted_proxy=args.trust_proxy
        )
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
        # waitress's run() swallows the KeyboardInterrupt our SIGTERM handler
        # raises and returns: log after it, not in an except clause.
        http.run()
    finally:
        log.info("shutting down: live sessions are recorded as incomplete")
        http.close()
        engine.stop()
        log.info("stopped")
    return 0


def _page_config(args: argparse.Namespace) -> PageConfig:
    from .volunteer_page import PageConfig

    extra: dict[str, Any] = {}
    if args.client_dir:
        extra["client_dir"] = Path(args.client_dir)
    return PageConfig(
        network_table=Path(args.network_table) if args.network_table else None,
        min_clients=args.page_min_clients,
        public_url=args.public_url,
        **extra,
    )
