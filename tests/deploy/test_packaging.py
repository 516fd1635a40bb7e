"""The platform installs itself: system packages, Python packages, the operator command.

- ``tools/setup-system.sh`` finds every missing program on a machine that has
  none of them (a PATH and a root folder without them) and names the Debian
  packages; without apt-get it stops with a clear message listing them.
- The volunteer client installs into an empty virtual environment without
  Flask, scapy or SQLAlchemy.
- The kickass-db wheel carries its migrations, so an installed server finds
  them with no path variable.
- ``kickass --help`` lists every subcommand the installed packages register.
- A trial runner's host (issue 15): a fresh virtual environment with only the
  core and wan-agents wheels, built and installed offline, has a working
  ``kickass`` (under ``env -i``) that lists ``trials``, and no kickass_db.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

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


def _key(name: str) -> str:
    """A distribution's name, normalised (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def _wheel_of_installed(name: str, out: Path) -> Path:
    """The wheel of a distribution installed here (a dependency of ours),
    rebuilt from its RECORD: how a host without an index gets it."""
    dist = importlib.metadata.distribution(name)
    files = [f for f in dist.files or () if "__pycache__" not in f.parts]
    assert files and not any(f.parts[0] == ".." for f in files), (name, "files outside")
    (info,) = {f.parts[0] for f in files if f.parts[0].endswith(".dist-info")}
    skip = {f"{info}/{n}" for n in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json")}
    tag = next(
        ln.split(":", 1)[1].strip()
        for ln in (dist.read_text("WHEEL") or "").splitlines()
        if ln.startswith("Tag:")
    )
    stem = re.sub(r"[-_.]+", "_", dist.metadata["Name"])
    wheel = out / f"{stem}-{dist.version}-{tag}.whl"
    record = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        for f in files:
            if f.as_posix() in skip:
                continue
            data = Path(str(dist.locate_file(f))).read_bytes()
            z.writestr(f.as_posix(), data)
            record.append(f"{f.as_posix()},{_record_hash(data)},{len(data)}")
        record.append(f"{info}/RECORD,,")
        z.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return wheel


def _requirements(wheel: Path) -> list[Requirement]:
    """A wheel's run-time requirements (without extras) on this system."""
    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        text = z.read(meta).decode()
    reqs = [
        Requirement(ln.split(":", 1)[1])
        for ln in text.splitlines()
        if ln.startswith("Requires-Dist:")
    ]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


@pytest.mark.slow
def test_a_runner_host_with_core_and_wan_agents_only_has_the_kickass_command(
    tmp_path: Path,
) -> None:
    """Issue 15: "installing only core and wan-agents gives a working
    `kickass --help` (run under `env -i`) that lists `trials`, and `import
    kickass_db` fails there". No network: our wheels are built here (the
    build backend from this environment), the dependencies' wheels rebuilt
    from what is installed here, and pip installs with --no-index."""
    if importlib.util.find_spec("hatchling") is None:
        pytest.fail("hatchling, the packages' build backend, is missing: `make install`")
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-index",
         "--no-build-isolation", "-w", str(wheels), str(REPO / "core"), str(REPO / "wan-agents")],
        check=True, timeout=600,
    )  # fmt: skip
    ours = {_key(w.name.split("-")[0]): w for w in wheels.glob("*.whl")}
    assert set(ours) == {"kickass-core", "kickass-wan"}, ours
    # The dependencies, and theirs: each one's wheel, from this environment.
    todo = [r for w in ours.values() for r in _requirements(w)]
    done: set[str] = set()
    while todo:
        req = todo.pop()
        key = _key(req.name)
        if key in done or key in ours:
            continue
        done.add(key)
        wheel = _wheel_of_installed(req.name, wheels)
        todo += _requirements(wheel)
    assert {"pydantic", "pydantic-core", "prometheus-client"} <= done, done
    assert not {"kickass-db", "sqlalchemy", "flask"} & done, done

    venv = tmp_path / "runner-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = str(venv / "bin" / "pip")
    subprocess.run(
        [pip, "install", "--quiet", "--no-index", "--find-links", str(wheels),
         "kickass-core", "kickass-wan"],
        check=True, timeout=600,
    )  # fmt: skip
    check = subprocess.run([pip, "check"], capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    frozen = subprocess.run([pip, "freeze"], capture_output=True, text=True, check=True).stdout
    installed = {_key(ln.split("==")[0]) for ln in frozen.split()}
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
