"""Alembic environment for the measurement database.

Run by ``kickass db ...`` (configured in code, may hand over an open
connection) or by developers with ``alembic -c db/alembic.ini ...``, where
the URL comes from KICKASS_DATABASE_URL.
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from kickass_db import make_engine, resolve_database_url, sqlalchemy_url
from kickass_db.models import Base
from kickass_db.partitions import is_partition
from sqlalchemy import Connection

config = context.config
if config.config_file_name is not None and config.get_section("loggers") is not None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def include_name(name: str | None, type_: str, parent_names: object) -> bool:
    """The day partitions (migration 0022) are made at run time, not by the
    models: autogenerate compares the partitioned tables, not each day."""
    return not (type_ == "table" and name is not None and is_partition(name))


def _url() -> str:
    return config.get_main_option("sqlalchemy.url") or resolve_database_url(None)


def run_migrations_offline() -> None:
    """``--sql``: print the DDL for a DBA instead of running it."""
    context.configure(
        url=sqlalchemy_url(_url()),
        target_metadata=target_metadata,
        include_name=include_name,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection, target_metadata=target_metadata, include_name=include_name
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(_url())
    try:
        with engine.connect() as connection:
            _run(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
