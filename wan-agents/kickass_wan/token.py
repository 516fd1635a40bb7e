"""Per-flow tokens: an agent serves a flow only to a runner it gave a token to.

A runner asks the agent's control API (authenticated by the per-agent secret)
for a token; the flow's first packet carries it; the agent checks the MAC and
the expiry and accepts each token once (a replayed token is refused). Both
the Python TCP receiver and the Rust Kick-Ass receiver check the same bytes,
pinned by ``core/vectors/flow_token.json``.

Layout (30 bytes):  version u8 = 1 | kind u8 (1 kickass, 2 tcp) |
expires u32 (unix seconds, big-endian) | nonce 8 bytes |
mac 16 bytes = HMAC-SHA256(secret, b"kickass-flow-token" || first 14 bytes)[:16]
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

VERSION = 1
KIND_KICKASS = 1
KIND_TCP = 2
TOKEN_LEN = 30
_HEAD = struct.Struct("!BBI8s")
_LABEL = b"kickass-flow-token"


@dataclass(frozen=True)
class FlowToken:
    kind: int
    expires: int
    nonce: bytes

    def encode(self, secret: bytes) -> bytes:
        head = _HEAD.pack(VERSION, self.kind, self.expires, self.nonce)
        return head + _mac(secret, head)


def _mac(secret: bytes, head: bytes) -> bytes:
    return hmac.new(secret, _LABEL + head, hashlib.sha256).digest()[:16]


def issue(secret: bytes, kind: int, now: float, lifetime_s: float = 600.0) -> bytes:
    if kind not in (KIND_KICKASS, KIND_TCP):
        raise ValueError(f"unknown flow kind {kind}")
    return FlowToken(kind, int(now + lifetime_s), secrets.token_bytes(8)).encode(secret)


def verify(secret: bytes, token: bytes, now: float) -> FlowToken | None:
    """The token if its MAC is right and it has not expired, else None."""
    if len(token) != TOKEN_LEN:
        return None
    head, mac = token[: _HEAD.size], token[_HEAD.size :]
    if not hmac.compare_digest(mac, _mac(secret, head)):
        return None
    version, kind, expires, nonce = _HEAD.unpack(head)
    if version != VERSION or kind not in (KIND_KICKASS, KIND_TCP) or expires < now:
        return None
    return FlowToken(kind, expires, nonce)


class ReplayGuard:
    """Accepts each valid token once, remembering nonces until they expire.

    With ``state_file`` the used nonces survive a restart of the agent (one
    line each, appended and flushed before the flow is accepted), so a token
    replayed after a restart is still refused.
    """

    def __init__(
        self, secret: bytes, max_live: int = 100_000, state_file: str | Path | None = None
    ) -> None:
        self.secret = secret
        self.max_live = max_live
        self._seen: dict[bytes, int] = {}
        self._lock = threading.Lock()
        self._state: Path | None = Path(state_file) if state_file else None
        if self._state is not None:
            self._load(time.time())

    def _load(self, now: float) -> None:
        assert self._state is not None
        try:
            lines = self._state.read_text().split()
        except FileNotFoundError:
            lines = []
        for line in lines:
            nonce_hex, _, expires = line.partition(":")
            try:
                nonce, exp = bytes.fromhex(nonce_hex), int(expires)
            except ValueError:
                continue
            if exp >= now:
                self._seen[nonce] = exp
        # Rewrite without the expired ones, so the file stays small.
        tmp = self._state.with_suffix(".tmp")
        tmp.write_text("".join(f"{n.hex()}:{e}\n" for n, e in self._seen.items()))
        os.replace(tmp, self._state)

    def accept(self, token: bytes, now: float, kind: int | None = None) -> FlowToken | None:
        t = verify(self.secret, token, now)
        if t is None or (kind is not None and t.kind != kind):
            return None
        with self._lock:
            if len(self._seen) >= self.max_live:
                self._seen = {n: e for n, e in self._seen.items() if e >= now}
                if len(self._seen) >= self.max_live:
                    return None  # refuse rather than forget a live nonce
            if t.nonce in self._seen:
                return None
            self._seen[t.nonce] = t.expires
            if self._state is not None:
                with self._state.open("a") as f:
                    f.write(f"{t.nonce.hex()}:{t.expires}\n")
                    f.flush()
                    os.fsync(f.fileno())
        return t
