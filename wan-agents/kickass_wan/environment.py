"""What a trial ran on, from both ends: the record a reviewer asks for.

Kernel and tool versions, the TCP settings that change TCP's results
(congestion control, the metrics cache that keeps ssthresh per destination,
slow start after idle, buffers, ECN), the route to each destination (device,
initial congestion window, MTU), its qdisc and offloads, and the path MTU.
Everything is read without root (/proc/sys, `ip`, `tc`, `ethtool -k`);
what cannot be read is recorded as such, never guessed. The runner stores its
own record and each agent's (``GET /v1/environment``) with the trial.

The TCP metrics cache (``tcp_no_metrics_save``): Linux remembers ssthresh
and RTT per destination, so after one loss every later TCP flow to the same
agent starts with a small ssthresh. ``MetricsCache`` disables it for the
trial (and restores it), or says why it could not.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import __version__

SYSCTLS = (
    "tcp_congestion_control",
    "tcp_available_congestion_control",
    "tcp_allowed_congestion_control",
    "tcp_no_metrics_save",
    "tcp_slow_start_after_idle",
    "tcp_rmem",
    "tcp_wmem",
    "tcp_ecn",
    "tcp_mtu_probing",
    "tcp_sack",
    "tcp_timestamps",
    "ip_no_pmtu_disc",
)
SYSCTL_DIR = Path("/proc/sys/net/ipv4")
IP_MTU = 14  # Linux <netinet/in.h>; not exported by Python's socket module


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _run(argv: list[str], timeout: float = 5.0) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _lines(text: str | None) -> list[str] | None:
    """Command output as short lines (the record is JSON that the server
    bounds: no control characters, no long strings)."""
    if text is None:
        return None
    return [ln.strip()[:200] for ln in text.splitlines() if ln.strip()][:50]


def sysctls() -> dict[str, str | None]:
    out = {}
    for name in SYSCTLS:
        value = _read(SYSCTL_DIR / name)
        out[name] = None if value is None else " ".join(value.split())[:200]
    return out


def route_to(address: str) -> dict[str, Any]:
    """The route the kernel takes to ``address``: device, source, initcwnd,
    MTU, and that device's qdisc and offloads; the path MTU it knows."""
    out: dict[str, Any] = {"address": address}
    line = _run(["ip", "-o", "route", "get", address])
    out["route"] = None if line is None else " ".join(line.split())[:200]
    dev = None
    if line:
        m = re.search(r"\bdev (\S+)", line)
        dev = m.group(1) if m else None
        for key in ("initcwnd", "initrwnd", "mtu", "src"):
            m = re.search(rf"\b{key} (\S+)", line)
            out[key] = m.group(1) if m else None
    out["dev"] = dev
    if dev:
        out["qdisc"] = _lines(_run(["tc", "qdisc", "show", "dev", dev]))
        offloads = _run(["ethtool", "-k", dev])
        out["offloads"] = (
            None
            if offloads is None
            else {
                k: v
                for k, v in (
                    ln.split(":", 1)
                    for ln in offloads.splitlines()
                    if ":" in ln and not ln.startswith("Features")
                )
                if k.strip()
                in (
                    "tcp-segmentation-offload",
                    "generic-segmentation-offload",
                    "generic-receive-offload",
                )
            }
        )
        if out["offloads"] is not None:
            out["offloads"] = {k.strip(): v.strip() for k, v in out["offloads"].items()}
    out["path_mtu"] = path_mtu(address)
    return out


def path_mtu(address: str) -> int | None:
    """The kernel's path MTU to ``address`` (a connected UDP socket; no packet sent)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))
            return int(s.getsockopt(socket.IPPROTO_IP, IP_MTU))
    except OSError:
        return None


def tool_versions(ka_send: str | None = None) -> dict[str, str | None]:
    versions: dict[str, str | None] = {
        "kickass-wan": __version__,
        "python": platform.python_version(),
        "git_commit": os.environ.get("KICKASS_GIT_COMMIT") or _git_commit(),
    }
    if ka_send:
        versions["ka-send"] = (_run([ka_send, "--version"]) or "")[:200] or None
    return versions


def _git_commit() -> str | None:
    here = Path(__file__).resolve().parent
    if not (here.parent.parent / ".git").exists():
        return None
    return _run(["git", "-C", str(here), "rev-parse", "HEAD"])


def local(destinations: Sequence[str] = (), ka_send: str | None = None) -> dict[str, Any]:
    """This host's record, with the route to each of ``destinations``."""
    uname = platform.uname()
    return {
        "host": uname.node,
        "kernel": uname.release,
        "system": f"{uname.system} {uname.version}"[:200],
        "machine": uname.machine,
        "sysctl": sysctls(),
        "routes": [route_to(d) for d in destinations],
        "versions": tool_versions(ka_send),
        "recorded_at": time.time(),
    }


class MetricsCache:
    """The TCP metrics cache for a trial: ``disable`` (the default) sets
    ``tcp_no_metrics_save`` to 1 for the trial and restores it; ``leave``
    keeps it as it is. ``record`` says what was in effect, and why."""

    def __init__(self, mode: str = "disable") -> None:
        if mode not in ("disable", "leave"):
            raise ValueError("tcp metrics mode must be 'disable' or 'leave'")
        self.mode = mode
        self.previous: str | None = None
        self.record: dict[str, Any] = {}

    def __enter__(self) -> MetricsCache:
        path = SYSCTL_DIR / "tcp_no_metrics_save"
        self.previous = _read(path)
        if self.mode == "leave" or self.previous is None:
            self.record = {
                "mode": "left on" if self.previous == "0" else "off already",
                "tcp_no_metrics_save": self.previous,
                "why": "asked to leave it" if self.mode == "leave" else "no such setting here",
            }
            return self
        if self.previous == "1":
            self.record = {"mode": "off already", "tcp_no_metrics_save": "1"}
            return self
        try:
            path.write_text("1\n")
            self.record = {"mode": "disabled for the trial", "tcp_no_metrics_save": "1",
                           "restored_to": self.previous}  # fmt: skip
            self._restore = True
        except OSError as exc:
            self.record = {
                "mode": "left on",
                "tcp_no_metrics_save": self.previous,
                "why": f"cannot disable it ({exc.strerror}): run the runner as root, or set "
                "net.ipv4.tcp_no_metrics_save=1 on this host",
            }
        return self

    _restore = False

    def __exit__(self, *exc: object) -> None:
        if self._restore and self.previous is not None:
            with contextlib.suppress(OSError):
                (SYSCTL_DIR / "tcp_no_metrics_save").write_text(self.previous + "\n")
