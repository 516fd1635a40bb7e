"""The Parquet archive of the raw tables' days, and their retirement (issue 28 part 3).

A day of ``probe_outcomes`` (by its sessions' ``created_at``) or of
``router_telemetry`` (by ``recorded_at``) is one partition (migration 0022).
Once it is older than ``keep_raw_days`` (probe_outcomes 30, router_telemetry
7) it leaves the database for files, in Hive layout, which DuckDB and Spark
read as they are::

    ROOT/probe_outcomes/day=2026-11-01/part-00000.parquet
    ROOT/probe_outcomes/day=2026-11-01/_manifest.json
    ROOT/sessions/day=2026-11-01/...        the sidecar: the day's sessions
    ROOT/router_telemetry/day=2026-11-01/...

**Files.** The partition's rows in its primary key's order, through the
export's machinery (``export.write_parquet``: PostgreSQL's COPY parsed by
Arrow with each column's type from the catalogue, zstd), in row groups of at
least ``ROW_GROUP_ROWS`` (128 Ki) rows. The columns are the table's own, so
``restore`` puts the rows back as they were. Beside them ``_manifest.json``,
on the conventions of the export's ``.schema.json``: ``schema_version``, the
database's ``alembic_revision``, the columns with their PostgreSQL and Arrow
types, per file its path, rows, bytes and sha256, and the day's ``checks``
(``kickass_db.archive_store.CHECKS``: rows, rows per outcome or marking mode,
the sum of seq or t, the least and greatest of each time, rows per flag),
computed by PostgreSQL in the snapshot the rows were read in, and computed
again from the files by every verification. A probe_outcomes day's manifest
names its sessions' sidecar (``kickass_db.archive_store.SIDECAR_SELECT``: no
address, no cookie hash, the client key salted and hashed) and that
manifest's sha256.

**Publishing.** A day's files and its manifest (written last) go into a
hidden folder ``.day=D.partial-TAG``, each forced to disk, and the folder
is renamed to ``day=D`` (``publish.publish_dir``): no file is ever under a
final name without its manifest. A partial folder left by a killed attempt
is removed by the next attempt at that day (one archiver per day: an
advisory lock).

**Retirement** (``retire``; the scheduled ``housekeeping`` runs it), per day:

1. claim the day (``ArchiveStore.claim``), only when nothing blocks it: every
   session of a probe_outcomes day final with its durable counts (a live one
   blocks, and is reported), every second of a router_telemetry day rolled up
   into ``router_telemetry_1s``. From the claim on a late write for the day
   is refused: a client report gets HTTP 409, a replayed batch goes to the
   writer's ``failed-*``, and ``ensure_day_partition`` never makes it again;
2. write the files (or keep those already published, when they verify and
   their checks equal the database's), record them (``written``);
3. read them back from disk and verify them (sha256, rows, the checks from
   the files against the manifest's), record it (``verified``);
4. ``DETACH PARTITION ... CONCURRENTLY``;
5. verify again (the files, and the detached table's checks against the
   manifest's: a difference attaches the day again, and nothing is dropped),
   then ``DROP`` it, its row marked dropped in the same transaction.

A process killed between any two steps leaves a state the next run finishes,
and never a dropped day without a verified row. ``KICKASS_ARCHIVE_INJECT``
(``POINT`` or ``POINT:kill``) stops a retirement at one of
``INJECTION_POINTS``: the crash-safety tests use it.

``verify`` needs no database: it checks every manifest and file under a
root (a researcher's copy). ``restore`` puts a retired day back from its
files (and, with ``recount``, writes its sessions' durable counts again).

A settled Atlas campaign's outcomes go to ``ROOT/atlas_outcomes/campaign=NAME/``
the same way (``write_campaign``; the scheduled ``atlas`` item calls it once
the campaign is settled), and stay in the database: Atlas tables are never
dropped. A snapshot that still holds what the database holds is kept.

The package, by subject: ``layout.py`` (the folders and their names, the
manifest's constants, ``ROW_GROUP_ROWS``, the injection points, ``Progress``),
``verifying.py`` (``verify_archive``, ``verify_dataset``, ``file_checks``:
no database), ``writing.py`` (a folder written in one snapshot, or kept:
``write_campaign``), ``retiring.py`` (``retire``, its steps, ``write``) and
``restoring.py`` (``restore``, ``listing``, ``state_of``). Every name
callers import is here; a setting is read from its own module (a test that
changes ``ROW_GROUP_ROWS`` sets ``writing.ROW_GROUP_ROWS`` and
``verifying.ROW_GROUP_ROWS``, not this copy).
"""

from __future__ import annotations

from .. import export
from . import layout, restoring, retiring, verifying, writing
from .layout import (
    ATLAS,
    FOLDERS,
    INJECT_ENV,
    INJECTION_POINTS,
    MANIFEST,
    ROW_GROUP_ROWS,
    SCHEMA_VERSION,
    InjectedFault,
    Key,
    Progress,
    campaign_dir,
    dataset_dir,
    day_dir,
    part_name,
)
from .restoring import listing, restore, state_of
from .retiring import KEEP_RAW_DAYS, DayResult, RetireResult, retire, write
from .verifying import Dataset, VerifyReport, file_checks, verify_archive, verify_dataset
from .writing import PARQUET, Written, write_campaign

__all__ = [
    "ATLAS",
    "Dataset",
    "DayResult",
    "FOLDERS",
    "INJECTION_POINTS",
    "INJECT_ENV",
    "InjectedFault",
    "KEEP_RAW_DAYS",
    "Key",
    "MANIFEST",
    "PARQUET",
    "Progress",
    "ROW_GROUP_ROWS",
    "RetireResult",
    "SCHEMA_VERSION",
    "VerifyReport",
    "Written",
    "campaign_dir",
    "dataset_dir",
    "day_dir",
    "export",
    "file_checks",
    "layout",
    "listing",
    "part_name",
    "restore",
    "restoring",
    "retire",
    "retiring",
    "state_of",
    "verify_archive",
    "verify_dataset",
    "verifying",
    "write",
    "write_campaign",
    "writing",
]
