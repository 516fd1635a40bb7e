"""`kickass atlas responder` with real packets: it answers on its addresses
only, silences the kernel's own replies there and gives them back on exit
(also after a crash, with --undo), stays within its caps under a flood from
one address and from a /24, and never sends a forged request more than it got.

    c (198.18.95.2) ──── s (198.18.95.1; responder on .10 whole, .11 split;
                            .12 is left to the kernel)

Floods use spoofed sources in 198.18.96.0/24 and 198.18.97.0/24, which s
routes back to c, where an AF_PACKET socket counts every reply.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
import yaml
from kickass_testbed.topology import Built, End, Host, Link, Process, Route, Topology, build
from scapy.layers.inet import ICMP, IP
from scapy.packet import Raw

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces"),
]

KICKASS = str(Path(sys.executable).with_name("kickass"))
WHOLE, SPLIT, KERNEL = "198.18.95.10", "198.18.95.11", "198.18.95.12"
PPS_ADDRESS, PPS_PREFIX, PPS_GLOBAL = 100, 300, 2000
SPLITS = [44, 548, 1052, 1452]
ETH_P_IP = 0x0800
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)


def topology() -> Topology:
    return Topology(
        name="kaicmp",
        hosts=(Host("c"), Host("s", sysctls={"net.ipv4.conf.all.rp_filter": 0})),
        links=(
            Link(
                End("c", "e0", ("198.18.95.2/24",)),
                End("s", "e0", ("198.18.95.1/24", f"{WHOLE}/24", f"{SPLIT}/24", f"{KERNEL}/24")),
            ),
        ),
        routes=tuple(Route("s", f"198.18.{n}.0/24", via="198.18.95.2") for n in (96, 97, 98)),
    )


def responder(path: Path) -> Process:
    return Process(
        "responder",
        "s",
        (KICKASS, "atlas", "responder", str(path), "--no-database"),
        env={"KICKASS_CONFIG": ""},
        ready_text="responder ready",
        ready_timeout=60,
    )


@pytest.fixture
def campaign_file(tmp_path: Path) -> Path:
    path = tmp_path / "responder.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "responder-netns",
                "target": {"whole": WHOLE, "split": SPLIT},
                "probes": {"ids": [1]},
                "split": {"leading": SPLITS},
                "duration": 3600,
                "credit_budget": 10**6,
                "responder": {
                    "pps_per_address": PPS_ADDRESS,
                    "pps_per_prefix": PPS_PREFIX,
                    "pps_global": PPS_GLOBAL,
                },
            }
        )
    )
    return path


def ping(net: Built, dst: str, count: int = 3, size: int = 56, wait: int = 2) -> tuple[int, str]:
    argv = ["ping", "-n", "-c", str(count), "-i", "0.2", "-W", str(wait), "-s", str(size)]
    p = net["c"].run([*argv, "-M", "dont", dst], check=False)
    return p.returncode, p.stdout


def nft_tables(net: Built) -> str:
    return net["s"].run(["nft", "list", "tables"]).stdout


def test_kernel_replies_off_for_our_addresses_only_and_back_on_exit(
    campaign_file: Path,
) -> None:
    with build(topology()) as net:
        assert ping(net, WHOLE)[0] == 0  # the kernel answers before
        net.start(responder(campaign_file))
        assert "kickass_icmp_responder" in nft_tables(net)
        # Exactly one reply per request (a kernel reply beside ours would be a DUP).
        rc, out = ping(net, WHOLE, count=4, size=1472)
        assert rc == 0 and "4 received" in out and "DUP" not in out, out
        rc, out = ping(net, SPLIT, count=4, size=1472)  # split replies, reassembled by c
        assert rc == 0 and "4 received" in out and "DUP" not in out, out
        # Not ours: the split address answers only 1500-byte requests ...
        assert ping(net, SPLIT, count=2, size=100, wait=1)[0] != 0
        # ... and the kernel still answers on every other address.
        rc, out = ping(net, KERNEL, count=2)
        assert rc == 0 and "DUP" not in out
        code, _ = net.stop("responder")
        assert code == 0
        assert "kickass_icmp_responder" not in nft_tables(net)
        assert ping(net, WHOLE)[0] == 0  # the kernel answers again

        # A responder killed outright leaves the table; --undo gives the replies back.
        net.start(responder(campaign_file))
        net.stop("responder", signal.SIGKILL)
        assert "kickass_icmp_responder" in nft_tables(net)
        assert ping(net, WHOLE, count=1, wait=1)[0] != 0
        undo = net["s"].run([KICKASS, "atlas", "responder", "--undo"])
        assert "restored" in undo.stdout
        assert ping(net, WHOLE, count=1)[0] == 0
        assert "nothing to undo" in net["s"].run([KICKASS, "atlas", "responder", "--undo"]).stdout


class Capture:
    """Every IPv4 packet arriving at c's e0 from the responder's addresses."""

    def __init__(self, net: Built) -> None:
        with net.in_netns("c"):
            self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(ETH_P_IP))
            self.sock.bind(("e0", 0))
        # Kernel receive times: a capture thread starved for a moment must
        # not squeeze the replies' spacing (and so fake a rate above the cap).
        self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        self.sock.settimeout(0.2)
        self.packets: list[tuple[float, bytes]] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frame, ancillary, _flags, addr = self.sock.recvmsg(65535, 64)
            except TimeoutError:
                continue
            except OSError:
                return  # the namespace is going away
            if addr[2] == socket.PACKET_OUTGOING or frame[9] != 1:
                continue
            if socket.inet_ntoa(frame[12:16]) in (WHOLE, SPLIT):
                stamp = time.time()
                for level, kind, data in ancillary:
                    if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                        sec, nsec = struct.unpack("qq", data[:16])
                        stamp = sec + nsec / 1e9
                self.packets.append((stamp, frame))

    def stop(self) -> list[tuple[float, bytes]]:
        time.sleep(0.5)  # the last replies
        self._stop.set()
        self.thread.join()
        self.sock.close()
        return self.packets


def sender(net: Built) -> socket.socket:
    with net.in_netns("c"):
        s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    return s


def echo(src: str, dst: str, ip_len: int, icmp_id: int, seq: int = 1, **ip: object) -> bytes:
    """An echo request of exactly ``ip_len`` bytes (IP options included)."""
    header = 24 if "options" in ip else 20
    data = bytes((i * 7) & 0xFF for i in range(ip_len - header - 8))
    pkt = IP(src=src, dst=dst, **ip) / ICMP(type=8, id=icmp_id, seq=seq) / Raw(data)  # type: ignore[arg-type]
    raw = bytes(pkt)
    assert len(raw) == ip_len
    return raw


def within_rate(times: list[float], rate: float) -> None:
    """No more than rate x window + the bucket's burst over the whole flood."""
    assert times
    window = max(times) - min(times)
    burst = max(1.0, rate / 10)
    assert len(times) <= rate * window + burst + 1, (len(times), window)


