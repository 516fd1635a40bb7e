"""A simulated RIPE Atlas probe: real ICMP echo requests from a namespace,
answered or not, written out as Atlas ping results.

Run inside a probe's namespace (root; a raw ICMP socket), one process per
probe running all its measurements at once, as the probe firmware does
(eperd/ping.c): one ICMP identifier for the whole probe, a sequence number
per measurement counting modulo 256 across its pings, echo data starting
with the send time (a timeval) and the measurement's index, zeros after.
Packet k of a ping leaves ``packet_interval`` after packet k-1; a request
with no valid reply by the next tick is a timeout. A reply is valid only
with our identifier and the exact data we sent (Atlas discards others); one
for a request already answered or timed out is listed as a duplicate.

    python atlas_simprobe.py SPEC.json  > results.ndjson

SPEC: {"icmp_id": 4242, "measurements": [{"msm_id", "target", "size",
"packets", "packet_interval_ms", "runs", "spacing_s", "start"}]}. Each output
line is one result (Atlas fields the probe knows: the stand-in adds ``from``,
``prb_id`` and the rest) plus ``truth``: per request its sequence number and
whether a valid reply came back in time — the ground truth the test checks
the stored drop rates against.
"""

from __future__ import annotations

import heapq
import json
import selectors
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any

COOKIE = struct.Struct("!qqI4x")  # timeval (64-bit) + index, padded: 24 bytes


def checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


@dataclass
class Ping:
    """One run (one Atlas result) of one measurement."""

    start: float
    entries: list[dict[str, Any]] = field(default_factory=list)
    truth: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Measurement:
    index: int
    msm_id: int
    target: str
    size: int
    packets: int
    packet_interval: float
    seq: int = 1
    outstanding: int | None = None  # seq of the request waiting for its reply
    sent: dict[int, tuple[bytes, float, int]] = field(default_factory=dict)  # seq -> data, t, k
    ping: Ping | None = None
    done: list[Ping] = field(default_factory=list)


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    icmp_id = int(spec["icmp_id"])
    sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    sock.setblocking(False)
    msms = [
        Measurement(
            i, m["msm_id"], m["target"], m["size"], m["packets"], m["packet_interval_ms"] / 1000
        )
        for i, m in enumerate(spec["measurements"])
    ]
    events: list[tuple[float, int, int, int]] = []  # (when, measurement, run, packet k)
    for i, m in enumerate(spec["measurements"]):
        for run in range(m["runs"]):
            t0 = m["start"] + run * m["spacing_s"]
            for k in range(m["packets"] + 1):  # +1: the tick that times out the last one
                heapq.heappush(events, (t0 + k * msms[i].packet_interval, i, run, k))
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    last = max(e[0] for e in events) + 0.3
    while time.time() < last:
        now = time.time()
        while events and events[0][0] <= now:
            _, i, _run, k = heapq.heappop(events)
            tick(sock, msms[i], k, icmp_id)
        wait = min((events[0][0] if events else last) - time.time(), 0.05)
        for _ in sel.select(max(wait, 0)):
            drain(sock, msms, icmp_id)
    for m in msms:
        for p in m.done:
            print(
                json.dumps(
                    {
                        "msm_id": m.msm_id,
                        "timestamp": int(p.start),
                        "start": p.start,
                        "dst_addr": m.target,
                        "size": m.size,
                        "result": p.entries,
                        "truth": p.truth,
                    }
                )
            )


def tick(sock: socket.socket, m: Measurement, k: int, icmp_id: int) -> None:
    now = time.time()
    if m.outstanding is not None:  # no reply by now: a timeout
        assert m.ping is not None
        m.ping.entries.append({"x": "*"})
        m.outstanding = None
        m.seq = (m.seq + 1) % 256
    if k == m.packets:
        assert m.ping is not None
        m.done.append(m.ping)
        m.ping = None
        return
    if k == 0:
        m.ping = Ping(start=now)
    assert m.ping is not None
    sec, usec = int(now), int((now % 1) * 1e6)
    data = (COOKIE.pack(sec, usec, m.index) + bytes(m.size))[: m.size]
    header = struct.pack("!BBHHH", 8, 0, 0, icmp_id, m.seq)
    packet = header[:2] + struct.pack("!H", checksum(header + data)) + header[4:] + data
    m.sent[m.seq] = (data, now, k)
    m.ping.truth.append({"seq": m.seq, "k": k, "acked": False})
    try:
        sock.sendto(packet, (m.target, 0))
    except OSError as exc:
        m.ping.entries.append({"error": f"sendto failed: {exc.strerror}"})
        m.ping.truth[-1]["error"] = True
        m.seq = (m.seq + 1) % 256
        return
    m.outstanding = m.seq


def drain(sock: socket.socket, msms: list[Measurement], icmp_id: int) -> None:
    while True:
        try:
            datagram = sock.recv(65535)
        except BlockingIOError:
            return
        now = time.time()
        ihl = (datagram[0] & 0x0F) * 4
        icmp = datagram[ihl:]
        if len(icmp) < 8 + COOKIE.size or icmp[0] != 0:
            continue
        rid, seq = struct.unpack_from("!HH", icmp, 4)
        data = icmp[8:]
        if rid != icmp_id:
            continue
        _, _, index = COOKIE.unpack_from(data)
        if index >= len(msms):
            continue
        m = msms[index]
        sent = m.sent.get(seq)
        if sent is None or sent[0] != data:
            continue  # not our payload: Atlas discards it
        rtt = round((now - sent[1]) * 1000, 3)
        if m.ping is None:
            continue  # after the result was written
        if seq == m.outstanding:
            m.ping.entries.append({"rtt": rtt})
            for t in m.ping.truth:
                if t["seq"] == seq:
                    t["acked"] = True
            m.outstanding = None
            m.seq = (m.seq + 1) % 256
        else:
            m.ping.entries.append({"dup": 1, "rtt": rtt})


if __name__ == "__main__":
    main()
