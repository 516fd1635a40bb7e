"""Verifying an archive with no database: every manifest and file under a root.

``verify_archive`` (``kickass archive verify``, a researcher's copy) and
``verify_dataset`` (one day's folder, which the retirement and ``restore``
call): each file listed with its size and sha256, no file missing or
unlisted, the rows and the checks the files hold (``file_checks``, as
``kickass_db.archive_store.pg_checks`` computes them in PostgreSQL) equal to
their manifest's, each probe_outcomes day's sidecar the one its manifest
names.
"""

from __future__ import annotations

import json
import math
import os
import re
import urllib.parse
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

from kickass_core.errors import KickassError
from kickass_db.archive_store import CHECKS, SIDECAR, iso, same_checks

from .. import export
from .layout import (
    ATLAS,
    FOLDERS,
    MANIFEST,
    ROW_GROUP_ROWS,
    SCHEMA_VERSION,
    Key,
    _date,
    _sha256,
    dataset_dir,
)

_DAY = re.compile(r"day=(\d{4}-\d{2}-\d{2})")
_CAMPAIGN = re.compile(r"campaign=(.+)")


@dataclass
class Dataset:
    """One verified folder: a day of a table or its sessions' sidecar, or a
    campaign's Atlas outcomes."""

    folder: str
    key: Key
    path: Path
    manifest: dict[str, Any] = field(default_factory=dict)
    manifest_sha256: str = ""
    rows: int = 0
    bytes: int = 0
    files: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def day(self) -> date | None:
        return _date(self.key[1]) if self.key[0] == "day" else None

    def to_json(self) -> dict[str, Any]:
        return {
            "table": self.folder,
            self.key[0]: self.key[1],
            "path": str(self.path),
            "rows": self.rows,
            "bytes": self.bytes,
            "files": self.files,
            "manifest_sha256": self.manifest_sha256,
            "problems": self.problems,
        }


@dataclass
class VerifyReport:
    root: Path
    datasets: list[Dataset] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # of the root and its folders
    partials: list[str] = field(default_factory=list)  # hidden partial files, not published

    @property
    def ok(self) -> bool:
        return not self.problems and all(d.ok for d in self.datasets)

    def all_problems(self) -> list[str]:
        return self.problems + [f"{d.path}: {p}" for d in self.datasets for p in d.problems]

    def to_json(self) -> dict[str, Any]:
        return {
            "root": str(self.root),
            "ok": self.ok,
            "partitions": [d.to_json() for d in self.datasets],
            "rows": sum(d.rows for d in self.datasets),
            "bytes": sum(d.bytes for d in self.datasets),
            "problems": self.all_problems(),
            "partials": self.partials,
        }


def verify_archive(root: str | os.PathLike[str]) -> VerifyReport:
    """Every manifest and file under ``root``, read from disk (no database):
    each file listed with its size and sha256, no file missing or unlisted,
    the rows and the checks the files hold equal to their manifest's, each
    probe_outcomes day's sidecar the one its manifest names."""
    base = Path(root)
    if not base.is_dir():
        raise KickassError(f"no archive at {base}", hint="give the archive's root folder")
    report = VerifyReport(base)
    for entry in sorted(base.iterdir()):
        if entry.name.startswith("."):
            report.partials.append(entry.name)
            continue
        if not entry.is_dir() or entry.name not in FOLDERS:
            report.problems.append(f"{entry}: unexpected (an archive holds {', '.join(FOLDERS)})")
            continue
        pattern, what = (_CAMPAIGN, "campaign=NAME") if entry.name == ATLAS else (_DAY, "day=D")
        for sub in sorted(entry.iterdir()):
            m = pattern.fullmatch(sub.name)
            if sub.name.startswith("."):
                report.partials.append(f"{entry.name}/{sub.name}")
            elif m is None or not sub.is_dir():
                report.problems.append(f"{sub}: unexpected (this table holds {what} folders)")
            else:
                key = (what.split("=")[0], urllib.parse.unquote(m[1]))
                report.datasets.append(_verify(base, entry.name, key))
    return report


def verify_dataset(root: Path, folder: str, day: date) -> Dataset:
    """One day's folder against its manifest (see ``verify_archive``)."""
    return _verify(root, folder, ("day", day.isoformat()))


