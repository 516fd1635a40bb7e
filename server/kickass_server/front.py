"""The HTTP front: waitress, bounded against hostile clients before Flask sees a byte.

waitress's defaults suit a trusted network, not a server that anyone on the
Internet may talk to:

* it spools request bodies of up to 1 GiB to disk before the app's own limit
  applies, so the body limit is set here (``max_body``, 256 KiB: the largest
  legitimate body is a trial runner's batch) and a larger request gets 413
  while its headers are parsed; the app still holds the study's endpoints to
  16 KiB. Every limit is inclusive, as documented: a body of exactly 256 KiB
  is served and one byte more is refused, whether it comes with a
  Content-Length or chunked (its decoded size counts, not the framing);
  waitress itself refuses a body *at* its limit and counts chunk framing, so
  it gets looser limits and ``_Parser`` holds the exact ones;
* a request head (request line, headers and the blank line that ends them)
  may be ``max_header`` (16 KiB) long; one byte more gets 431;
* one address may hold all of its 100 connections (slowloris), so connections
  are capped per address (``per_address``) and a request must be complete
  within ``request_timeout`` seconds of its first byte, however slowly it trickles;
* it ignores ``X-Forwarded-For`` unless told which proxy to trust; with
  ``trusted_proxy`` set it takes the client address from the entry that proxy
  appended (the rightmost), never the leftmost the client wrote itself.

Behind a reverse proxy, every client arrives from the proxy's address: the
trusted proxy is exempt from the per-address cap (else eight requests in
flight from all volunteers together would be the server's limit) and must
bound connections per client itself (docker/README.md: nginx allows 8); the
total cap (``total``, 200 client connections; one more waits in the listen
backlog until one of them closes) still holds.

tests/server/test_limits.py tries every one of these at its edge.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from waitress.adjustments import Adjustments
from waitress.channel import HTTPChannel
from waitress.parser import HTTPRequestParser
from waitress.server import TcpWSGIServer
from waitress.task import ThreadedTaskDispatcher
from waitress.utilities import RequestEntityTooLarge

log = logging.getLogger("kickass.http")


@dataclass(frozen=True)
class FrontLimits:
    # The study's requests are tiny (the app refuses more than 16 KiB); a trial
    # runner's batch of flow records is the largest legitimate body.
    max_body: int = 256 * 1024
    max_header: int = 16 * 1024
    per_address: int = 8
    total: int = 200
    request_timeout: float = 10.0
    idle_timeout: int = 30
    # How often slow requests are looked for (waitress's maintenance tick).
    sweep_interval: int = 1


# waitress refuses a chunked body by its bytes on the wire, framing included;
# the decoded body is held to max_body, the wire to this many times it.
CHUNKED_WIRE_FACTOR = 2


class _Parser(HTTPRequestParser):  # type: ignore[misc]  # waitress is untyped
    """Remembers when a request's first byte arrived, and holds the body to
    ``max_body`` bytes exactly (a subclass per server sets it)."""

    max_body = FrontLimits.max_body
    error: Any  # waitress's: set when the request is refused

    def __init__(self, adj: Adjustments) -> None:
        super().__init__(adj)
        self.started = time.monotonic()

    def received(self, data: bytes) -> int:
        consumed: int = super().received(data)
        if self.error is None and self.headers_finished:
            body = self.body_rcv
            size = len(body) if self.chunked and body is not None else self.content_length
            if size > self.max_body:
                self.error = RequestEntityTooLarge(f"exceeds max_body of {self.max_body}")
                self.completed = True
        return consumed


class _Channel(HTTPChannel):  # type: ignore[misc]  # waitress is untyped
    parser_class = _Parser


class FrontServer(TcpWSGIServer):  # type: ignore[misc]  # waitress is untyped
    channel_class = _Channel

    def __init__(self, *args: Any, limits: FrontLimits, **kwargs: Any) -> None:
        self.limits = limits
        self.refused: Counter[str] = Counter()

        class Parser(_Parser):
            max_body = limits.max_body

        class Channel(_Channel):
            parser_class = Parser

        self.channel_class = Channel
        super().__init__(*args, **kwargs)
        # waitress counts its socket map against connection_limit, and the map
        # holds its own listening socket and wake-up pipe too: 198 clients
        # for a limit of 200. These are in it now, and no client yet.
        self.adj.connection_limit = limits.total + len(self._map)

    def handle_accept(self) -> None:
        try:
            pair = self.accept()
        except OSError:
            return
        if pair is None:
            return
        conn, addr = pair
        host = addr[0]
        same = sum(1 for ch in self.active_channels.values() if ch.addr[0] == host)
        if same >= self.limits.per_address and host != self.adj.trusted_proxy:
            # Closed before a byte is read: costs the server one accept.
            self.refused[host] += 1
            if self.refused[host] in (1, 10, 100, 1000):
                log.warning(
                    "refused a connection from %s: %d open (limit %d per address; %d refused)",
                    host,
                    same,
                    self.limits.per_address,
                    self.refused[host],
                )
            conn.close()
            return
        self.set_socket_options(conn)
        self.channel_class(self, conn, self.fix_addr(addr), self.adj, map=self._map)

    def maintenance(self, now: float) -> None:
        super().maintenance(now)
        cutoff = time.monotonic() - self.limits.request_timeout
        for channel in list(self.active_channels.values()):
            partial = channel.request
            if partial is not None and not channel.requests and partial.started < cutoff:
                log.info(
                    "closed a connection from %s: request not complete in time", channel.addr[0]
                )
                channel.will_close = True


def create_front(
    app: Any,
    host: str,
    port: int,
    *,
    threads: int = 8,
    trusted_proxy: str | None = None,
    limits: FrontLimits | None = None,
) -> FrontServer:
    limits = limits or FrontLimits()
    kw: dict[str, Any] = {
        "host": host,
        "port": port,
        "threads": threads,
        "ident": "kickass",
        # waitress refuses at these sizes, not above them (and counts chunk
        # framing): _Parser holds bodies to max_body exactly.
        "max_request_body_size": limits.max_body * CHUNKED_WIRE_FACTOR + 1,
        "max_request_header_size": limits.max_header + 1,
        "connection_limit": limits.total,
        "channel_timeout": limits.idle_timeout,
        "cleanup_interval": limits.sweep_interval,
        # Bodies are tiny: never spool them to a temporary file.
        "inbuf_overflow": limits.max_body * CHUNKED_WIRE_FACTOR + 1,
    }
    if trusted_proxy:
        kw.update(
            trusted_proxy=trusted_proxy,
            trusted_proxy_count=1,
            trusted_proxy_headers={"x-forwarded-for"},
            clear_untrusted_proxy_headers=True,
        )
    adj = Adjustments(**kw)
    dispatcher = ThreadedTaskDispatcher()
    dispatcher.set_thread_count(adj.threads)
    (sockinfo,) = adj.listen[:1]
    return FrontServer(app, {}, dispatcher=dispatcher, adj=adj, sockinfo=sockinfo, limits=limits)
