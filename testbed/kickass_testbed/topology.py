"""A namespace internet as data, and the one builder that makes and removes it.

A ``Topology`` lists hosts (one network namespace each; ``router=True``
makes one forward), bridges, links (veth pairs with addresses, MTU, MAC,
offloads), routes, static neighbours, nftables rules and the processes to
start. ``build(spec)`` is a context manager yielding a ``Built``: handles to
run commands and processes in each namespace, to switch a thread into one,
and to start and stop further processes. The demo's study internet, the
`kickass testbed` WAN, the router tests and benchmarks are all specs (see
internet.py, wan.py, edge.py) built by this one function.

Clean-up is the point of having one builder:

- everything is removed on exit, also when the body or the build itself
  raises, and on SIGINT/SIGTERM/SIGHUP (turned into KeyboardInterrupt in the
  main thread, and held back while the teardown runs so it cannot be cut
  short);
- veths are created directly inside their namespaces, so nothing is ever
  left in the root namespace: deleting the namespaces removes every link;
- processes are stopped (SIGTERM, then SIGKILL after their stop timeout)
  before their namespaces go, and anything else still running inside is
  killed by the namespace delete;
- namespace names are ``<prefix><host>`` with a random per-run prefix (not
  in use by any namespace at build time), so two builds of the same spec,
  even in one process, never collide. Interface names are per namespace and
  need no prefix.

An external SIGKILL is the one thing that leaves namespaces behind; they
are recognisable by the prefix (``ip netns list``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

from kickass_core.errors import KickassError

from .netns import NETNS_DIR, Netns, in_netns, require_root, run_cmd

IFNAMSIZ = 15  # longest Linux interface name

# -- the spec ------------------------------------------------------------------


@dataclass(frozen=True)
class Host:
    """A network namespace. ``router`` forwards IPv4 with reverse-path
    filtering off (asymmetric and spoofed test traffic must pass);
    ``sysctls`` are set before any link exists, so ``default.*`` keys apply
    to its interfaces."""

    name: str
    router: bool = False
    sysctls: Mapping[str, str | int] = field(default_factory=dict)

    def all_sysctls(self) -> dict[str, str | int]:
        # Forwarding is set either way: a new namespace inherits the machine's
        # IPv4 settings, and on a machine that forwards (Docker turns it on)
        # an end host would route packets meant for nobody and stop taking
        # redirects, so a test's result would depend on what ran before it.
        base: dict[str, str | int] = {"net.ipv4.ip_forward": 0}
        if self.router:
            base = {
                "net.ipv4.ip_forward": 1,
                "net.ipv4.conf.all.rp_filter": 0,
                "net.ipv4.conf.default.rp_filter": 0,
            }
        return {**base, **self.sysctls}


@dataclass(frozen=True)
class Bridge:
    """A Linux bridge in ``host``; link ends join it with ``End.master``."""

    host: str
    name: str
    addresses: tuple[str, ...] = ()  # CIDR, e.g. "198.18.50.1/24"


@dataclass(frozen=True)
class End:
    """One end of a veth pair."""

    host: str
    dev: str
    addresses: tuple[str, ...] = ()  # CIDR
    master: str | None = None  # a Bridge of the same host
    mac: str | None = None  # fixed MAC (for static neighbours); random if None
    ipv6: bool = True  # False: no IPv6 (no ND/MLD chatter on an emulated link)


@dataclass(frozen=True)
class Link:
    """A veth pair. Offloads (GRO/GSO/TSO) are off unless ``offloads``: the
    tests want to see the packets that were sent, fragments included."""

    a: End
    b: End
    mtu: int = 1500
    offloads: bool = False


@dataclass(frozen=True)
class Route:
    host: str
    dest: str  # "default" or CIDR
    via: str | None = None
    dev: str | None = None


@dataclass(frozen=True)
class Neighbor:
    """A permanent ARP entry: a lossy emulated link must not eat the ARP."""

    host: str
    dev: str
    address: str
    mac: str


@dataclass(frozen=True)
class NftRule:
    """One nftables rule. Rules of one host are loaded together: one table per
    (family, table), one base chain per (kind, hook, priority), rules in
    spec order. A ``nat`` chain loads conntrack into that namespace (which
    reassembles fragments), so keep nat rules off a host whose fragments
    matter."""

    host: str
    rule: str  # e.g. 'oifname "c2" ip frag-off & 0x3fff != 0 drop'
    hook: str = "forward"
    kind: Literal["filter", "nat", "route"] = "filter"
    priority: str | int = 0  # a number or a keyword such as "srcnat"
    family: str = "inet"
    table: str = "kickass"


Output = Literal["log", "pipe", "null", "inherit"]


@dataclass(frozen=True)
class Process:
    """A process started in ``host`` once the network is up (in spec order),
    or later with ``Built.start``; stopped before its namespace goes. It runs
    in the build's log directory (its run directory): whatever it writes to
    a relative path stays there, never in the caller's working directory.

    ``log`` output goes to ``<log dir>/<log or name.log>``, appended (a
    restart keeps the earlier output). Start-up waits until ``ready_text``
    appears in ``ready_file`` (default: the log; only text written since
    this start counts, or the whole file if the program truncated it) and
    at least ``settle`` seconds have passed; the process exiting meanwhile
    is an error showing its output.
    """

    name: str
    host: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)  # on top of os.environ
    stdout: Output = "log"
    stderr: Output = "log"
    log: str | None = None
    ready_text: str | None = None
    ready_file: Path | None = None  # relative paths are in the log directory
    ready_timeout: float = 30.0
    settle: float = 0.0
    cpus: tuple[int, ...] | None = None  # CPU affinity
    stop_timeout: float = 10.0  # SIGTERM, then SIGKILL after this long

    @property
    def log_name(self) -> str:
        return self.log or f"{self.name}.log"

    @property
    def uses_log(self) -> bool:
        return "log" in (self.stdout, self.stderr)


@dataclass(frozen=True)
class Topology:
    """A whole namespace internet. ``name`` starts every namespace name of a
    build (followed by random hex, then the host name)."""

    name: str
    hosts: tuple[Host, ...]
    links: tuple[Link, ...] = ()
    bridges: tuple[Bridge, ...] = ()
    routes: tuple[Route, ...] = ()
    neighbors: tuple[Neighbor, ...] = ()
    nft: tuple[NftRule, ...] = ()
    processes: tuple[Process, ...] = ()

    def validate(self) -> None:
        """Catch spec mistakes before anything is created."""
        problems: list[str] = []
        names = [h.name for h in self.hosts]
        if len(set(names)) != len(names):
            problems.append(f"duplicate host names in {names}")
        hosts = set(names)
        devs: dict[str, list[str]] = {h: ["lo"] for h in hosts}
        for br in self.bridges:
            devs.setdefault(br.host, []).append(br.name)
        for lk in self.links:
            for e in (lk.a, lk.b):
                devs.setdefault(e.host, []).append(e.dev)
                if e.master is not None and not any(
                    b.host == e.host and b.name == e.master for b in self.bridges
                ):
                    problems.append(f"{e.host}/{e.dev}: no bridge {e.master!r} in {e.host}")
        for host, ds in devs.items():
            if host not in hosts:
                problems.append(f"interfaces {ds[1:]} on unknown host {host!r}")
            if len(set(ds)) != len(ds):
                problems.append(f"{host}: duplicate interface names in {ds}")
            problems += [
                f"{host}/{d}: interface names have at most {IFNAMSIZ} characters"
                for d in ds
                if len(d) > IFNAMSIZ
            ]
        for kind, items in (
            ("route", self.routes),
            ("neighbor", self.neighbors),
            ("nft rule", self.nft),
            ("process", self.processes),
        ):
            problems += [f"{kind} on unknown host {x.host!r}" for x in items if x.host not in hosts]
        procs = [p.name for p in self.processes]
        if len(set(procs)) != len(procs):
            problems.append(f"duplicate process names in {procs}")
        problems += [
            f"process {p.name}: ready_text needs a ready_file or a log"
            for p in self.processes
            if p.ready_text and p.ready_file is None and not p.uses_log
        ]
        if problems:
            raise KickassError("bad topology spec: " + "; ".join(problems))


# -- running processes -----------------------------------------------------------


class Proc:
    """A started ``Process``: the Popen and where its output went."""

    def __init__(
        self, spec: Process, popen: subprocess.Popen[bytes], ns: Netns, log_path: Path | None
    ) -> None:
        self.spec = spec
        self.popen = popen
        self.ns = ns
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    @property
    def stdout(self) -> IO[bytes] | None:
        return self.popen.stdout

    @property
    def stderr(self) -> IO[bytes] | None:
        return self.popen.stderr

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.popen.wait(timeout)

    def send_signal(self, sig: int) -> None:
        """Signal the process group (it runs in its own session)."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float | None = None) -> tuple[int, str]:
        """Send ``sig``, wait (SIGKILL after ``timeout``, default the spec's
        stop timeout); returns (exit code, its stderr if piped)."""
        self.send_signal(sig)
        try:
            err = self._collect(self.spec.stop_timeout if timeout is None else timeout)
        except subprocess.TimeoutExpired:
            self.send_signal(signal.SIGKILL)
            err = self._collect(5)
        return self.popen.wait(), err

    def _collect(self, timeout: float) -> str:
        p = self.popen
        # A piped stdout belongs to whoever reads it (e.g. a telemetry pump
        # thread): reading it here would steal lines, so only wait then.
        if p.stdout is None and p.stderr is not None and not p.stderr.closed:
            _, err = p.communicate(timeout=timeout)
            return (err or b"").decode("utf-8", "replace")
        p.wait(timeout)
        return ""

    def output_tail(self, since: int = 0, limit: int = 2000) -> str:
        """The end of what it wrote (piped stderr once it exited, or its log)."""
        text = ""
        p = self.popen
        if p.stderr is not None and not p.stderr.closed and p.poll() is not None:
            with contextlib.suppress(OSError, ValueError):
                text += p.stderr.read().decode("utf-8", "replace")
        if self.log_path is not None and self.log_path.exists():
            with open(self.log_path, "rb") as f:
                f.seek(since)
                text += f.read().decode("utf-8", "replace")
        return text[-limit:]


