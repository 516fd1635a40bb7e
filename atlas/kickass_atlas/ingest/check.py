"""What a result must be to be stored: ``check_result``.

A result with a value its column cannot hold, or a reader cannot read back
(by ``kickass_core.bounds``), is refused before it is parsed or joined:
fetch counts and logs it (``fetch.storable_results``), ``kickass atlas
import`` skips its line by number (``result_files``).

Pure: no database, no network.
"""

from __future__ import annotations

import ipaddress
import math
import re
from typing import Any

from kickass_core import bounds, strictjson
from ripe.atlas.sagan.base import ParsingDict
from ripe.atlas.sagan.ping import PingResult

from .parse import _int

# A result line is a few hundred bytes to a few kilobytes.
MAX_RESULT_BYTES = 256 * 1024
# Entries of one result: a ping sends at most 16 packets; each entry is a
# reply, a duplicate, a timeout or an error. Each becomes an outcome with a
# smallint packet index.
MAX_ENTRIES = 1024
# What jsonb refuses in text (NUL) and UTF-8 cannot hold (lone surrogates).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
# A result's key and times (as ingest reads them), and its numbers as Sagan
# reads them, named as in the line, bounded by the column each lands in.
_KEY = bounds.ATLAS_RESULT_KEY
_TIMESTAMP = bounds.wall_clock("timestamp", required=True)
_STORED = bounds.wall_clock("stored_timestamp")
_RESULT = {f.name: f for f in bounds.ATLAS_RESULTS}
_FW = bounds.renamed(_RESULT["firmware"], "fw")
_SIZE, _SENT, _RCVD, _DUP = (_RESULT[n] for n in ("size", "sent", "rcvd", "dup"))
_RTT = bounds.renamed({f.name: f for f in bounds.ATLAS_OUTCOMES}["rtt_ms"], "rtt")


class ResultRefused(ValueError):
    """A result that cannot be stored as it is, or not read back: what is wrong with it."""


def key_integer(value: Any) -> int | None:
    """An integer as ``ingest`` reads a key (an int, or a string of digits);
    None otherwise. Longer than any bigint: -1, no measurement's or probe's."""
    if isinstance(value, str) and value.strip().isdigit() and len(value.strip()) > 19:
        return -1
    return _int(value)


def check_result(line: bytes | str | Any) -> dict[str, Any]:
    """The result of one line, if everything of it that is stored fits its
    column and every reader can read it; ResultRefused otherwise. A result
    Sagan cannot read passes: it is stored ``invalid``, with its reason."""
    if isinstance(line, bytes | str):
        data = line.encode("utf-8", "surrogatepass") if isinstance(line, str) else line
        if len(data.strip()) > MAX_RESULT_BYTES:
            raise ResultRefused(f"longer than {MAX_RESULT_BYTES} bytes")
        try:
            obj = strictjson.loads(data.strip())
        except UnicodeDecodeError:
            raise ResultRefused("not UTF-8") from None
        except ValueError as exc:
            raise ResultRefused(f"not JSON: {str(exc)[:200]}") from None
    else:
        obj = line
    if not isinstance(obj, dict):
        raise ResultRefused("not a JSON object")
    _check_storable(obj)
    # The key and the times as ingest reads them (an integer or digits).
    for f in (*_KEY, _TIMESTAMP):
        given = obj.get(f.name)
        if given is None:
            raise ResultRefused(f"{f.name}: missing")
        value = key_integer(given)
        if value is None:
            raise ResultRefused(f"{f.name}: must be an integer")
        _check(f, value)
    _check(_STORED, key_integer(obj.get("stored_timestamp")))
    _check(_FW, key_integer(obj.get("fw")))
    entries = obj.get("result")
    if isinstance(entries, list) and len(entries) > MAX_ENTRIES:
        raise ResultRefused(f"result: more than {MAX_ENTRIES} entries")
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
                raise ResultRefused(f"{name}: not an IP address") from None


def _check(f: bounds.Field, value: Any) -> None:
    """``value`` within ``f`` (None: checked elsewhere, or not stored)."""
    if value is None:
        return
    try:
        bounds.check_value(f, value)
    except ValueError as exc:
        raise ResultRefused(str(exc)) from None


def _check_storable(obj: dict[str, Any]) -> None:
    """Raw JSON ``jsonb`` keeps as it is: finite numbers (an element of a JSON
    list was parsed leniently), no NUL, no lone surrogate."""
    stack: list[Any] = [obj]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if _UNSTORABLE.search(v):
                raise ResultRefused("holds a NUL character or invalid Unicode")
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise ResultRefused("holds NaN or an infinity")
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            for k, x in v.items():
                if not isinstance(k, str) or _UNSTORABLE.search(k):
                    raise ResultRefused("holds a NUL character or invalid Unicode")
                stack.append(x)
