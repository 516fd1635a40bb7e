"""The remote receiver as one Debian package (issue 25): built, installed, run, measured through.

- The package (``make agent-deb``: wan-agents/deploy/build-deb.sh) is
  reproducible: built twice, in other folders under another umask, the same
  bytes; its unit passes `systemd-analyze verify` among the host's own units;
  the dependencies it carries are the ones wan-agents pins.
- On a plain Debian host (a container booted with systemd, with nothing of
  ours) install-agent.sh installs it from the package alone, the unit runs the
  agent exactly as written (a dynamic user, CAP_NET_RAW and nothing else, the
  secret through a credential file), the receiver is registered with the
  runner in one command, and a paired Kick-Ass/TCP trial from this machine
  through ka-router and an emulated WAN reaches it: Kick-Ass flows complete in
  Kick-Ass mode, TCP flows complete, all stored. Installing again and
  upgrading keep the secret and the state.
- On a host that does not grant CAP_NET_RAW the install fails and says why.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import subprocess
import time
import tomllib
from pathlib import Path

import pytest
from _deployed import (
    INSTALL,
    ROOT,
    Docker,
    all_capabilities_but_missing,
    assert_paired_trial_stored,
    build_deb,
    docker_daemon,
    docker_env,
    plug_into_far,
    trial_to_deployed,
)

UNIT = "kickass-agent.service"
CAP_NET_RAW = 1 << 13  # the one capability, as a mask
# systemd's DynamicUser= range (systemd.exec(5)).
DYNAMIC_UIDS = range(61184, 65520)


def test_the_lock_file_carries_what_wan_agents_pins() -> None:
    lock = (ROOT / "wan-agents" / "deploy" / "requirements.lock").read_text()
    locked = dict(re.findall(r"^([a-z0-9-]+)==(\S+) --hash=sha256:[0-9a-f]{64}$", lock, re.M))
    pins = tomllib.loads((ROOT / "wan-agents" / "pyproject.toml").read_text())["project"]
    for pin in pins["dependencies"]:
        name, _, version = pin.partition("==")
        name = re.sub(r"[-_.]+", "-", name).lower()
        if name != "kickass-core":
            assert locked.get(name) == version, (name, locked)


@pytest.mark.slow
def test_the_package_is_reproducible_and_its_unit_verifies(tmp_path: Path) -> None:
    """Same sources, same bytes (other output folder, umask and working
    directory; ka-agent-recv from one compilation: its remapped paths are what
    a clean build in another checkout would change, checked by hand: README).
    The unit verifies among this machine's systemd units, the package's files
    in place."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is missing (Debian package systemd)")
    epoch = 1_790_000_000
    first = build_deb(tmp_path / "a", version="0.1.0+test", epoch=epoch)
    old = os.umask(0o077)
    try:
        second = build_deb(tmp_path / "b", version="0.1.0+test", epoch=epoch)
    finally:
        os.umask(old)
    digest = hashlib.sha256(first.read_bytes()).hexdigest()
    assert hashlib.sha256(second.read_bytes()).hexdigest() == digest
    assert (first.parent / f"{first.name}.sha256").read_text() == f"{digest}  {first.name}\n"
    fields = subprocess.run(
        ["dpkg-deb", "-f", str(first), "Version", "Depends", "Architecture"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "Version: 0.1.0+test" in fields and "Architecture: amd64" in fields
    assert re.search(r"Depends: python3\.11, libc6 \(>= 2\.\d+\)", fields), fields

    root = tmp_path / "root"
    subprocess.run(["dpkg-deb", "-x", str(first), str(root)], check=True)
    assert (root / "opt/kickass-agent/bin/ka-agent-recv").stat().st_mode & 0o111
    assert not (root / "etc/kickass-agent/secret").exists()  # never the package's
    units = root / "lib" / "systemd" / "system"
    # The targets the unit is ordered against, copied in (systemd refuses
    # links that leave the root).
    shutil.copytree("/lib/systemd/system", units, symlinks=True, dirs_exist_ok=True)
    verify = subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", str(units / UNIT)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    # Warnings (an unknown key, a missing file) fail the test as errors do.
    assert verify.returncode == 0 and not verify.stdout + verify.stderr, verify


@pytest.mark.slow
def test_install_refuses_a_package_that_is_not_its_own(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("install-agent.sh runs as root")
    fake = tmp_path / "kickass-agent_1_amd64.deb"
    fake.write_text("not a package")
    out = subprocess.run(["bash", str(INSTALL), str(fake)], capture_output=True, text=True)
    assert out.returncode == 1 and "is not a Debian package" in out.stderr, out
    out = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True)
    assert out.returncode == 2 and "install-agent.sh kickass-agent_" in out.stderr, out


def _boot_host(docker: Docker, name: str) -> None:
    """A Debian host booted with systemd, its network only what a test plugs in."""
    docker.run(
        "run", "-d", "--name", name, "--hostname", name, "--network", "none",
        *all_capabilities_but_missing(), "--security-opt", "seccomp=unconfined",
        "-v", "/sys/fs/cgroup:/sys/fs/cgroup:rw", docker.host_image(),
        # A booted host's / is a shared mount (systemd makes it so); Docker's is
        # not, and the credentials systemd mounts for a unit would never reach it.
        "sh", "-c", "mount --make-rshared / && exec /sbin/init",
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = docker.exec(name, "systemctl", "is-system-running", check=False).stdout.strip()
        if state in ("running", "degraded"):
            return
        time.sleep(0.5)
    raise AssertionError(f"{name} did not boot: {state}")


def _install(
    docker: Docker, host: str, deb: Path
) -> tuple[subprocess.CompletedProcess[str], float]:
    for f in (deb, deb.parent / f"{deb.name}.sha256", INSTALL):
        docker.run("cp", str(f), f"{host}:/root/")
    t0 = time.monotonic()
    out = docker.exec(host, "/root/install-agent.sh", f"/root/{deb.name}", check=False,
                      timeout=300)  # fmt: skip
    return out, time.monotonic() - t0


def _status(docker: Docker, host: str, pid: str) -> dict[str, str]:
    lines = docker.exec(host, "cat", f"/proc/{pid}/status").stdout.splitlines()
    return {k: v.strip() for k, _, v in (ln.partition(":") for ln in lines)}


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.machine  # a container, and a veth from the testbed into it
@pytest.mark.timeout(1800)
def test_a_plain_debian_host_runs_the_package_and_a_trial_reaches_it(
    agent_deb: Path, database_url: str, tmp_path: Path
) -> None:
    docker = Docker(docker_env(docker_daemon()))
    host = f"kickass-far-{secrets.token_hex(3)}"
    figures: dict[str, object] = {"package_bytes": agent_deb.stat().st_size}
    try:
        _boot_host(docker, host)
        out, took = _install(docker, host, agent_deb)
        assert out.returncode == 0, out.stdout + out.stderr
        figures["install_s"] = round(took, 1)
        assert "digest " + hashlib.sha256(agent_deb.read_bytes()).hexdigest() in out.stdout
        assert "a new agent secret is in /etc/kickass-agent/secret" in out.stdout
        assert re.search(r"runs: control API 8700/tcp, TCP flows 8701/tcp, Kick-Ass flows "
                         r"8702/udp \(ka-agent-recv ", out.stdout), out.stdout  # fmt: skip
        secret = docker.exec(host, "cat", "/etc/kickass-agent/secret").stdout.strip()
        assert docker.exec(host, "stat", "-c", "%a %U", "/etc/kickass-agent/secret").stdout == (
            "600 root\n"
        )
        # The unit as written, on this host's systemd.
        verify = docker.exec(host, "systemd-analyze", "verify", UNIT, check=False)
        assert verify.returncode == 0 and not verify.stdout + verify.stderr, verify

        # The agent and its receiver: a dynamic user, CAP_NET_RAW and nothing
        # else, the secret from the unit's credential directory.
        main = docker.exec(host, "systemctl", "show", "-P", "MainPID", UNIT).stdout.strip()
        children = docker.exec(host, "sh", "-c", f"cat /proc/{main}/task/*/children").stdout.split()
        assert len(children) == 1, children
        cmdline = docker.exec(host, "cat", f"/proc/{main}/cmdline").stdout.split("\0")
        assert cmdline[cmdline.index("--secret-file") + 1] == (f"/run/credentials/{UNIT}/secret"), (
            cmdline
        )
        for pid in (main, children[0]):
            status = _status(docker, host, pid)
            uid = int(status["Uid"].split()[0])
            assert uid in DYNAMIC_UIDS and set(status["Uid"].split()) == {str(uid)}, status
            for caps in ("CapEff", "CapPrm", "CapBnd", "CapAmb"):
                assert int(status[caps], 16) == CAP_NET_RAW, (pid, caps, status[caps])
            assert status["NoNewPrivs"] == "1"
        assert docker.exec(host, "cat", f"/proc/{children[0]}/comm").stdout.strip() == (
            "ka-agent-recv"
        )

        # Installed again: the same secret, the agent back up.
        again, _ = _install(docker, host, agent_deb)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "new agent secret" not in again.stdout
        assert docker.exec(host, "cat", "/etc/kickass-agent/secret").stdout.strip() == secret

        # A paired trial from this machine through ka-router and the WAN to it.
        t0 = time.monotonic()
        outcome, said = trial_to_deployed(
            database_url, tmp_path / "trial", "far-deb",
            plug=lambda tb: plug_into_far(tb, docker.pid(host)), secret=lambda: secret + "\n",
        )  # fmt: skip
        figures["trial_s"] = round(time.monotonic() - t0, 1)
        assert "far-deb" in said and "ok  agent 0.1.0, ka-agent-recv 0.1.0" in said, said
        assert "path MTU >= 1500" in said, said
        figures.update(assert_paired_trial_stored(outcome, "far-deb"))
        used = docker.exec(host, "cat", "/var/lib/kickass-agent/used-tokens").stdout
        assert used.count("\n") >= figures["kickass_flows"], used

        # An upgrade (a newer version of the same sources) keeps the secret and the state.
        version = subprocess.run(
            ["dpkg-deb", "-f", str(agent_deb), "Version"], capture_output=True, text=True,
            check=True,
        ).stdout.strip()  # fmt: skip
        newer = build_deb(tmp_path / "newer", version=f"{version}.1")
        up, _ = _install(docker, host, newer)
        assert up.returncode == 0, up.stdout + up.stderr
        installed = docker.exec(host, "dpkg-query", "-W", "-f", "${Version}", "kickass-agent")
        assert installed.stdout == f"{version}.1"
        assert docker.exec(host, "cat", "/etc/kickass-agent/secret").stdout.strip() == secret
        assert docker.exec(host, "cat", "/var/lib/kickass-agent/used-tokens").stdout == used
    except BaseException:
        print(docker.exec(host, "journalctl", "-u", UNIT, "--no-pager", "-n", "60",
                          check=False).stdout)  # fmt: skip
        raise
    finally:
        docker.run("rm", "-f", "-v", host, check=False)
    print("deployed receiver:", figures)


@pytest.mark.slow
@pytest.mark.machine  # a container
@pytest.mark.timeout(900)
def test_install_on_a_host_without_cap_net_raw_fails_saying_why(agent_deb: Path) -> None:
    """A bare Debian (debootstrap's minbase: no Python yet; apt fetches it) in a
    container without CAP_NET_RAW, as some hosting gives: the receiver cannot
    read leading fragments there, so the install must not pass for a success."""
    docker = Docker(docker_env(docker_daemon()))
    host = f"kickass-noraw-{secrets.token_hex(3)}"
    try:
        docker.run("run", "-d", "--name", host, "--network", "host", "--cap-drop", "NET_RAW",
                   "debian:bookworm", "sleep", "infinity")  # fmt: skip
        out, took = _install(docker, host, agent_deb)
        print(f"install without CAP_NET_RAW: exit {out.returncode} after {took:.1f} s")
        assert out.returncode == 1, out.stdout + out.stderr
        assert "this host does not grant CAP_NET_RAW" in out.stderr, out.stderr
        assert re.search(r"ERROR: kickass-agent \S+ could not be installed", out.stderr)
        state = docker.exec(host, "dpkg-query", "-W", "-f", "${db:Status-Status}",
                            "kickass-agent").stdout  # fmt: skip
        assert state == "half-configured", state  # not "installed"
    finally:
        docker.run("rm", "-f", "-v", host, check=False)
