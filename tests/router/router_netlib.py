"""Packet helpers for the edge-router tests (test-only; the topology, the
programs and namespace switching come from kickass_testbed: edge.py,
binaries.py, netns.in_netns).

- ``udp_socket(ns)``: a UDP socket living in a namespace, DF as asked.
- ``Capture``: AF_PACKET capture of IPv4 packets, fragment fields parsed
  (fragments are seen before reassembly).
- ``read_ndjson``: telemetry files, tolerating a torn last line.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kickass_testbed.netns import in_netns

ETH_P_IP = 0x0800
PACKET_OUTGOING = 4
IP_MTU_DISCOVER = 10
IP_PMTUDISC_DONT = 0
IP_PMTUDISC_DO = 2


def udp_socket(ns: str, bind: tuple[str, int] | None = None, *, df: bool = False) -> socket.socket:
    """A UDP socket living in ``ns``; DF clear unless ``df`` (Linux sets it
    by default, and a Kick-Ass router only cuts DF-clear packets)."""
    with in_netns(ns):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO if df else IP_PMTUDISC_DONT)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    if bind:
        s.bind(bind)
    return s


@dataclass
class IpInfo:
    t: float
    total_len: int
    header_len: int
    ident: int
    df: bool
    mf: bool
    offset: int  # bytes
    src: str
    dst: str
    proto: int
    sport: int | None  # only in offset-0 pieces

    @property
    def payload_len(self) -> int:
        return self.total_len - self.header_len

    @property
    def is_leading_fragment(self) -> bool:
        return self.mf and self.offset == 0


def parse_ip(data: bytes, t: float) -> IpInfo | None:
    if len(data) < 20 or data[0] >> 4 != 4:
        return None
    hl = (data[0] & 0x0F) * 4
    total, ident, fo = struct.unpack("!HHH", data[2:8])
    off = (fo & 0x1FFF) * 8
    sport = None
    if off == 0 and data[9] in (6, 17) and len(data) >= hl + 2:
        sport = struct.unpack("!H", data[hl : hl + 2])[0]
    return IpInfo(
        t=t,
        total_len=total,
        header_len=hl,
        ident=ident,
        df=bool(fo & 0x4000),
        mf=bool(fo & 0x2000),
        offset=off,
        src=socket.inet_ntoa(data[12:16]),
        dst=socket.inet_ntoa(data[16:20]),
        proto=data[9],
        sport=sport,
    )


class Capture:
    """AF_PACKET capture of incoming IPv4 on one interface of a namespace,
    in a background thread (fragments are seen before reassembly)."""

    def __init__(self, ns: str, iface: str, on_packet=None) -> None:  # noqa: ANN001
        with in_netns(ns):
            self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(ETH_P_IP))
            self.sock.bind((iface, ETH_P_IP))
        self.sock.settimeout(0.05)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.packets: list[IpInfo] = []
        self.on_packet = on_packet
        # A callback that raises must not end the capture unseen: kept here
        # for the test to assert on.
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data, addr = self.sock.recvfrom(65535)
            except TimeoutError:
                continue
            except OSError as exc:
                self.errors.append(f"capture socket: {exc!r}")
                return
            if addr[2] == PACKET_OUTGOING:
                continue
            info = parse_ip(data, time.monotonic())
            if info is None:
                continue
            self.packets.append(info)
            if self.on_packet:
                try:
                    self.on_packet(info)
                except Exception as exc:  # noqa: BLE001 - reported, not swallowed
                    if len(self.errors) < 20:
                        self.errors.append(f"on_packet: {exc!r}")

    def __enter__(self) -> Capture:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


def read_ndjson(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out
