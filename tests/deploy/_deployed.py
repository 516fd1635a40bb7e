"""A deployed receiver in a trial: Docker's daemon, the agent's Debian package,
and a trial from the host through ka-router and an emulated WAN to a receiver
that runs in a container (tests/deploy/test_agent_package.py, test_compose.py).

The trial is ``kickass_testbed.trials.run_trial`` with no receiver namespace of
its own: the container's network is plugged into the testbed's far bridge with
a veth (its end at the first receiver's address, ``198.18.51.11``), the
receiver is registered with the runner as an operator does (its secret piped
into `kickass trials agents add`), and `kickass trials run --agent NAME` runs
in the sender namespace with a wrong $KICKASS_AGENT_SECRET, so only the
registered secret can work. The runner checks the receiver before its round.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from kickass_testbed.trials import AGENT_CONTROL_PORT, TrialOutcome, TrialSpec, run_trial
from kickass_testbed.wan import WAN_NET, Testbed, TestbedConfig, receiver_address

ROOT = Path(__file__).resolve().parents[2]
BUILD_DEB = ROOT / "wan-agents" / "deploy" / "build-deb.sh"
INSTALL = ROOT / "wan-agents" / "deploy" / "install-agent.sh"
BASE_IMAGES = ROOT.parent / "shared" / "oracles" / "docker" / "make-base-images.sh"
DOCKER_STATE = Path(os.environ.get("KICKASS_DOCKER_STATE", "/var/tmp/kickass-docker"))
KICKASS = str(Path(sys.executable).parent / "kickass")
AGENT_ADDRESS = receiver_address(1)
AGENT_URL = f"http://{AGENT_ADDRESS}:{AGENT_CONTROL_PORT}"
# A plain Debian host: systemd as init, and the Debian packages any standard
# installation has (python3.11 with it, iproute2). Nothing of ours.
HOST_IMAGE = "kickass-test/debian-host:bookworm"
HOST_DOCKERFILE = """\
FROM debian:bookworm
LABEL org.kickass.image="kickass-test-host"
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \\
    --no-install-recommends systemd systemd-sysv python3.11 iproute2 >/dev/null \\
    && rm -rf /var/lib/apt/lists/*
"""
# linux/capability.h, in order: the names Docker's --cap-drop takes.
CAPABILITIES = (
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETPCAP",
    "LINUX_IMMUTABLE",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_ADMIN",
    "NET_RAW",
    "IPC_LOCK",
    "IPC_OWNER",
    "SYS_MODULE",
    "SYS_RAWIO",
    "SYS_CHROOT",
    "SYS_PTRACE",
    "SYS_PACCT",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_NICE",
    "SYS_RESOURCE",
    "SYS_TIME",
    "SYS_TTY_CONFIG",
    "MKNOD",
    "LEASE",
    "AUDIT_WRITE",
    "AUDIT_CONTROL",
    "SETFCAP",
    "MAC_OVERRIDE",
    "MAC_ADMIN",
    "SYSLOG",
    "WAKE_ALARM",
    "BLOCK_SUSPEND",
    "AUDIT_READ",
    "PERFMON",
    "BPF",
    "CHECKPOINT_RESTORE",
)


# -- Docker ---------------------------------------------------------------------------


def docker_env(docker_host: str | None) -> dict[str, str]:
    env = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    if docker_host:
        env["DOCKER_HOST"] = docker_host
    return env


def _answers(docker_host: str | None) -> bool:
    probe = subprocess.run(
        ["docker", "info", "--format", "{{.ServerVersion}}"],
        env=docker_env(docker_host),
        capture_output=True,
        text=True,
        timeout=30,
    )
    return probe.returncode == 0


def docker_daemon() -> str | None:
    """DOCKER_HOST of a daemon that holds the base images, or a skip."""
    if shutil.which("docker") is None or shutil.which("docker-compose") is None:
        pytest.skip(
            "docker / docker-compose not installed (Debian packages docker.io, docker-compose)"
        )
    if BASE_IMAGES.is_file() and os.geteuid() == 0:
        # Starts a daemon unless one answers on its socket; builds the base
        # images the compose file names from Debian packages (minutes, once).
        made = subprocess.run(
            ["bash", str(BASE_IMAGES), str(DOCKER_STATE)],
            capture_output=True,
            text=True,
            timeout=900,
        )
        last = made.stdout.strip().splitlines()[-1:] or [""]
        if made.returncode == 0 and last[0].startswith("export DOCKER_HOST="):
            return last[0].removeprefix("export DOCKER_HOST=")
        if "dockerd did not start" in made.stderr:
            pytest.skip(f"Docker's daemon is not reachable: {made.stderr.strip()[-400:]}")
        pytest.fail(f"make-base-images.sh failed (exit {made.returncode}): {made.stderr[-2000:]}")
    host = os.environ.get("DOCKER_HOST")
    if _answers(host):
        return host
    pytest.skip(
        "Docker's daemon is not reachable (no answer on DOCKER_HOST or the default socket, "
        f"and {BASE_IMAGES} cannot start one here: it needs the file and root)"
    )


@dataclass
class Docker:
    env: dict[str, str]

    def run(
        self, *args: str, timeout: float = 120, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            ["docker", *args], env=self.env, capture_output=True, text=True, timeout=timeout,
            input=input,
        )  # fmt: skip
        if check and out.returncode != 0:
            raise AssertionError(f"docker {' '.join(args[:3])}: {out.stderr[-2000:]}")
        return out

    def exec(
        self, container: str, *argv: str, timeout: float = 120, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return self.run("exec", container, *argv, timeout=timeout, check=check)

    def pid(self, container: str) -> int:
        return int(self.run("inspect", "-f", "{{.State.Pid}}", container).stdout)

    def host_image(self) -> str:
        """The plain Debian host image (built once from HOST_DOCKERFILE)."""
        if self.run("image", "inspect", HOST_IMAGE, check=False).returncode != 0:
            self.run("build", "-q", "--network", "host", "-t", HOST_IMAGE, "-",
                     input=HOST_DOCKERFILE, timeout=600)  # fmt: skip
        return HOST_IMAGE


def all_capabilities_but_missing() -> list[str]:
    """docker run flags for every capability this machine's root has: a
    container as privileged as a host's root (--privileged fails where the
    machine's own bounding set lacks one)."""
    status = Path("/proc/self/status").read_text()
    bounding = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("CapBnd")), 16)
    missing = [name for bit, name in enumerate(CAPABILITIES) if not bounding >> bit & 1]
    return ["--cap-add", "ALL", *(a for name in missing for a in ("--cap-drop", name))]


# -- the package ------------------------------------------------------------------------


def build_deb(out: Path, *, version: str | None = None, epoch: int | None = None) -> Path:
    """`wan-agents/deploy/build-deb.sh OUT` (what `make agent-deb` runs); the package."""
    env = {**os.environ}
    if version:
        env["KICKASS_AGENT_VERSION"] = version
    if epoch is not None:
        env["SOURCE_DATE_EPOCH"] = str(epoch)
    made = subprocess.run(
        ["bash", str(BUILD_DEB), str(out)], env=env, capture_output=True, text=True, timeout=1500
    )
    assert made.returncode == 0, made.stderr[-3000:]
    (deb,) = out.glob("kickass-agent_*_amd64.deb")
    assert made.stdout.split()[1] == deb.name, made.stdout
    return deb


# -- the trial ----------------------------------------------------------------------------


def plug_into_far(tb: Testbed, pid: int | None) -> None:
    """A veth from the testbed's far bridge to the receiver host's network
    namespace (a container's, by its pid; None: this machine's own), with
    the first receiver's address and the way back through the router."""
    far = tb.built.ns_name("far")
    a, b = f"kf{secrets.token_hex(3)}", f"ka{secrets.token_hex(3)}"
    subprocess.run(["ip", "link", "add", a, "type", "veth", "peer", "name", b], check=True)
    subprocess.run(["ip", "link", "set", a, "netns", far], check=True)
    subprocess.run(["ip", "-n", far, "link", "set", a, "master", "sw", "up"], check=True)
    enter = [] if pid is None else ["nsenter", "-t", str(pid), "-n"]
    if pid is not None:
        subprocess.run(["ip", "link", "set", b, "netns", str(pid)], check=True)
    # The testbed's own veths carry what was sent, fragments included: no offloads.
    for ns, dev in ((["ip", "netns", "exec", far], a), (enter, b)):
        subprocess.run([*ns, "ethtool", "-K", dev, "gro", "off", "gso", "off", "tso", "off"],
                       check=False, capture_output=True)  # fmt: skip
    subprocess.run([*enter, "ip", "link", "set", "lo", "up"], check=True)
    subprocess.run([*enter, "ip", "addr", "add", f"{AGENT_ADDRESS}/24", "dev", b], check=True)
    subprocess.run([*enter, "ip", "link", "set", b, "up"], check=True)
    if pid is None:
        subprocess.run(["ip", "route", "add", "198.18.50.0/24", "via", f"{WAN_NET}.1"], check=True)
    else:
        subprocess.run([*enter, "ip", "route", "add", "default", "via", f"{WAN_NET}.1"], check=True)


def unplug_root() -> None:
    """What plug_into_far(tb, None) left in this machine's namespace (the veth
    goes with the testbed's far namespace)."""
    subprocess.run(["ip", "route", "del", "198.18.50.0/24", "via", f"{WAN_NET}.1"],
                   check=False, capture_output=True)  # fmt: skip


def wait_ready(tb: Testbed, url: str, timeout_s: float = 60) -> dict:
    """The agent's /v1/health from the sender, once its Kick-Ass receiver is up."""
    deadline = time.monotonic() + timeout_s
    last = ""
    probe = (
        "import json,sys,urllib.request;"
        f"print(urllib.request.urlopen('{url}/v1/health', timeout=2).read().decode())"
    )
    while time.monotonic() < deadline:
        got = tb.built["s1"].run([sys.executable, "-c", probe], check=False, timeout=10)
        if got.returncode == 0:
            health = json.loads(got.stdout)
            if (health["receivers"]["kickass"] or {}).get("ready"):
                return health
            last = got.stdout
        else:
            last = got.stderr[-300:]
        time.sleep(0.5)
    raise AssertionError(f"the deployed agent did not come up at {url}: {last}")


def trial_to_deployed(
    database_url: str,
    work: Path,
    name: str,
    plug: Callable[[Testbed], None],
    secret: Callable[[], str],
    url: str = AGENT_URL,
) -> tuple[TrialOutcome, str]:
    """One paired Kick-Ass/TCP trial to the deployed receiver ``name`` (its
    control API at ``url``, on the first receiver's address): the outcome,
    and what `kickass trials agents add` said."""
    registry = work / "agents"
    said: list[str] = []

    def prepare(tb: Testbed) -> None:
        plug(tb)
        wait_ready(tb, url)
        added = tb.built["s1"].run(
            [KICKASS, "trials", "agents", "add", name, url, "--secret-file", "-",
             "--agents-dir", str(registry)],
            input=secret(), check=False, timeout=60,
        )  # fmt: skip
        assert added.returncode == 0, added.stderr
        said.append(added.stderr)

    spec = TrialSpec(
        pairs=1, period_s=8.0, gap_s=2.0, mean_gap_s=0.4, mean_packets=30.0, max_packets=300,
        seed=3, extra_args=["--agent", name, "--agents-dir", str(registry)],
    )  # fmt: skip
    outcome = run_trial(
        database_url,
        TestbedConfig(senders=1, receivers=0, capacity="10mbit", rtt_ms=40.0),
        spec,
        prepare=prepare,
        work_dir=work,
        # Not the agent's: the runner must take the registered one.
        agent_secret=secrets.token_hex(32),
        timeout_s=180,
    )
    return outcome, said[0]


def assert_paired_trial_stored(outcome: TrialOutcome, name: str) -> dict[str, float]:
    """Kick-Ass flows completed in Kick-Ass mode, TCP flows completed, all stored."""
    flows = outcome.flows
    ka = [f for f in flows if f["protocol"] == "kickass"]
    tcp = [f for f in flows if f["protocol"] == "tcp"]
    assert outcome.result["failed_flows"] == 0, outcome.result
    assert len(ka) >= 8 and len(tcp) >= 8, (len(ka), len(tcp))
    assert {f["destination"] for f in flows} == {name}
    assert all(f["completed"] for f in flows), [f.get("error") for f in flows]
    ka_mode = sum(f["ka_mode_fraction"] for f in ka) / len(ka)
    # Measured 0.99-1.0 through the router at 10 Mbit/s; a receiver that cannot
    # read leading fragments gives 0 (every flow in TCP mode).
    assert ka_mode >= 0.9, ka_mode
    return {"kickass_flows": len(ka), "tcp_flows": len(tcp), "ka_mode_mean": round(ka_mode, 3)}
