"""Where the Rust programs (RUST_BINARIES) are found: one place.

First the virtualenv's bin directory, where `make install` copies them;
else ``target/release`` of the repository's Cargo workspace (a source
checkout after ``cargo build --release --workspace``). Nothing here builds:
`make install` (and so `make test`) rebuilds them when the sources changed.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kickass_core.errors import KickassError

RUST_BINARIES = ("ka-router", "ka-linkem", "ka-blast", "ka-agent-recv", "ka-send")

# testbed/kickass_testbed/binaries.py -> the repository root, in a source checkout.
_REPO = Path(__file__).resolve().parents[2]


def search_path() -> list[Path]:
    """The directories looked in, in order."""
    # Not resolved: the venv's python is a symlink out of the venv.
    dirs = [Path(sys.executable).parent]
    if (_REPO / "Cargo.toml").exists():
        dirs.append(_REPO / "target" / "release")
    return dirs


def rust_binary(name: str) -> Path:
    for d in search_path():
        path = d / name
        if path.is_file():
            return path
    raise KickassError(
        f"{name} not found in {', '.join(map(str, search_path()))}",
        hint="run `make install` (or `cargo build --release --workspace` at the repository root)",
    )
