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
window (the server keeps nonces in PostgreSQL, an agent in a file of its state
directory, so that a restart forgets none). A request captured on the wire
therefore yields neither the secret nor a second use.

Standard library only: runners, agents and the server all import this.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

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


def signed_json(
    key: bytes,
    key_id: str,
    method: str,
    url: str,
    body: Any = None,
    *,
    timeout_s: float,
) -> tuple[int, dict[str, Any]]:
    """One signed request with a JSON body (``body`` None: none) and a JSON
    answer: (status, the answer if it is an object, else {}). An HTTP error
    status is returned, not raised: what a 409 or a 413 means is the
    caller's. An unreachable peer raises OSError (urllib's URLError, a
    timeout) and an answer that is not JSON ValueError, for the caller to
    say what that means. The signed path keeps the URL's query."""
    # Imported here: most of this module's users never send (an agent, the server).
    import urllib.error
    import urllib.parse
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    parts = urllib.parse.urlsplit(url)
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    for name, value in sign(key, key_id, method, path, data or b"").items():
        req.add_header(name, value)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
        try:
            answer = json.loads(raw or b"{}")
        except ValueError:
            answer = {}  # an error page from a proxy, say: the status says enough
        return status, answer if isinstance(answer, dict) else {}
    answer = json.loads(raw or b"{}")
    return status, answer if isinstance(answer, dict) else {}


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
    """Nonces of accepted requests, remembered while their request could still
    pass ``check``'s time test: until ``2 * window_s`` past the time it was
    signed at (the window, and as much again for this host's clock being
    stepped back).

    With ``state_file`` each nonce is also appended to that file, and synced,
    before its request is accepted, and the file is read back at start: a
    request captured before a restart of this process (an agent's) and
    replayed after it, within its window, is refused as before the restart.
    Refusing every request dated before the start would not do: the window
    admits runners whose clock is ahead of ours, so a request accepted just
    before a restart can carry a time after it.

    At ``max_entries`` live nonces a new request is refused (SignatureError)
    rather than a live nonce forgotten; only holders of a key can add any.
    """

    def __init__(
        self,
        window_s: float = WINDOW_S,
        max_entries: int = 100_000,
        state_file: str | Path | None = None,
        now: float | None = None,
    ) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self._seen: dict[str, int] = {}  # nonce -> the time its request was signed at
        self._lock = threading.Lock()
        self._state = Path(state_file) if state_file is not None else None
        # Nonces remembered since expired ones were last forgotten (and the
        # state file last rewritten): when to do it again, so that both stay
        # within twice the live nonces and the work is amortised.
        self._added = 0
        self._next_sweep = _MIN_SWEEP
        if self._state is not None:
            self._load(time.time() if now is None else now)

    def _live(self, signed_at: int, now: float) -> bool:
        return now <= signed_at + 2 * self.window_s

    def _load(self, now: float) -> None:
        assert self._state is not None
        try:
            text = self._state.read_text(encoding="ascii", errors="replace")
        except FileNotFoundError:
            text = ""
        for line in text.splitlines():
            nonce_hex, _, when = line.partition(" ")
            try:
                nonce, signed_at = bytes.fromhex(nonce_hex).decode(), int(when)
            except ValueError:
                continue  # a line cut short by a crash
            if self._live(signed_at, now):
                self._seen[nonce] = signed_at
        self._rewrite()

    def _rewrite(self) -> None:
        """The state file with the live nonces only, replaced in one step."""
        assert self._state is not None
        tmp = self._state.with_name(self._state.name + ".tmp")
        with tmp.open("w", encoding="ascii") as f:
            f.writelines(_nonce_line(n, t) for n, t in self._seen.items())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._state)

    def seen(self, nonce: str, signed_at: int, now: float | None = None) -> bool:
        """Remember the nonce of a request signed at ``signed_at`` (its
        ``Signed.time``); True if it was seen before (a replay). OSError: the
        state file could not be written, and the request must be refused."""
        clock = time.time() if now is None else now
        with self._lock:
            if nonce in self._seen:
                return True
            if len(self._seen) >= self.max_entries:
                self._forget_expired(clock)
                if len(self._seen) >= self.max_entries:
                    raise SignatureError(
                        "too many signed requests within the replay window: try again later"
                    )
            self._seen[nonce] = signed_at
            self._added += 1
            if self._added >= self._next_sweep:
                self._forget_expired(clock)
                self._added = 0
                self._next_sweep = max(_MIN_SWEEP, len(self._seen))
                if self._state is not None:
                    self._rewrite()
            elif self._state is not None:
                with self._state.open("a", encoding="ascii") as f:
                    f.write(_nonce_line(nonce, signed_at))
                    f.flush()
                    os.fsync(f.fileno())
            return False

    def _forget_expired(self, now: float) -> None:
        self._seen = {n: t for n, t in self._seen.items() if self._live(t, now)}


# Nonces added between two sweeps of the expired ones, at least.
_MIN_SWEEP = 1024


def _nonce_line(nonce: str, signed_at: int) -> str:
    # Hex: a nonce is whatever header value its signer chose.
    return f"{nonce.encode().hex()} {signed_at}\n"
