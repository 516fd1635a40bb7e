"""Publishing a file once: how exports (and the archive) give a file its final name.

A file is written under a hidden partial name in the folder it is published
to, ``.<final name>.partial-<tag>`` (the tag names the attempt writing it),
forced to disk, and then given its final name by a hard link, which never
replaces a file already there; the folder is forced to disk after. Of any
number of attempts at one name exactly one publishes, and no reader ever
sees a final name with half a file behind it.

The final name is the caller's, and says what the file holds (an export's
window), never when it was written: an attempt that redoes a dead one's work
finds the file already published (``publish`` answers False) instead of
publishing a copy beside it. A killed attempt leaves at most its partial
files; ``sweep`` removes those of attempts the caller knows are dead (the
scheduled export does so when it takes over a run).

A folder of files that must appear together (an archived day: its Parquet
files and its manifest) is published the same way as one: written as a
hidden partial folder, every file and the folder forced to disk, then
renamed to its final name (``publish_dir``), so no file is ever under a
final name without the manifest that describes it.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

PARTIAL = ".partial-"
# A tag is part of a file name: short, and nothing a shell or a glob treats specially.
TAG = re.compile(r"[A-Za-z0-9_]{1,40}")


def partial_path(final: Path, tag: str) -> Path:
    """The hidden name ``final`` is written under by the attempt ``tag``."""
    if not TAG.fullmatch(tag):
        raise ValueError(f"not a partial file tag: {tag!r}")
    return final.with_name(f".{final.name}{PARTIAL}{tag}")


def partial_of(path: Path) -> tuple[str, str] | None:
    """(final name, tag) of a partial file's name; None for any other file."""
    name = path.name
    if not name.startswith("."):
        return None
    final, sep, tag = name[1:].rpartition(PARTIAL)
    if not sep or not final or not TAG.fullmatch(tag):
        return None
    return final, tag


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """The folder's entries on disk (a new name survives a crash)."""
    fsync_file(path)


def publish(partial: Path, final: Path, *, replace: bool = False) -> bool:
    """``partial`` (complete) under its final name: True once done; False if a
    file is already published there (another attempt's: the caller's copy is
    not needed). ``replace``: a file there is replaced instead (by a rename,
    atomic too), for one the caller knows is an orphan of a dead attempt.
    The partial file stays for the caller to remove (it does, in a
    ``finally``, whatever happened)."""
    fsync_file(partial)
    if replace:
        os.replace(partial, final)
    else:
        try:
            os.link(partial, final)
        except FileExistsError:
            return False
    fsync_dir(final.parent)
    return True


def publish_dir(partial: Path, final: Path) -> bool:
    """The folder ``partial`` (complete: its files written and closed) under its
    final name at once: True once done; False if a folder is already there
    (nothing is replaced; the partial folder stays for the caller to remove)."""
    for path in partial.iterdir():
        fsync_file(path)
    fsync_dir(partial)
    if final.exists():
        return False
    try:
        # A rename onto an empty folder would replace it; onto anything else it fails.
        os.rename(partial, final)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            return False
        raise
    fsync_dir(final.parent)
    return True


@dataclass
class Swept:
    """The partial files a sweep removed."""

    files: list[str] = field(default_factory=list)
    bytes: int = 0

    def to_json(self) -> dict[str, object]:
        return {"files": self.files, "bytes": self.bytes}


def sweep(directory: Path, dead: Callable[[str], bool]) -> Swept:
    """Remove the partial files (and partial folders) of ``directory`` whose
    tag ``dead(tag)`` says belongs to an attempt that will never finish them."""
    out = Swept()
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return out
    for path in sorted(entries):
        found = partial_of(path)
        if found is None or not dead(found[1]):
            continue
        try:
            if path.is_dir() and not path.is_symlink():
                size = sum(f.lstat().st_size for f in path.rglob("*"))
                shutil.rmtree(path)
            else:
                size = path.lstat().st_size
                path.unlink()
        except FileNotFoundError:
            continue  # another sweep had it
        out.files.append(path.name)
        out.bytes += size
    if out.files:
        fsync_dir(directory)
    return out
