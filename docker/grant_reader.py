"""Create the read-only database role for Grafana and notebooks: the analysis views, nothing else.

Dashboards and notebooks read only the views (db/README.md); this makes that
a rule the database enforces rather than a habit. The role gets CONNECT on
the database and SELECT on every view named ``v_*`` in schema public; it
gets nothing on the tables. That is enough because a view runs with its
owner's rights. Run after every ``kickass db upgrade`` (docker-compose's
``migrate`` service does): a migration that adds a view needs a new grant.
Idempotent; the password is updated when given.

    KICKASS_DATABASE_URL=postgresql://kickass:...@postgres/kickass \\
    KICKASS_GRAFANA_DB_USER=kickass_reader KICKASS_GRAFANA_DB_PASSWORD=... \\
    python docker/grant_reader.py
"""

from __future__ import annotations

import os
import sys

import psycopg
from psycopg import sql

# The analysis views (and any materialised view named like one; the rollups of
# migration 0012 are read through plain v_* views over them).
VIEWS = """
SELECT viewname FROM pg_views
WHERE schemaname = 'public' AND viewname LIKE 'v\\_%'
UNION
SELECT matviewname FROM pg_matviews
WHERE schemaname = 'public' AND matviewname LIKE 'v\\_%'
ORDER BY 1
"""


def grant_reader(conn: psycopg.Connection, role: str, password: str | None = None) -> list[str]:
    """Create or update ``role`` and grant it the views; returns the views granted."""
    ident = sql.Identifier(role)
    # Utility statements take no bind parameters: the password goes in as a
    # quoted literal, composed client-side.
    secret = sql.SQL(" PASSWORD {}").format(sql.Literal(password)) if password else sql.SQL("")
    exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
    verb = "ALTER" if exists else "CREATE"
    conn.execute(sql.SQL(verb + " ROLE {} LOGIN NOINHERIT").format(ident) + secret)
    database = conn.execute("SELECT current_database()").fetchone()
    assert database is not None
    conn.execute(
        sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(sql.Identifier(database[0]), ident)
    )
    conn.execute(sql.SQL("GRANT USAGE ON SCHEMA public TO {}").format(ident))
    # Whatever it was given before (by hand, say), tables are not for it.
    conn.execute(sql.SQL("REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {}").format(ident))
    views = [row[0] for row in conn.execute(VIEWS)]
    for view in views:
        conn.execute(sql.SQL("GRANT SELECT ON {} TO {}").format(sql.Identifier(view), ident))
    return views


def main() -> int:
    url = os.environ.get("KICKASS_DATABASE_URL")
    role = os.environ.get("KICKASS_GRAFANA_DB_USER")
    if not url or not role:
        print(
            "ERROR: set KICKASS_DATABASE_URL (an owner of the schema) and "
            "KICKASS_GRAFANA_DB_USER (the role to create)",
            file=sys.stderr,
        )
        return 2
    try:
        with psycopg.connect(url) as conn:
            views = grant_reader(conn, role, os.environ.get("KICKASS_GRAFANA_DB_PASSWORD"))
    except psycopg.Error as exc:
        print(f"ERROR: cannot grant {role} the analysis views: {exc}", file=sys.stderr)
        return 1
    if not views:
        print("ERROR: no v_* views found: run `kickass db upgrade` first", file=sys.stderr)
        return 1
    print(f"{role} may read {len(views)} views: {', '.join(views)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
