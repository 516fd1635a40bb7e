"""`kickass testbed`: the emulated wide-area testbed of DESIGN.md.

    s1..sN ──┐                                          ┌── r1..rM
             bridge "lan" ── ka-router ── wan0 ═ ka-linkem ═ bridge ──┘
    (senders)       (router ns: edge Kick-Ass router)   (emu ns)   (far ns)

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
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kickass_core.errors import KickassError

from .netns import Netns, addr, cleanup_on_signals, make_router, require_root, route, veth
from .netns import unique_prefix as _unique_prefix

LAN_NET = "198.18.50"
WAN_NET = "198.18.51"


@dataclass
class TestbedConfig:
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
    config: dict = field(default_factory=dict)


def find_binary(name: str) -> Path:
    here = Path(sys.executable).parent / name
    if here.exists():
        return here
    found = shutil.which(name)
    if found:
        return Path(found)
    raise KickassError(f"{name} not found", hint="run `make install` (builds router-edge/)")


class Testbed:
    def __init__(
        self,
        config: TestbedConfig,
        prefix: str | None = None,
        database_url: str | None = None,
        log_dir: Path | None = None,
        keep_logs: bool = False,
    ) -> None:
        self.config = config
        self.prefix = prefix or _unique_prefix("kw")
        self.database_url = database_url
        self.keep_logs = keep_logs
        self._own_log_dir = log_dir is None
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="kickass-testbed-"))
        self.namespaces: list[Netns] = []
        self.router_proc: subprocess.Popen | None = None
        self.linkem_proc: subprocess.Popen | None = None
        self._ingest_thread: threading.Thread | None = None
        self.ingest_summary: dict | None = None
        self.info: TestbedInfo | None = None

    def _ns(self, name: str) -> Netns:
        ns = Netns(f"{self.prefix}{name}").create()
        self.namespaces.append(ns)
        return ns

    def build(self) -> TestbedInfo:
        require_root()
        c = self.config
        rtr = self._ns("rtr")
        emu = self._ns("emu")
        far = self._ns("far")
        make_router(rtr)
        rtr.run(["ip", "link", "add", "lan", "type", "bridge"])
        rtr.run(["ip", "link", "set", "dev", "lan", "up"])
        addr(rtr, "lan", f"{LAN_NET}.1/24")
        senders = self._hosts("s", c.senders, rtr, "lan", LAN_NET)
        veth(rtr, "wan0", emu, "a")
        addr(rtr, "wan0", f"{WAN_NET}.1/24")
        veth(emu, "b", far, "up0")
        far.run(["ip", "link", "add", "sw", "type", "bridge"])
        far.run(["ip", "link", "set", "dev", "sw", "up"])
        far.run(["ip", "link", "set", "dev", "up0", "master", "sw"])
        receivers = self._hosts("r", c.receivers, far, "sw", WAN_NET)
        self.info = TestbedInfo(
            self.prefix, senders, receivers, rtr.name, emu.name, far.name, config=asdict(c)
        )
        self._start_linkem(emu)
        self._start_router(rtr)
        return self.info

    def _hosts(self, kind: str, count: int, hub: Netns, bridge: str, net: str) -> dict[str, str]:
        """``count`` end hosts ``{kind}1..`` on ``bridge`` in ``hub``, addresses
        net.11 and up, default route via net.1; returns namespace -> address."""
        hosts = {}
        for i in range(1, count + 1):
            h = self._ns(f"{kind}{i}")
            veth(h, "eth0", hub, f"{kind}{i}")
            hub.run(["ip", "link", "set", "dev", f"{kind}{i}", "master", bridge])
            a = f"{net}.{10 + i}"
            addr(h, "eth0", f"{a}/24")
            route(h, "default", via=f"{net}.1")
            hosts[h.name] = a
        return hosts

    def _start_linkem(self, emu: Netns) -> None:
        c = self.config
        cmd = [
            str(find_binary("ka-linkem")),
            "--a",
            "a",
            "--b",
            "b",
            "--delay",
            f"{c.rtt_ms / 2}ms",
            "--loss",
            str(c.loss),
        ]
        if c.bottleneck:
            cmd += ["--rate", c.bottleneck, "--queue", c.bottleneck_queue]
        with open(self.log_dir / "ka-linkem.log", "ab") as log:
            self.linkem_proc = emu.popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def _start_router(self, rtr: Netns) -> None:
        c = self.config
        cmd = [
            str(find_binary("ka-router")),
            "--lan",
            "lan",
            "--wan",
            "wan0",
            "--capacity",
            c.capacity,
            "--mode",
            c.mode,
            *c.router_args,
        ]
        if c.buffer:
            cmd += ["--buffer", c.buffer]
        telemetry = self.log_dir / "router-telemetry.ndjson"
        errlog = open(self.log_dir / "ka-router.log", "ab")  # noqa: SIM115
        self.router_proc = rtr.popen(cmd, stdout=subprocess.PIPE, stderr=errlog)
        errlog.close()
        self._ingest_thread = threading.Thread(target=self._pump, args=(telemetry,), daemon=True)
        self._ingest_thread.start()
        time.sleep(0.3)
        if self.router_proc.poll() is not None:
            raise KickassError(
                "ka-router exited at start:\n"
                + (self.log_dir / "ka-router.log").read_text()[-2000:]
            )

    def _pump(self, path: Path) -> None:
        """Router telemetry to a file, and to PostgreSQL when a database is set."""
        assert self.router_proc is not None and self.router_proc.stdout is not None
        ingest = None
        if self.database_url:
            from kickass_db.telemetry import TelemetryIngest

            ingest = TelemetryIngest(self.database_url, run_name=self.prefix)
        with open(path, "a", encoding="utf-8") as out:
            for raw in self.router_proc.stdout:
                line = raw.decode("utf-8", "replace")
                out.write(line)
                if ingest is not None:
                    ingest.feed_line(line)
            out.flush()
        if ingest is not None:
            ingest.flush()
            self.ingest_summary = {"run_id": ingest.run_id, **ingest.counts}

    def telemetry(self) -> list[dict]:
        path = self.log_dir / "router-telemetry.ndjson"
        if not path.exists():
            return []
        rows = []
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
        return rows

    def teardown(self) -> None:
        for p in (self.router_proc, self.linkem_proc):
            if p is not None and p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, 15)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(10)
        if self._ingest_thread is not None:
            self._ingest_thread.join(10)
        for ns in reversed(self.namespaces):
            ns.delete()
        self.namespaces.clear()
        if self._own_log_dir and not self.keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)


@contextlib.contextmanager
def testbed(config: TestbedConfig, **kwargs) -> Iterator[Testbed]:  # noqa: ANN003
    tb = Testbed(config, **kwargs)
    try:
        tb.build()
        yield tb
    finally:
        tb.teardown()


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
    )
    url = args.database_url or os.environ.get("KICKASS_DATABASE_URL")
    with cleanup_on_signals(), testbed(config, database_url=url, keep_logs=args.keep_logs) as tb:
        assert tb.info is not None
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
            ns_name = f"{tb.prefix}{args.ns}"
            if ns_name not in {n.name for n in tb.namespaces}:
                raise KickassError(
                    f"no namespace {args.ns!r} in this testbed",
                    hint="use s1..sN, r1..rM, rtr, emu or far",
                )
            full = ["ip", "netns", "exec", ns_name, *full]
        rc = subprocess.run(full, env=env, check=False).returncode
    return rc


def add_parser(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument("--ns", default=None, help="run COMMAND inside this namespace (e.g. s1)")
    p.add_argument("--database-url", default=None, help="store router telemetry here")
    p.add_argument(
        "--keep-logs",
        action="store_true",
        help="keep router/emulator logs and the telemetry NDJSON (default: removed)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    p.set_defaults(func=run)