def test_floods_stay_within_the_caps(campaign_file: Path) -> None:
    with build(topology()) as net:
        net.start(responder(campaign_file))
        tx = sender(net)
        cap = Capture(net)
        # One address, as fast as Python sends: ~10x its cap for ~1 s.
        one = echo("198.18.96.7", WHOLE, 84, 0x1111)
        t0 = time.monotonic()
        n = 0
        while time.monotonic() - t0 < 1.0:
            tx.sendto(one, (WHOLE, 0))
            n += 1
            if n % 50 == 0:
                time.sleep(0.005)  # ~ a few thousand per second, not a CPU hog
        # A /24: 200 spoofed addresses in turn, ~3000 requests.
        sources = [echo(f"198.18.97.{h}", WHOLE, 84, 0x2000 + h) for h in range(1, 201)]
        t1 = time.monotonic()
        m = 0
        while time.monotonic() - t1 < 1.0:
            tx.sendto(sources[m % len(sources)], (WHOLE, 0))
            m += 1
            if m % 50 == 0:
                time.sleep(0.005)
        got = cap.stop()
        tx.close()
        net.stop("responder")
    by_dst: dict[str, list[float]] = defaultdict(list)
    for t, frame in got:
        by_dst[socket.inet_ntoa(frame[16:20])].append(t)
    flood_one = by_dst.pop("198.18.96.7")
    assert n > 5 * PPS_ADDRESS and len(flood_one) < n / 3
    within_rate(flood_one, PPS_ADDRESS)
    prefix = sorted(t for times in by_dst.values() for t in times)
    assert m > 5 * PPS_PREFIX and len(prefix) < m / 3
    within_rate(prefix, PPS_PREFIX)
    for times in by_dst.values():
        within_rate(times, PPS_ADDRESS)


