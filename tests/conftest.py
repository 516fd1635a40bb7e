"""Database fixtures: every test that touches the database gets a real PostgreSQL.

- ``pg_server_url``: the server, once per session — $KICKASS_TEST_DATABASE_URL
  (a role allowed to CREATE DATABASE) or an embedded server in a temp dir.
- ``database_url``: a fresh database per test, already migrated to head.
  Migrating costs about a second, so it happens once, into a template
  database, and each test gets a cheap ``CREATE DATABASE ... TEMPLATE`` copy,
  dropped afterwards even when the test fails.
- ``empty_database_url``: a fresh database with no schema (migration tests).
- ``store``: a StudyStore on ``database_url``.

Other fixtures live in their own modules, listed in ``pytest_plugins``.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import kickass_db as db
import pytest
from kickass_db.study_store import StudyStore
from kickass_testbed.pg import create_database, drop_database, embedded_postgres

pytest_plugins: list[str] = []

ENV_TEST_DATABASE_URL = "KICKASS_TEST_DATABASE_URL"


@pytest.fixture(scope="session")
def pg_server_url() -> Iterator[str]:
    external = os.environ.get(ENV_TEST_DATABASE_URL)
    if external:
        yield external
        return
    with embedded_postgres() as url:
        yield url


@pytest.fixture(scope="session")
def _migrated_template(pg_server_url: str) -> Iterator[str]:
    name = f"kickass_template_{secrets.token_hex(4)}"
    try:
        db.upgrade(create_database(pg_server_url, name))
        yield name
    finally:
        drop_database(pg_server_url, name)


def _fresh_database(server_url: str, template: str | None) -> Iterator[str]:
    name = f"test_{secrets.token_hex(6)}"
    try:
        yield create_database(server_url, name, template=template)
    finally:
        # WITH (FORCE) inside: a test that leaks a pooled connection must
        # not leak its database too.
        drop_database(server_url, name)


@pytest.fixture
def database_url(pg_server_url: str, _migrated_template: str) -> Iterator[str]:
    yield from _fresh_database(pg_server_url, _migrated_template)


@pytest.fixture
def empty_database_url(pg_server_url: str) -> Iterator[str]:
    yield from _fresh_database(pg_server_url, None)


@pytest.fixture
def store(database_url: str) -> Iterator[StudyStore]:
    s = StudyStore(database_url)
    try:
        yield s
    finally:
        s.close()
