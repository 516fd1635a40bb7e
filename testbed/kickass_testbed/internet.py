"""A small internet of network namespaces for the fragment-viability study.

    server ns (203.0.113.10) ── router ns ──┬── clean     (198.18.1.2)
                                            ├── fragdrop  (198.18.2.2)  middlebox drops fragments
                                            ├── lossy     (198.18.3.2)  5% random loss each way
                                            └── nat box (198.18.4.2) ── natted (100.64.4.2)

More kinds for the study's known-answer tests (issue 11), by name:

* ``smallfrag``: fragments with an IP length under 200 bytes are dropped
  (either piece of the splits with a leading fragment < 200 or > 1320).
* ``duplicating``: every packet is duplicated, both ways (nft ``dup``), so
  every split leaves its duplicate piece in the client's reassembly queue.
* ``smallmtu``: the router's link to the client has MTU 1400: whole packets
  above it arrive fragmented.
* ``swapped``: a middlebox with connection tracking (which reassembles)
  forwards onto a VXLAN overlay to the client (MTU 1450): Linux re-cuts the
  datagram by its largest fragment, largest piece first, so a 604 + 916 split
  arrives as 916 + 604 (ARCHITECTURE.md, "Facts of the path"). The client's address is on
  the overlay (100.65.<i>.2) and the probes reach it on ``vx0``.
* ``wan``: a long path with random loss: ka-linkem (host ``lk<i>``, bridging
  the router's port and the client's at layer 2) adds ``wan_rtt_ms / 2``
  each way and loses ``wan_loss`` of the packets each way (defaults: the
  issue's 100 ms and 1%); static ARP entries, so the loss never eats the
  ARP. ``wan_downlink`` (ka-linkem ``--rate``, e.g. "4mbit", with a drop-tail
  queue of ``wan_queue``, e.g. "125000b") makes the client's downlink a
  bottleneck: a volunteer's slow access link. ka-linkem writes its counters
  (JSON lines, a->b is towards the client) to ``lk<i>-stats.jsonl`` in the
  log directory.
* ``wanfragdrop``, ``wanhalffrag``, ``wanleadsmall``: the ``wan`` path with a
  middlebox in the router: every fragment dropped; each fragment dropped
  with probability 1/2; only leading fragments (offset 0, MF set) shorter
  than ``SMALL_FRAGMENT_LEN`` dropped. Beside a ``wan`` client at the same
  RTT, they compare a fragment-intolerant path with a clean one.

``study_internet`` is the spec; ``probe_internet`` builds it (topology.build)
with the measurement server running and yields a ``ProbeInternet`` to run
clients in it. Everything they start keeps its state in the build's run
directory (its log directory), never in the caller's working directory: the
server's write journal is ``<run dir>/journal`` (its default is
``.kickass/journal`` under its working directory: two servers started from
one directory would share one and race on its replay), and every process,
clients included, runs in the run directory. The middleboxes are single nftables rules in the router
namespace (no conntrack there: it would reassemble fragments); the NAT box
masquerades, and so reassembles and re-fragments like a home router does.
Addresses come from documentation/benchmarking ranges and exist only inside
these namespaces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .edge import ka_linkem
from .netns import Netns
from .topology import (
    Built,
    End,
    Host,
    Link,
    Neighbor,
    NftRule,
    Process,
    Route,
    Topology,
    build,
)

SERVER_IP = "203.0.113.10"
ROUTER_SERVER_SIDE = "203.0.113.1"
HTTP_PORT = 8080
PROBE_PORT = 9000

CLIENT_KINDS = ("clean", "fragdrop", "lossy", "natted")
# The "wan" path's middleboxes (nft rules in the router, {iface}: the client's port).
WAN_MIDDLEBOXES = {
    "wan": None,
    "wanfragdrop": 'oifname "{iface}" ip frag-off & 0x3fff != 0 drop',
    "wanhalffrag": 'oifname "{iface}" ip frag-off & 0x3fff != 0 numgen random mod 2 == 0 drop',
    "wanleadsmall": ('oifname "{iface}" ip frag-off & 0x3fff == 0x2000 ip length < {small} drop'),
}
EXTRA_KINDS = ("smallfrag", "duplicating", "smallmtu", "swapped", *WAN_MIDDLEBOXES)
DEFAULT_LOSS_PERCENT = 5
# The "wan" kind: the path of issue 11 part 4's measurements.
DEFAULT_WAN_RTT_MS = 100.0
DEFAULT_WAN_LOSS = 0.01
# smallfrag drops fragments shorter than this (IP length).
SMALL_FRAGMENT_LEN = 200
SMALL_MTU = 1400
VXLAN_ID = 42


@dataclass(frozen=True)
class ClientPlace:
    """Where a client of ``kind`` sits: its host, its own address, and the
    address the server sees (the NAT box's for "natted")."""

    kind: str
    host: str
    address: str
    public_address: str


def client_places(kinds: Sequence[str] = CLIENT_KINDS) -> list[ClientPlace]:
    """Client ``i`` (from 1) is host ``c<i>`` on 198.18.<i>.0/24, behind
    100.64.<i>.0/24 if NATed."""
    out = []
    for i, kind in enumerate(kinds, start=1):
        public = f"198.18.{i}.2"
        own = f"100.64.{i}.2" if kind == "natted" else public
        if kind == "swapped":
            own = public = f"100.65.{i}.2"
        out.append(ClientPlace(kind, f"c{i}", own, public))
    return out


def capture_interface(kind: str) -> str:
    """The client's interface the probes arrive on (for tcpdump)."""
    return "vx0" if kind == "swapped" else "uplink"


@dataclass(frozen=True)
class _WanPath:
    """The "wan" kinds' path: ka-linkem's delay, loss, downlink and counters."""

    rtt_ms: float
    loss: float
    downlink: str | None
    queue: str
    stats_dir: Path | None


@dataclass
class _Parts:
    """A topology's parts as they are added, client by client, in order."""

    hosts: list[Host]
    links: list[Link]
    routes: list[Route]
    nft: list[NftRule] = dataclasses.field(default_factory=list)
    neighbors: list[Neighbor] = dataclasses.field(default_factory=list)
    emulators: list[Process] = dataclasses.field(default_factory=list)


def study_internet(
    kinds: Sequence[str] = CLIENT_KINDS,
    loss_percent: int = DEFAULT_LOSS_PERCENT,
    processes: tuple[Process, ...] = (),
    wan_rtt_ms: float = DEFAULT_WAN_RTT_MS,
    wan_loss: float = DEFAULT_WAN_LOSS,
    wan_downlink: str | None = None,
    wan_queue: str = "1000p",
    wan_stats_dir: Path | None = None,
) -> Topology:
    parts = _Parts(
        hosts=[Host("srv"), Host("rtr", router=True)],
        links=[
            Link(
                End("srv", "uplink", (f"{SERVER_IP}/24",)),
                End("rtr", "srv", (f"{ROUTER_SERVER_SIDE}/24",)),
            )
        ],
        routes=[Route("srv", "default", via=ROUTER_SERVER_SIDE)],
    )
    wan = _WanPath(wan_rtt_ms, wan_loss, wan_downlink, wan_queue, wan_stats_dir)
    for i, place in enumerate(client_places(kinds), start=1):
        if place.kind == "natted":
            _add_natted(parts, i, place)
        elif place.kind == "swapped":
            _add_swapped(parts, i, place)
        elif place.kind in WAN_MIDDLEBOXES:
            _add_wan(parts, i, place, wan)
        else:
            _add_direct(parts, i, place, loss_percent)
    return Topology(
        name="kd",
        hosts=tuple(parts.hosts),
        links=tuple(parts.links),
        routes=tuple(parts.routes),
        nft=tuple(parts.nft),
        neighbors=tuple(parts.neighbors),
        # The emulators first (probe_internet starts the server once the build is up).
        processes=(*parts.emulators, *processes),
    )


def _add_box(parts: _Parts, i: int, box: str, client: str) -> str:
    """The router host ``box`` in front of client ``i`` (the client's host
    added after it): on the router's link ``c{i}`` (``.2`` of the client's
    /24), its default route through the router. Returns the /24's prefix."""
    net = f"198.18.{i}"
    parts.hosts += [Host(box, router=True), Host(client)]
    parts.links.append(
        Link(End(box, "wan", (f"{net}.2/24",)), End("rtr", f"c{i}", (f"{net}.1/24",)))
    )
    parts.routes.append(Route(box, "default", via=f"{net}.1"))
    return net


def _add_natted(parts: _Parts, i: int, place: ClientPlace) -> None:
    """Client ``i`` behind a NAT box that masquerades (and so reassembles)."""
    cl, nat = place.host, f"nat{i}"
    _add_box(parts, i, nat, cl)
    parts.links.append(
        Link(End(cl, "uplink", (f"100.64.{i}.2/24",)), End(nat, "lan", (f"100.64.{i}.1/24",)))
    )
    parts.routes.append(Route(cl, "default", via=f"100.64.{i}.1"))
    parts.nft.append(
        NftRule(
            nat,
            'oifname "wan" masquerade',
            hook="postrouting",
            kind="nat",
            priority="srcnat",
            family="ip",
            table="nat",
        )
    )


def _add_swapped(parts: _Parts, i: int, place: ClientPlace) -> None:
    """Client ``i`` on a VXLAN overlay behind a conntrack middlebox."""
    cl, mb = place.host, f"mb{i}"
    net = _add_box(parts, i, mb, cl)
    # The underlay of the overlay; its default MTU (1500) leaves the VXLAN
    # device 1450.
    parts.links.append(
        Link(End(mb, "lan", (f"10.200.{i}.1/24",)), End(cl, "under", (f"10.200.{i}.2/24",)))
    )
    parts.routes.append(Route("rtr", f"100.65.{i}.0/24", via=f"{net}.2"))
    # Any ct expression loads connection tracking in this namespace,
    # and with it the defragmenter.
    parts.nft.append(
        NftRule(
            mb,
            "ct state new,established,related accept",
            hook="forward",
            family="ip",
            table="conntrack",
        )
    )


def _add_wan(parts: _Parts, i: int, place: ClientPlace, wan: _WanPath) -> None:
    """Client ``i`` across ka-linkem (a long, lossy path), behind the kind's
    middlebox in the router if it has one."""
    net, iface, cl = f"198.18.{i}", f"c{i}", place.host
    rule = WAN_MIDDLEBOXES[place.kind]
    if rule is not None:
        parts.nft.append(_middlebox(rule.format(iface=iface, small=SMALL_FRAGMENT_LEN)))
    lk = f"lk{i}"
    rtr_mac, cl_mac = f"02:4b:41:{i:02x}:00:01", f"02:4b:41:{i:02x}:00:02"
    parts.hosts += [Host(lk), Host(cl)]
    parts.links += [
        Link(End("rtr", iface, (f"{net}.1/24",), mac=rtr_mac), End(lk, "a", ipv6=False)),
        Link(End(lk, "b", ipv6=False), End(cl, "uplink", (f"{net}.2/24",), mac=cl_mac)),
    ]
    parts.routes.append(Route(cl, "default", via=f"{net}.1"))
    parts.neighbors += [
        Neighbor("rtr", iface, f"{net}.2", cl_mac),
        Neighbor(cl, "uplink", f"{net}.1", rtr_mac),
    ]
    rate = ("--rate-ab", wan.downlink, "--queue-ab", wan.queue) if wan.downlink else ()
    stats = ("--stats", str(wan.stats_dir / f"{lk}-stats.jsonl")) if wan.stats_dir else ()
    parts.emulators.append(
        ka_linkem(
            "--delay",
            f"{wan.rtt_ms / 2:g}ms",
            "--loss",
            f"{wan.loss:g}",
            *rate,
            *stats,
            a="a",
            b="b",
            host=lk,
            name=f"ka-linkem-{lk}",
            stdout="log",
            stderr="log",
        )  # fmt: skip
    )


def _add_direct(parts: _Parts, i: int, place: ClientPlace, loss_percent: int) -> None:
    """Client ``i`` on a link of the router, with its kind's middlebox there."""
    net, iface, cl = f"198.18.{i}", f"c{i}", place.host
    parts.hosts.append(Host(cl))
    mtu = SMALL_MTU if place.kind == "smallmtu" else 1500
    parts.links.append(
        Link(End(cl, "uplink", (f"{net}.2/24",)), End("rtr", iface, (f"{net}.1/24",)), mtu=mtu)
    )
    parts.routes.append(Route(cl, "default", via=f"{net}.1"))
    nft = parts.nft
    if place.kind == "fragdrop":
        nft.append(_middlebox(f'oifname "{iface}" ip frag-off & 0x3fff != 0 drop'))
    elif place.kind == "lossy":
        p = loss_percent
        nft.append(_middlebox(f'oifname "{iface}" numgen random mod 100 < {p} drop'))
        nft.append(_middlebox(f'iifname "{iface}" numgen random mod 100 < {p} drop'))
    elif place.kind == "smallfrag":
        nft.append(
            _middlebox(
                f'oifname "{iface}" ip frag-off & 0x3fff != 0 ip length < {SMALL_FRAGMENT_LEN} drop'
            )
        )
    elif place.kind == "duplicating":
        # dup needs the ip family; the copy goes out of the same device.
        for rule in (
            f'oifname "{iface}" dup to {net}.2 device "{iface}"',
            f'iifname "{iface}" dup to {SERVER_IP} device "srv"',
        ):
            nft.append(NftRule("rtr", rule, hook="forward", family="ip", table="duplicator"))


def _middlebox(rule: str) -> NftRule:
    return NftRule("rtr", rule, hook="forward", table="middlebox")


def server_process(
    bin_dir: Path,
    database_url: str,
    journal_dir: Path,
    env: dict[str, str] | None = None,
    extra_args: Sequence[str] = (),
) -> Process:
    """`kickass server` in "srv" with its journal in ``journal_dir``, ready
    once it logs "listening http"."""
    return Process(
        name="server",
        host="srv",
        argv=(
            str(bin_dir / "kickass"),
            "server",
            "--listen",
            f"{SERVER_IP}:{HTTP_PORT}",
            "--probe-port",
            str(PROBE_PORT),
            "--journal-dir",
            str(journal_dir),
            *extra_args,
        ),
        env={"KICKASS_DATABASE_URL": database_url, **(env or {})},
        ready_text="listening http",
        ready_timeout=30.0,
        stop_timeout=15.0,
    )


@dataclass
class Client:
    kind: str
    ns: Netns
    address: str  # the client's own address (inside the NAT for "natted")
    public_address: str  # what the server sees


class ProbeInternet:
    """A built study internet: the server and the clients by kind."""

    def __init__(
        self,
        built: Built,
        kinds: Sequence[str],
        bin_dir: Path,
        database_url: str,
        server_env: dict[str, str],
    ) -> None:
        self.built = built
        self.prefix = built.prefix
        self.bin_dir = bin_dir
        self.database_url = database_url
        self.server_env = server_env
        self.server = built["srv"]
        self.router = built["rtr"]
        self.clients = {
            p.kind: Client(p.kind, built[p.host], p.address, p.public_address)
            for p in client_places(kinds)
        }

    @property
    def server_url(self) -> str:
        return f"http://{SERVER_IP}:{HTTP_PORT}"

    @property
    def server_log(self) -> Path:
        return self.built.log_dir / "server.log"

    @property
    def journal_dir(self) -> Path:
        """The server's write journal: the same for every start of this build,
        so a restarted server replays what the killed one left."""
        return self.built.log_dir / "journal"

    # -- server -----------------------------------------------------------------
    def start_server(self, extra_args: Sequence[str] = (), timeout: float = 30.0) -> None:
        proc = server_process(
            self.bin_dir, self.database_url, self.journal_dir, self.server_env, extra_args
        )
        self.built.start(dataclasses.replace(proc, ready_timeout=timeout))

    def stop_server(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        proc = self.built.procs.get("server")
        if proc is None:
            return None
        return proc.stop(sig, timeout)[0]

    # -- clients ----------------------------------------------------------------
    def client_cmd(self, args: Sequence[str]) -> list[str]:
        return [str(self.bin_dir / "kickass-probe"), "--server", self.server_url, "--yes", *args]

    def run_client(
        self, kind: str, args: Sequence[str], timeout: float = 300.0, **kwargs: Any
    ) -> subprocess.CompletedProcess[str]:
        ns = self.clients[kind].ns
        kwargs.setdefault("cwd", self.built.log_dir)
        return subprocess.run(
            ns.cmd(self.client_cmd(args)),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            **kwargs,
        )

    def popen_client(self, kind: str, args: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        kwargs.setdefault("cwd", self.built.log_dir)
        return self.clients[kind].ns.popen(self.client_cmd(args), **kwargs)


@contextlib.contextmanager
def probe_internet(
    database_url: str,
    *,
    bin_dir: Path | None = None,
    kinds: Sequence[str] = CLIENT_KINDS,
    loss_percent: int = DEFAULT_LOSS_PERCENT,
    server_env: dict[str, str] | None = None,
    start_server: bool = True,
    prefix: str | None = None,
    log_dir: Path | None = None,
    wan_rtt_ms: float = DEFAULT_WAN_RTT_MS,
    wan_loss: float = DEFAULT_WAN_LOSS,
    wan_downlink: str | None = None,
    wan_queue: str = "1000p",
) -> Iterator[ProbeInternet]:
    bin_dir = bin_dir or Path(sys.executable).parent
    env = server_env or {}
    spec = study_internet(
        kinds,
        loss_percent,
        wan_rtt_ms=wan_rtt_ms,
        wan_loss=wan_loss,
        wan_downlink=wan_downlink,
        wan_queue=wan_queue,
        wan_stats_dir=log_dir,
    )
    with build(spec, prefix=prefix, log_dir=log_dir) as built:
        for i, place in enumerate(client_places(kinds), start=1):
            if place.kind == "swapped":
                _vxlan_overlay(built, i, place.host)
        net = ProbeInternet(built, kinds, bin_dir, database_url, env)
        if start_server:
            # Once the build knows its run directory, where the journal goes.
            net.start_server()
        yield net


def _vxlan_overlay(built: Built, i: int, client_host: str) -> None:
    """The "swapped" client's VXLAN overlay to its middlebox (the topology
    builder has no VXLAN devices, so it is added once the underlay is up)."""
    mb, cl = built[f"mb{i}"], built[client_host]
    for ns, local, remote, under, addr in (
        (mb, f"10.200.{i}.1", f"10.200.{i}.2", "lan", f"100.65.{i}.1/24"),
        (cl, f"10.200.{i}.2", f"10.200.{i}.1", "under", f"100.65.{i}.2/24"),
    ):
        ns.ip(
            f"link add vx0 type vxlan id {VXLAN_ID} local {local} remote {remote} "
            f"dstport 4789 dev {under}",
            "link set vx0 up",
            f"addr add {addr} dev vx0",
        )
    cl.ip(f"route add default via 100.65.{i}.1 dev vx0")
    for ns in (mb, cl):
        # See the packets as they are, fragments included.
        ns.run(["ethtool", "-K", "vx0", "gro", "off", "gso", "off", "tso", "off"], check=False)


def parse_json_output(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    try:
        out: dict[str, Any] = json.loads(proc.stdout)
        return out
    except json.JSONDecodeError as exc:
        raise AssertionError(
            f"client printed no JSON (exit {proc.returncode}):\nstdout={proc.stdout[-2000:]}\n"
            f"stderr={proc.stderr[-3000:]}"
        ) from exc
