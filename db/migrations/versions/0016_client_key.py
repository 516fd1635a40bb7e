"""One definition of "a client" for the volunteer page: ``client_key(address)``.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-28

The volunteer page shows a group of other volunteers only when at least k
clients are in it, and counted a client by the install id the client sends
(or, without one, its address). An install id is whatever the client writes:
five runs from one address with five made-up ids counted as five clients,
and put a group of two real volunteers on the attacker's page (issue 27).

``client_key(address)`` is the address block a session was requested from:
the /24 of an IPv4 address, the /48 of an IPv6 one (``198.51.100.0/24``),
NULL for none. A volunteer cannot mint blocks: a home connection has one
IPv4 address and one IPv6 prefix (a /48 to a /64, hence /48); more blocks
cost an address in another network each. Volunteers behind one NAT, or on
one provider's /24, count once: their results share a path, and the page
shows groups later rather than ever fewer than k networks.

``mv_size_clients`` (0014) is rebuilt on it, with the same columns; the page
counts its groups with the same function (``kickass_server.volunteer_page``).
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CLIENT_KEY = """
CREATE FUNCTION client_key(address inet) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT network(set_masklen(address, CASE family(address) WHEN 4 THEN 24 ELSE 48 END))::text
$$
"""

FINAL = "('complete', 'ended', 'expired', 'incomplete')"

# Per phase and IP length, the distinct clients that measured it in a finished session.
SIZE_CLIENTS = f"""
SELECT x.phase, x.ip_len, count(DISTINCT client_key(s.source_address)) AS clients
FROM (SELECT DISTINCT session_pk, phase, ip_len::integer AS ip_len FROM probe_outcomes) x
JOIN sessions s ON s.id = x.session_pk
WHERE s.state IN {FINAL}
GROUP BY x.phase, x.ip_len
"""

# 0014's: a client was its install id, else its address.
SIZE_CLIENTS_0014 = f"""
SELECT x.phase, x.ip_len,
       count(DISTINCT coalesce(c.install_id, 'addr:' || host(s.source_address))) AS clients
FROM (SELECT DISTINCT session_pk, phase, ip_len::integer AS ip_len FROM probe_outcomes) x
JOIN sessions s ON s.id = x.session_pk
LEFT JOIN clients c ON c.id = s.client_id
WHERE s.state IN {FINAL}
GROUP BY x.phase, x.ip_len
"""


def _size_clients(body: str) -> None:
    op.execute("DROP MATERIALIZED VIEW mv_size_clients")
    op.execute(f"CREATE MATERIALIZED VIEW mv_size_clients AS {body}")
    # REFRESH ... CONCURRENTLY needs a unique index.
    op.execute("CREATE UNIQUE INDEX ux_mv_size_clients ON mv_size_clients (phase, ip_len)")


def upgrade() -> None:
    op.execute(CLIENT_KEY)
    _size_clients(SIZE_CLIENTS)


def downgrade() -> None:
    _size_clients(SIZE_CLIENTS_0014)
    op.execute("DROP FUNCTION client_key(inet)")
