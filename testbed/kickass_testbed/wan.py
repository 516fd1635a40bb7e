"""`kickass testbed`: the emulated wide-area testbed of paper §IV-A.

    s1..sN ──┐                                          ┌── r1..rM
             bridge "lan" ── ka-router ── wan0 ═ ka-linkem ═ bridge ──┘
    (senders)       (router ns: edge Kick-Ass router)   (emu ns)   (far ns)
                                               │
                                    x1..xK ────┘ (with ``cross``: a bridge "mid"
                                                  between the router and the
                                                  emulator: cross traffic that
                                                  meets the legacy bottleneck
                                                  without crossing ka-router)

Senders sit on the router's LAN (198.18.50.0/24); the router's WAN side and
the receivers share 198.18.51.0/24 through the link emulator, which adds the
wide-area delay, random loss and, optionally, a legacy (non-Kick-Ass)
bottleneck beyond the edge router. Everything is torn down on exit, also
after failures and on Ctrl-C/SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kickass_core.errors import KickassError

from .edge import ka_linkem, ka_router
from .topology import Bridge, Built, End, Host, Link, Route, Topology, build, cleanup_on_signals

LAN_NET = "198.18.50"
WAN_NET = "198.18.51"


@dataclass
class TestbedConfig:
    # Not a pytest test class, whatever its name says to collection.
    __test__ = False

    senders: int = 2
    receivers: int = 1
    capacity: str = "10mbit"
    buffer: str | None = None
    mode: str = "kickass"  # or droptail
    rtt_ms: float = 100.0
    loss: float = 0.0  # each direction
    bottleneck: str | None = None  # legacy link rate beyond the edge router
    bottleneck_queue: str = "1000p"
    router_args: list[str] = field(default_factory=list)
    # Cross-traffic hosts x1..xK on the WAN side of ka-router, before the
    # emulator (paper §III-D2: congestion at a legacy router the Kick-Ass
    # router does not see).
    cross: int = 0


@dataclass
class TestbedInfo:
    prefix: str
    senders: dict[str, str]  # namespace -> address
    receivers: dict[str, str]
    router_ns: str
    emu_ns: str
    far_ns: str
    router_lan: str = "lan"
    router_wan: str = "wan0"
    config: dict[str, Any] = field(default_factory=dict)


def sender_address(i: int) -> str:
    return f"{LAN_NET}.{10 + i}"


def receiver_address(i: int) -> str:
    return f"{WAN_NET}.{10 + i}"


def cross_address(i: int) -> str:
    return f"{WAN_NET}.{200 + i}"


def wan_topology(c: TestbedConfig) -> Topology:
    """The testbed as a spec: hosts s1..sN on the router's LAN bridge, r1..rM
    on the far bridge, ka-linkem between them, ka-router on the edge."""
    hosts = [Host("rtr", router=True), Host("emu"), Host("far")]
    links = [Link(End("emu", "b"), End("far", "up0", master="sw"))]
    bridges = [Bridge("rtr", "lan", (f"{LAN_NET}.1/24",)), Bridge("far", "sw")]
    routes: list[Route] = []
    if c.cross:
        hosts.append(Host("mid"))
        bridges.append(Bridge("mid", "br"))
        links += [
            Link(End("rtr", "wan0", (f"{WAN_NET}.1/24",)), End("mid", "r0", master="br")),
            Link(End("emu", "a"), End("mid", "e0", master="br")),
        ]
        for i in range(1, c.cross + 1):
            hosts.append(Host(f"x{i}"))
            links.append(
                Link(
                    End(f"x{i}", "eth0", (f"{cross_address(i)}/24",)),
                    End("mid", f"x{i}", master="br"),
                )
            )
    else:
        links.append(Link(End("rtr", "wan0", (f"{WAN_NET}.1/24",)), End("emu", "a")))
    for kind, count, hub, bridge, net, address in (
        ("s", c.senders, "rtr", "lan", LAN_NET, sender_address),
        ("r", c.receivers, "far", "sw", WAN_NET, receiver_address),
    ):
        # End hosts net.11 and up, each with a port on the hub's bridge.
        for i in range(1, count + 1):
            name = f"{kind}{i}"
            hosts.append(Host(name))
            links.append(
                Link(End(name, "eth0", (f"{address(i)}/24",)), End(hub, name, master=bridge))
            )
            routes.append(Route(name, "default", via=f"{net}.1"))
    linkem_args = ["--delay", f"{c.rtt_ms / 2}ms", "--loss", str(c.loss)]
    if c.bottleneck:
        linkem_args += ["--rate", c.bottleneck, "--queue", c.bottleneck_queue]
    router_args = ["--capacity", c.capacity, "--mode", c.mode, *c.router_args]
    if c.buffer:
        router_args += ["--buffer", c.buffer]
    return Topology(
        name="kw",
        hosts=tuple(hosts),
        bridges=tuple(bridges),
        links=tuple(links),
        routes=tuple(routes),
        processes=(
            ka_linkem(*linkem_args, a="a", b="b", host="emu", stdout="log", stderr="log"),
            # Telemetry on stdout, read by Testbed._pump; ready when it survives 0.3 s.
            ka_router(*router_args, lan="lan", wan="wan0", stderr="log", settle=0.3),
        ),
    )


class Testbed:
    """A built testbed: its info, and the router's telemetry pumped to a file
    (and to PostgreSQL when a database is set)."""

    def __init__(self, built: Built, config: TestbedConfig, database_url: str | None) -> None:
        self.built = built
        self.config = config
        self.prefix = built.prefix
        self.log_dir = built.log_dir
        self.database_url = database_url
        self.ingest_summary: dict[str, Any] | None = None
        self.info = TestbedInfo(
            self.prefix,
            {built.ns_name(f"s{i}"): sender_address(i) for i in range(1, config.senders + 1)},
            {built.ns_name(f"r{i}"): receiver_address(i) for i in range(1, config.receivers + 1)},
            built.ns_name("rtr"),
            built.ns_name("emu"),
            built.ns_name("far"),
            config=asdict(config),
        )
        self._ingest_thread = threading.Thread(
            target=self._pump, args=(self.log_dir / "router-telemetry.ndjson",), daemon=True
        )
        self._ingest_thread.start()

    def _pump(self, path: Path) -> None:
        """Router telemetry to a file, and to PostgreSQL when a database is set."""
        stdout = self.built.procs["ka-router"].stdout
        assert stdout is not None
        ingest = None
        if self.database_url:
            from kickass_db.telemetry import TelemetryIngest

            ingest = TelemetryIngest(self.database_url, run_name=self.prefix)
        with open(path, "a", encoding="utf-8") as out:
            for raw in stdout:
                line = raw.decode("utf-8", "replace")
                out.write(line)
                if ingest is not None:
                    ingest.feed_line(line)
            out.flush()
        if ingest is not None:
            ingest.flush()
            self.ingest_summary = ingest.summary().to_json()

    def telemetry(self) -> list[dict[str, Any]]:
        path = self.log_dir / "router-telemetry.ndjson"
        if not path.exists():
            return []
        rows = []
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
        return rows

    def stop(self) -> None:
        """Stop the router first so its last telemetry (the exit line) is
        stored before the namespaces go."""
        self.built.stop("ka-router")
        self._ingest_thread.join(10)


@contextlib.contextmanager
def testbed(
    config: TestbedConfig,
    *,
    database_url: str | None = None,
    prefix: str | None = None,
    log_dir: Path | None = None,
    keep_logs: bool = False,
    topology: Topology | None = None,
) -> Iterator[Testbed]:
    """The testbed of ``config`` built, or ``topology`` (another layout of the
    same hosts and addresses: ka-router in "rtr" between "lan" and "wan0")."""
    spec = topology or wan_topology(config)
    with build(spec, prefix=prefix, log_dir=log_dir, keep_logs=keep_logs) as built:
        tb = Testbed(built, config, database_url)
        try:
            yield tb
        finally:
            tb.stop()


def run(args: argparse.Namespace) -> int:
    cmd: Sequence[str] = args.command
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    config = TestbedConfig(
        senders=args.senders,
        receivers=args.receivers,
        capacity=args.capacity,
        buffer=args.buffer,
        mode=args.mode,
        rtt_ms=args.rtt,
        loss=args.loss,
        bottleneck=args.bottleneck,
        cross=args.cross,
    )
    url = args.database_url or os.environ.get("KICKASS_DATABASE_URL")
    with cleanup_on_signals(), testbed(config, database_url=url, keep_logs=args.keep_logs) as tb:
        info_path = tb.log_dir / "testbed.json"
        info_path.write_text(json.dumps(asdict(tb.info), indent=1))
        print(
            f"testbed {tb.prefix}: senders {list(tb.info.senders.values())}, receivers "
            f"{list(tb.info.receivers.values())}"
            + (f", logs kept in {tb.log_dir}" if args.keep_logs else ""),
            file=sys.stderr,
        )
        env = {**os.environ, "KICKASS_TESTBED": str(info_path)}
        if not cmd:
            print(json.dumps(asdict(tb.info)))
            return 0
        full = list(cmd)
        if args.ns:
            if args.ns not in tb.built.hosts:
                raise KickassError(
                    f"no namespace {args.ns!r} in this testbed",
                    hint="use s1..sN, r1..rM, x1..xK, rtr, emu, far or mid",
                )
            full = tb.built[args.ns].cmd(full)
        rc = subprocess.run(full, env=env, check=False).returncode
    return rc


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "testbed",
        help="build the emulated wide-area testbed, run a command in it, tear it down",
        description="Build senders -> edge Kick-Ass router (ka-router) -> WAN emulator "
        "(ka-linkem: delay, loss, legacy bottleneck) -> receivers in network namespaces, "
        "run COMMAND (in the root namespace, or inside --ns NAME), then remove everything, "
        "also after failures. The topology is written as JSON to the file named by "
        "$KICKASS_TESTBED. With a database configured the router's telemetry is stored "
        "in PostgreSQL. Without COMMAND, prints the topology and exits.",
    )
    p.add_argument("--senders", type=int, default=2)
    p.add_argument("--receivers", type=int, default=1)
    p.add_argument("--capacity", default="10mbit", help="edge link capacity (default 10mbit)")
    p.add_argument("--buffer", default=None, help="router buffer, e.g. 1000p or 1500000b")
    p.add_argument("--mode", choices=["kickass", "droptail"], default="kickass")
    p.add_argument("--rtt", type=float, default=100.0, help="wide-area RTT in ms (default 100)")
    p.add_argument("--loss", type=float, default=0.0, help="random loss each way (0..1)")
    p.add_argument("--bottleneck", default=None, help="legacy bottleneck rate beyond the router")
    p.add_argument(
        "--cross",
        type=int,
        default=0,
        help="cross-traffic hosts x1..xK between the router and the emulator: their traffic "
        "meets the legacy bottleneck without crossing ka-router",
    )
    p.add_argument("--ns", default=None, help="run COMMAND inside this namespace (e.g. s1)")
    p.add_argument("--database-url", default=None, help="store router telemetry here")
    p.add_argument(
        "--keep-logs",
        action="store_true",
        help="keep router/emulator logs and the telemetry NDJSON (default: removed)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    p.set_defaults(func=run)
