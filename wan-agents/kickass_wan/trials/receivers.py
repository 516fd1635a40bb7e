"""The runner's side of a deployed receiver: registering it, and checking it before a round.

**Registering** (`kickass trials agents add NAME URL --secret-file -`): the
operator pipes the secret the agent's package made (``/etc/kickass-agent/secret``
on the receiver host) into the runner; the agent is checked with it, and the
registry (``--agents-dir``, ``$KICKASS_AGENTS_DIR``, default ``.kickass/agents``)
keeps ``NAME`` (the secret, mode 0600: the file ``--secret-dir`` reads) and
``NAME.url``. `kickass trials run --agent NAME` then needs nothing else.

**Checking** (before every `kickass trials run`, and `kickass trials agents
check`): what would spoil a round, named per agent:

* reachable, and the secret is the agent's (a signed ``GET /v1/environment``);
* its version: the flow tokens it issues are the ones this runner's ka-send and
  TCP sender present (``token_version``); another agent version is noted;
* its Kick-Ass receiver present and up (``GET /v1/health``), and answering on
  its UDP port: a HANDSHAKE without a token, which every receiver refuses with
  one 32-byte HANDSHAKE_ACK (ka-transport's wire format);
* the clock offset between the two hosts (signed requests are refused beyond
  120 s);
* the path MTU: that HANDSHAKE is 1500 bytes of IP with DF set, the size of
  every Kick-Ass data datagram. A hop with a smaller MTU would cut those
  datagrams again, and the receiver would read that hop's cut as the rate a
  Kick-Ass router advertised. If only a 92-byte HANDSHAKE is answered, the path
  cannot carry them.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import socket
import struct
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kickass_core.errors import KickassError

from .. import __version__
from .. import token as tk
from ..environment import IP_MTU, path_mtu
from .runner import AgentClient, AgentRef

AGENTS_DIR_ENV = "KICKASS_AGENTS_DIR"
DEFAULT_AGENTS_DIR = ".kickass/agents"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # service.AgentSetting's names

# Beyond this the round is refused (signed requests fail at 120 s, and clocks
# drift during a round); beyond CLOCK_NOTE_S the offset is only noted.
CLOCK_LIMIT_S = 60.0
CLOCK_NOTE_S = 1.0
# Every Kick-Ass data datagram is this long (IP bytes).
KICKASS_DATAGRAM_IP = 1500

# ka-transport's wire format (wan-agents/README.md, "Wire format"): the
# 32-byte fixed header of a HANDSHAKE, and the HANDSHAKE_ACK it gets.
WIRE_MAGIC = b"KA"
WIRE_VERSION = 1
KIND_HANDSHAKE = 1
KIND_HANDSHAKE_ACK = 2
FLAG_PADDED = 0x02
MIN_HANDSHAKE = 64
_HEADER = struct.Struct("!2sBBQBBHQQ")  # magic, version, kind, flow id, flags, aux8, aux16, w0, w1
IP_UDP_HEADERS = 28
IP_MTU_DISCOVER = 10  # <netinet/in.h>
IP_PMTUDISC_DO = 2  # DF set, never fragment locally


# -- the registry -------------------------------------------------------------------


def agents_dir(flag: str | None = None) -> Path:
    return Path(flag or os.environ.get(AGENTS_DIR_ENV) or DEFAULT_AGENTS_DIR)


def registered(name: str, directory: Path) -> tuple[str, Path] | None:
    """The control URL and secret file of a registered agent, or None."""
    url_file, secret_file = directory / f"{name}.url", directory / name
    if not (url_file.is_file() and secret_file.is_file()):
        return None
    return url_file.read_text().strip(), secret_file


def register(name: str, url: str, secret: str, directory: Path) -> Path:
    """Store an agent's URL and secret (0600) in the registry; its secret file."""
    if not NAME_PATTERN.match(name):
        raise KickassError(f"bad agent name {name!r}", hint="letters, digits, '.', '_', '-'")
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    secret_file = directory / name
    for path, text, mode in ((secret_file, secret, 0o600), (directory / f"{name}.url", url, 0o644)):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return secret_file


