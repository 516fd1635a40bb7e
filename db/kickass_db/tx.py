"""The one transaction policy under every store (study, trials, Atlas, telemetry, schedule).

A store owns an engine and runs each unit of work in one short transaction
through ``StoreBase.run``. A connection killed under a call by a database
restart (``pool_pre_ping`` only checks at checkout) is retried once on a
fresh connection; while the database is really down the call raises
``DatabaseUnavailable``, which callers retry with ``kickass_db.retry``. Every
store write is idempotent, so that retry is always safe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Self, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import InterfaceError, OperationalError

from . import engine as db
from .retry import unavailable

T = TypeVar("T")


class StoreBase:
    """An engine on ``database_url`` (flag > $KICKASS_DATABASE_URL > config file)."""

    def __init__(self, database_url: str | None = None, **engine_options: Any) -> None:
        self.database_url = db.resolve_database_url(database_url)
        self.engine: Engine = db.make_engine(self.database_url, **engine_options)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({db.describe_url(self.database_url)})"

    def run(self, work: Callable[[Connection], T], *, isolation: str | None = None) -> T:
        """``work(conn)`` in one transaction, with the restart policy above."""
        for attempt in (1, 2):
            try:
                conn = self.engine.connect()
                try:
                    if isolation:
                        conn.execution_options(isolation_level=isolation)
                    with conn.begin():
                        return work(conn)
                finally:
                    conn.close()
            except (OperationalError, InterfaceError) as exc:
                if attempt == 1 and exc.connection_invalidated:
                    continue
                raise unavailable(db.describe_url(self.database_url), exc) from exc
        raise AssertionError("unreachable")
