"""One network namespace, as a handle: run commands and start processes in
it, or switch the calling thread into it.

This is the mechanism only; what namespaces exist and how they are wired is
data (``topology.Topology``) and ``topology.build`` is the one place that
creates and removes them. A namespace deleted here takes its veths with it
and its processes are killed first (our own, then any straggler found by
``ip netns pids``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

from kickass_core.errors import KickassError

NETNS_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000

_libc = ctypes.CDLL(None, use_errno=True)


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


def run_cmd(
    cmd: Sequence[str],
    *,
    check: bool = True,
    input: str | None = None,
    timeout: float = 30,
    cpus: Collection[int] | None = None,
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        list(cmd),
        capture_output=True,
        text=True,
        input=input,
        timeout=timeout,
        check=False,
        preexec_fn=_pin(cpus),
    )
    if check and proc.returncode != 0:
        raise KickassError(
            f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr.strip()}"
        )
    return proc


def _pin(cpus: Collection[int] | None) -> Callable[[], None] | None:
    """A pre-exec hook pinning the child to ``cpus``: the affinity survives
    `ip netns exec` (it execs in place), so no `taskset` is needed."""
    if not cpus:
        return None
    mask = set(cpus)
    return lambda: os.sched_setaffinity(0, mask)


@contextlib.contextmanager
def in_netns(name: str) -> Iterator[None]:
    """Switch the calling thread into namespace ``name`` for the block.

    Namespaces are per thread in Linux: a socket created inside the block
    stays in ``name`` after the thread switches back.
    """
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(NETNS_DIR / name, os.O_RDONLY)
    except BaseException:
        os.close(own)
        raise
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


class Netns:
    """One network namespace; ``create()``/``delete()`` are called by the builder."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._procs: list[subprocess.Popen[Any]] = []
        self._created = False

    def create(self) -> Netns:
        require_root()
        if (NETNS_DIR / self.name).exists():
            # A crashed earlier run may have left it: a restart needs no manual clean-up.
            run_cmd(["ip", "netns", "del", self.name], check=False)
        run_cmd(["ip", "netns", "add", self.name])
        self._created = True
        self.ip("link set lo up")
        return self

    def delete(self) -> None:
        for p in reversed(self._procs):
            kill(p)
        self._procs.clear()
        if self._created:
            # Kill stragglers started by others inside this namespace.
            pids = run_cmd(["ip", "netns", "pids", self.name], check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            run_cmd(["ip", "netns", "del", self.name], check=False)
            self._created = False

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
        cpus: Collection[int] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        return run_cmd(self.cmd(cmd), check=check, input=input, timeout=timeout, cpus=cpus)

    def popen(
        self, cmd: Sequence[str], *, cpus: Collection[int] | None = None, **kwargs: Any
    ) -> subprocess.Popen[Any]:
        """Start a long-running process inside, in its own session (so a stop
        signal reaches its children); killed when the namespace goes."""
        kwargs.setdefault("start_new_session", True)
        # Bytes or text: ``kwargs`` decide (text=True, encoding=...).
        p: subprocess.Popen[Any] = subprocess.Popen(self.cmd(cmd), preexec_fn=_pin(cpus), **kwargs)
        self._procs.append(p)
        return p

    def ip(self, *lines: str) -> None:
        """`ip` commands in this namespace, in one `ip -batch` (one exec, not one each)."""
        if lines:
            run_cmd(["ip", "-n", self.name, "-batch", "-"], input="\n".join(lines) + "\n")

    def nft(self, ruleset: str) -> None:
        """Load an nftables ruleset (text) into this namespace."""
        if not shutil.which("nft"):
            raise KickassError("nftables (`nft`) is missing", hint="apt-get install nftables")
        self.run(["nft", "-f", "-"], input=ruleset)

    def in_netns(self) -> contextlib.AbstractContextManager[None]:
        return in_netns(self.name)


def kill(p: subprocess.Popen[Any], grace: float = 2.0) -> None:
    """SIGTERM the process group, SIGKILL after ``grace`` seconds."""
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