# -- the builder -----------------------------------------------------------------


class Built:
    """A built topology: namespace handles by host name, started processes
    by name, the log directory. Only ``build`` makes one."""

    def __init__(self, spec: Topology, prefix: str, log_dir: Path | None, keep_logs: bool) -> None:
        self.spec = spec
        self.prefix = prefix
        self._own_log_dir = log_dir is None
        self.keep_logs = keep_logs
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix=f"kickass-{prefix}-"))
        self.hosts: dict[str, Netns] = {}
        self.procs: dict[str, Proc] = {}  # latest start of each name
        self._started: list[Proc] = []  # every start, for the teardown

    def __getitem__(self, host: str) -> Netns:
        return self.hosts[host]

    def ns_name(self, host: str) -> str:
        return self.hosts[host].name

    def in_netns(self, host: str) -> contextlib.AbstractContextManager[None]:
        """Switch the calling thread into ``host``'s namespace for the block."""
        return in_netns(self.ns_name(host))

    # -- processes ---------------------------------------------------------------
    def start(self, spec: Process) -> Proc:
        """Start ``spec`` (again, if it ran before and exited) and wait until it is ready."""
        old = self.procs.get(spec.name)
        if old is not None and old.poll() is None:
            raise KickassError(f"process {spec.name!r} is already running (pid {old.pid})")
        ns = self.hosts[spec.host]
        log_path = self.log_dir / spec.log_name if spec.uses_log else None
        ready_path = spec.ready_file or log_path
        if ready_path is not None and not ready_path.is_absolute():
            ready_path = self.log_dir / ready_path
        since = ready_path.stat().st_size if ready_path and ready_path.exists() else 0
        log_since = log_path.stat().st_size if log_path and log_path.exists() else 0
        with contextlib.ExitStack() as stack:
            log = stack.enter_context(open(log_path, "ab")) if log_path else None
            streams = {
                "log": log,
                "pipe": subprocess.PIPE,
                "null": subprocess.DEVNULL,
                "inherit": None,
            }
            popen = ns.popen(
                spec.argv,
                stdout=streams[spec.stdout],
                stderr=streams[spec.stderr],
                env={**os.environ, **spec.env},
                cpus=spec.cpus,
                cwd=self.log_dir,
            )
        proc = Proc(spec, popen, ns, log_path)
        self.procs[spec.name] = proc
        self._started.append(proc)
        self._wait_ready(proc, ready_path, since, log_since)
        return proc

    def _wait_ready(self, proc: Proc, ready_path: Path | None, since: int, log_since: int) -> None:
        spec = proc.spec
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise KickassError(
                    f"{spec.name} exited ({proc.returncode}) at start-up in {proc.ns.name}:\n"
                    + proc.output_tail(log_since)
                )
            ready = spec.ready_text is None or (
                ready_path is not None
                and ready_path.exists()
                and spec.ready_text.encode() in _read_new(ready_path, since)
            )
            elapsed = time.monotonic() - t0
            if ready and elapsed >= spec.settle:
                return
            if not ready and elapsed > spec.ready_timeout:
                _, err = proc.stop(signal.SIGKILL, 5)
                raise KickassError(
                    f"{spec.name} did not start within {spec.ready_timeout}s "
                    f"(no {spec.ready_text!r} in {ready_path}):\n"
                    + (err + proc.output_tail(log_since))[-2000:]
                )
            time.sleep(0.05)

    def stop(
        self, name: str, sig: int = signal.SIGTERM, timeout: float | None = None
    ) -> tuple[int, str]:
        return self.procs[name].stop(sig, timeout)

    # -- build and teardown --------------------------------------------------------
    def _build(self) -> None:
        spec = self.spec
        if spec.nft and not shutil.which("nft"):
            raise KickassError("nftables (`nft`) is missing", hint="apt-get install nftables")
        for h in spec.hosts:
            # Registered before creation: a half-made namespace is deleted too.
            ns = self.hosts[h.name] = Netns(self.prefix + h.name)
            ns.create()
            sysctls = h.all_sysctls()
            if sysctls:
                ns.run(["sysctl", "-q", "-w", *(f"{k}={v}" for k, v in sysctls.items())])
        if spec.links:
            # Each pair is made with its ends already in their namespaces:
            # nothing ever exists in the root namespace, so nothing can leak there.
            run_cmd(
                ["ip", "-batch", "-"],
                input="".join(
                    f"link add name {lk.a.dev} netns {self.ns_name(lk.a.host)} type veth "
                    f"peer name {lk.b.dev} netns {self.ns_name(lk.b.host)}\n"
                    for lk in spec.links
                ),
            )
        for h in spec.hosts:
            self._configure_host(h.name)
        for p in spec.processes:
            self.start(p)

    def _configure_host(self, host: str) -> None:
        spec, ns = self.spec, self.hosts[host]
        bridges = [b for b in spec.bridges if b.host == host]
        links = [(lk, e) for lk in spec.links for e in (lk.a, lk.b) if e.host == host]
        ns.ip(*(f"link add name {b.name} type bridge" for b in bridges))
        no_v6 = [f"net.ipv6.conf.{e.dev}.disable_ipv6=1" for _, e in links if not e.ipv6]
        if no_v6:  # before the link comes up, so it never sends IPv6
            ns.run(["sysctl", "-q", "-w", *no_v6])
        lines = [f"link set dev {b.name} up" for b in bridges]
        for lk, e in links:
            mac = f" address {e.mac}" if e.mac else ""
            master = f" master {e.master}" if e.master else ""
            lines.append(f"link set dev {e.dev} mtu {lk.mtu}{mac}{master} up")
        lines += [f"addr add {a} dev {b.name}" for b in bridges for a in b.addresses]
        lines += [f"addr add {a} dev {e.dev}" for _, e in links for a in e.addresses]
        for r in spec.routes:
            if r.host == host:
                via = f" via {r.via}" if r.via else ""
                dev = f" dev {r.dev}" if r.dev else ""
                lines.append(f"route add {r.dest}{via}{dev}")
        lines += [
            f"neigh replace {n.address} lladdr {n.mac} dev {n.dev} nud permanent"
            for n in spec.neighbors
            if n.host == host
        ]
        ns.ip(*lines)
        if shutil.which("ethtool"):
            for lk, e in links:
                if not lk.offloads:
                    ns.run(
                        ["ethtool", "-K", e.dev, "gro", "off", "gso", "off", "tso", "off"],
                        check=False,
                    )
        ruleset = nft_ruleset([r for r in spec.nft if r.host == host])
        if ruleset:
            ns.nft(ruleset)

    def teardown(self) -> None:
        """Stop processes (newest first), delete namespaces (with their veths
        and any process left inside), remove an own log directory."""
        for proc in reversed(self._started):
            with contextlib.suppress(Exception):  # the namespace delete kills it anyway
                proc.stop()
        failed: Exception | None = None
        for ns in reversed(list(self.hosts.values())):
            try:
                ns.delete()
            except Exception as exc:  # one stuck namespace must not keep the others
                failed = failed or exc
        if self._own_log_dir and not self.keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        if failed is not None:
            raise failed


