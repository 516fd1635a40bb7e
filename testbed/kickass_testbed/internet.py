"""A small internet of network namespaces for the fragment-viability study.

    server ns (203.0.113.10) ── router ns ──┬── clean     (198.18.1.2)
                                            ├── fragdrop  (198.18.2.2)  middlebox drops fragments
                                            ├── lossy     (198.18.3.2)  5% random loss each way
                                            └── nat box (198.18.4.2) ── natted (100.64.4.2)

The middleboxes are single nftables rules in the router namespace (no
conntrack there: it would reassemble fragments); the NAT box masquerades,
and so reassembles and re-fragments like a home router does. Addresses come
from documentation/benchmarking ranges and exist only inside these
namespaces.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kickass_core.errors import KickassError

from .netns import Netns, addr, make_router, route, unique_prefix, veth

SERVER_IP = "203.0.113.10"
ROUTER_SERVER_SIDE = "203.0.113.1"
HTTP_PORT = 8080
PROBE_PORT = 9000

CLIENT_KINDS = ("clean", "fragdrop", "lossy", "natted")
DEFAULT_LOSS_PERCENT = 5


@dataclass
class Client:
    kind: str
    ns: Netns
    address: str  # the client's own address (inside the NAT for "natted")
    public_address: str  # what the server sees


@dataclass
class ProbeInternet:
    prefix: str
    bin_dir: Path
    database_url: str
    loss_percent: int = DEFAULT_LOSS_PERCENT
    kinds: Sequence[str] = CLIENT_KINDS
    server_env: dict[str, str] = field(default_factory=dict)
    log_dir: Path | None = None
    namespaces: list[Netns] = field(default_factory=list)
    clients: dict[str, Client] = field(default_factory=dict)
    server_proc: subprocess.Popen | None = None
    server_log: Path | None = None
    router: Netns | None = None
    server: Netns | None = None

    @property
    def server_url(self) -> str:
        return f"http://{SERVER_IP}:{HTTP_PORT}"

    def _ns(self, name: str) -> Netns:
        ns = Netns(f"{self.prefix}{name}").create()
        self.namespaces.append(ns)
        return ns

    # -- topology ---------------------------------------------------------------
    def build(self) -> None:
        self.server = srv = self._ns("srv")
        self.router = rtr = self._ns("rtr")
        make_router(rtr)
        veth(srv, "uplink", rtr, "srv")
        addr(srv, "uplink", f"{SERVER_IP}/24")
        addr(rtr, "srv", f"{ROUTER_SERVER_SIDE}/24")
        route(srv, "default", via=ROUTER_SERVER_SIDE)
        rules: list[str] = []
        for i, kind in enumerate(self.kinds, start=1):
            net = f"198.18.{i}"
            iface = f"c{i}"
            if kind == "natted":
                nat = self._ns(f"nat{i}")
                make_router(nat)
                veth(nat, "wan", rtr, iface)
                addr(nat, "wan", f"{net}.2/24")
                addr(rtr, iface, f"{net}.1/24")
                route(nat, "default", via=f"{net}.1")
                cl = self._ns(f"c{i}")
                veth(cl, "uplink", nat, "lan")
                addr(nat, "lan", f"100.64.{i}.1/24")
                addr(cl, "uplink", f"100.64.{i}.2/24")
                route(cl, "default", via=f"100.64.{i}.1")
                nat.nft(
                    "table ip nat {\n"
                    " chain post { type nat hook postrouting priority srcnat;"
                    ' oifname "wan" masquerade; }\n}\n'
                )
                self.clients[kind] = Client(kind, cl, f"100.64.{i}.2", f"{net}.2")
                continue
            cl = self._ns(f"c{i}")
            veth(cl, "uplink", rtr, iface)
            addr(cl, "uplink", f"{net}.2/24")
            addr(rtr, iface, f"{net}.1/24")
            route(cl, "default", via=f"{net}.1")
            self.clients[kind] = Client(kind, cl, f"{net}.2", f"{net}.2")
            if kind == "fragdrop":
                rules.append(f'oifname "{iface}" ip frag-off & 0x3fff != 0 drop')
            elif kind == "lossy":
                p = self.loss_percent
                rules.append(f'oifname "{iface}" numgen random mod 100 < {p} drop')
                rules.append(f'iifname "{iface}" numgen random mod 100 < {p} drop')
        if rules:
            body = "\n  ".join(rules)
            rtr.nft(
                "table inet middlebox {\n"
                " chain forwarding {\n  type filter hook forward priority 0; policy accept;\n"
                f"  {body}\n }}\n}}\n"
            )

    # -- server -----------------------------------------------------------------
    def start_server(self, extra_args: Sequence[str] = (), timeout: float = 30.0) -> None:
        assert self.server is not None
        log_dir = self.log_dir or Path(os.environ.get("TMPDIR", "/tmp"))
        self.server_log = log_dir / f"{self.prefix}-server.log"
        env = {**os.environ, "KICKASS_DATABASE_URL": self.database_url, **self.server_env}
        # A restart appends to the same log: only what this run writes counts.
        start_at = self.server_log.stat().st_size if self.server_log.exists() else 0
        with open(self.server_log, "ab") as logf:
            self.server_proc = self.server.popen(
                [
                    str(self.bin_dir / "kickass"),
                    "server",
                    "--listen",
                    f"{SERVER_IP}:{HTTP_PORT}",
                    "--probe-port",
                    str(PROBE_PORT),
                    *extra_args,
                ],
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=env,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.server_proc.poll() is not None:
                raise KickassError(
                    f"the measurement server exited ({self.server_proc.returncode}):\n"
                    + self.server_log.read_text()[-2000:]
                )
            if b"listening http" in self.server_log.read_bytes()[start_at:]:
                return
            time.sleep(0.05)
        raise KickassError(
            "the measurement server did not start in time:\n" + self.server_log.read_text()[-2000:]
        )

    def stop_server(self, sig: int = 15, timeout: float = 15.0) -> int | None:
        p = self.server_proc
        if p is None or p.poll() is not None:
            return p.returncode if p else None
        os.killpg(p.pid, sig)
        try:
            return p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            return p.wait(5)

    # -- clients ----------------------------------------------------------------
    def client_cmd(self, args: Sequence[str]) -> list[str]:
        return [str(self.bin_dir / "kickass-probe"), "--server", self.server_url, "--yes", *args]

    def run_client(
        self, kind: str, args: Sequence[str], timeout: float = 300.0, **kwargs
    ) -> subprocess.CompletedProcess[str]:
        ns = self.clients[kind].ns
        return subprocess.run(
            ns.cmd(self.client_cmd(args)),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            **kwargs,
        )

    def popen_client(self, kind: str, args: Sequence[str], **kwargs) -> subprocess.Popen:
        return self.clients[kind].ns.popen(self.client_cmd(args), **kwargs)

    def teardown(self) -> None:
        with contextlib.suppress(Exception):
            self.stop_server()
        for ns in reversed(self.namespaces):
            ns.delete()
        self.namespaces.clear()


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
) -> Iterator[ProbeInternet]:
    net = ProbeInternet(
        prefix=prefix or unique_prefix("kd"),
        bin_dir=bin_dir or Path(sys.executable).parent,
        database_url=database_url,
        loss_percent=loss_percent,
        kinds=kinds,
        server_env=server_env or {},
        log_dir=log_dir,
    )
    try:
        net.build()
        if start_server:
            net.start_server()
        yield net
    finally:
        net.teardown()


def parse_json_output(proc: subprocess.CompletedProcess[str]) -> dict:
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        raise AssertionError(
            f"client printed no JSON (exit {proc.returncode}):\nstdout={proc.stdout[-2000:]}\n"
            f"stderr={proc.stderr[-3000:]}"
        ) from exc
