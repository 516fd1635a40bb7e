"""`kickass db`: migrate the measurement database (Alembic, configured in code).

    kickass db upgrade [REV]     to REV, default the newest (head)
    kickass db downgrade REV     back to REV ("base" = empty database)
    kickass db current           the revision the database is at
    kickass db history           every migration, newest first
    kickass db partitions [list] the raw tables' day partitions (0022): days, days ahead
    kickass db partitions ahead [--days N]          today's and N days ahead (7)
    kickass db partitions add TABLE FIRST [LAST]    past days (an old capture's, say)

The URL comes from --database-url, else KICKASS_DATABASE_URL.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator
from datetime import date

from alembic import command
from alembic.runtime.migration import MigrationContext
from alembic.util.exc import CommandError
from kickass_core.cli import group
from kickass_core.errors import KickassError
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from . import engine as db
from . import migrations, partitions


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sub = group(
        subparsers,
        "db",
        help="migrate the measurement database",
        description="Migrate the measurement database (PostgreSQL) with its Alembic migrations.",
    )

    def url_option(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--database-url",
            help=f"PostgreSQL URL (default: ${db.ENV_DATABASE_URL}, "
            "else database_url in the $KICKASS_CONFIG file)",
        )

    p = sub.add_parser("upgrade", help="migrate up to a revision (default: head)")
    p.add_argument("revision", nargs="?", default="head")
    p.add_argument("--sql", action="store_true", help="print the SQL instead of running it")
    url_option(p)
    p.set_defaults(func=cmd_upgrade)

    p = sub.add_parser("downgrade", help="migrate down to a revision ('base' drops everything)")
    p.add_argument("revision")
    p.add_argument("--sql", action="store_true", help="print the SQL instead of running it")
    url_option(p)
    p.set_defaults(func=cmd_downgrade)

    p = sub.add_parser("current", help="show the database's revision")
    url_option(p)
    p.set_defaults(func=cmd_current)

    p = sub.add_parser("history", help="list the migrations")
    url_option(p)  # accepted for symmetry; history reads only the scripts
    p.set_defaults(func=cmd_history)

    p = sub.add_parser(
        "partitions",
        help="the raw tables' day partitions: list, make ahead, add past days",
        description="probe_outcomes and router_telemetry hold one partition per UTC day "
        "(migration 0022); a write for a day without one is refused. The housekeeping item "
        "makes them ahead; `add` makes past days, e.g. before ingesting an old capture.",
    )
    url_option(p)
    p.set_defaults(func=cmd_partitions, partitions_command="list", days=partitions.AHEAD)
    psub = p.add_subparsers(dest="partitions_command", metavar="ACTION")
    q = psub.add_parser("list", help="per table: its days and how many are ahead of today")
    url_option(q)
    q = psub.add_parser("ahead", help="make today's and the next days' partitions")
    q.add_argument("--days", type=int, default=partitions.AHEAD, help="days ahead (default 7)")
    url_option(q)
    q = psub.add_parser("add", help="make the partitions of the days FIRST..LAST")
    q.add_argument("table", choices=sorted(partitions.PARTITIONED))
    q.add_argument("first", type=_day, help="YYYY-MM-DD (UTC)")
    q.add_argument("last", type=_day, nargs="?", help="YYYY-MM-DD (default: FIRST)")
    url_option(q)


def cmd_upgrade(args: argparse.Namespace) -> int:
    return _migrate(args, command.upgrade, "upgraded")


def cmd_downgrade(args: argparse.Namespace) -> int:
    return _migrate(args, command.downgrade, "downgraded")


def _migrate(args: argparse.Namespace, step: Callable[..., None], verb: str) -> int:
    url = db.resolve_database_url(args.database_url)
    if args.sql:
        # Offline: no connection, the DDL goes to stdout for a DBA to review.
        with _alembic_errors():
            step(migrations.alembic_config(url), args.revision, sql=True)
        return 0
    with _connection(url) as conn:
        before = _revision(conn)
        with _alembic_errors():
            step(migrations.alembic_config(url, connection=conn), args.revision)
        after = _revision(conn)
    head = migrations.head_revision()
    label = f"{after or 'base'}{' (head)' if after == head else ''}"
    print(f"{verb} {db.describe_url(url)}: {before or 'base'} -> {label}")
    return 0


def cmd_current(args: argparse.Namespace) -> int:
    url = db.resolve_database_url(args.database_url)
    with _connection(url) as conn:
        current = _revision(conn)
    head = migrations.head_revision()
    if current is None:
        print(f"{db.describe_url(url)}: empty (no migrations applied; run: kickass db upgrade)")
    elif current == head:
        print(f"{db.describe_url(url)}: {current} (head)")
    else:
        print(f"{db.describe_url(url)}: {current} (head is {head}; run: kickass db upgrade)")
    return 0


def cmd_history(_args: argparse.Namespace) -> int:
    with _alembic_errors():
        command.history(migrations.alembic_config(), indicate_current=False)
    return 0


MAX_ADD_DAYS = 3660  # ten years of days at once is a mistake, not a backfill


def _day(text: str) -> date:
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a day (YYYY-MM-DD): {text!r}") from None


def cmd_partitions(args: argparse.Namespace) -> int:
    url = db.resolve_database_url(args.database_url)
    with partitions.Partitions(url) as store:
        db.check_connection(store.engine)
        if args.partitions_command == "ahead":
            if not 0 <= args.days <= MAX_ADD_DAYS:
                raise KickassError(f"--days must be 0..{MAX_ADD_DAYS}, got {args.days}")
            for table, made in store.ensure_ahead(args.days).items():
                print(_made(table, made))
        elif args.partitions_command == "add":
            last = args.last or args.first
            if last < args.first or (last - args.first).days >= MAX_ADD_DAYS:
                raise KickassError(
                    f"{args.first}..{last} is not a range of at most {MAX_ADD_DAYS} days"
                )
            print(_made(args.table, store.ensure_days(args.table, args.first, last)))
        for table, st in store.status().items():
            print(
                f"{table}: {st['partitions']} partitions ({st['first_day']} .. {st['last_day']}), "
                f"today {'made' if st['today'] else 'MISSING'}, {st['days_ahead']} days ahead"
            )
    return 0


def _made(table: str, days: list[date]) -> str:
    return f"{table}: {len(days)} partition{'' if len(days) == 1 else 's'} made " + " ".join(
        map(str, days)
    )


@contextlib.contextmanager
def _connection(url: str) -> Iterator[Connection]:
    """A connection whose work is committed at the end, opened after a
    reachability check that turns a refused connection into one ERROR line
    instead of a traceback."""
    engine = db.make_engine(url)
    try:
        db.check_connection(engine)
        with engine.connect() as conn:
            yield conn
            conn.commit()
    finally:
        engine.dispose()


def _revision(conn: Connection) -> str | None:
    return MigrationContext.configure(conn).get_current_revision()


@contextlib.contextmanager
def _alembic_errors() -> Iterator[None]:
    # Alembic reports a bad revision as CommandError; to the operator that is
    # an input mistake like any other.
    try:
        yield
    except CommandError as exc:
        raise KickassError(str(exc), hint="see: kickass db history") from exc
    except DBAPIError as exc:
        reason = str(exc.orig or exc).strip().splitlines()[0]
        raise KickassError(
            f"migration failed: {reason}",
            hint="migrations run in one transaction: nothing was applied",
        ) from exc
