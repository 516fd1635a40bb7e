"""The study's answers computed from the Parquet archive, by DuckDB or Spark (issue 28 part 4).

The archive (``kickass_analysis.archive``) holds the raw probe rows of the
days retired from PostgreSQL, their sessions' sidecar and the settled Atlas
campaigns. This module reads it with an engine chosen by name and computes
what the database's views show, so a researcher with a copy of the archive
and no database gets the same numbers:

=========================  =====================================================================
result                     equals
=========================  =====================================================================
``v_whole_drop``           the view, per session and IP length, with the exact median RTT
``v_split_drop``           the view, per session and leading-fragment IP length
``v_session_summary``      the view's counts, drop rates and excess per session (the columns
                           the archive holds: no address, server version or client metadata)
``session_verdicts``       each session's verdict and reason by ``kickass_core.verdict.decide``
                           on its per-phase counts (a late acknowledgement counts as
                           delivered, as ``StudyStore`` decides); NULL for a session that sent
                           no probe
``v_size_drop_all``        the view (final sessions); ``rtt_ms_median`` exact, where the
                           view's comes from a histogram within 0.4975% of it
``v_split_drop_all``       the view (final sessions)
``v_size_drop_by_source``  the view: volunteers as ``v_size_drop_all``, Atlas from the
                           archived campaigns (``ROOT/atlas_outcomes/campaign=NAME``)
``v_split_drop_by_source`` the view, likewise
``client_verdicts``        ``v_client_verdicts``' rule per client: the sessions and the latest
                           finished session's verdict, a client being the archive's
                           ``client_key_hash`` (the volunteer page's client key, hashed; the
                           archive holds no install id or address)
=========================  =====================================================================

Every count is exact, and so is every rate and per-session median: the
engines compute them as PostgreSQL does, in double precision from the same
integers, and ``rtt_ms`` (a ``real`` in PostgreSQL, a double in the files)
is rounded to single precision first, as PostgreSQL computes with it.
Medians are exact: DuckDB's ``quantile_cont`` and Spark's ``percentile``
(never ``percentile_approx``); on single-precision values every way of
interpolating two middle values gives the same double, so they equal
PostgreSQL's ``percentile_cont(0.5)`` to the bit. The excess over the
two-fragment bound takes a power, which the engines' libraries round
differently: it is computed here, from the counts the engine returns
(``split_excess``), with C's ``pow`` as PostgreSQL's.

Only a verified archive is read (``archive.verify_archive`` first: every
manifest and sha256), and only the files its manifests list. The results
go to ``OUT/<result>.parquet`` with ``<result>.parquet.schema.json`` beside
each (the export's conventions: columns with their PostgreSQL and Arrow
types, rows, bytes, sha256, the query, plus the engine and the archive's
manifests read), all published at once: ``OUT`` is written as a hidden
partial folder and renamed (``publish.publish_dir``), and is never an
existing folder.

Engines: ``duckdb`` (one machine: a researcher's laptop) and ``spark``
(``local[2]`` by default; ``master`` a cluster's URL, the driver started
through pyspark's ``spark-submit``). Spark needs Java 17 or later. All the
work is SQL the engine runs where the data is; only results come back to
the driver (per session and size at most: a hundredth of the probe rows of
the paper's plan), and the verdicts and the excesses are computed there.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from kickass_core import verdict as verdicts
from kickass_core.errors import KickassError
from kickass_core.states import FINAL_STATES
from kickass_db.archive_store import SIDECAR

# Absolute, not relative: spark-submit runs this file as a program (``main``).
from kickass_analysis import __version__, archive, export, publish

SCHEMA_VERSION = 1
ENGINES = ("duckdb", "spark")
LOCAL_MASTER = "local[2]"
MIN_JAVA = 17  # Spark 4
ENGINES_EXTRA = "pip install 'kickass-analysis[engines]' (make install does)"

# The archive's folders read, as engine views: probe rows, their sessions, Atlas outcomes.
PROBES, SESSIONS, ATLAS = "probe_rows", "session_rows", "atlas_rows"

_FINAL = "(" + ", ".join(f"'{s}'" for s in FINAL_STATES) + ")"
_SENT_ATLAS = "('acked', 'lost', 'late')"

# 0007's rules for one probe row (as migration 0020's write_unit_counts counts
# them): name -> condition, in SQL that PostgreSQL, DuckDB and Spark read alike.
COUNTERS: dict[str, str] = {
    "sent": "NOT (reassembly_invalid AND outcome = 'lost')",
    "acked": "outcome = 'acked'",
    "late": "outcome = 'late'",
    "reassembly_invalid": "reassembly_invalid AND outcome = 'lost'",
    "frag_observed": "outcome = 'acked' AND observed_frag_size > 0",
    "largest_fragment_as_sent": (
        "phase = 'split' AND outcome = 'acked' "
        "AND observed_frag_size = greatest(ip_len, 1520 - ip_len)"
    ),
    "fragments_observed": "outcome = 'acked' AND observed_fragments IS NOT NULL",
    "fragmented_observed": "outcome = 'acked' AND observed_fragments > 1",
    "leading_as_sent": (
        "phase = 'split' AND outcome = 'acked' AND observed_fragments = 2 "
        "AND observed_leading_len = ip_len"
    ),
    "leading_swapped": (
        "phase = 'split' AND outcome = 'acked' AND observed_fragments = 2 "
        "AND observed_leading_len = 1520 - ip_len AND ip_len <> 760"
    ),
}

# PostgreSQL type name (pg_type.typname) -> the name format_type() gives it.
_PG_TYPES = {
    "int8": "bigint",
    "int4": "integer",
    "float8": "double precision",
    "text": "text",
    "timestamptz": "timestamp with time zone",
}


@dataclass(frozen=True)
class Result:
    """One result: its file's name, the view whose rows it equals, its columns
    as (name, PostgreSQL type name), in the view's order."""

    name: str
    view: str
    columns: tuple[tuple[str, str], ...]
    note: str = ""

    def schema_columns(self) -> list[dict[str, str]]:
        return [
            {
                "name": n,
                "postgresql_type": _PG_TYPES[t],
                "arrow_type": export.ARROW_TYPES.get(t, export.STRING),
            }
            for n, t in self.columns
        ]


