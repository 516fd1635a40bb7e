"""The one declarative base of every model, with its naming convention.

Every model module imports this, and nothing here imports a model module back
(``kickass_db.models`` imports them all, for Alembic and the tests).
"""

from __future__ import annotations

from sqlalchemy import MetaData
from sqlalchemy.orm import DeclarativeBase

# Deterministic constraint names: migrations can drop or alter a constraint by
# name, and a name chosen by PostgreSQL would differ between databases.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def check_in(column: str, values: tuple[str, ...]) -> str:
    """SQL of a CHECK that ``column`` holds one of ``values``."""
    return f"{column} IN ({', '.join(repr(v) for v in values)})"