def nft_ruleset(rules: list[NftRule]) -> str:
    """The nft script for one host's rules (empty if none)."""
    tables: dict[tuple[str, str], dict[tuple[str, str, str], list[str]]] = {}
    for r in rules:
        chains = tables.setdefault((r.family, r.table), {})
        chains.setdefault((r.kind, r.hook, str(r.priority)), []).append(r.rule)
    out = []
    for (family, table), chains in tables.items():
        out.append(f"table {family} {table} {{")
        for i, ((kind, hook, prio), body) in enumerate(chains.items()):
            # Named after type and hook (never "fwd", an nft keyword).
            policy = " policy accept;" if kind == "filter" else ""
            out.append(f" chain {kind}_{hook}_{i} {{")
            out.append(f"  type {kind} hook {hook} priority {prio};{policy}")
            out += [f"  {rule}" for rule in body]
            out.append(" }")
        out.append("}")
    return "\n".join(out) + "\n" if out else ""


def _read_new(path: Path, since: int) -> bytes:
    """What was written after byte ``since``; all of it if the file shrank
    (a program that truncates its output file on start)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size >= since:
            f.seek(since)
        return f.read()


def _free_prefix(base: str) -> str:
    """A random prefix no existing namespace name starts with."""
    existing = [p.name for p in NETNS_DIR.iterdir()] if NETNS_DIR.exists() else []
    while True:
        prefix = f"{base}{secrets.token_hex(3)}"
        if not any(n.startswith(prefix) for n in existing):
            return prefix


@contextlib.contextmanager
def build(
    spec: Topology,
    *,
    prefix: str | None = None,
    log_dir: Path | None = None,
    keep_logs: bool = False,
) -> Iterator[Built]:
    """Build ``spec``, yield the handles, remove everything on exit.

    ``log_dir``: where process logs go; by default a temporary directory,
    removed on exit unless ``keep_logs``. ``prefix`` overrides the random
    per-run prefix (a namespace left with the same name by a crashed run is
    replaced).
    """
    spec.validate()
    require_root()
    built = Built(spec, prefix or _free_prefix(spec.name), log_dir, keep_logs)
    with cleanup_on_signals():
        try:
            built._build()
            yield built
        finally:
            with _signals_held():
                built.teardown()


# -- signals -------------------------------------------------------------------

_UNWIND_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def cleanup_on_signals() -> Iterator[None]:
    """Turn SIGTERM/SIGHUP into KeyboardInterrupt (as SIGINT already is) so
    `with` blocks unwind and clean up. Only the main thread can set signal
    handlers (and Python runs them there): elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.signal(s, handler) for s in _UNWIND_SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP back during a teardown (a second Ctrl-C
    must not leave half the namespaces behind); raise KeyboardInterrupt
    afterwards if one came."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []

    def handler(signum: int, frame: object) -> None:
        got.append(signum)

    sigs = (signal.SIGINT, *_UNWIND_SIGNALS)
    old: dict[int, Any] = {s: signal.signal(s, handler) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if got:
        raise KeyboardInterrupt(f"signal {got[0]} during the teardown")
