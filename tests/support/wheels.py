"""Installing our packages the way a host without a package index would.

Our wheels are built here with the build backend of this environment
(``--no-index --no-build-isolation``); every dependency's wheel, and theirs,
is rebuilt from the files installed here (its RECORD). A test then installs
them with ``pip --no-index``: no traffic leaves the machine, and what it
installs is exactly what the packages declare.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]


def key(name: str) -> str:
    """A distribution's name, normalised (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def wheel_of_installed(name: str, out: Path) -> Path:
    """The wheel of a distribution installed here (a dependency of ours),
    rebuilt from its RECORD: how a host without an index gets it."""
    dist = importlib.metadata.distribution(name)
    # Files outside site-packages are the console scripts pip wrote from
    # entry_points.txt: it writes them again when it installs this wheel.
    files = [f for f in dist.files or () if "__pycache__" not in f.parts and f.parts[0] != ".."]
    assert files, name
    (info,) = {f.parts[0] for f in files if f.parts[0].endswith(".dist-info")}
    skip = {f"{info}/{n}" for n in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json")}
    # Every Tag line, compressed into the file name (py2-none-any and
    # py3-none-any: py2.py3-none-any), or pip would not take it for py3.
    tags = [
        ln.split(":", 1)[1].strip().split("-")
        for ln in (dist.read_text("WHEEL") or "").splitlines()
        if ln.startswith("Tag:")
    ]
    tag = "-".join(".".join(dict.fromkeys(t[i] for t in tags)) for i in range(3))
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


def requirements(wheel: Path) -> list[Requirement]:
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


def build_ours(folders: list[str], out: Path) -> dict[str, Path]:
    """Our packages' wheels (``folders`` under the repository), offline."""
    if importlib.util.find_spec("hatchling") is None:
        pytest.fail("hatchling, the packages' build backend, is missing: `make install`")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-index",
         "--no-build-isolation", "-w", str(out), *(str(REPO / f) for f in folders)],
        check=True, timeout=600,
    )  # fmt: skip
    return {key(w.name.split("-")[0]): w for w in out.glob("*.whl")}


def wheelhouse(folders: list[str], out: Path) -> tuple[dict[str, Path], set[str]]:
    """Our wheels and every dependency's, transitively, in ``out``: (ours by
    name, the dependencies' names)."""
    ours = build_ours(folders, out)
    todo = [r for w in ours.values() for r in requirements(w)]
    deps: set[str] = set()
    while todo:
        req = todo.pop()
        k = key(req.name)
        if k in deps or k in ours:
            continue
        deps.add(k)
        todo += requirements(wheel_of_installed(req.name, out))
    return ours, deps


def install_offline(venv: Path, wheels: Path, names: list[str]) -> set[str]:
    """A fresh virtual environment with ``names`` from ``wheels`` only; what
    it holds (pip freeze, normalised names). ``pip check`` must pass."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = str(venv / "bin" / "pip")
    subprocess.run(
        [pip, "install", "--quiet", "--no-index", "--find-links", str(wheels), *names],
        check=True, timeout=600,
    )  # fmt: skip
    check = subprocess.run([pip, "check"], capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    frozen = subprocess.run([pip, "freeze"], capture_output=True, text=True, check=True).stdout
    return {key(ln.split("==")[0]) for ln in frozen.split()}
