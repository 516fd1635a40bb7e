"""The platform installs itself: system packages, Python packages, the operator command.

- ``tools/setup-system.sh`` finds every missing program on a machine that has
  none of them (a PATH and a root folder without them) and names the Debian
  packages; without apt-get it stops with a clear message listing them.
- The volunteer client installs into an empty virtual environment without
  Flask, scapy or SQLAlchemy (built and installed offline: tests/support/wheels.py).
- The kickass-db wheel carries its migrations, so an installed server finds
  them with no path variable.
- ``kickass --help`` lists every subcommand the installed packages register.
- A trial runner's host (issue 15): a fresh virtual environment with only the
  core and wan-agents wheels, built and installed offline, has a working
  ``kickass`` (under ``env -i``) that lists ``trials``, and no kickass_db.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from support.wheels import build_ours, install_offline, wheelhouse

REPO = Path(__file__).resolve().parents[2]
SETUP = REPO / "tools" / "setup-system.sh"
ALL_PACKAGES = {
    "iproute2",
    "nftables",
    "ethtool",
    "tcpdump",
    "iputils-ping",
    "procps",
    "util-linux",
    "mount",
    "iperf3",
    "docker-compose",
    "docker.io",
    "debootstrap",
    "postgresql",
    "pypy3",
    "cron",
    "systemd",
    "dpkg-dev",
    "chromium",
    "openjdk-17-jre-headless",
}


def _bare_path(tmp_path: Path, keep: tuple[str, ...] = ()) -> str:
    """A PATH with only a shell's basics (and ``keep``): a freshly installed machine."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "sed", "id", "mktemp", "rm", "tail", *keep):
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    return str(bin_dir)


def _setup(tmp_path: Path, *args: str, keep: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {"PATH": _bare_path(tmp_path, keep), "SETUP_SYSROOT": str(tmp_path / "root")}
    return subprocess.run(
        ["bash", str(SETUP), *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_setup_check_names_every_package_a_fresh_machine_lacks(tmp_path: Path) -> None:
    proc = _setup(tmp_path, "--check")
    assert proc.returncode == 1, proc.stderr
    line = proc.stdout.strip()
    assert line.startswith("setup: missing system packages:")
    assert set(line.removeprefix("setup: missing system packages:").split()) == ALL_PACKAGES


def test_setup_lists_every_program_that_code_or_tests_start() -> None:
    listed = subprocess.run(
        ["bash", str(SETUP), "--list"], capture_output=True, text=True, check=True
    ).stdout.split()
    # Programs started by name anywhere in the Python code or tests.
    import re

    started: set[str] = set()
    for path in [
        *REPO.glob("*/kickass_*/*.py"),
        *REPO.glob("tests/*.py"),
        *REPO.glob("bench/*.py"),
    ]:
        for m in re.finditer(
            r'\[\s*"(ip|tc|nft|ethtool|tcpdump|ping|sysctl|iperf3|docker-compose|setpriv)"',
            path.read_text(),
        ):
            started.add(m.group(1))
    assert started, "the scan found nothing: the pattern is broken"
    assert started <= set(listed), started - set(listed)


def test_setup_without_apt_is_a_clear_error(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the non-Debian branch is reached only as root")
    proc = _setup(tmp_path)
    assert proc.returncode == 1
    assert "not a Debian system" in proc.stderr
    for pkg in ALL_PACKAGES:
        assert pkg in proc.stderr


def test_setup_is_silent_when_everything_is_present() -> None:
    proc = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == ""


@pytest.mark.slow
def test_volunteer_client_installs_without_server_dependencies(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    ours, deps = wheelhouse(["core", "probe-client"], wheels)
    installed = install_offline(tmp_path / "venv", wheels, sorted(ours))
    assert installed == deps | set(ours), installed
    for heavy in ("flask", "scapy", "sqlalchemy", "psycopg", "alembic", "waitress"):
        assert heavy not in installed, installed
    out = subprocess.run(
        [str(tmp_path / "venv" / "bin" / "kickass-probe"), "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "--server" in out.stdout


@pytest.mark.slow
def test_db_wheel_carries_its_migrations(tmp_path: Path) -> None:
    (wheel,) = build_ours(["db"], tmp_path).values()
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "kickass_db/migrations/env.py" in names
    versions = {n for n in names if n.startswith("kickass_db/migrations/versions/")}
    assert len(versions) == len(list((REPO / "db" / "migrations" / "versions").glob("0*.py")))


def test_kickass_help_lists_every_registered_subcommand() -> None:
    out = subprocess.run(
        [str(Path(sys.executable).parent / "kickass"), "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for command in ("db", "telemetry", "server", "demo", "testbed"):
        assert f"    {command}" in out, out


@pytest.mark.slow
def test_a_runner_host_with_core_and_wan_agents_only_has_the_kickass_command(
    tmp_path: Path,
) -> None:
    """Issue 15: "installing only core and wan-agents gives a working
    `kickass --help` (run under `env -i`) that lists `trials`, and `import
    kickass_db` fails there". No network: our wheels are built here (the
    build backend from this environment), the dependencies' wheels rebuilt
    from what is installed here, and pip installs with --no-index."""
    wheels = tmp_path / "wheels"
    ours, done = wheelhouse(["core", "wan-agents"], wheels)
    assert set(ours) == {"kickass-core", "kickass-wan"}, ours
    assert {"pydantic", "pydantic-core", "prometheus-client"} <= done, done
    assert not {"kickass-db", "sqlalchemy", "flask"} & done, done
    venv = tmp_path / "runner-venv"
    installed = install_offline(venv, wheels, ["kickass-core", "kickass-wan"])
    assert installed == done | {"kickass-core", "kickass-wan"}, installed

    def bare(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["env", "-i", *argv], capture_output=True, text=True, timeout=60, cwd=tmp_path
        )

    kickass = str(venv / "bin" / "kickass")
    top = bare(kickass, "--help")
    assert top.returncode == 0, top.stderr
    commands = {
        m.group(1): m.group(2) for m in re.finditer(r"^    (\w[\w-]*)\s*(.*)$", top.stdout, re.M)
    }
    assert "trials" in commands, top.stdout
    assert "unavailable" not in commands["trials"], top.stdout  # imported, not just listed
    assert not {"db", "server"} & set(commands), top.stdout  # their packages are not here
    trials = bare(kickass, "trials", "--help")
    assert trials.returncode == 0 and "run" in trials.stdout, trials.stderr
    probe = bare(str(venv / "bin" / "python"), "-c", "import kickass_db")
    assert probe.returncode != 0 and "No module named 'kickass_db'" in probe.stderr, probe
