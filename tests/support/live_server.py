"""A real `kickass server` process on loopback, for tests in several rooms."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

KICKASS = str(Path(sys.executable).parent / "kickass")


def free_port(kind: int) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server(
    database_url: str, probe_port: int, http_port: int, *, schedule_file: Path | None = None
) -> Iterator[subprocess.Popen]:
    """``schedule_file``: the schedule runner hosts' claims are judged by (none: no
    runner may claim a scheduled run)."""
    journal = tempfile.mkdtemp(prefix="kickass-journal-")
    proc = subprocess.Popen(
        [
            KICKASS,
            "server",
            "--listen",
            f"127.0.0.1:{http_port}",
            "--probe-bind",
            "127.0.0.1",
            "--probe-port",
            str(probe_port),
            "--database-url",
            database_url,
            "--journal-dir",
            journal,
            *(["--schedule-file", str(schedule_file)] if schedule_file else []),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_http(http_port, proc)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(journal, ignore_errors=True)


def _wait_http(port: int, proc: subprocess.Popen, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}: {proc.stderr.read()}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/health", timeout=1).read()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError("server did not answer in time")
