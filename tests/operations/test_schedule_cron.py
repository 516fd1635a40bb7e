"""The line `kickass schedule crontab --install` writes, run as cron runs it.

A throwaway user is made for the test (never root's own crontab); the line
is installed into its crontab, read back, and executed the way cron does:
``/bin/sh -c LINE`` as that user with cron's environment (``PATH=/usr/bin:/bin``,
``HOME``, ``SHELL``, ``LOGNAME`` and nothing else: no virtual environment
activated). The database URL comes from the configuration file the line
names (``KICKASS_CONFIG``), readable by that user only.

The kickass installed for that user is a virtual environment of Debian's own
``/usr/bin/python3`` holding the wheels of core, db and operations (the
development venv's interpreter may live where other users cannot enter, as
pyenv's under /root does here). The test database listens on a Unix socket
in a directory only its owner may enter, so the test forwards a loopback TCP
port to it for the other user.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from support.schedule import item_runs, stable_cron, write_schedule

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("crontab") is None or shutil.which("useradd") is None,
    reason="needs root, crontab and useradd",
)


@contextmanager
def tcp_to_unix(path: str) -> Iterator[int]:
    """127.0.0.1:PORT forwarded to the Unix socket ``path``."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    stop = threading.Event()

    def pipe(a: socket.socket, b: socket.socket) -> None:
        with suppress(OSError):
            while data := a.recv(65536):
                b.sendall(data)
        with suppress(OSError):
            b.shutdown(socket.SHUT_WR)

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            upstream = socket.socket(socket.AF_UNIX)
            upstream.connect(path)
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=pipe, args=(a, b), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        listener.close()


@contextmanager
def throwaway_user() -> Iterator[tuple[str, Path]]:
    name = f"kkcron{secrets.token_hex(3)}"
    home = Path(tempfile.mkdtemp(prefix="kickass-cron-"))
    subprocess.run(
        ["useradd", "--no-create-home", "--home-dir", str(home), "--shell", "/bin/sh",
         "--no-user-group", "--gid", "nogroup", name],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    try:
        uid = pwd.getpwnam(name).pw_uid
        os.chown(home, uid, -1)
        home.chmod(0o755)
        yield name, home
    finally:
        subprocess.run(["crontab", "-u", name, "-r"], capture_output=True, timeout=60)
        subprocess.run(["userdel", name], capture_output=True, timeout=60)
        shutil.rmtree(home, ignore_errors=True)


REPO = Path(__file__).resolve().parents[2]
SYSTEM_PYTHON = "/usr/bin/python3"


def user_venv(home: Path) -> Path:
    """kickass for the cron user: core, db and operations, from wheels."""
    wheels = home / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(wheels),
         str(REPO / "core"), str(REPO / "db"), str(REPO / "operations")],
        check=True, timeout=600,
    )  # fmt: skip
    venv = home / "venv"
    subprocess.run([SYSTEM_PYTHON, "-m", "venv", str(venv)], check=True, timeout=120)
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "--quiet", *map(str, sorted(wheels.glob("*.whl")))],
        check=True, timeout=900,
    )  # fmt: skip
    return venv / "bin" / "kickass"


@pytest.mark.slow
@pytest.mark.skipif(not Path(SYSTEM_PYTHON).exists(), reason="no /usr/bin/python3")
def test_the_installed_cron_line_runs_the_schedule_as_cron_would(database_url: str) -> None:
    parts = urlsplit(database_url)
    socket_dir = parse_qs(parts.query)["host"][0]
    dbname = parts.path.lstrip("/")
    cron, due = stable_cron()
    with throwaway_user() as (user, home), tcp_to_unix(f"{socket_dir}/.s.PGSQL.5432") as port:
        uid = pwd.getpwnam(user).pw_uid
        config = home / "kickass.toml"
        config.write_text(f'database_url = "postgresql://postgres@127.0.0.1:{port}/{dbname}"\n')
        os.chown(config, uid, -1)
        config.chmod(0o600)
        schedule = write_schedule(
            home / "schedule.toml",
            [{"name": "house-by-cron", "kind": "housekeeping", "cron": cron}],
            name="cron-test",
        )
        log_file = home / "log" / "schedule.log"
        (home / "log").mkdir()
        os.chown(home / "log", uid, -1)
        kickass = user_venv(home)
        install = subprocess.run(
            [str(kickass), "schedule", "crontab", str(schedule), "--install", "--user", user,
             "--config", str(config), "--log-file", str(log_file)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert install.returncode == 0, install.stderr
        table = subprocess.run(
            ["crontab", "-u", user, "-l"], capture_output=True, text=True, check=True, timeout=60
        ).stdout
        [line] = [x for x in table.splitlines() if x.startswith("* * * * * ")]
        assert "BEGIN kickass schedule cron-test" in table
        command = line.removeprefix("* * * * * ")
        assert "KICKASS_CONFIG=" in command and "postgresql://" not in command  # no secret
        assert command.split()[1] == str(kickass)  # the kickass that installed it
        # What cron does: /bin/sh -c, as the user, with its minimal environment.
        proc = subprocess.run(
            ["setpriv", f"--reuid={uid}", f"--regid={pwd.getpwnam(user).pw_gid}",
             "--init-groups", "--",
             "env", "-i", "PATH=/usr/bin:/bin", f"HOME={home}", "SHELL=/bin/sh",
             f"LOGNAME={user}", "/bin/sh", "-c", command],
            capture_output=True, text=True, timeout=120, cwd=home,
        )  # fmt: skip
        assert proc.returncode == 0, (proc.stdout, proc.stderr)
        assert proc.stdout == "" and proc.stderr == ""  # nothing for cron to mail
        assert '"event":"finished"' in log_file.read_text()
        [run] = item_runs(database_url)
        assert (run["item"], run["outcome"], run["due_at"]) == ("house-by-cron", "ok", due)
        assert run["host"] == socket.gethostname()
