"""Helpers for the edge-router namespace tests and benchmark (ours, beside
the lead's kickass_testbed.netns, which we only use).

- ``binaries()``: build router-edge once (cargo, release) and find ka-router,
  ka-linkem, ka-blast.
- ``in_netns(name)``: run a block inside a namespace *in this thread*, so a
  socket created there stays there (Linux namespaces are per thread).
- ``Topology``: sender -- router -- [link emulator] -- receiver, addresses
  only in 198.18.0.0/15, all removed on exit.
- AF_PACKET capture of IPv4 packets, with fragment fields parsed.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kickass_testbed import netns

REPO = Path(__file__).resolve().parents[1]
ROUTER_EDGE = REPO / "router-edge"
CLONE_NEWNET = 0x40000000
ETH_P_IP = 0x0800
PACKET_OUTGOING = 4
IP_MTU_DISCOVER = 10
IP_PMTUDISC_DONT = 0
IP_PMTUDISC_DO = 2

_libc = ctypes.CDLL(None, use_errno=True)
_build_lock = threading.Lock()
_built: dict[str, Path] | None = None


def binaries() -> dict[str, Path]:
    """Paths of ka-router, ka-linkem, ka-blast (cargo build --release once)."""
    global _built
    with _build_lock:
        if _built is not None:
            return _built
        if shutil.which("cargo"):
            subprocess.run(
                [
                    "cargo",
                    "build",
                    "--quiet",
                    "--release",
                    "--manifest-path",
                    str(REPO / "Cargo.toml"),
                ],
                check=True,
                timeout=900,
            )
            d = REPO / "target" / "release"
        else:
            d = REPO / ".venv" / "bin"
        out = {n: d / n for n in ("ka-router", "ka-linkem", "ka-blast")}
        for n, p in out.items():
            if not p.exists():
                raise FileNotFoundError(f"{n} not found at {p} (run `make install`)")
        _built = out
        return out


@contextlib.contextmanager
def in_netns(name: str) -> Iterator[None]:
    """Switch this thread into namespace ``name`` for the block."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if _libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({name}) failed")
        try:
            yield
        finally:
            if _libc.setns(own, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back failed")
    finally:
        os.close(own)
        os.close(target)


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
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data, addr = self.sock.recvfrom(65535)
            except TimeoutError:
                continue
            except OSError:
                return
            if addr[2] == PACKET_OUTGOING:
                continue
            info = parse_ip(data, time.monotonic())
            if info is None:
                continue
            self.packets.append(info)
            if self.on_packet:
                self.on_packet(info)

    def __enter__(self) -> Capture:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


@dataclass
class Topology:
    """snd (198.18.1.2) -- rtr (198.18.1.1 | 198.18.2.1) -- [lk] -- rcv (198.18.2.2).

    With ``linkem=True`` a link-emulator namespace bridges rtr's WAN and the
    receiver at layer 2 (same subnet on both sides of it).
    """

    linkem: bool = False
    prefix: str = field(default_factory=lambda: netns.unique_prefix("kr"))
    ns: dict[str, netns.Netns] = field(default_factory=dict)
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    SND = "198.18.1.2"
    RTR_LAN = "198.18.1.1"
    RTR_WAN = "198.18.2.1"
    RCV = "198.18.2.2"

    def name(self, role: str) -> str:
        return self.ns[role].name

    def __enter__(self) -> Topology:
        roles = ["snd", "rtr", "rcv"] + (["lk"] if self.linkem else [])
        try:
            for r in roles:
                self.ns[r] = self._stack.enter_context(netns.Netns(f"{self.prefix}{r}"))
            snd, rtr, rcv = self.ns["snd"], self.ns["rtr"], self.ns["rcv"]
            netns.veth(snd, "lan0", rtr, "lan")
            if self.linkem:
                lk = self.ns["lk"]
                netns.veth(rtr, "wan", lk, "la")
                netns.veth(lk, "lb", rcv, "wan0")
                for i in ("la", "lb"):
                    lk.sysctl(f"net.ipv6.conf.{i}.disable_ipv6", 1)
            else:
                netns.veth(rtr, "wan", rcv, "wan0")
            netns.addr(snd, "lan0", f"{self.SND}/24")
            netns.addr(rtr, "lan", f"{self.RTR_LAN}/24")
            netns.addr(rtr, "wan", f"{self.RTR_WAN}/24")
            netns.addr(rcv, "wan0", f"{self.RCV}/24")
            netns.route(snd, "default", via=self.RTR_LAN)
            netns.route(rcv, "default", via=self.RTR_WAN)
            netns.make_router(rtr)
            return self
        except BaseException:
            self._stack.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def start_router(
        self, *args: str, telemetry: Path, wrapper: tuple[str, ...] = ()
    ) -> subprocess.Popen[bytes]:
        cmd = [
            *wrapper,
            str(binaries()["ka-router"]),
            "--lan",
            "lan",
            "--wan",
            "wan",
            "--telemetry",
            str(telemetry),
            *args,
        ]
        p = self.ns["rtr"].popen(cmd, stderr=subprocess.PIPE)
        wait_router_up(p, telemetry)
        return p

    def start_linkem(self, *args: str) -> subprocess.Popen[bytes]:
        cmd = [str(binaries()["ka-linkem"]), "--a", "la", "--b", "lb", *args]
        p = self.ns["lk"].popen(cmd, stderr=subprocess.PIPE)
        time.sleep(0.3)
        if p.poll() is not None:
            raise RuntimeError(f"ka-linkem exited: {p.stderr.read().decode() if p.stderr else ''}")
        return p


def wait_router_up(p: subprocess.Popen[bytes], telemetry: Path, timeout: float = 10) -> None:
    """Ready when the metadata line is out: it is written after the TUN,
    route and rule are installed."""

    def up() -> bool:
        if p.poll() is not None:
            err = p.stderr.read().decode() if p.stderr else ""
            raise RuntimeError(f"ka-router exited with {p.returncode}: {err}")
        return telemetry.exists() and '"metadata"' in telemetry.read_text()

    netns.wait_for(up, timeout, what="ka-router start-up")


def stop(p: subprocess.Popen[bytes], timeout: float = 10) -> tuple[int, str]:
    """SIGTERM the process (it runs in its own session) and collect stderr."""
    if p.poll() is None:
        os.killpg(p.pid, 15)
    try:
        _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        _, err = p.communicate()
    return p.returncode, (err or b"").decode()


def read_ndjson(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out


def static_neighbors(
    a: netns.Netns, a_if: str, a_ip: str, b: netns.Netns, b_if: str, b_ip: str
) -> None:
    """Permanent ARP entries both ways: lossy links must not eat the ARP."""

    def mac(ns: netns.Netns, iface: str) -> str:
        return json.loads(ns.run(["ip", "-j", "link", "show", iface]).stdout)[0]["address"]

    ma, mb = mac(a, a_if), mac(b, b_if)
    a.run(["ip", "neigh", "replace", b_ip, "lladdr", mb, "dev", a_if, "nud", "permanent"])
    b.run(["ip", "neigh", "replace", a_ip, "lladdr", ma, "dev", b_if, "nud", "permanent"])
