"""Database URLs and engines.

Operators give a plain libpq URL (``postgresql://user:pw@host/db``, or the
unix-socket form ``postgresql://user@/db?host=/run/postgresql``); SQLAlchemy
needs the driver named, so every URL is rewritten to psycopg 3 here, once.
Precedence: explicit argument (``--database-url``) > ``KICKASS_DATABASE_URL``.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from kickass_core import config
from kickass_core.errors import KickassError
from sqlalchemy import URL, Engine, create_engine, event, make_url, text
from sqlalchemy.exc import ArgumentError, DBAPIError

ENV_DATABASE_URL = "KICKASS_DATABASE_URL"
DRIVER = "postgresql+psycopg"
ACCEPTED_SCHEMES = ("postgresql", "postgres", DRIVER)
CONNECT_TIMEOUT_S = 10
URL_HINT = (
    f"pass --database-url or set {ENV_DATABASE_URL}, e.g. "
    "postgresql://kickass:secret@localhost/kickass "
    "or postgresql://kickass@/kickass?host=/run/postgresql (unix socket)"
)


def resolve_database_url(explicit: str | None = None) -> str:
    """The URL to use: flag > KICKASS_DATABASE_URL > ``database_url`` in the config file."""
    url = config.resolve("database_url", explicit or None, file=config.load_file(None))
    if not url:
        raise KickassError("no database URL given", hint=URL_HINT)
    return url


def sqlalchemy_url(url: str | URL) -> URL:
    """A libpq-style URL rewritten for SQLAlchemy's psycopg 3 dialect."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as exc:
        # ValueError: a port that is not a number (postgresql://u@host:abc/db).
        raise KickassError(f"not a database URL: {_mask(str(url))}", hint=URL_HINT) from exc
    if parsed.drivername not in ACCEPTED_SCHEMES:
        raise KickassError(
            f"unsupported database URL scheme {parsed.drivername!r}: "
            "the measurement database is PostgreSQL",
            hint=URL_HINT,
        )
    _check_query(parsed)
    parsed = parsed.set(drivername=DRIVER)
    # libpq also accepts the socket directory percent-encoded in the host
    # part (postgresql://%2Frun%2Fpostgresql/db); SQLAlchemy would take it as
    # a host name, so move it to the ``host`` parameter that psycopg reads.
    if parsed.host and parsed.host.lower().startswith("%2f"):
        parsed = URL.create(
            parsed.drivername,
            username=parsed.username,
            password=parsed.password,
            port=parsed.port,
            database=parsed.database,
            query={**parsed.query, "host": unquote(parsed.host)},
        )
    return parsed


def _check_query(parsed: URL) -> None:
    """Refuse query parameters the driver would fail on at the first connect
    with a traceback (a port that is not a number, a bad timeout)."""
    for key, numbers in (("port", True), ("connect_timeout", False)):
        raw = parsed.query.get(key)
        values = [raw] if isinstance(raw, str) else list(raw or ())
        for value in values:
            parts = value.split(",") if numbers else [value]
            for part in parts:
                ok = part.strip().isdigit() and (not numbers or 0 < int(part) < 65536)
                if not ok:
                    raise KickassError(
                        f"bad {key}={part!r} in the database URL {_mask(str(parsed))}",
                        hint="a port is a number 1-65535 (several: 5432,5433); "
                        "connect_timeout is whole seconds. " + URL_HINT,
                    )


def describe_url(url: str | URL) -> str:
    """The URL with its password hidden, for messages and logs."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return _mask(str(url))
    if parsed.drivername == DRIVER:
        parsed = parsed.set(drivername="postgresql")  # as the operator wrote it
    # Unquoted so a socket directory reads as a path, not %2F...
    return unquote(parsed.render_as_string(hide_password=True))


def _mask(raw: str) -> str:
    # Unparseable URLs can still hold a password: show the scheme only.
    return raw.split("://", 1)[0] + "://..." if "://" in raw else "<unparseable>"


def make_engine(url: str | None = None, **kwargs: Any) -> Engine:
    """An engine for ``url`` (resolved as above), safe to share between threads.

    ``pool_pre_ping`` tests a pooled connection before handing it out, so
    after a database restart the next call reconnects instead of failing on
    a dead socket. Every connection runs in UTC so timestamps read back are
    UTC-aware whatever the server's TimeZone is.
    """
    sa_url = sqlalchemy_url(resolve_database_url(url))
    connect_args: dict[str, Any] = {}
    if "connect_timeout" not in sa_url.query:
        # libpq waits forever for an unanswering host by default.
        connect_args["connect_timeout"] = CONNECT_TIMEOUT_S
    if "application_name" not in sa_url.query:
        connect_args["application_name"] = "kickass"
    connect_args.update(kwargs.pop("connect_args", {}))
    engine = create_engine(sa_url, pool_pre_ping=True, connect_args=connect_args, **kwargs)
    event.listen(engine, "connect", _set_utc)
    return engine


def _set_utc(dbapi_connection: Any, _record: Any) -> None:
    # psycopg 3 is in autocommit=False mode here: commit so the SET is not
    # rolled back with the pool's first reset.
    with dbapi_connection.cursor() as cur:
        cur.execute("SET TIME ZONE 'UTC'")
    dbapi_connection.commit()


def check_connection(engine: Engine) -> None:
    """Raise KickassError (not a traceback) when the database cannot be reached."""
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except DBAPIError as exc:
        raise unreachable(engine.url, exc) from exc


def unreachable(url: str | URL, exc: BaseException) -> KickassError:
    reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
    return KickassError(
        f"cannot reach the database at {describe_url(url)}: {reason}",
        hint="is PostgreSQL running and the URL right? " + URL_HINT,
    )


def libpq_url(url: str | URL, database: str | None = None) -> str:
    """``url`` as libpq/psycopg take it (no driver name), optionally for another database."""
    parsed = sqlalchemy_url(url).set(drivername="postgresql")
    if database is not None:
        parsed = parsed.set(database=database)
    return parsed.render_as_string(hide_password=False)
