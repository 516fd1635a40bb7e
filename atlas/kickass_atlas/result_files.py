"""`kickass atlas import`: Atlas result files, read and checked line by line, stored.

A file is the results API's JSON list, newline-delimited JSON (the API's
``format=txt``, RIPE Atlas's hourly archive dumps), each as is or
bzip2/gzip/xz-compressed (told by their first bytes, not the name). Every
line (or element of a JSON list) of one of the campaign's measurements is
checked before anything of it is stored: strict JSON (no NaN or infinities,
bounded nesting and length), text and values that ``jsonb`` stores as they
are, a key (``prb_id``, ``timestamp``) its columns hold, and every number that
reaches a column within that column's bounds (``kickass_core.bounds``: sizes
and counts, each reply's RTT, the wall-clock times from 1970 to 2100), the
addresses addresses. A line that is not is skipped and counted with its
line number and the reason (``ImportReport.skipped``); the rest is parsed,
joined and stored exactly as ``fetch`` stores the API's (``ingest``). A result
that passes and still cannot be read is stored ``invalid`` with its reason,
as fetch does. Lines of other measurements (the archive dumps hold every
public one) are counted as ignored, unread.
"""

from __future__ import annotations

import bz2
import gzip
import io
import ipaddress
import json
import lzma
import math
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kickass_core import bounds, strictjson
from kickass_core.errors import KickassError
from ripe.atlas.sagan.base import ParsingDict
from ripe.atlas.sagan.ping import PingResult

from .campaign import Campaign
from .ingest import (
    DEFAULT_CHUNK_S,
    FetchReport,
    MeasurementSpec,
    _int,
    _measurement_specs,
    ingest_window,
)
from .store import AtlasStore

# An Atlas ping result is a few hundred bytes to a few kilobytes.
MAX_LINE_BYTES = 256 * 1024
# Entries of one result: a ping sends at most 16 packets; each entry is a
# reply, a duplicate, a timeout or an error. Each becomes an outcome with a
# smallint packet index.
MAX_ENTRIES = 1024
# What jsonb refuses in text (NUL) and UTF-8 cannot hold (lone surrogates).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
_MSM_ID = re.compile(rb'"msm_id"\s*:\s*"?(\d+)')

# A result's key and times (as ingest reads them), and its numbers as Sagan
# reads them, named as in the line, bounded by the column each lands in.
_KEY = bounds.ATLAS_RESULT_KEY
_TIMESTAMP = bounds.wall_clock("timestamp", required=True)
_STORED = bounds.wall_clock("stored_timestamp")
_RESULT = {f.name: f for f in bounds.ATLAS_RESULTS}
_FW = bounds.renamed(_RESULT["firmware"], "fw")
_SIZE, _SENT, _RCVD, _DUP = (_RESULT[n] for n in ("size", "sent", "rcvd", "dup"))
_RTT = bounds.renamed({f.name: f for f in bounds.ATLAS_OUTCOMES}["rtt_ms"], "rtt")


class LineRefused(ValueError):
    """A result line skipped: what is wrong with it, for the summary."""


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
        return _integer(line.get("msm_id"))
    if isinstance(line, str):
        line = line.encode("utf-8", "surrogatepass")
    if not isinstance(line, bytes):
        return None
    m = _MSM_ID.search(line)
    return _integer(m.group(1).decode()) if m else None


def _integer(value: Any) -> int | None:
    """An integer as ``ingest`` reads a key (an int, or a string of digits);
    None otherwise. Longer than any bigint: -1, no measurement's or probe's."""
    if isinstance(value, str) and value.strip().isdigit() and len(value.strip()) > 19:
        return -1
    return _int(value)


def check_line(line: bytes | str | Any) -> dict[str, Any]:
    """The result of one line, if everything of it that is stored fits its
    column and every reader can read it; LineRefused otherwise. A result
    Sagan cannot read passes: it is stored ``invalid``, with its reason."""
    if isinstance(line, bytes | str):
        data = line.encode("utf-8", "surrogatepass") if isinstance(line, str) else line
        if len(data.strip()) > MAX_LINE_BYTES:
            raise LineRefused(f"longer than {MAX_LINE_BYTES} bytes")
        try:
            obj = strictjson.loads(data.strip())
        except UnicodeDecodeError:
            raise LineRefused("not UTF-8") from None
        except ValueError as exc:
            raise LineRefused(f"not JSON: {str(exc)[:200]}") from None
    else:
        obj = line
    if not isinstance(obj, dict):
        raise LineRefused("not a JSON object")
    _check_storable(obj)
    # The key and the times as ingest reads them (an integer or digits).
    for f in (*_KEY, _TIMESTAMP):
        given = obj.get(f.name)
        if given is None:
            raise LineRefused(f"{f.name}: missing")
        value = _integer(given)
        if value is None:
            raise LineRefused(f"{f.name}: must be an integer")
        _check(f, value)
    _check(_STORED, _integer(obj.get("stored_timestamp")))
    _check(_FW, _integer(obj.get("fw")))
    entries = obj.get("result")
    if isinstance(entries, list) and len(entries) > MAX_ENTRIES:
        raise LineRefused(f"result: more than {MAX_ENTRIES} entries")
    _check_as_read(obj)
    return obj


def _check_as_read(obj: dict[str, Any]) -> None:
    """The numbers and addresses of the result as Sagan reads them (it turns
    "1e300" into a float and 1e300 into an integer), each within its column."""
    try:
        r = PingResult(
            obj, on_error=ParsingDict.ACTION_IGNORE, on_malformation=ParsingDict.ACTION_IGNORE
        )
    except Exception:  # noqa: BLE001 - unreadable: stored invalid by ingest, with the reason
        return
    for f, value in (
        (_FW, r.firmware),
        (_SIZE, r.packet_size),
        (_SENT, r.packets_sent),
        (_RCVD, r.packets_received),
        (_DUP, r.duplicates),
    ):
        _check(f, value)
    for p in r.packets:
        _check(_RTT, p.rtt)
    for name, value in (("from", r.origin), ("dst_addr", r.destination_address)):
        if value:
            try:
                ipaddress.ip_address(value)
            except ValueError:
                raise LineRefused(f"{name}: not an IP address") from None


def _check(f: bounds.Field, value: Any) -> None:
    """``value`` within ``f`` (None: checked elsewhere, or not stored)."""
    if value is None:
        return
    try:
        bounds.check_value(f, value)
    except ValueError as exc:
        raise LineRefused(str(exc)) from None


def _check_storable(obj: dict[str, Any]) -> None:
    """Raw JSON ``jsonb`` keeps as it is: finite numbers (an element of a JSON
    list was parsed leniently), no NUL, no lone surrogate."""
    stack: list[Any] = [obj]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if _UNSTORABLE.search(v):
                raise LineRefused("holds a NUL character or invalid Unicode")
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise LineRefused("holds NaN or an infinity")
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            for k, x in v.items():
                if not isinstance(k, str) or _UNSTORABLE.search(k):
                    raise LineRefused("holds a NUL character or invalid Unicode")
                stack.append(x)


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
            obj = check_line(where.line)
        except LineRefused as exc:
            report.skipped.append((where, str(exc)))
            continue
        msm_id, timestamp = _integer(obj["msm_id"]), _integer(obj["timestamp"])
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
