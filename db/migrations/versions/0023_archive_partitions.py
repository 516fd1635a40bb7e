"""The Parquet archive of the raw tables' days, and their retirement.

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-02

A day of ``probe_outcomes`` or ``router_telemetry`` (a partition of 0022)
leaves the database only through ``kickass archive retire``
(``kickass_analysis.archive``): its rows are written as Parquet, re-read and
verified, recorded in ``archive_partitions``, then the partition is detached
(``DETACH PARTITION ... CONCURRENTLY``) and dropped.

- ``archive_partitions``: one row per archived day (table, day, bounds, rows,
  bytes, files, the manifest's sha256, and when it was claimed, written,
  verified, detached, dropped, restored). A CHECK refuses a detached or
  dropped day without a verified archive.
- ``archive_secrets``: the salt of the client key the sessions' sidecar
  carries hashed (``client_key``: 32 bytes from ``gen_random_uuid``, which
  draws from the operating system's strong random source).
- ``archive_lock_key(table)``: the advisory lock of a table's days. A retire
  claims a day under it (exclusive, per day); a late write for a day takes
  it shared and asks ``archive_claimed(table, day)``, so a write either
  lands before the claim (and is in the files) or is refused after it.
- ``ensure_day_partition`` refuses to make again a day that is archived and
  claimed: a retired day comes back only by ``kickass archive restore``.
- ``v_router_telemetry`` is a window of the days kept raw (``keep_raw_days``,
  router_telemetry 7 by default); its comment says so.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import op

revision: str = "0023"
down_revision: str | None = "0022"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The SQLSTATE of a refused write for a retired day (kickass_db.partitions.RETIRED_SQLSTATE).
RETIRED = "KA028"

LOCK_KEY = """
CREATE FUNCTION archive_lock_key(tbl text) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT hashtext('kickass: archive of ' || tbl) $$;
COMMENT ON FUNCTION archive_lock_key(text) IS
'The first key of the advisory lock of a day of an archived table (the second: the day '
'minus 2000-01-01): a retire claims the day holding it exclusively, a late write holds it shared.';
"""

CLAIMED = """
CREATE FUNCTION archive_claimed(tbl text, d date) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    -- Shared: writes go on beside each other; a claim waits for them, and
    -- a write after the claim sees it (this statement's snapshot is newer).
    PERFORM pg_advisory_xact_lock_shared(archive_lock_key(tbl), d - date '2000-01-01');
    RETURN EXISTS (SELECT 1 FROM archive_partitions a
                   WHERE a.table_name = tbl AND a.day = d AND a.claimed_at IS NOT NULL);
END
$$;
COMMENT ON FUNCTION archive_claimed(text, date) IS
'Whether a retire has claimed the day of the table (its late writes are refused).';
"""


def _ensure(refuse_retired: bool) -> str:
    refusal = f"""
    IF EXISTS (SELECT 1 FROM archive_partitions a
               WHERE a.table_name = base AND a.day = ensure_day_partition.day
                 AND a.claimed_at IS NOT NULL) THEN
        RAISE EXCEPTION 'the % partition of % is archived and retired', day, base
            USING ERRCODE = '{RETIRED}',
                  HINT = 'kickass archive restore ' || base || ' ' || day || ' puts it back';
    END IF;"""
    return f"""
CREATE OR REPLACE FUNCTION ensure_day_partition(parent regclass, day date) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    base text := (SELECT relname FROM pg_class WHERE oid = parent);
    name text := base || '_p' || to_char(day, 'YYYYMMDD');
    low timestamptz := day::timestamp AT TIME ZONE 'UTC';
BEGIN
    IF EXISTS (SELECT 1 FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
               WHERE i.inhparent = parent AND c.relname = name) THEN
        RETURN false;
    END IF;
    -- One maker at a time (a server, the ingest, housekeeping): look again.
    PERFORM pg_advisory_xact_lock(hashtext('kickass: partitions of ' || base));
    IF EXISTS (SELECT 1 FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
               WHERE i.inhparent = parent AND c.relname = name) THEN
        RETURN false;
    END IF;{refusal if refuse_retired else ""}
    IF to_regclass(quote_ident(name)) IS NOT NULL THEN
        RAISE EXCEPTION 'table % exists but is not a partition of %', name, base
            USING HINT = 'attach it (ALTER TABLE ... ATTACH PARTITION) or drop it';
    END IF;
    -- CREATE TABLE ... PARTITION OF would lock the parent against every reader;
    -- ATTACH PARTITION takes SHARE UPDATE EXCLUSIVE only.
    EXECUTE format('CREATE TABLE %I (LIKE %s INCLUDING DEFAULTS INCLUDING CONSTRAINTS)',
                   name, parent);
    EXECUTE format('ALTER TABLE %s ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                   parent, name, low, low + interval '1 day');
    RETURN true;
END
$$;
"""


def _migration(prefix: str) -> ModuleType:
    (path,) = Path(__file__).parent.glob(f"{prefix}_*.py")
    spec = importlib.util.spec_from_file_location(f"_kickass_migration_{prefix}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ROUTER_COMMENT = (
    "Per router run and control interval: the router's samples of the days kept raw "
    "(router_telemetry, partitioned by the UTC day of recorded_at; days older than "
    "keep_raw_days, 7 by default, are in the Parquet archive, and their seconds and minutes "
    "in v_router_telemetry_1s/_1m). A window, not the whole history."
)


def upgrade() -> None:
    op.create_table(
        "archive_partitions",
        sa.Column("table_name", sa.Text(), nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("range_from", sa.DateTime(timezone=True), nullable=False),
        sa.Column("range_to", sa.DateTime(timezone=True), nullable=False),
        sa.Column("rows", sa.BigInteger(), nullable=True),
        sa.Column("bytes", sa.BigInteger(), nullable=True),
        sa.Column("files", sa.Integer(), nullable=True),
        sa.Column("manifest_sha256", sa.Text(), nullable=True),
        sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("written_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("verified_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("detached_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("dropped_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("restored_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "table_name IN ('probe_outcomes', 'router_telemetry')",
            name=op.f("ck_archive_partitions_table_name"),
        ),
        sa.CheckConstraint(
            "(detached_at IS NULL AND dropped_at IS NULL) OR verified_at IS NOT NULL",
            name=op.f("ck_archive_partitions_verified_before_detach"),
        ),
        sa.PrimaryKeyConstraint("table_name", "day", name=op.f("pk_archive_partitions")),
    )
    op.create_table(
        "archive_secrets",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("secret", sa.LargeBinary(), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_archive_secrets")),
    )
    op.execute(
        "INSERT INTO archive_secrets (name, secret) VALUES ('client_key', "
        "decode(replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', ''), 'hex'))"
    )
    op.execute(LOCK_KEY)
    op.execute(CLAIMED)
    op.execute(_ensure(refuse_retired=True))
    _migration("0020")._comment("v_router_telemetry", ROUTER_COMMENT)


def downgrade() -> None:
    _migration("0020")._comment("v_router_telemetry", _migration("0022").ROUTER_COMMENT)
    op.execute(_ensure(refuse_retired=False))
    op.execute("DROP FUNCTION archive_claimed(text, date)")
    op.execute("DROP FUNCTION archive_lock_key(text)")
    op.drop_table("archive_secrets")
    op.drop_table("archive_partitions")