def read_secret_arg(path: str, read_stdin: Callable[[], str]) -> str:
    """The secret from a file, or from standard input for ``-``."""
    if path == "-":
        secret = read_stdin().strip()
        where = "standard input"
    else:
        try:
            secret = Path(path).read_text().strip()
        except OSError as exc:
            raise KickassError(f"cannot read the secret file {path}: {exc.strerror}") from None
        where = path
    if len(secret.encode()) < 16:
        raise KickassError(
            f"no agent secret on {where}" if not secret else f"the secret on {where} is too short",
            hint="pipe in the receiver host's /etc/kickass-agent/secret",
        )
    return secret


# -- the check ----------------------------------------------------------------------


@dataclass
class AgentCheck:
    """What the check found out about one agent: ``problems`` spoil a round."""

    name: str
    url: str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "url": self.url, "ok": self.ok, "problems": self.problems,
                "notes": self.notes, **self.facts}  # fmt: skip

    def render(self) -> str:
        facts = self.facts
        parts = [
            f"agent {facts['agent_version']}" if facts.get("agent_version") else None,
            facts.get("receiver"),
            f"clock offset {facts['clock_offset_s']:+.3f} s"
            if facts.get("clock_offset_s") is not None
            else None,
            f"path MTU >= {facts['path_mtu']}" if facts.get("path_mtu") else None,
        ]
        head = f"{self.name:<16} {'ok' if self.ok else 'NOT READY'}  " + ", ".join(
            p for p in parts if p
        )
        lines = [head.rstrip()]
        lines += [f"  problem: {p}" for p in self.problems]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def check_agent(
    agent: AgentRef, source: str | None = None, *, kickass: bool = True, timeout_s: float = 5.0
) -> AgentCheck:
    """Everything a round needs from this agent, checked now (see the module's
    doc); its Kick-Ass receiver and the path MTU only if the round has
    Kick-Ass periods (``kickass``)."""
    result = AgentCheck(agent.name, agent.control_url)
    client = AgentClient(agent, timeout_s=timeout_s)
    try:
        env = client.environment()
    except KickassError as exc:
        if "HTTP 401" in exc.message:
            result.problems.append(
                f"the runner's secret for {agent.name} is not the agent's, or the clocks are "
                f"more than 120 s apart ({exc.message})"
            )
        else:
            result.problems.append(exc.message)
        return result

    version = _version(agent.control_url, timeout_s)
    result.facts["agent_version"] = version.get("agent")
    if "token_version" not in version:
        result.problems.append(
            f"the agent ({version.get('agent') or 'unknown version'}) does not say which flow "
            "tokens it issues: it predates this runner; upgrade it (its Debian package)"
        )
    elif version["token_version"] != tk.VERSION:
        result.problems.append(
            f"the agent issues flow tokens of version {version['token_version']}, this runner "
            f"sends version {tk.VERSION}: install the same release on both"
        )
    if version.get("agent") and version["agent"] != __version__:
        result.notes.append(f"agent version {version['agent']}, runner {__version__}")

    offset = env.get("clock_offset_s")
    if isinstance(offset, int | float):
        result.facts["clock_offset_s"] = offset
        if abs(offset) > CLOCK_LIMIT_S:
            result.problems.append(
                f"its clock is {offset:+.1f} s off this host's (over {CLOCK_LIMIT_S:g} s; "
                "signed requests fail at 120 s): run NTP on both hosts"
            )
        elif abs(offset) > CLOCK_NOTE_S:
            result.notes.append(f"clock offset {offset:+.1f} s: keep both hosts on NTP")

    health = client.health()
    ka = (health.get("receivers") or {}).get("kickass")
    if not kickass:
        result.facts["receiver"] = (ka or {}).get("version")
        return result
    if not ka:
        result.problems.append(
            "no Kick-Ass receiver: the agent serves only TCP flows (started with "
            "--kickass-receiver none); install the kickass-agent package"
        )
        return result
    result.facts["receiver"] = ka.get("version")
    if not ka.get("ready"):
        why = ka.get("error") or "not started"
        result.problems.append(
            f"its Kick-Ass receiver is not up ({why}; {ka.get('restarts', 0)} restarts)"
        )
        return result
    host = agent.host
    kernel_mtu = path_mtu(host)
    if kernel_mtu is not None and kernel_mtu < KICKASS_DATAGRAM_IP:
        result.problems.append(
            f"the route to {host} has an MTU of {kernel_mtu}: Kick-Ass datagrams are "
            f"{KICKASS_DATAGRAM_IP} bytes"
        )
        return result
    probe = probe_receiver(host, int(ka["port"]), source=source)
    if probe.full:
        result.facts["path_mtu"] = KICKASS_DATAGRAM_IP
    elif probe.small:
        known = f" (the kernel's path MTU: {probe.mtu})" if probe.mtu else ""
        result.problems.append(
            f"{KICKASS_DATAGRAM_IP}-byte datagrams with DF set do not reach its Kick-Ass "
            f"receiver, {IP_UDP_HEADERS + MIN_HANDSHAKE}-byte ones do: the path MTU is below "
            f"{KICKASS_DATAGRAM_IP}{known}, so Kick-Ass rates would be misread"
        )
    else:
        result.problems.append(
            f"its Kick-Ass receiver does not answer on {host}:{ka['port']}/udp "
            f"({probe.error or 'no reply'}): is that port open to this host?"
        )
    return result


