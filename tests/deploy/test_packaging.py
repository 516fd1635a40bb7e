"""The platform installs itself: system packages, Python packages, the operator command.

- ``tools/setup-system.sh`` finds every missing program on a machine that has
  none of them (a PATH and a root folder without them) and names the Debian
  packages; without apt-get it stops with a clear message listing them.
- The volunteer client installs into an empty virtual environment without
  Flask, scapy or SQLAlchemy.
- The kickass-db wheel carries its migrations, so an installed server finds
  them with no path variable.
- ``kickass --help`` lists every subcommand the installed packages register.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

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
    "iperf3",
    "docker-compose",
    "docker.io",
    "debootstrap",
    "postgresql",
    "pypy3",
    "cron",
    "systemd",
    "chromium",
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
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = venv / "bin" / "pip"
    subprocess.run(
        [str(pip), "install", "--quiet", str(REPO / "core"), str(REPO / "probe-client")],
        check=True,
        timeout=600,
    )
    frozen = subprocess.run(
        [str(pip), "freeze"], capture_output=True, text=True, check=True
    ).stdout.lower()
    for heavy in ("flask", "scapy", "sqlalchemy", "psycopg", "alembic", "waitress"):
        assert heavy not in frozen, frozen
    out = subprocess.run(
        [str(venv / "bin" / "kickass-probe"), "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "--server" in out.stdout


@pytest.mark.slow
def test_db_wheel_carries_its_migrations(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "-w",
            str(tmp_path),
            str(REPO / "db"),
        ],
        check=True,
        timeout=600,
    )
    (wheel,) = tmp_path.glob("kickass_db-*.whl")
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
