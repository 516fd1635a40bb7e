"""Where the Alembic migrations are, and running them in code.

The migrations live in ``db/migrations`` beside this package in a source
tree, and inside it (``kickass_db/migrations``) in a built wheel, so an
installed package finds them without any environment variable.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from kickass_core.errors import KickassError
from sqlalchemy import URL

from .engine import check_connection, make_engine, sqlalchemy_url

_HERE = Path(__file__).resolve().parent
# Wheel layout first, then the source tree (the package's own project folder).
_CANDIDATES = (_HERE / "migrations", _HERE.parent / "migrations")


def upgrade(url: str | None = None, revision: str = "head") -> None:
    """Migrate the database to ``revision`` (what `kickass db upgrade` does), in code."""
    engine = make_engine(url)
    try:
        check_connection(engine)
        with engine.begin() as conn:
            command.upgrade(alembic_config(url, connection=conn), revision)
    finally:
        engine.dispose()


def migrations_dir() -> Path:
    """The migrations shipped with this package."""
    for path in _CANDIDATES:
        if (path / "env.py").is_file():
            return path
    raise KickassError(
        "Alembic migrations not found next to the kickass_db package "
        f"(looked in {', '.join(str(p) for p in _CANDIDATES)})",
        hint="reinstall kickass-db: its wheel carries db/migrations",
    )


def alembic_config(url: str | URL | None = None, connection: Any = None) -> Config:
    """Alembic configured in code, so no alembic.ini is needed at run time.

    With ``connection`` given, migrations run on it (tests and ``kickass db``
    use this to check reachability first and report errors cleanly).
    """
    # stdout looked up now, not at import time, so redirection (and pytest's
    # capture) applies to `kickass db history`.
    config = Config(stdout=sys.stdout)
    config.set_main_option("script_location", str(migrations_dir()))
    config.set_main_option("path_separator", "os")
    if url is not None:
        # ConfigParser interpolation would choke on a '%' in a password.
        rendered = sqlalchemy_url(url).render_as_string(hide_password=False)
        config.set_main_option("sqlalchemy.url", rendered.replace("%", "%%"))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def head_revision() -> str | None:
    """The newest migration's revision, or None when the scripts are not available."""
    try:
        return ScriptDirectory.from_config(alembic_config()).get_current_head()
    except KickassError:
        return None