def _version(url: str, timeout_s: float) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/v1/version", timeout=timeout_s) as r:
            reply = json.load(r)
    except (OSError, ValueError):
        return {}
    return reply if isinstance(reply, dict) else {}


@dataclass
class Probe:
    full: bool = False  # a 1500-byte HANDSHAKE, DF set, was answered
    small: bool = False  # a 92-byte one was (IP bytes)
    mtu: int | None = None  # the kernel's path MTU after the probe, if it learned one
    error: str | None = None


def handshake(flow_id: int, ip_len: int) -> bytes:
    """A HANDSHAKE without a token, ``ip_len`` bytes of IP: the receiver refuses it."""
    payload = ip_len - IP_UDP_HEADERS
    flags = FLAG_PADDED if payload > MIN_HANDSHAKE else 0
    head = _HEADER.pack(WIRE_MAGIC, WIRE_VERSION, KIND_HANDSHAKE, flow_id, flags, 0, 0, 1,
                        time.monotonic_ns())  # fmt: skip
    return head + bytes(payload - len(head))


def _refusal_of(reply: bytes, flow_id: int) -> bool:
    if len(reply) < _HEADER.size:
        return False
    magic, version, kind, fid, *_ = _HEADER.unpack_from(reply)
    return (magic, version, kind, fid) == (WIRE_MAGIC, WIRE_VERSION, KIND_HANDSHAKE_ACK, flow_id)


def probe_receiver(
    host: str, port: int, *, source: str | None = None, tries: int = 3, wait_s: float = 1.0
) -> Probe:
    """Ask the Kick-Ass receiver at ``host:port`` with a full-size HANDSHAKE
    (DF set), then, if that goes unanswered, a 92-byte one."""
    out = Probe()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((source or "0.0.0.0", 0))
        s.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
        s.connect((host, port))
        s.settimeout(wait_s)
        sizes = ((KICKASS_DATAGRAM_IP, "full"), (IP_UDP_HEADERS + MIN_HANDSHAKE, "small"))
        for size, attr in sizes:
            flow_id = secrets.randbits(64)
            for _ in range(tries):
                try:
                    s.send(handshake(flow_id, size))
                    while True:
                        if _refusal_of(s.recv(2048), flow_id):
                            setattr(out, attr, True)
                            break
                except TimeoutError:
                    continue
                except OSError as exc:
                    # EMSGSIZE: the kernel knows a smaller path MTU; ECONNREFUSED:
                    # an ICMP port unreachable (nothing listens there).
                    out.error = exc.strerror
                    if exc.errno == errno.EMSGSIZE:
                        break
                    continue
                break
            if out.full:
                break
        try:
            out.mtu = int(s.getsockopt(socket.IPPROTO_IP, IP_MTU))
        except OSError:
            out.mtu = None
    return out
