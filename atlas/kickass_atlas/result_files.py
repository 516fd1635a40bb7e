"""`kickass atlas import`: Atlas result files, read and checked line by line, stored.

A file is the results API's JSON list, newline-delimited JSON (the API's
``format=txt``, RIPE Atlas's hourly archive dumps), each as is or
bzip2/gzip/xz-compressed (told by their first bytes, not the name). Every
line (or element of a JSON list) of one of the campaign's measurements is
checked before anything of it is stored (``ingest.check.check_result``, which
fetch applies to the API's results too): strict JSON (no NaN or infinities,
bounded nesting and length), text and values that ``jsonb`` stores as they
are, a key (``prb_id``, ``timestamp``) its columns hold, and every number that
reaches a column within that column's bounds (``kickass_core.bounds``: sizes
and counts, each reply's RTT, the wall-clock times from 1970 to 2100), the
addresses addresses. A line that is not is skipped and counted with its
line number and the reason (``ImportReport.skipped``); the rest is parsed,
joined and stored exactly as ``fetch`` stores the API's
(``ingest.fetch.ingest_window``). A result that passes and still cannot be
read is stored ``invalid`` with its reason, as fetch does. Lines of other
measurements (the archive dumps hold every public one) are counted as
ignored, unread.
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kickass_core import strictjson
from kickass_core.errors import KickassError

from .campaign import Campaign
from .ingest.check import MAX_RESULT_BYTES, ResultRefused, check_result, key_integer
from .ingest.fetch import DEFAULT_CHUNK_S, FetchReport, _measurement_specs, ingest_window
from .ingest.join import MeasurementSpec
from .store import AtlasStore

MAX_LINE_BYTES = MAX_RESULT_BYTES
_MSM_ID = re.compile(rb'"msm_id"\s*:\s*"?(\d+)')


@dataclass(frozen=True)
class SourceLine:
    """One line of a result file, or one element of a JSON list, and where it was."""

    source: str
    number: int  # the line's number in its file, or the element's in its list
    line: bytes | str | Any
    item: bool = False  # an element of a JSON list

    def to_json(self, reason: str) -> dict[str, Any]:
        return {"source": self.source, "item" if self.item else "line": self.number,
                "reason": reason}  # fmt: skip

    def where(self) -> str:
        return f"{self.source}, {'item' if self.item else 'line'} {self.number}"


@dataclass
class ImportReport(FetchReport):
    """``FetchReport`` and the lines skipped, each with its reason."""

    skipped: list[tuple[SourceLine, str]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            **super().to_json(),
            "skipped": len(self.skipped),
            "skipped_lines": [where.to_json(reason) for where, reason in self.skipped],
        }


def numbered_result_lines(source: str | Path) -> Iterator[SourceLine]:
    """The lines of a result file (``-``: standard input), numbered as in the
    file (blank ones counted, not yielded), or a JSON list's elements."""
    name = str(source)
    if name == "-":
        raw: IO[bytes] = sys.stdin.buffer
    else:
        try:
            raw = open(source, "rb")  # noqa: SIM115 - closed below, also on errors
        except OSError as exc:
            raise KickassError(
                f"cannot read {source}: {exc.strerror or exc}",
                hint="give a file of Atlas result lines, or - for standard input",
            ) from None
    try:
        reader: Any = raw if isinstance(raw, io.BufferedReader) else io.BufferedReader(raw)
        head = reader.peek(8)[:8]
        # Every decompressor here can peek, as the plain reader can.
        stream: Any
        if head.startswith(b"BZh"):
            stream = bz2.BZ2File(reader)
        elif head.startswith(b"\x1f\x8b"):
            stream = gzip.GzipFile(fileobj=reader)
        elif head.startswith(b"\xfd7zXZ\x00"):
            stream = lzma.LZMAFile(reader)  # noqa: SIM115 - closed with the file
        else:
            stream = reader
        first = stream.peek(4096).lstrip()[:1]
        if first == b"[":
            data = _json_list(name, stream.read())
            for n, obj in enumerate(data, 1):
                yield SourceLine(name, n, obj, item=True)
            return
        for n, line in enumerate(strictjson.read_lines(stream, MAX_LINE_BYTES), 1):
            if line.strip():
                yield SourceLine(name, n, line)
    except (OSError, EOFError, lzma.LZMAError) as exc:
        raise KickassError(
            f"{source}: cannot decompress or read: {exc}",
            hint="bzip2, gzip or xz archives, or plain JSON",
        ) from None
    finally:
        if raw is not sys.stdin.buffer:
            raw.close()


