"""Every study source of the durable counts in ``v_drop_rollup``.

Revision ID: 0026
Revises: 0025
Create Date: 2026-11-28

Issue 26 item 1 (study sources as a registry, ``kickass_core.sources``):
``v_drop_rollup``'s counted half read the volunteers' rows of
``unit_counts_daily`` and ``unit_count_changes`` by name (0020), so a third
source writing its per-unit counts there (its one migration adds its name to
the counts' ``source`` CHECK) reached no report, no dashboard. Now that half
is every source of the counts but Atlas, whose rows come from its own
tables (``mv_atlas_probe_drop``) as before. The view keeps its columns;
today's rows are the same (only volunteers write the counts).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from alembic import op

revision: str = "0026"
down_revision: str | None = "0025"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _migration(prefix: str) -> ModuleType:
    """An earlier migration module, for its view definitions."""
    (path,) = Path(__file__).parent.glob(f"{prefix}_*.py")
    spec = importlib.util.spec_from_file_location(f"_kickass_migration_{prefix}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_0020 = _migration("0020")
_COUNTED = _0020._VOLUNTEER_DROP
# The counted half per source: its name from the row, the volunteers' filter
# now "not Atlas" (Atlas's rows come from its own tables below).
_EVERY_SOURCE = (
    _COUNTED.replace("SELECT 'volunteer'::text AS source,", "SELECT d.source,", 1)
    .replace("SELECT day, phase, ip_len, units,", "SELECT source, day, phase, ip_len, units,")
    .replace("WHERE source = 'volunteer'", "WHERE source <> 'atlas'")
    .replace("GROUP BY d.day, d.phase, d.ip_len", "GROUP BY d.source, d.day, d.phase, d.ip_len")
)
assert _COUNTED.count("SELECT day, phase, ip_len, units,") == 2, "0020's counted half changed"
assert _EVERY_SOURCE.count("WHERE source <> 'atlas'") == 2 and "'volunteer'" not in _EVERY_SOURCE
assert _COUNTED in _0020.V_DROP_ROLLUP
V_DROP_ROLLUP = _0020.V_DROP_ROLLUP.replace(_COUNTED, _EVERY_SOURCE)
COMMENT = (
    "Per day, phase and IP length: every study source of the durable counts (volunteers; "
    "a source registered in kickass.sources that writes unit_counts) from their day rollup "
    "(unit_counts_daily) plus the changes not yet folded into it (migrations 0020, 0026), "
    "Atlas from its own tables per campaign, probe country and ASN. Summed over days it "
    "equals v_size_drop_all / v_split_drop_all and the Atlas rows of the *_by_source views."
)


def _replace(create: str, comment: str) -> None:
    op.execute(create.replace("CREATE VIEW", "CREATE OR REPLACE VIEW", 1))
    op.execute(f"COMMENT ON VIEW v_drop_rollup IS '{comment.replace(chr(39), chr(39) * 2)}'")


def upgrade() -> None:
    _replace(V_DROP_ROLLUP, COMMENT)


def downgrade() -> None:
    _replace(_0020.V_DROP_ROLLUP, _0020.ROLLUP_COMMENTS["v_drop_rollup"])