def _cols(spec: str) -> tuple[tuple[str, str], ...]:
    """``"a:int8 b:text"`` -> ((a, int8), (b, text))."""
    return tuple((n, t) for n, _, t in (w.partition(":") for w in spec.split()))


_COUNTS = "sent:int8 acked:int8 late:int8 drop_rate:float8"
RESULTS: dict[str, Result] = {
    r.name: r
    for r in (
        Result(
            "v_whole_drop", "v_whole_drop",
            _cols(f"session_id:text ip_len:int4 {_COUNTS} rtt_ms_median:float8 "
                  "fragmented_on_arrival:int8 reassembly_invalid:int8 fragments_observed:int8 "
                  "fragmented_observed:int8"),
        ),
        Result(
            "v_split_drop", "v_split_drop",
            _cols(f"session_id:text leading_ip_len:int4 {_COUNTS} frag_observed:int8 "
                  "arrived_as_sent:int8 reassembly_invalid:int8 largest_fragment_as_sent:int8 "
                  "fragments_observed:int8 leading_as_sent:int8 leading_swapped:int8"),
        ),
        Result(
            "v_session_summary", "v_session_summary",
            _cols("session_id:text state:text verdict:text verdict_reason:text "
                  "created_at:timestamptz finished_at:timestamptz client_version:text "
                  "whole_sent:int8 whole_acked:int8 whole_drop_rate:float8 split_sent:int8 "
                  "split_acked:int8 split_drop_rate:float8 split_to_whole_ratio:float8 "
                  "whole_reassembly_invalid:int8 split_reassembly_invalid:int8 "
                  "split_excess_drop:float8 split_excess_low:float8 split_excess_high:float8 "
                  "whole_fragmented_on_arrival:int8 split_largest_fragment_as_sent:int8 "
                  "split_fragments_observed:int8 split_leading_as_sent:int8 "
                  "split_leading_swapped:int8"),
            "the view's columns the archive holds (no server_version, source_address or "
            "client metadata); verdict and verdict_reason as stored",
        ),
        Result(
            "session_verdicts", "v_session_summary",
            _cols("session_id:text state:text verdict:text verdict_reason:text"),
            "verdict and verdict_reason decided again by kickass_core.verdict.decide from the "
            "session's per-phase counts (late counts as delivered); NULL without any probe",
        ),
        Result(
            "v_size_drop_all", "v_size_drop_all",
            _cols(f"ip_len:int4 sessions:int8 {_COUNTS} rtt_ms_median:float8 "
                  "fragmented_on_arrival:int8 reassembly_invalid:int8 fragments_observed:int8 "
                  "fragmented_observed:int8"),
            "rtt_ms_median exact (percentile_cont(0.5) of the acked probes' RTTs); the "
            "view's comes from a histogram, within 0.4975% of it",
        ),
        Result(
            "v_split_drop_all", "v_split_drop_all",
            _cols(f"leading_ip_len:int4 sessions:int8 {_COUNTS} frag_observed:int8 "
                  "arrived_as_sent:int8 reassembly_invalid:int8 largest_fragment_as_sent:int8 "
                  "fragments_observed:int8 leading_as_sent:int8 leading_swapped:int8"),
        ),
        Result(
            "v_size_drop_by_source", "v_size_drop_by_source",
            _cols(f"source:text ip_len:int4 sessions:int8 {_COUNTS} rtt_ms_median:float8 "
                  "fragmented_on_arrival:int8"),
            "atlas: the archived campaigns; volunteers' rtt_ms_median exact (see "
            "v_size_drop_all)",
        ),
        Result(
            "v_split_drop_by_source", "v_split_drop_by_source",
            _cols(f"source:text leading_ip_len:int4 sessions:int8 {_COUNTS} frag_observed:int8 "
                  "arrived_as_sent:int8 largest_fragment_as_sent:int8 reassembly_invalid:int8"),
            "atlas: the archived campaigns",
        ),
        Result(
            "client_verdicts", "v_client_verdicts",
            _cols("client_key_hash:text sessions:int8 latest_session_id:text "
                  "latest_verdict:text latest_finished_at:timestamptz"),
            "v_client_verdicts' rule with the archive's client: client_key_hash (the volunteer "
            "page's client key, salted and hashed)",
        ),
    )
}  # fmt: skip


