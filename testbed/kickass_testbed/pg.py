"""Embedded PostgreSQL for the demo and the tests (the pinned ``pgserver`` wheel).

The server listens on a unix socket only, inside its data directory, so
several can run side by side with no port to choose, and it is stopped on
exit, also when the block raises. As root, pgserver runs postgres as its own
``pgserver`` user (postgres refuses to run as root).
"""

from __future__ import annotations

import atexit
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import kickass_db as db
import psycopg

with warnings.catch_warnings():
    # platformdirs warns when XDG_RUNTIME_DIR is unset (root shells, CI):
    # pgserver only uses that directory when the socket path is too long.
    warnings.simplefilter("ignore")
    import pgserver
    from pgserver.postgres_server import PostgresServer, get_server
    from pgserver.utils import PostmasterInfo


class EmbeddedPostgres:
    """One embedded server on ``data_dir``; ``url`` stays valid across stop/start.

    stop() and start() exist so tests can restart the database under a
    running client, the way a real database restarts under the server.
    """

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir).resolve()
        self._server: Any = None
        self._system_user: str | None = None
        self.url = ""

    def start(self) -> str:
        if self._server is None:
            self.data_dir.parent.mkdir(parents=True, exist_ok=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._server = get_server(self.data_dir, cleanup_mode="stop")
            # We stop it ourselves, deterministically; pgserver's own atexit
            # hook would run again at interpreter exit.
            atexit.unregister(self._server._cleanup)
            self._system_user = self._server.system_user
            self.url = self._server.get_uri()
        return self.url

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        try:
            server.cleanup()
        finally:
            # pgserver skips the stop (and keeps a stale handle) when its pid
            # list names another process, e.g. left by a crashed run.
            PostgresServer._instances.pop(self.data_dir, None)
            self._force_stop()

    def _force_stop(self) -> None:
        info = PostmasterInfo.read_from_pgdata(self.data_dir)
        if info is None or not info.is_running():
            return
        try:
            pgserver.pg_ctl(  # type: ignore[attr-defined]  # made at import, one per program
                ["-w", "-m", "fast", "stop"],
                pgdata=self.data_dir,
                user=self._system_user,
                timeout=30,
            )
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            # is_running() found the process, so ``process`` is set.
            info.process.kill()  # type: ignore[attr-defined]  # typed None in __init__, set later

    def __enter__(self) -> EmbeddedPostgres:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def embedded_postgres(data_dir: Path | None = None) -> Iterator[str]:
    """Run PostgreSQL for the block; yields its ``postgresql://`` unix-socket URL.

    Superuser ``postgres``, trust authentication, database ``postgres``.
    With ``data_dir`` None the cluster lives in a temporary directory that is
    removed afterwards; a given ``data_dir`` is kept (and reused next time).
    """
    tmp: Path | None = None
    if data_dir is None:
        tmp = Path(tempfile.mkdtemp(prefix="kickass-pg-"))
        data_dir = tmp / "pgdata"
    try:
        with EmbeddedPostgres(data_dir) as pg:
            yield pg.url
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def create_database(server_url: str, name: str, template: str | None = None) -> str:
    """Create database ``name`` (optionally a copy of ``template``) on the server
    of ``server_url``; returns the URL of the new database."""
    clause = f" TEMPLATE {_ident(template)}" if template else ""
    _admin(server_url, f"CREATE DATABASE {_ident(name)}{clause}")
    return db.libpq_url(server_url, name)


def drop_database(server_url: str, name: str) -> None:
    """Drop ``name`` if it exists, disconnecting whoever still uses it."""
    _admin(server_url, f"DROP DATABASE IF EXISTS {_ident(name)} WITH (FORCE)")


def _admin(server_url: str, sql: str) -> None:
    # CREATE/DROP DATABASE refuse to run inside a transaction block.
    with psycopg.connect(db.libpq_url(server_url), autocommit=True) as conn:
        conn.execute(sql)


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'
