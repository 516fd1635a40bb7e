"""Atlas ping results in, per-echo outcomes joined to the reply log out, stored.

What the probe firmware writes (``eperd/ping.c``, checked against the real
``evping`` in tests/atlas): a result's entries come in the order events
happened, without sequence numbers or times. Before the run's first reply a
timeout writes ``{"x": "*"}`` and the probe moves on to the next sequence
number; a reply with the awaited sequence number writes ``{"rtt"}`` and moves
on; any other reply (a duplicate, or a late one whose sequence number has
passed) writes ``{"dup": 1, "rtt"}``. *After* the first reply a timeout
writes nothing and the next request re-uses the sequence number: such losses
are countable (the run sends ``packets`` requests whatever happens) but not
placeable from the result alone. A failed send writes ``{"error"}`` and from
then on timeouts write nothing either. ``sent``/``rcvd``/``dup`` are added by
RIPE's back end, not by the probe: they are stored as served but never
trusted (a run has the measurement's ``packets`` requests). The result's
``timestamp`` is taken when the run *ends* (start + packets x interval).

One module per subject; the first three are pure (no database, no network:
they import neither the store nor the client), the last does the I/O:

    parse.py  a result line as the firmware wrote it, read through Sagan
    check.py  what a result must be to be stored (``kickass_core.bounds``)
    join.py   a result joined to the reply log: its result row and outcomes
    fetch.py  windows of results from the API (or a file, ``result_files``)
              parsed, joined and stored with their watermark

The names callers use are re-exported here.
"""

from .check import MAX_ENTRIES, MAX_RESULT_BYTES, ResultRefused, check_result, key_integer
from .fetch import (
    DEFAULT_CHUNK_S,
    DEFAULT_LATE_HORIZON_S,
    DEFAULT_SETTLE_S,
    FetchReport,
    fetch_campaign,
    ingest_window,
    storable_results,
)
from .join import (
    JOIN_SLACK_S,
    MIN_TIMED_INTERVAL_S,
    RIVAL_RUN_S,
    SEQ_MOD,
    LoggedRun,
    LogIndex,
    MeasurementSpec,
    invalid_row,
    join,
    join_one,
    nominal_len,
    runs_near,
)
from .parse import (
    ERROR,
    MAX_ERROR_CHARS,
    REPLY,
    TIMEOUT,
    ParsedResult,
    ResultIgnored,
    ResultInvalid,
    Slot,
    identify,
    parse_result,
    why_unreadable,
)

__all__ = [
    "DEFAULT_CHUNK_S",
    "DEFAULT_LATE_HORIZON_S",
    "DEFAULT_SETTLE_S",
    "ERROR",
    "JOIN_SLACK_S",
    "MAX_ENTRIES",
    "MAX_ERROR_CHARS",
    "MAX_RESULT_BYTES",
    "MIN_TIMED_INTERVAL_S",
    "REPLY",
    "RIVAL_RUN_S",
    "SEQ_MOD",
    "TIMEOUT",
    "FetchReport",
    "LogIndex",
    "LoggedRun",
    "MeasurementSpec",
    "ParsedResult",
    "ResultIgnored",
    "ResultInvalid",
    "ResultRefused",
    "Slot",
    "check_result",
    "fetch_campaign",
    "identify",
    "ingest_window",
    "invalid_row",
    "join",
    "join_one",
    "key_integer",
    "nominal_len",
    "parse_result",
    "runs_near",
    "storable_results",
    "why_unreadable",
]