# -- engines -----------------------------------------------------------------------------------


class Engine(Protocol):
    """What the computation asks of an engine: SQL over views of Parquet files."""

    name: str
    version: str
    master: str | None

    def register(self, view: str, files: Sequence[Path], base: Path) -> None:
        """``view``: the rows of ``files`` (Hive folders under ``base``: ``day`` a DATE)."""

    def empty(self, view: str, select: str) -> None:
        """``view``: no rows, with ``select``'s columns."""

    def materialize(self, view: str, select: str) -> None:
        """``view``: ``select``'s rows, computed once for the queries that read it."""

    def fetch(self, select: str) -> Any:
        """``select``'s rows as a pyarrow Table."""

    def median(self, expr: str) -> str:
        """The exact median (percentile_cont(0.5)) of ``expr`` as this engine's SQL."""

    def reset(self) -> None:
        """Forget the views (an engine kept for several analyses)."""

    def close(self) -> None: ...


class DuckDBEngine:
    """DuckDB in this process (in memory, every core it finds)."""

    name = "duckdb"
    master: str | None = None

    def __init__(self) -> None:
        try:
            import duckdb
        except ImportError as exc:
            raise KickassError("DuckDB is not installed", hint=ENGINES_EXTRA) from exc
        self.version = str(duckdb.__version__)
        self._con = duckdb.connect(":memory:")
        self._con.execute("SET TimeZone = 'UTC'")
        self._views: list[tuple[str, str]] = []  # (kind, name)

    def register(self, view: str, files: Sequence[Path], base: Path) -> None:
        listed = ", ".join(_quote(str(f)) for f in files)
        self._con.execute(
            f"CREATE OR REPLACE TEMP VIEW {view} AS SELECT * FROM read_parquet([{listed}], "
            "hive_partitioning = true)"
        )
        self._views.append(("VIEW", view))

    def empty(self, view: str, select: str) -> None:
        self._con.execute(f"CREATE OR REPLACE TEMP VIEW {view} AS {select}")
        self._views.append(("VIEW", view))

    def materialize(self, view: str, select: str) -> None:
        self._con.execute(f"CREATE OR REPLACE TEMP TABLE {view} AS {select}")
        self._views.append(("TABLE", view))

    def fetch(self, select: str) -> Any:
        return self._con.sql(select).to_arrow_table()

    def median(self, expr: str) -> str:
        return f"quantile_cont({expr}, 0.5)"

    def reset(self) -> None:
        for kind, view in reversed(self._views):
            self._con.execute(f"DROP {kind} IF EXISTS {view}")
        self._views.clear()

    def close(self) -> None:
        self._con.close()


class SparkEngine:
    """A SparkSession: ``master`` given (a cluster's URL, or ``local[N]``), or the
    one ``spark-submit`` set when it started this program, else ``local[2]``."""

    name = "spark"

    def __init__(self, master: str | None = None, conf: dict[str, str] | None = None) -> None:
        try:
            import pyspark
            from pyspark.sql import SparkSession

            with warnings.catch_warnings():
                # PySpark imports this lazily, and it warns of pandas, which no
                # part of this uses: imported once here, without the warning.
                warnings.filterwarnings("ignore", "PySpark does not yet fully support pandas")
                import pyspark.testing.utils  # noqa: F401
        except ImportError as exc:
            raise KickassError("PySpark is not installed", hint=ENGINES_EXTRA) from exc
        java_home = _java_home()
        env = {"JAVA_HOME": java_home} if java_home else {}
        self.version = str(pyspark.__version__)
        builder = (
            SparkSession.builder.appName("kickass archive analyze")
            .config("spark.sql.session.timeZone", "UTC")
            .config("spark.ui.showConsoleProgress", "false")
        )
        # Started by spark-submit (its gateway is in the environment): its master stands.
        if master is None and "PYSPARK_GATEWAY_PORT" not in os.environ:
            master = LOCAL_MASTER
        if master is not None:
            builder = builder.master(master)
        if master is not None and master.startswith("local"):
            # Few cores, small shuffles: Spark's 200 default partitions cost more than the work.
            builder = builder.config("spark.sql.shuffle.partitions", "2").config(
                "spark.ui.enabled", "false"
            )
        for key, value in (conf or {}).items():
            builder = builder.config(key, value)
        with _environ(env):
            try:
                self._spark = builder.getOrCreate()
            except Exception as exc:  # noqa: BLE001 - Py4J and JVM start errors alike
                reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise KickassError(
                    f"Spark did not start: {reason}",
                    hint="Spark 4 needs Java 17 or later (JAVA_HOME, or java on PATH); "
                    f"master {master or 'from spark-submit'}",
                ) from exc
        self._spark.sparkContext.setLogLevel("ERROR")
        self.master: str | None = str(self._spark.sparkContext.master)
        self._views: list[str] = []

    def register(self, view: str, files: Sequence[Path], base: Path) -> None:
        df = self._spark.read.option("basePath", str(base)).parquet(*(str(f) for f in files))
        df.createOrReplaceTempView(view)
        self._views.append(view)

    def empty(self, view: str, select: str) -> None:
        self._spark.sql(select).createOrReplaceTempView(view)
        self._views.append(view)

    def materialize(self, view: str, select: str) -> None:
        df = self._spark.sql(select).cache()
        df.createOrReplaceTempView(view)
        self._views.append(view)

    def fetch(self, select: str) -> Any:
        return self._spark.sql(select).toArrow()

    def median(self, expr: str) -> str:
        return f"percentile({expr}, 0.5)"

    def reset(self) -> None:
        for view in reversed(self._views):
            self._spark.catalog.dropTempView(view)
        self._spark.catalog.clearCache()
        self._views.clear()

    def close(self) -> None:
        self._spark.stop()


