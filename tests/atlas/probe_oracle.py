"""The real RIPE Atlas probe's ping (``busybox evping``) as a test oracle.

``../shared/oracles/ripe-atlas-probe`` (beside the repository) holds a
snapshot of the RIPE Atlas software probe's source and a build of its
busybox; its README says how to run ``evping``. The project never copies
that code (GPL): tests run the binary. A test that needs it *fails* when it
is missing — a missing oracle must never read as a passing suite.

``busybox()`` is the prebuilt binary if ``busybox evping --help`` runs here,
else the one ``build.sh`` builds (once per session, into a temp directory).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
ORACLE = Path(
    os.environ.get("KICKASS_ATLAS_ORACLE", REPO.parent / "shared/oracles/ripe-atlas-probe")
)
# evping refuses private, loopback and documentation targets unless told.
ENV = {"ATLAS_DISABLE_CHECK_ADDR": "yes"}


def _runs(binary: Path) -> bool:
    try:
        p = subprocess.run(
            [str(binary), "evping", "--help"], capture_output=True, text=True, timeout=20
        )
    except OSError:
        return False
    return "Usage: evping" in p.stdout + p.stderr


@functools.cache
def busybox() -> Path:
    """The probe's busybox; fails the test (never skips) when there is none."""
    prebuilt = ORACLE / "bin" / "busybox"
    if not ORACLE.is_dir():
        pytest.fail(
            f"the RIPE Atlas probe oracle is missing: {ORACLE} (see ../shared/oracles/README); "
            "these tests check the Atlas path against the real probe firmware and must not "
            "pass without it"
        )
    if _runs(prebuilt):
        return prebuilt
    out = Path(tempfile.mkdtemp(prefix="kickass-evping-"))
    p = subprocess.run(
        [str(ORACLE / "build.sh"), str(out)], capture_output=True, text=True, timeout=900
    )
    lines = p.stdout.strip().splitlines()
    built = Path(lines[-1]) if p.returncode == 0 and lines else None
    if built is None or not _runs(built):
        pytest.fail(
            f"the prebuilt evping does not run here and build.sh failed ({p.returncode}): "
            f"{(p.stderr or p.stdout)[-1500:]}"
        )
    return built


def argv(target: str, size: int, packets: int, interval_ms: int, msm_id: int) -> list[str]:
    """One run of the probe's ping, as an Atlas measurement would schedule it."""
    return [
        str(busybox()),
        "evping",
        "-4",
        "-e",
        "-c",
        str(packets),
        "-s",
        str(size),
        "-i",
        str(interval_ms),
        "-A",
        str(msm_id),
        target,
    ]


def result_line(stdout: str) -> dict[str, Any]:
    """The probe's result: the JSON after ``RESULT `` (other lines may come first)."""
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            parsed: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return parsed
    raise AssertionError(f"evping printed no RESULT line: {stdout[-500:]!r}")
