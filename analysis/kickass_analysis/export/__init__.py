"""`kickass export`: one analysis view to a dated CSV or Parquet file, in constant memory.

Only the public ``v_*`` views are exportable (listed from the database, so a
view a migration adds is exportable at once); ``views()`` says, for the views
it knows, which column dates a row (for ``since``/``until``) and which
source every row comes from when the view has no ``source`` column (each
study source's own views from the registry, ``kickass_core.sources``). A view
with a ``source`` or ``campaign`` column can be filtered on it.

How the rows travel, all inside one read-only REPEATABLE READ transaction
(the rows, the row count, the export time and the alembic revision are one
snapshot of the database):

* **Parquet**: PostgreSQL's ``COPY (SELECT ...) TO STDOUT (FORMAT csv)``,
  parsed by Arrow's C++ CSV reader (``pyarrow.csv.open_csv``) with every
  column's type given from the catalogue (nothing inferred), and written as
  row groups of at most ``ROW_GROUP_BYTES`` of Arrow data by
  ``pyarrow.parquet.ParquetWriter``. The calling thread runs the COPY and
  hands its rows over in blocks of ``COPY_BLOCK_BYTES`` (at most
  ``COPY_BLOCKS_AHEAD`` waiting); one thread parses and writes them. Not a
  server-side cursor (the first version): it made a Python object of every
  value, and that alone took 3x as long as COPY of a cheap view
  (bench/README.md).
  Types: integers int64, real, double and numeric float64, boolean bool,
  timestamptz ``timestamp[us, tz=UTC]`` (timestamp without time zone stays
  naive), date date32, and everything else (text, jsonb, inet, arrays, ...)
  as a string in PostgreSQL's own text form. Values are PostgreSQL's text
  output, so a ``real`` reads back as the number PostgreSQL prints (12.345,
  not 12.345000267...), as in the CSV. NULL is COPY's unquoted empty field
  and an empty string its quoted ``""``, so NULLs stay NULL and ``''`` stays
  ``''``. A value Arrow cannot hold in its column's type (an infinite or BC
  timestamp, a year after 9999) is an error naming it: such a view exports
  as CSV.
* **CSV**: PostgreSQL's own ``COPY (SELECT ...) TO STDOUT (FORMAT csv,
  HEADER, FORCE_QUOTE *)``, streamed to the file in blocks of
  ``COPY_BLOCK_BYTES`` (not a cursor: COPY is PostgreSQL's fastest stream,
  and its CSV is the one psql's ``\\copy`` writes). Every value is quoted
  except NULL, which is an unquoted empty field, so an empty string
  (``""``) and NULL differ; values are PostgreSQL's text output (timestamps
  ``2026-11-25 03:12:05.123+00`` in UTC, booleans ``t``/``f``, jsonb as
  JSON text). The ``.schema.json``
  says how to read it back typed (its ``arrow_type`` per column).

Both run with DateStyle ISO and extra_float_digits 1 (whatever the server's
defaults), so dates are ISO 8601 and a float's text is the shortest that
reads back exactly.

Memory: a few blocks of COPY's output, one row group of Arrow data and the
Parquet writer's footer (a few hundred bytes per row group and column)
whatever the number of rows (measured: tests/analysis/test_export.py,
bench/export_bench.py).

Files: ``<view>[-<source>][-campaign-<c>][-since<T>][-until<T>]-<exported>.<ext>``
with times as ``20261125T031205Z``; the export time is the database's
transaction time. ``since`` is inclusive and ``until`` exclusive, so
consecutive windows (the scheduled ``export`` item) neither overlap nor
leave gaps. A caller that exports windows names the file by its window
alone (``window_name``: no export time): an export of a window already
published is then not done again, its publication is returned
(``already_published``), so a window is published once however many
attempts it takes. Beside the data file, ``<data file>.schema.json``:
columns with their PostgreSQL and Arrow types, the query and its filters,
the row count, the sha256 and size of the data file, the export time and
the database's alembic revision. Both are published the one way
``kickass_analysis.publish`` does it (a hidden ``.<name>.partial-<tag>``
file, forced to disk, hard-linked to its final name when complete; the tag
is the process id, or the scheduled run's attempt), the schema first, so a
data file under its final name always has its schema beside it; an error,
Ctrl-C (or SIGTERM, which `kickass export` turns into one) removes the
partial files, SIGKILL can leave only hidden partial files (the scheduled
export sweeps those of dead attempts), and nothing is ever written under a
final name that already exists (but a schema a dead attempt published
without its data file, which the next attempt's replaces).

The package, by subject: ``view.py`` (``export_view``, ``exportable_views``:
the export proper, one transaction), ``filters.py`` (``views()``, ``SHARED_VIEWS``,
``Filters`` and their WHERE clause), ``readers.py`` (the COPY readers: the
catalogue, ``Column`` with its Arrow type, COPY's output in blocks, the
progress ``Meter``), ``formats.py`` (CSV, and Parquet through Arrow:
``write_parquet``, which the archive uses too) and ``files.py`` (the names,
``window_name``, ``ExportResult``, a window published before); the publish
primitive itself is ``kickass_analysis.publish``. Every name callers import
is here; a setting is read from its own module (a test that changes
``COPY_BLOCK_BYTES`` sets ``readers.COPY_BLOCK_BYTES``, not this copy).
"""

from __future__ import annotations

from . import files, filters, formats, readers, view
from .files import SCHEMA_VERSION, STAMP, ExportResult, window_name
from .filters import SHARED_VIEWS, Filters, ViewSpec, views
from .formats import (
    ARROW_READ_BYTES,
    COPY_BLOCKS_AHEAD,
    CSV_CONVENTIONS,
    FORMATS,
    PARQUET_COMPRESSION,
    PARQUET_SETTINGS,
    ROW_GROUP_BYTES,
    pa_type,
    sha256_file,
    write_parquet,
)
from .readers import (
    ARROW_TYPES,
    COPY_BLOCK_BYTES,
    PROGRESS_EVERY_S,
    STRING,
    Column,
    Meter,
    Progress,
    alembic_revision,
    text_settings,
)
from .view import export_view, exportable_views

__all__ = [
    "ARROW_READ_BYTES",
    "ARROW_TYPES",
    "COPY_BLOCKS_AHEAD",
    "COPY_BLOCK_BYTES",
    "CSV_CONVENTIONS",
    "FORMATS",
    "PARQUET_COMPRESSION",
    "PARQUET_SETTINGS",
    "PROGRESS_EVERY_S",
    "ROW_GROUP_BYTES",
    "SCHEMA_VERSION",
    "SHARED_VIEWS",
    "STAMP",
    "STRING",
    "Column",
    "ExportResult",
    "Filters",
    "Meter",
    "Progress",
    "ViewSpec",
    "alembic_revision",
    "export_view",
    "exportable_views",
    "files",
    "filters",
    "formats",
    "pa_type",
    "readers",
    "sha256_file",
    "text_settings",
    "view",
    "views",
    "window_name",
    "write_parquet",
]
