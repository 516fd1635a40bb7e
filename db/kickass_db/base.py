"""The one declarative base of every model, with its naming convention.

Every model module imports this, and nothing here imports a model module back
(``kickass_db.models`` imports them all, for Alembic and the tests).
"""

from __future__ import annotations

from kickass_core import bounds
from sqlalchemy import CheckConstraint, MetaData
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


def check_bounds(f: bounds.Field) -> str:
    """SQL of a CHECK that column ``f.name`` lies within ``f``'s bounds
    (``kickass_core.bounds``). Both ends always: NaN sorts above every number
    in PostgreSQL, so the upper bound is what refuses it (and infinity); a
    time lies within the years every reader holds (``bounds.TIME_MIN`` and
    ``TIME_MAX``, which also refuse 'infinity')."""
    if f.kind == "time":
        low, high = (f"'{t:%Y-%m-%dT%H:%MZ}'" for t in (bounds.TIME_MIN, bounds.TIME_MAX))
        return f"{f.name} >= {low} AND {f.name} <= {high}"
    above = ">" if f.exclusive_minimum else ">="
    low = f"{f.name} {above} {f.minimum!r}"
    if f.kind == "float":
        # Every float is 0 or at least REAL_MIN (flow_record.real_ok): below
        # it, a reader's quotient or product underflows, an error in PostgreSQL.
        assert f.minimum == 0, f"{f.name}: a float's lower bound is 0"
        tiny = bounds.REAL_MIN
        low = (
            f"{f.name} >= {tiny!r}"
            if f.exclusive_minimum
            else f"({f.name} = 0 OR {f.name} >= {tiny!r})"
        )
    return f"{low} AND {f.name} <= {f.maximum!r}"


def bounds_checks(table: str) -> tuple[CheckConstraint, ...]:
    """The CHECK constraints of ``table``'s entry in ``kickass_core.bounds.TABLES``
    (named ``ck_<table>_<column>_bounds``; migration 0018 made them)."""
    return tuple(
        CheckConstraint(check_bounds(f), name=f"{f.name}_bounds") for f in bounds.checked(table)
    )
