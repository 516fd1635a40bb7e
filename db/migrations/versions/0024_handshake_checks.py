"""The handshake of a flow and of a trial period as a CHECK.

Revision ID: 0024
Revises: 0023
Create Date: 2026-11-28

``flows.handshake`` and ``trial_periods.handshake`` are one of the flow
record's handshakes (``kickass_core.flow_record.HANDSHAKES``) or NULL, as the
API's body and the record's field already say; the database held any text.
A value outside them, stored before this revision, is copied whole to
``quarantine`` (action ``nulled``, as 0018 does for a bound) and set to
NULL, and the upgrade says how many; the downgrade drops the CHECKs and puts
the values back.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from alembic import context, op
from sqlalchemy import text

revision: str = "0024"
down_revision: str | None = "0023"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

log = logging.getLogger("kickass.db")  # what `kickass db upgrade` prints

# Frozen here (a migration does not follow the code); kickass_core.flow_record.HANDSHAKES.
HANDSHAKES = ("paper", "padded")
KEYS = {"flows": ("id",), "trial_periods": ("trial_pk", "period_index")}
ALLOWED = "handshake IN (" + ", ".join(repr(h) for h in HANDSHAKES) + ")"


def _key(table: str) -> str:
    return "jsonb_build_object(" + ", ".join(f"'{k}', q.{k}" for k in KEYS[table]) + ")"


def upgrade() -> None:
    for table in KEYS:
        outside = f"handshake IS NOT NULL AND NOT ({ALLOWED})"
        op.execute(f"""
            INSERT INTO quarantine (table_name, row_key, columns, "row", action, revision)
            SELECT '{table}', {_key(table)}, ARRAY['handshake'], to_jsonb(q), 'nulled', '{revision}'
            FROM {table} q WHERE {outside}
        """)
        if not context.is_offline_mode():
            n = op.get_bind().execute(text(f"SELECT count(*) FROM {table} WHERE {outside}"))
            count = n.scalar_one()
            if count:
                log.warning(
                    "%s: %s.handshake not one of %s in %d rows: set to NULL (kept in table "
                    "quarantine)",
                    revision,
                    table,
                    HANDSHAKES,
                    count,
                )
        op.execute(f"UPDATE {table} SET handshake = NULL WHERE {outside}")
        op.execute(f"ALTER TABLE {table} ADD CONSTRAINT ck_{table}_handshake CHECK ({ALLOWED})")


def downgrade() -> None:
    for table, keys in KEYS.items():
        op.execute(f"ALTER TABLE {table} DROP CONSTRAINT ck_{table}_handshake")
        match = " AND ".join(
            f"t.{k} = (q.row_key ->> '{k}')::{'bigint' if k in ('id', 'trial_pk') else 'integer'}"
            for k in keys
        )
        op.execute(f"""
            UPDATE {table} t SET handshake = q."row" ->> 'handshake'
            FROM quarantine q
            WHERE q.revision = '{revision}' AND q.table_name = '{table}' AND {match}
        """)
        op.execute(
            f"DELETE FROM quarantine WHERE revision = '{revision}' AND table_name = '{table}'"
        )