def test_a_forged_request_never_gets_more_bytes_back_than_it_sent(campaign_file: Path) -> None:
    """Spoofed requests of every shape: any reply datagram is at most the
    request's length and carries exactly its ICMP bytes. (A split reply's
    second fragment needs its own 20-byte IP header on the wire: 1520 bytes
    of packets for a 1500-byte datagram, the one overhead fragmenting adds.)"""
    forged: dict[int, bytes] = {}
    shapes = [
        (WHOLE, 64, {}), (WHOLE, 1000, {}), (WHOLE, 1500, {}), (SPLIT, 1500, {}),
        (SPLIT, 1499, {}), (SPLIT, 600, {}),
        (WHOLE, 1500, {"options": [b"\x01\x01\x01\x00"]}),  # IP options: 20-byte reply header
        (SPLIT, 1500, {"options": [b"\x01\x01\x01\x00"]}),
    ]  # fmt: skip
    with build(topology()) as net:
        net.start(responder(campaign_file))
        tx = sender(net)
        cap = Capture(net)
        for i, (dst, ip_len, ip) in enumerate(shapes):
            for k in range(3):
                icmp_id = 0x3000 + 16 * i + k
                req = echo(f"198.18.98.{1 + k}", dst, ip_len, icmp_id, seq=k, **ip)
                forged[icmp_id] = req
                tx.sendto(req, (dst, 0))
                time.sleep(0.01)
        bad = bytearray(echo("198.18.98.9", WHOLE, 200, 0x3FFF))
        bad[-1] ^= 0xFF  # a broken ICMP checksum
        forged[0x3FFF] = bytes(bad)
        tx.sendto(bytes(bad), (WHOLE, 0))
        got = cap.stop()
        tx.close()
        net.stop("responder")
    datagrams: dict[int, list[bytes]] = defaultdict(list)
    for _, frame in got:
        datagrams[struct.unpack_from("!H", frame, 4)[0]].append(frame)
    answered: dict[int, tuple[int, int, bytes]] = {}
    for frags in datagrams.values():
        frags.sort(key=lambda f: struct.unpack_from("!H", f, 6)[0] & 0x1FFF)
        icmp = b"".join(f[20 : struct.unpack_from("!H", f, 2)[0]] for f in frags)
        wire = sum(struct.unpack_from("!H", f, 2)[0] for f in frags)
        icmp_id = struct.unpack_from("!H", icmp, 4)[0]
        answered[icmp_id] = (20 + len(icmp), wire, icmp)
    for icmp_id, (datagram_len, wire, icmp) in answered.items():
        req = forged[icmp_id]
        ihl = (req[0] & 0x0F) * 4
        assert datagram_len <= len(req)
        assert icmp[0] == 0 and icmp[4:] == req[ihl + 4 :]  # the echo, byte for byte
        assert wire <= len(req) + 20 * (wire > datagram_len)
    # Which shapes got answers: whole sizes, the 1500-byte split, options only whole.
    got_shapes = {
        shapes[(i - 0x3000) // 16][:2] + (bool(shapes[(i - 0x3000) // 16][2]),) for i in answered
    }
    assert got_shapes == {
        (WHOLE, 64, False), (WHOLE, 1000, False), (WHOLE, 1500, False), (SPLIT, 1500, False),
        (WHOLE, 1500, True),
    }  # fmt: skip
    assert 0x3FFF not in answered
