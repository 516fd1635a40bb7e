#!/usr/bin/env python3
"""Build kickass-probe.pyz: the volunteer client in one file, for any Python 3.9+.

    python probe-client/build_zipapp.py [--output PATH] [--root REPO]

(``make zipapp``; ``make install`` runs it). The archive holds the sources of
``kickass_core`` and ``kickass_probe`` (pure Python, nothing compiled; no
rich: the one-file client draws its progress bar with the standard library)
and a ``__main__.py``, behind the interpreter line ``#!/usr/bin/env python3``:

    python3 kickass-probe.pyz --server URL

It is reproducible: the modules go into a zip in sorted order, each with
one fixed time (1980-01-01, the zip epoch), mode and system, nothing taken
from the checkout (times, umask, directory order, time zone); the standard
library's ``zipapp`` then puts the interpreter line in front. The same
sources give the same bytes (with the same zlib: the archive is deflated).
The file is replaced atomically, so a server serving it never sends half of
one. Standard library only; runs on Python 3.9+ like what it builds.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import io
import os
import sys
import zipapp
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = Path(".venv/share/kickass/kickass-probe.pyz")
INTERPRETER = "/usr/bin/env python3"
# (folder in the repository, package name in the archive)
PACKAGES = (("core/kickass_core", "kickass_core"), ("probe-client/kickass_probe", "kickass_probe"))
OLDEST_PYTHON = (3, 9)
# Every entry's metadata, whatever the checkout: the zip epoch, a regular
# file readable by all, made on Unix.
FIXED_DATE_TIME = (1980, 1, 1, 0, 0, 0)
FILE_ATTR = 0o100644 << 16
UNIX = 3

MAIN = """\
# kickass-probe.pyz: the Kick-Ass volunteer client in one file.
#   python3 kickass-probe.pyz --server URL
# Built by probe-client/build_zipapp.py from kickass_core and kickass_probe.
import sys

if sys.version_info < (3, 9):
    sys.stderr.write(
        "ERROR: kickass-probe needs Python 3.9 or newer; this is Python %d.%d\\n"
        "hint: install a newer Python 3 and run: python3 kickass-probe.pyz --server URL\\n"
        % tuple(sys.version_info[:2])
    )
    sys.exit(2)

from kickass_probe.cli import main  # noqa: E402

# use_rich=False: only what this file carries and the standard library run,
# whatever packages this Python has installed.
sys.exit(main(use_rich=False))
"""


class BuildError(Exception):
    """A source tree the archive cannot be built from."""


def sources(root: Path) -> list[tuple[str, Path]]:
    """(name in the archive, file) of every module, sorted; .py files only."""
    out: list[tuple[str, Path]] = []
    for folder, package in PACKAGES:
        src = root / folder
        if not (src / "__init__.py").is_file():
            raise BuildError(f"{src} is not a package (no __init__.py)")
        for path in sorted(src.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            out.append((f"{package}/{path.relative_to(src).as_posix()}", path))
    return out


def check_syntax(name: str, source: bytes) -> None:
    """Refuse a module that Python 3.9 cannot parse (match, except*, ...)."""
    version = f"{OLDEST_PYTHON[0]}.{OLDEST_PYTHON[1]}"
    try:
        ast.parse(source, filename=name, feature_version=OLDEST_PYTHON)
    except SyntaxError as exc:
        raise BuildError(
            f"{name}:{exc.lineno}: not Python {version} syntax ({exc.msg}); "
            "the one-file client must run there"
        ) from None
    except ValueError as exc:  # e.g. a NUL byte
        raise BuildError(f"{name}: not Python source ({exc})") from None


def archive(root: Path) -> bytes:
    """The zip (without the interpreter line) of the modules and __main__.py."""
    files: list[tuple[str, bytes]] = [(name, path.read_bytes()) for name, path in sources(root)]
    files.append(("__main__.py", MAIN.encode("utf-8")))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in sorted(files):
            check_syntax(name, data)
            info = zipfile.ZipInfo(name, date_time=FIXED_DATE_TIME)
            info.external_attr = FILE_ATTR
            info.create_system = UNIX
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    return buf.getvalue()


def build(output: Path, root: Path = ROOT) -> tuple[Path, int, str]:
    """Write the archive to ``output``; returns (path, size, sha256)."""
    output = output.resolve()
    data = archive(root)
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.{os.getpid()}.partial")
    try:
        # zipapp copies an existing archive behind the interpreter line.
        zipapp.create_archive(io.BytesIO(data), partial, interpreter=INTERPRETER)
        os.chmod(partial, 0o755)
        os.replace(partial, output)
    finally:
        if partial.exists():
            partial.unlink()
    written = output.read_bytes()
    return output, len(written), hashlib.sha256(written).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Build kickass-probe.pyz, the volunteer client in one file (Python 3.9+)."
    )
    parser.add_argument(
        "--output",
        "-o",
        type=Path,
        default=ROOT / DEFAULT_OUTPUT,
        help=f"where to write it (default: {DEFAULT_OUTPUT} in the repository)",
    )
    parser.add_argument(
        "--root", type=Path, default=ROOT, help="the repository to build from (default: this one)"
    )
    args = parser.parse_args(argv)
    try:
        path, size, digest = build(args.output, args.root)
    except (BuildError, OSError) as exc:
        print(f"ERROR: cannot build kickass-probe.pyz: {exc}", file=sys.stderr)
        return 1
    print(f"zipapp: {path} ({size:,} bytes, sha256 {digest})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
