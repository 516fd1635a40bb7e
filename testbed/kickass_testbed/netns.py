"""Network namespaces as context managers: the building block of every
emulated internet here (demo, tests, benchmarks).

Everything created is torn down on exit, also when the body raises or the
process gets SIGTERM/SIGINT (see ``cleanup_on_signals``): namespaces are
deleted (which kills their veths) and processes started inside are killed.
Names carry a per-process prefix so parallel runs never collide.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from kickass_core.errors import KickassError

NETNS_DIR = Path("/run/netns")


def require_root() -> None:
    if os.geteuid() != 0:
        raise KickassError(
            "network namespaces need root privileges",
            hint="run as root (sudo) — the demo and the namespace tests build a private internet",
        )
    if not shutil.which("ip"):
        raise KickassError(
            "the `ip` command (iproute2) is missing", hint="apt-get install iproute2"
        )


def unique_prefix(base: str = "ka") -> str:
    """A short prefix unique to this run (interface names max 15 chars)."""
    return f"{base}{secrets.token_hex(2)}"


def _run(
    cmd: Sequence[str], *, check: bool = True, input: str | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        list(cmd), capture_output=True, text=True, input=input, timeout=timeout, check=False
    )
    if check and proc.returncode != 0:
        raise KickassError(
            f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr.strip()}"
        )
    return proc


class Netns:
    """One network namespace. ``with Netns("x") as ns:`` creates and deletes it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._procs: list[subprocess.Popen[bytes]] = []
        self._created = False

    # -- lifecycle -----------------------------------------------------------
    def create(self) -> Netns:
        require_root()
        if (NETNS_DIR / self.name).exists():
            # A crashed earlier run may have left it: a restart needs no manual clean-up.
            _run(["ip", "netns", "del", self.name], check=False)
        _run(["ip", "netns", "add", self.name])
        self._created = True
        self.run(["ip", "link", "set", "lo", "up"])
        return self

    def delete(self) -> None:
        for p in reversed(self._procs):
            _kill(p)
        self._procs.clear()
        if self._created:
            # Kill stragglers started by others inside this namespace.
            pids = _run(["ip", "netns", "pids", self.name], check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _run(["ip", "netns", "del", self.name], check=False)
            self._created = False

    def __enter__(self) -> Netns:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.delete()

    # -- running things ------------------------------------------------------
    def cmd(self, cmd: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *cmd]

    def run(
        self,
        cmd: Sequence[str],
        *,
        check: bool = True,
        input: str | None = None,
        timeout: float = 30,
    ) -> subprocess.CompletedProcess[str]:
        return _run(self.cmd(cmd), check=check, input=input, timeout=timeout)

    def sh(self, script: str, *, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run(["sh", "-c", script], check=check)

    def popen(self, cmd: Sequence[str], **kwargs: object) -> subprocess.Popen[bytes]:
        """Start a long-running process inside; killed when the namespace goes."""
        kwargs.setdefault("start_new_session", True)
        p = subprocess.Popen(self.cmd(cmd), **kwargs)  # type: ignore[call-overload]
        self._procs.append(p)
        return p

    def sysctl(self, key: str, value: str | int) -> None:
        self.run(["sysctl", "-q", "-w", f"{key}={value}"])

    def nft(self, ruleset: str) -> None:
        """Load an nftables ruleset (text) into this namespace."""
        if not shutil.which("nft"):
            raise KickassError("nftables (`nft`) is missing", hint="apt-get install nftables")
        self.run(["nft", "-f", "-"], input=ruleset)

    def ifaces_offloads_off(self, *ifaces: str) -> None:
        """GRO/GSO/TSO off: fragments and packet sizes stay what was sent."""
        if not shutil.which("ethtool"):
            return
        for i in ifaces:
            self.run(["ethtool", "-K", i, "gro", "off", "gso", "off", "tso", "off"], check=False)


def _kill(p: subprocess.Popen[bytes], grace: float = 2.0) -> None:
    if p.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(5)


def veth(
    a: Netns, a_if: str, b: Netns, b_if: str, *, mtu: int = 1500, offloads: bool = False
) -> None:
    """A veth pair with one end in each namespace, both ends up."""
    tmp = f"v{secrets.token_hex(5)}"
    _run(["ip", "link", "add", tmp, "type", "veth", "peer", "name", f"{tmp}p"])
    _run(["ip", "link", "set", tmp, "netns", a.name])
    _run(["ip", "link", "set", f"{tmp}p", "netns", b.name])
    a.run(["ip", "link", "set", "dev", tmp, "name", a_if])
    b.run(["ip", "link", "set", f"{tmp}p", "name", b_if])
    for ns, i in ((a, a_if), (b, b_if)):
        ns.run(["ip", "link", "set", "dev", i, "mtu", str(mtu), "up"])
        if not offloads:
            ns.ifaces_offloads_off(i)


def addr(ns: Netns, iface: str, cidr: str) -> None:
    ns.run(["ip", "addr", "add", cidr, "dev", iface])


def route(ns: Netns, dest: str, via: str | None = None, dev: str | None = None) -> None:
    cmd = ["ip", "route", "add", dest]
    if via:
        cmd += ["via", via]
    if dev:
        cmd += ["dev", dev]
    ns.run(cmd)


def make_router(ns: Netns) -> None:
    """Forward IPv4, no reverse-path filtering (spoof tests need it off)."""
    ns.sysctl("net.ipv4.ip_forward", 1)
    ns.sysctl("net.ipv4.conf.all.rp_filter", 0)
    ns.sysctl("net.ipv4.conf.default.rp_filter", 0)


@contextlib.contextmanager
def namespaces(*names: str) -> Iterator[list[Netns]]:
    """Several namespaces at once, all removed on exit."""
    created: list[Netns] = []
    try:
        for n in names:
            created.append(Netns(n).create())
        yield created
    finally:
        for ns in reversed(created):
            ns.delete()


def wait_for(predicate, timeout: float, interval: float = 0.05, what: str = "condition") -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


@contextlib.contextmanager
def cleanup_on_signals() -> Iterator[None]:
    """Turn SIGTERM/SIGHUP into KeyboardInterrupt so `with` blocks unwind."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