def open_engine(name: str, master: str | None = None) -> Engine:
    """The engine called ``name`` (one of ``ENGINES``); ``master`` is Spark's."""
    if name == "duckdb":
        if master is not None:
            raise KickassError("--master is Spark's", hint="DuckDB runs in this process")
        return DuckDBEngine()
    if name == "spark":
        return SparkEngine(master)
    raise KickassError(f"unknown engine {name!r}", hint=f"one of: {', '.join(ENGINES)}")


def _java_home() -> str | None:
    """JAVA_HOME for Spark (None: the one set stands), after checking Java is
    there and new enough: Spark's own error for a missing or old Java is a
    Py4J traceback."""
    home = os.environ.get("JAVA_HOME")
    java = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    if not java or not Path(java).exists():
        raise KickassError(
            "Spark needs Java, and there is none (no JAVA_HOME, no java on PATH)",
            hint="install openjdk-17-jre-headless (tools/setup-system.sh does), or use "
            "--engine duckdb",
        )
    try:
        proc = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except OSError as exc:
        raise KickassError(f"cannot run {java}: {exc}", hint="check JAVA_HOME") from exc
    m = re.search(r'version "(\d+)(?:\.(\d+))?', proc.stderr + proc.stdout)
    major = 0 if m is None else int(m[2] if m[1] == "1" and m[2] else m[1])
    if major < MIN_JAVA:
        raise KickassError(
            f"Spark 4 needs Java {MIN_JAVA} or later; {java} is "
            + (f"Java {major}" if major else "not a Java it can read the version of"),
            hint="install openjdk-17-jre-headless and point JAVA_HOME at it",
        )
    return None if home else str(Path(java).resolve().parent.parent)


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _quote(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


# -- the archive, as the engine's views ----------------------------------------------------


@dataclass
class Inputs:
    """The verified archive's files per folder, and its manifests (provenance)."""

    root: Path
    files: dict[str, list[Path]] = field(default_factory=dict)
    datasets: list[dict[str, Any]] = field(default_factory=list)

    @property
    def revisions(self) -> list[str]:
        return sorted({str(d["alembic_revision"]) for d in self.datasets if d["alembic_revision"]})


def read_archive(root: str | os.PathLike[str]) -> Inputs:
    """The archive at ``root``, verified (``archive.verify_archive``), as the
    files each folder's manifests list. Raises KickassError when it does not
    verify or holds nothing to analyze."""
    base = Path(root)
    report = archive.verify_archive(base)
    if not report.ok:
        problems = report.all_problems()
        raise KickassError(
            f"{base} is not a verified archive: {len(problems)} problems, the first: "
            + "; ".join(problems[:3]),
            hint=f"kickass archive verify {base} names them all; only a verified archive "
            "is analyzed",
        )
    out = Inputs(base)
    for d in report.datasets:
        files = [d.path / f["path"] for f in d.manifest.get("files") or []]
        out.files.setdefault(d.folder, []).extend(files)
        out.datasets.append(
            {
                "table": d.folder,
                d.key[0]: d.key[1],
                "rows": d.rows,
                "manifest_sha256": d.manifest_sha256,
                "alembic_revision": d.manifest.get("alembic_revision"),
            }
        )
    if not out.files.get("probe_outcomes") and not out.files.get(archive.ATLAS):
        raise KickassError(
            f"{base} holds no probe_outcomes day and no Atlas campaign",
            hint="give the archive's root folder (it holds probe_outcomes/, sessions/, "
            "atlas_outcomes/)",
        )
    return out


# The columns a folder's view must have when the archive holds none of it.
_EMPTY = {
    PROBES: "CAST(NULL AS BIGINT) AS session_pk, CAST(NULL AS DATE) AS day, "
    "CAST(NULL AS STRING) AS phase, CAST(NULL AS BIGINT) AS ip_len, "
    "CAST(NULL AS STRING) AS outcome, CAST(NULL AS DOUBLE) AS rtt_ms, "
    "CAST(NULL AS BOOLEAN) AS reassembly_invalid, CAST(NULL AS BIGINT) AS observed_frag_size, "
    "CAST(NULL AS BIGINT) AS observed_fragments, CAST(NULL AS BIGINT) AS observed_leading_len",
    SESSIONS: "CAST(NULL AS BIGINT) AS session_pk, CAST(NULL AS DATE) AS day, "
    "CAST(NULL AS STRING) AS session_id, CAST(NULL AS STRING) AS state, "
    "CAST(NULL AS STRING) AS verdict, CAST(NULL AS STRING) AS verdict_reason, "
    "CAST(NULL AS TIMESTAMP) AS created_at, CAST(NULL AS TIMESTAMP) AS finished_at, "
    "CAST(NULL AS STRING) AS client_version, CAST(NULL AS STRING) AS client_key_hash",
    ATLAS: "CAST(NULL AS BIGINT) AS campaign_id, CAST(NULL AS BIGINT) AS prb_id, "
    "CAST(NULL AS STRING) AS phase, CAST(NULL AS BIGINT) AS ip_len, "
    "CAST(NULL AS STRING) AS outcome, CAST(NULL AS DOUBLE) AS rtt_ms",
}
_FOLDERS = {PROBES: "probe_outcomes", SESSIONS: SIDECAR, ATLAS: archive.ATLAS}


def register(engine: Engine, inputs: Inputs) -> None:
    """The archive's folders as the engine's views, and the per-size counts
    every volunteer result starts from (computed once)."""
    for view, folder in _FOLDERS.items():
        files = inputs.files.get(folder) or []
        if files:
            engine.register(view, files, inputs.root / folder)
        else:
            engine.empty(view, f"SELECT {_EMPTY[view]} FROM (SELECT 1 AS x) one WHERE 1 = 0")
    counts = ",\n       ".join(
        f"count(*) FILTER (WHERE {cond}) AS {name}" for name, cond in COUNTERS.items()
    )
    # rtt_ms is a real in PostgreSQL: its median is taken of the single-precision values.
    rtt = "CAST(CAST(rtt_ms AS FLOAT) AS DOUBLE)"
    engine.materialize(
        "per_size",
        f"""
SELECT s.session_id, s.state, o.phase, CAST(o.ip_len AS INT) AS ip_len,
       {counts},
       {engine.median(rtt)} FILTER (WHERE phase = 'whole' AND outcome = 'acked') AS rtt_ms_median
FROM {PROBES} o JOIN {SESSIONS} s ON s.session_pk = o.session_pk AND s.day = o.day
GROUP BY s.session_id, s.state, o.phase, o.ip_len""",
    )


# -- one function per result -------------------------------------------------------------------

_DROP_RATE = "CAST(sent - acked AS DOUBLE) / CAST(nullif(sent, 0) AS DOUBLE) AS drop_rate"
_ATLAS_DROP_RATE = (
    "CAST(count(*) FILTER (WHERE outcome IN ('lost', 'late')) AS DOUBLE) "
    f"/ CAST(nullif(count(*) FILTER (WHERE outcome IN {_SENT_ATLAS}), 0) AS DOUBLE) AS drop_rate"
)


def whole_drop(engine: Engine) -> Any:
    """``v_whole_drop``: per session and IP length, the exact median RTT."""
    return engine.fetch(f"""
SELECT session_id, ip_len, sent, acked, late, {_DROP_RATE}, rtt_ms_median,
       frag_observed AS fragmented_on_arrival, reassembly_invalid, fragments_observed,
       fragmented_observed
FROM per_size WHERE phase = 'whole'
ORDER BY session_id, ip_len""")


def split_drop(engine: Engine) -> Any:
    """``v_split_drop``: per session and leading-fragment IP length."""
    return engine.fetch(f"""
SELECT session_id, ip_len AS leading_ip_len, sent, acked, late, {_DROP_RATE},
       frag_observed, largest_fragment_as_sent AS arrived_as_sent, reassembly_invalid,
       largest_fragment_as_sent, fragments_observed, leading_as_sent, leading_swapped
FROM per_size WHERE phase = 'split'
ORDER BY session_id, leading_ip_len""")


def _sum(column: str, where: str, name: str) -> str:
    # A BIGINT: DuckDB sums BIGINTs as HUGEINTs, which Arrow reads as decimals.
    return f"CAST(coalesce(sum({column}) FILTER (WHERE {where}), 0) AS BIGINT) AS {name}"


def _per_session(engine: Engine) -> None:
    """Per session (every one in the sidecar, with or without probes), the
    counts of both phases."""
    phases = []
    for name, column in (("sent", "sent"), ("acked", "acked"), ("late", "late"),
                         ("invalid", "reassembly_invalid")):  # fmt: skip
        for phase in ("whole", "split"):
            phases.append(_sum(f"p.{column}", f"p.phase = '{phase}'", f"{phase}_{name}"))
    observed = {
        "whole_fragmented": ("frag_observed", "whole"),
        "split_largest_as_sent": ("largest_fragment_as_sent", "split"),
        "split_observed": ("fragments_observed", "split"),
        "split_leading_as_sent": ("leading_as_sent", "split"),
        "split_leading_swapped": ("leading_swapped", "split"),
    }
    for name, (column, phase) in observed.items():
        phases.append(_sum(f"p.{column}", f"p.phase = '{phase}'", name))
    engine.materialize(
        "per_session",
        f"""
SELECT s.session_pk, s.session_id, s.state, s.verdict, s.verdict_reason, s.created_at,
       s.finished_at, s.client_version,
       {", ".join(phases)},
       count(p.phase) AS sizes
FROM {SESSIONS} s LEFT JOIN per_size p ON p.session_id = s.session_id
GROUP BY s.session_pk, s.session_id, s.state, s.verdict, s.verdict_reason, s.created_at,
         s.finished_at, s.client_version""",
    )


def split_excess(
    whole_sent: int, whole_acked: int, split_sent: int, split_acked: int
) -> tuple[float, float, float] | None:
    """``v_session_summary``'s split_excess_drop, _low and _high (None: NULL,
    a phase without probes): ``kickass_core.verdict.excess``, which is 0007's
    SQL term by term. Computed here from the counts, not by an engine, so
    every engine gives PostgreSQL's doubles: Spark's ``power`` is Java's,
    which differs from C's ``pow`` in the last bit for some counts (and the
    subtraction of two nearly equal numbers brings that bit into the
    result's visible digits)."""
    x = verdicts.excess(whole_sent, whole_acked, split_sent, split_acked)
    return None if x is None else (x.estimate, x.low, x.high)


EXCESS_COLUMNS = ("split_excess_drop", "split_excess_low", "split_excess_high")


def session_summary(engine: Engine) -> Any:
    """``v_session_summary``'s counts, drop rates and excess (0007's formulas:
    the rates by the engine, in PostgreSQL's order of operations, so every
    rate is the same double; the excess by ``split_excess`` from the counts)."""
    import pyarrow as pa

    table = engine.fetch("""
SELECT session_id, state, verdict, verdict_reason, created_at, finished_at, client_version,
       whole_sent, whole_acked, whole_drop_rate, split_sent, split_acked, split_drop_rate,
       split_drop_rate / nullif(whole_drop_rate, 0) AS split_to_whole_ratio,
       whole_invalid AS whole_reassembly_invalid, split_invalid AS split_reassembly_invalid,
       whole_fragmented AS whole_fragmented_on_arrival,
       split_largest_as_sent AS split_largest_fragment_as_sent,
       split_observed AS split_fragments_observed, split_leading_as_sent, split_leading_swapped
FROM (
    SELECT c.*,
           CAST(whole_sent - whole_acked AS DOUBLE) / CAST(nullif(whole_sent, 0) AS DOUBLE)
               AS whole_drop_rate,
           CAST(split_sent - split_acked AS DOUBLE) / CAST(nullif(split_sent, 0) AS DOUBLE)
               AS split_drop_rate
    FROM per_session c
) q
ORDER BY session_id""")
    counts = table.select(["whole_sent", "whole_acked", "split_sent", "split_acked"])
    excess = [split_excess(**r) for r in counts.to_pylist()]
    for i, name in enumerate(EXCESS_COLUMNS):
        values = [None if e is None else e[i] for e in excess]
        table = table.append_column(name, pa.array(values, pa.float64()))
    return table


def session_verdicts(engine: Engine) -> Any:
    """Each session's verdict by ``kickass_core.verdict.decide`` on its
    per-phase counts: valid sent, delivered (acked or late), invalid, late;
    NULL for a session that sent no probe."""
    import pyarrow as pa

    rows = engine.fetch("""
SELECT session_id, state, whole_sent, whole_acked + whole_late AS whole_delivered, split_sent,
       split_acked + split_late AS split_delivered, whole_invalid, split_invalid,
       whole_late + split_late AS late, sizes
FROM per_session ORDER BY session_id""").to_pylist()
    out: dict[str, list[Any]] = {"session_id": [], "state": [], "verdict": [], "verdict_reason": []}
    for r in rows:
        v = None
        if r["sizes"]:
            v = verdicts.decide(
                r["whole_sent"], r["whole_delivered"], r["split_sent"], r["split_delivered"],
                whole_invalid=r["whole_invalid"], split_invalid=r["split_invalid"], late=r["late"],
            )  # fmt: skip
        out["session_id"].append(r["session_id"])
        out["state"].append(r["state"])
        out["verdict"].append(None if v is None else v.verdict)
        out["verdict_reason"].append(None if v is None else v.reason)
    return pa.table(out)


def _pooled(engine: Engine) -> None:
    """The pooled counts of final sessions per phase and size (``v_*_drop_all``'s
    rule: a session counts at a size where it has a probe row), and the whole
    phase's exact median RTT per size."""
    sums = ", ".join(f"CAST(sum({c}) AS BIGINT) AS {c}" for c in COUNTERS)
    rtt = "CAST(CAST(o.rtt_ms AS FLOAT) AS DOUBLE)"
    engine.materialize(
        "pooled",
        f"""
SELECT t.*, m.rtt_ms_median
FROM (
    SELECT phase, ip_len, count(*) AS sessions, {sums}
    FROM per_size WHERE state IN {_FINAL}
    GROUP BY phase, ip_len
) t
LEFT JOIN (
    SELECT CAST(o.ip_len AS INT) AS ip_len, {engine.median(rtt)} AS rtt_ms_median
    FROM {PROBES} o JOIN {SESSIONS} s ON s.session_pk = o.session_pk AND s.day = o.day
    WHERE s.state IN {_FINAL} AND o.phase = 'whole' AND o.outcome = 'acked'
    GROUP BY o.ip_len
) m ON t.phase = 'whole' AND m.ip_len = t.ip_len""",
    )


def size_drop_all(engine: Engine) -> Any:
    """``v_size_drop_all``: final sessions pooled per IP length, the exact median RTT."""
    return engine.fetch(f"""
SELECT ip_len, sessions, sent, acked, late, {_DROP_RATE}, rtt_ms_median,
       frag_observed AS fragmented_on_arrival, reassembly_invalid, fragments_observed,
       fragmented_observed
FROM pooled WHERE phase = 'whole' ORDER BY ip_len""")


def split_drop_all(engine: Engine) -> Any:
    """``v_split_drop_all``: final sessions pooled per leading-fragment IP length."""
    return engine.fetch(f"""
SELECT ip_len AS leading_ip_len, sessions, sent, acked, late, {_DROP_RATE}, frag_observed,
       largest_fragment_as_sent AS arrived_as_sent, reassembly_invalid,
       largest_fragment_as_sent, fragments_observed, leading_as_sent, leading_swapped
FROM pooled WHERE phase = 'split' ORDER BY leading_ip_len""")


def _atlas(engine: Engine, phase: str, size: str, extra: str) -> str:
    rtt = "CAST(CAST(rtt_ms AS FLOAT) AS DOUBLE)"
    key = "CAST(campaign_id AS STRING) || '/' || CAST(prb_id AS STRING)"
    return f"""
SELECT 'atlas' AS source, CAST(ip_len AS INT) AS {size},
       count(DISTINCT CASE WHEN outcome IN {_SENT_ATLAS} THEN {key} END) AS sessions,
       count(*) FILTER (WHERE outcome IN {_SENT_ATLAS}) AS sent,
       count(*) FILTER (WHERE outcome = 'acked') AS acked,
       count(*) FILTER (WHERE outcome = 'late') AS late,
       {_ATLAS_DROP_RATE}, {extra.format(median=engine.median(rtt))}
FROM {ATLAS} WHERE phase = '{phase}' AND ip_len IS NOT NULL
GROUP BY ip_len
HAVING count(*) FILTER (WHERE outcome IN {_SENT_ATLAS}) > 0"""


def size_drop_by_source(engine: Engine) -> Any:
    """``v_size_drop_by_source``: volunteers as ``v_size_drop_all``, Atlas from
    the archived campaigns (its median exact, as the view's)."""
    atlas = _atlas(
        engine, "whole", "ip_len",
        "{median} FILTER (WHERE outcome = 'acked') AS rtt_ms_median, "
        "CAST(NULL AS BIGINT) AS fragmented_on_arrival",
    )  # fmt: skip
    return engine.fetch(f"""
SELECT * FROM (
    SELECT 'volunteer' AS source, ip_len, sessions, sent, acked, late, {_DROP_RATE},
           rtt_ms_median, frag_observed AS fragmented_on_arrival
    FROM pooled WHERE phase = 'whole'
    UNION ALL
    {atlas}
) u ORDER BY source, ip_len""")


def split_drop_by_source(engine: Engine) -> Any:
    """``v_split_drop_by_source``: volunteers as ``v_split_drop_all``, Atlas
    from the archived campaigns (no fragment sizes, no reassembly state)."""
    atlas = _atlas(
        engine, "split", "leading_ip_len",
        "CAST(NULL AS BIGINT) AS frag_observed, CAST(NULL AS BIGINT) AS arrived_as_sent, "
        "CAST(NULL AS BIGINT) AS largest_fragment_as_sent, "
        "CAST(NULL AS BIGINT) AS reassembly_invalid",
    )  # fmt: skip
    return engine.fetch(f"""
SELECT * FROM (
    SELECT 'volunteer' AS source, ip_len AS leading_ip_len, sessions, sent, acked, late,
           {_DROP_RATE}, frag_observed, largest_fragment_as_sent AS arrived_as_sent,
           largest_fragment_as_sent, reassembly_invalid
    FROM pooled WHERE phase = 'split'
    UNION ALL
    {atlas}
) u ORDER BY source, leading_ip_len""")


def client_verdicts(engine: Engine) -> Any:
    """``v_client_verdicts``' rule per client key: its sessions, and its most
    recently finished final session (by finished_at, the latest session first
    on a tie) with that session's stored verdict."""
    return engine.fetch(f"""
SELECT client_key_hash, sessions,
       CASE WHEN final THEN session_id END AS latest_session_id,
       CASE WHEN final THEN verdict END AS latest_verdict,
       CASE WHEN final THEN finished_at END AS latest_finished_at
FROM (
    SELECT client_key_hash, session_id, verdict, finished_at, state IN {_FINAL} AS final,
           count(*) OVER (PARTITION BY client_key_hash) AS sessions,
           row_number() OVER (
               PARTITION BY client_key_hash
               ORDER BY CASE WHEN state IN {_FINAL} THEN 0 ELSE 1 END,
                        finished_at DESC NULLS LAST, session_pk DESC
           ) AS k
    FROM {SESSIONS} WHERE client_key_hash IS NOT NULL
) c
WHERE k = 1
ORDER BY client_key_hash""")


COMPUTE: dict[str, Callable[[Engine], Any]] = {
    "v_whole_drop": whole_drop,
    "v_split_drop": split_drop,
    "v_session_summary": session_summary,
    "session_verdicts": session_verdicts,
    "v_size_drop_all": size_drop_all,
    "v_split_drop_all": split_drop_all,
    "v_size_drop_by_source": size_drop_by_source,
    "v_split_drop_by_source": split_drop_by_source,
    "client_verdicts": client_verdicts,
}
assert set(COMPUTE) == set(RESULTS)


def compute(engine: Engine, inputs: Inputs) -> dict[str, Any]:
    """Every result as a pyarrow Table of its columns and types, by ``engine``."""
    import pyarrow as pa

    engine.reset()
    register(engine, inputs)
    _per_session(engine)
    _pooled(engine)
    out = {}
    for name, fn in COMPUTE.items():
        table = fn(engine)
        result = RESULTS[name]
        schema = pa.schema(
            [(n, export.pa_type(pa, export.ARROW_TYPES.get(t, export.STRING)))
             for n, t in result.columns]
        )  # fmt: skip
        out[name] = table.select([n for n, _ in result.columns]).cast(schema)
    engine.reset()
    return out


# -- the command's work --------------------------------------------------------------------


@dataclass
class Analysis:
    out: Path
    engine: str
    engine_version: str
    master: str | None
    seconds: float
    results: dict[str, dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return {
            "out": str(self.out),
            "engine": self.engine,
            "engine_version": self.engine_version,
            "master": self.master,
            "seconds": round(self.seconds, 3),
            "results": self.results,
        }


def analyze(
    root: str | os.PathLike[str],
    engine: str | Engine,
    out: str | os.PathLike[str],
    *,
    master: str | None = None,
    tag: str | None = None,
) -> Analysis:
    """Every result of the archive at ``root`` by ``engine`` (a name, or an
    engine kept open by the caller), written to the new folder ``out``."""
    t0 = time.monotonic()
    final = Path(out)
    if final.exists():
        raise KickassError(
            f"{final} already exists", hint="name a new folder: the results are published at once"
        )
    inputs = read_archive(root)
    own = isinstance(engine, str)
    eng = open_engine(engine, master) if isinstance(engine, str) else engine
    try:
        tables = compute(eng, inputs)
    finally:
        if own:
            eng.close()
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = publish.partial_path(final, tag or f"p{os.getpid()}")
    summary: dict[str, dict[str, Any]] = {}
    try:
        staging.mkdir()
        computed_at = datetime.now(UTC).isoformat()
        for name, table in tables.items():
            summary[name] = _write(staging, RESULTS[name], table, eng, inputs, computed_at)
        if not publish.publish_dir(staging, final):
            raise KickassError(f"{final} appeared while the results were written",
                               hint="name a new folder")  # fmt: skip
    except OSError as exc:
        raise KickassError(
            f"cannot write the results in {final.parent}: {exc.strerror or exc}",
            hint="choose a writable folder with room (-o OUT); nothing was left there",
        ) from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(staging)
    return Analysis(final, eng.name, eng.version, eng.master, time.monotonic() - t0, summary)


def _write(
    folder: Path, result: Result, table: Any, engine: Engine, inputs: Inputs, computed_at: str
) -> dict[str, Any]:
    import pyarrow.parquet as pq

    data = folder / f"{result.name}.parquet"
    pq.write_table(table, data, compression=export.PARQUET_COMPRESSION)
    size = data.stat().st_size
    digest = export.sha256_file(data)
    schema = {
        "kickass_archive_analysis": SCHEMA_VERSION,
        "result": result.name,
        "view": result.view,
        "format": "parquet",
        "data_file": data.name,
        "rows": table.num_rows,
        "bytes": size,
        "sha256": digest,
        "computed_at": computed_at,
        "engine": {"name": engine.name, "version": engine.version, "master": engine.master},
        "note": result.note,
        "archive": {
            "root": str(inputs.root),
            "alembic_revisions": inputs.revisions,
            "datasets": inputs.datasets,
        },
        "columns": result.schema_columns(),
        "parquet": {"compression": export.PARQUET_COMPRESSION},
        "kickass_analysis_version": __version__,
    }
    with open(folder / f"{data.name}.schema.json", "x", encoding="utf-8") as f:
        json.dump(schema, f, indent=2, ensure_ascii=False)
        f.write("\n")
    return {"path": str(data.name), "rows": table.num_rows, "bytes": size, "sha256": digest}


def main(argv: list[str] | None = None) -> int:
    """``spark-submit [--master URL] .../archive_analysis.py DIR -o OUT``: the
    analyze command with Spark, the master and resources spark-submit's (the
    executors run SQL only: they need no Python package of ours)."""
    from kickass_core import cli

    args = sys.argv[1:] if argv is None else argv
    return cli.main(["archive", "analyze", "--engine", "spark", *args])


if __name__ == "__main__":
    sys.exit(main())