def _verify(root: Path, folder: str, key: Key) -> Dataset:
    path = dataset_dir(root, folder, key)
    out = Dataset(folder, key, path)
    manifest_path = path / MANIFEST
    try:
        blob = manifest_path.read_bytes()
    except FileNotFoundError:
        out.problems.append(f"no {MANIFEST}: its files are described by nothing")
        return out
    out.manifest_sha256 = _sha256(blob)
    try:
        manifest = json.loads(blob)
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        out.problems.append(f"{MANIFEST} is not readable JSON: {exc}")
        return out
    out.manifest = manifest
    if manifest.get("schema_version") != SCHEMA_VERSION:
        out.problems.append(f"{MANIFEST}: schema_version {manifest.get('schema_version')!r}")
        return out
    if manifest.get("table") != folder or manifest.get(key[0]) != key[1]:
        out.problems.append(
            f"{MANIFEST} describes {manifest.get('table')} {manifest.get(key[0])}, "
            f"not {folder} {key[1]}"
        )
    listed = {str(f.get("path")): f for f in manifest.get("files") or []}
    present = {p.name for p in path.iterdir() if p.name != MANIFEST}
    for name in sorted(present - set(listed)):
        out.problems.append(f"extra file {name} (in no manifest)")
    for name in sorted(set(listed) - present):
        out.problems.append(f"missing file {name}")
    columns = manifest.get("columns") or []
    readable: list[Path] = []
    for name, entry in sorted(listed.items()):
        if name not in present:
            continue
        file = path / name
        size = file.stat().st_size
        out.bytes += size
        out.files += 1
        damaged = False
        if size != entry.get("bytes"):
            out.problems.append(f"{name}: {size} bytes, the manifest says {entry.get('bytes')}")
            damaged = True
        if export.sha256_file(file) != entry.get("sha256"):
            out.problems.append(f"{name}: its sha256 is not the manifest's (the file changed)")
            damaged = True
        problem = _parquet_problem(file, entry, columns)
        if problem:
            out.problems.append(f"{name}: {problem}")
        elif not damaged:
            # Only an intact file's rows are read: a changed byte in a data
            # page reads as pyarrow's error, not as the damage it is.
            readable.append(file)
    rows = sum(int(f.get("rows") or 0) for f in listed.values())
    out.rows = rows
    if manifest.get("rows") != rows:
        out.problems.append(f"the manifest says {manifest.get('rows')} rows, its files list {rows}")
    if len(readable) == len(listed) and folder in CHECKS:
        try:
            found = file_checks(folder, readable)
        except Exception as exc:  # noqa: BLE001 - any damage reads as an error of the day
            out.problems.append(f"its files cannot be read ({type(exc).__name__}: {exc})")
            return out
        differ = same_checks(manifest.get("checks") or {}, found)
        if differ:
            out.problems.append(
                "the files' checks differ from the manifest's: " + "; ".join(differ)
            )
    sidecar = manifest.get("sidecar")
    if folder == "probe_outcomes":
        if not isinstance(sidecar, dict):
            out.problems.append("the manifest names no sessions sidecar")
        else:
            target = dataset_dir(root, SIDECAR, key) / MANIFEST
            try:
                actual = _sha256(target.read_bytes())
            except FileNotFoundError:
                out.problems.append(f"its sessions sidecar {target} is missing")
            else:
                if actual != sidecar.get("sha256"):
                    out.problems.append(f"its sessions sidecar {target} is not the one it names")
    return out


def _parquet_problem(file: Path, entry: Mapping[str, Any], columns: list[Any]) -> str | None:
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(file)
    except Exception as exc:  # noqa: BLE001 - any damage reads as an error of the file
        return f"not a readable Parquet file ({type(exc).__name__}: {exc})"
    if meta.metadata.num_rows != entry.get("rows"):
        return f"holds {meta.metadata.num_rows} rows, the manifest says {entry.get('rows')}"
    names = [c.get("name") for c in columns]
    if meta.schema_arrow.names != names:
        return f"its columns {meta.schema_arrow.names} are not the manifest's {names}"
    return None


def file_checks(folder: str, files: Iterable[Path]) -> dict[str, Any]:
    """The day's checks computed from its files (``pg_checks`` computes them in
    PostgreSQL): a boolean flag counts true rows, any other non-NULL ones."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    spec = CHECKS[folder]
    wanted = [spec.group, *([spec.total] if spec.total else []), *spec.times, *spec.flags]
    rows = 0
    groups: Counter[str] = Counter()
    int_total = 0
    float_totals: list[float] = []
    total_is_float = False
    seen_total = False
    lows: dict[str, Any] = {}
    highs: dict[str, Any] = {}
    flags: Counter[str] = Counter()
    for path in files:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=ROW_GROUP_ROWS, columns=wanted):
            rows += batch.num_rows
            for item in pc.value_counts(batch.column(spec.group)).to_pylist():
                groups[_key(item["values"])] += int(item["counts"])
            if spec.total:
                col = batch.column(spec.total)
                if col.null_count < len(col):
                    seen_total = True
                if pa.types.is_floating(col.type):
                    total_is_float = True
                    float_totals.append(math.fsum(col.drop_null().to_pylist()))
                else:
                    int_total += int(pc.sum(col).as_py() or 0)
            for t in spec.times:
                mm = pc.min_max(batch.column(t))
                low, high = mm["min"].as_py(), mm["max"].as_py()
                if low is not None and (t not in lows or low < lows[t]):
                    lows[t] = low
                if high is not None and (t not in highs or high > highs[t]):
                    highs[t] = high
            for f in spec.flags:
                col = batch.column(f)
                if pa.types.is_boolean(col.type):
                    flags[f] += int(pc.sum(col).as_py() or 0)
                else:
                    flags[f] += len(col) - col.null_count
    out: dict[str, Any] = {"rows": rows, f"by_{spec.group}": dict(sorted(groups.items()))}
    if spec.total:
        total: int | float | None = None
        if seen_total:
            total = math.fsum(float_totals) if total_is_float else int_total
        out[f"sum_{spec.total}"] = total
    for t in spec.times:
        out[f"min_{t}"] = iso(lows.get(t))
        out[f"max_{t}"] = iso(highs.get(t))
    for f in spec.flags:
        out[f"rows_{f}"] = flags[f]
    return out


def _key(value: Any) -> str:
    return "null" if value is None else str(value)