def _json_list(source: str, data: bytes) -> list[Any]:
    """The results API's JSON list. Its elements are checked one by one
    (``check_line``): a NaN in one of them costs that one, not the file."""
    try:
        text = data.decode("utf-8")
        if strictjson.nesting_depth(text, strictjson.MAX_DEPTH) > strictjson.MAX_DEPTH:
            raise ValueError(f"nested deeper than {strictjson.MAX_DEPTH} levels")
        parsed = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise KickassError(
            f"{source}: not a JSON list of results: {str(exc)[:200]}",
            hint="the results API's JSON, or one JSON result per line",
        ) from None
    return parsed if isinstance(parsed, list) else [parsed]


def read_result_lines(source: str | Path) -> Iterator[bytes | str | Any]:
    """The lines (bytes) or JSON list elements of a result file, unnumbered."""
    for x in numbered_result_lines(source):
        yield x.line


def peek_msm_id(line: bytes | str | Any) -> int | None:
    """The line's msm_id, found without parsing the line (the archive dumps
    are mostly other measurements' results)."""
    if isinstance(line, Mapping):
        return key_integer(line.get("msm_id"))
    if isinstance(line, str):
        line = line.encode("utf-8", "surrogatepass")
    if not isinstance(line, bytes):
        return None
    m = _MSM_ID.search(line)
    return key_integer(m.group(1).decode()) if m else None


def import_campaign(
    store: AtlasStore,
    campaign: Campaign,
    lines: Iterable[SourceLine | bytes | str | Mapping[str, Any]],
    *,
    chunk_s: int = DEFAULT_CHUNK_S,
    progress: Callable[[str], None] = lambda _msg: None,
) -> ImportReport:
    """Store result lines from files exactly as ``fetch`` stores the API's:
    same parsing, join and rows (origin ``import``), idempotent; no
    watermark moves and no API is asked (probe addresses: those stored).
    Lines that are not ``SourceLine`` are numbered in the order given."""
    campaign_id, measurements = _measurement_specs(store, campaign)
    specs = {int(m["msm_id"]): MeasurementSpec.from_row(m) for m in measurements}
    report = ImportReport()
    by_msm: dict[int, list[tuple[int, dict[str, Any]]]] = defaultdict(list)
    for n, x in enumerate(lines, 1):
        where = x if isinstance(x, SourceLine) else SourceLine("-", n, x)
        msm_id = peek_msm_id(where.line)
        if msm_id is not None and msm_id not in specs:
            # The archive dumps hold every public measurement: not an error.
            report.ignored["another measurement's result"] += 1
            continue
        try:
            obj = check_result(where.line)
        except ResultRefused as exc:
            report.skipped.append((where, str(exc)))
            continue
        msm_id, timestamp = key_integer(obj["msm_id"]), key_integer(obj["timestamp"])
        assert msm_id is not None and timestamp is not None  # check_line
        if msm_id not in specs:
            report.ignored["another measurement's result"] += 1
            continue
        by_msm[msm_id].append((timestamp, obj))
    for msm_id, items in sorted(by_msm.items()):
        spec = specs[msm_id]
        items.sort(key=lambda x: x[0])
        i = 0
        while i < len(items):
            start = items[i][0] - items[i][0] % chunk_s
            stop = start + chunk_s
            j = i
            while j < len(items) and items[j][0] < stop:
                j += 1
            new = ingest_window(
                store,
                spec,
                [x[1] for x in items[i:j]],
                start,
                stop,
                report,
                store.known_probes,
                watermark=None,
                origin="import",
            )
            progress(f"measurement {msm_id}: {new} new results of {j - i}")
            i = j
        report.measurements += 1
    if report.probes:
        store.refresh_verdicts(campaign_id, report.probes)
    return report
