"""The measurement database: models, URL handling and engines, the StudyStore,
the ordered writer, migrations and the `kickass db` / `kickass telemetry` commands.

The common entry points are re-exported here (``kickass_db.make_engine``,
``kickass_db.upgrade``) so callers need not know the module layout.
"""

from __future__ import annotations

from .engine import (
    ENV_DATABASE_URL,
    check_connection,
    describe_url,
    libpq_url,
    make_engine,
    resolve_database_url,
    sqlalchemy_url,
)
from .migrations import alembic_config, head_revision, migrations_dir, upgrade
from .retry import DatabaseUnavailable, RetryPolicy, retry

__all__ = [
    "ENV_DATABASE_URL",
    "DatabaseUnavailable",
    "RetryPolicy",
    "alembic_config",
    "check_connection",
    "describe_url",
    "head_revision",
    "libpq_url",
    "make_engine",
    "migrations_dir",
    "resolve_database_url",
    "retry",
    "sqlalchemy_url",
    "upgrade",
]
