"""Names of the study's session life cycle, defined once (ARCHITECTURE.md, "Names").

A session is *live* (``created`` until the client proves its address,
``probing`` while probes go out) and then *final*; the database's CHECK
constraints, the engine, the HTTP API and the volunteer client all use these.
"""

from __future__ import annotations

CREATED = "created"
PROBING = "probing"
COMPLETE = "complete"
ENDED = "ended"
EXPIRED = "expired"
INCOMPLETE = "incomplete"

LIVE_STATES = (CREATED, PROBING)
FINAL_STATES = (COMPLETE, ENDED, EXPIRED, INCOMPLETE)
SESSION_STATES = LIVE_STATES + FINAL_STATES

# What happened to one probe: acknowledged in time, never, or after its timeout.
ACKED = "acked"
LOST = "lost"
LATE = "late"
OUTCOMES = (ACKED, LOST, LATE)
