"""Signed HTTP requests: no secret ever travels, and a replayed request is refused.

Trial runners talk to the measurement server (uploads, scheduled items) and
to the remote agents (flow tokens), usually across the Internet and without
TLS (the agent and a runner need no certificate). Instead of sending a token,
the client signs each request with a key derived from its secret:

    signature = HMAC-SHA256(key, METHOD \\n PATH \\n TIME \\n NONCE \\n SHA256(body))

and sends the key's id (a runner's name; ``agent`` for an agent), the time,
the nonce and the signature in ``X-Kickass-*`` headers. The receiver
recomputes the signature with its copy of the key, refuses a time outside
``WINDOW_S`` of its own clock, and refuses a nonce it has seen within that
window (the server keeps nonces in PostgreSQL, an agent in memory). A request
captured on the wire therefore yields neither the secret nor a second use.

Standard library only: runners, agents and the server all import this.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

KEY_ID = "X-Kickass-Key-Id"
TIME = "X-Kickass-Time"
NONCE = "X-Kickass-Nonce"
SIGNATURE = "X-Kickass-Signature"
HEADERS = (KEY_ID, TIME, NONCE, SIGNATURE)
# The key id of a request to an agent (one key: the agent secret's).
AGENT_KEY_ID = "agent"
# Clocks of runners and agents are NTP-synchronised hosts: two minutes of
# skew is generous, and bounds how long nonces must be remembered.
WINDOW_S = 120
NONCE_CHARS = 32


class SignatureError(ValueError):
    """A request whose signature does not hold (HTTP 401): ``reason`` says why."""


def key_from_secret(secret: str | bytes) -> bytes:
    """The signing key of a secret (a runner token, an agent secret). Only the
    key is stored by the verifier; the secret itself stays with its owner."""
    raw = secret.encode() if isinstance(secret, str) else secret
    return hashlib.sha256(raw.strip()).digest()


def runner_name(token: str) -> str:
    """The runner name a token (``NAME.SECRET``) signs as."""
    name, dot, rest = token.strip().rpartition(".")
    if not dot or not name or not rest:
        raise SignatureError(
            "a runner token is NAME.SECRET (from `kickass trials runners add NAME`)"
        )
    return name


def _canonical(method: str, path: str, when: str, nonce: str, body: bytes) -> bytes:
    digest = hashlib.sha256(body).hexdigest()
    return "\n".join((method.upper(), path, when, nonce, digest)).encode()


def sign(
    key: bytes,
    key_id: str,
    method: str,
    path: str,
    body: bytes = b"",
    *,
    now: float | None = None,
    nonce: str | None = None,
) -> dict[str, str]:
    """The headers that authenticate this request (``path`` with its query)."""
    when = str(int(time.time() if now is None else now))
    nonce = nonce or secrets.token_hex(NONCE_CHARS // 2)
    mac = hmac.new(key, _canonical(method, path, when, nonce, body), hashlib.sha256)
    return {KEY_ID: key_id, TIME: when, NONCE: nonce, SIGNATURE: mac.hexdigest()}


@dataclass(frozen=True)
class Signed:
    key_id: str
    nonce: str
    time: int


class HeaderLookup(Protocol):
    """A request's headers: a mapping, werkzeug's Headers or http.server's message
    (all that is used is ``get(name)``, case-insensitive for the latter two)."""

    def get(self, name: str, /) -> str | None: ...


def check(
    headers: HeaderLookup,
    method: str,
    path: str,
    body: bytes,
    key_for: Callable[[str], bytes | None],
    *,
    now: float | None = None,
    window_s: float = WINDOW_S,
) -> Signed:
    """The signer of a request, or SignatureError. ``key_for(key_id)`` gives the
    key of a known signer (None: unknown). The nonce is returned for the
    caller's replay check; it is not remembered here."""
    values = {h: headers.get(h) for h in HEADERS}
    missing = [h for h, v in values.items() if not v]
    if missing:
        raise SignatureError(f"unsigned request (missing {', '.join(missing)})")
    key_id, when, nonce, signature = (str(values[h]) for h in HEADERS)
    if len(key_id) > 64 or len(nonce) > 64 or len(signature) > 128 or len(when) > 12:
        raise SignatureError("malformed signature headers")
    try:
        t = int(when)
    except ValueError:
        raise SignatureError("malformed signature time") from None
    clock = time.time() if now is None else now
    if abs(clock - t) > window_s:
        raise SignatureError(
            f"request time {t} is {abs(clock - t):.0f} s from this host's clock "
            f"(more than {window_s:g} s): check both clocks (NTP)"
        )
    key = key_for(key_id)
    # An unknown signer costs the same work as a known one: timing tells nothing.
    mac = sign(key or bytes(32), key_id, method, path, body, now=t, nonce=nonce)[SIGNATURE]
    if not hmac.compare_digest(mac, signature) or key is None:
        raise SignatureError("bad signature (unknown signer, wrong key, or altered request)")
    return Signed(key_id, nonce, t)


class NonceCache:
    """Nonces seen within the window, in memory (one process: an agent)."""

    def __init__(self, window_s: float = WINDOW_S, max_entries: int = 100_000) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def seen(self, nonce: str, now: float | None = None) -> bool:
        """Remember ``nonce``; True if it was already seen (a replay)."""
        clock = time.monotonic() if now is None else now
        with self._lock:
            while self._seen:
                oldest, at = next(iter(self._seen.items()))
                if clock - at <= 2 * self.window_s and len(self._seen) < self.max_entries:
                    break
                self._seen.popitem(last=False)
            if nonce in self._seen:
                return True
            self._seen[nonce] = clock
            return False
