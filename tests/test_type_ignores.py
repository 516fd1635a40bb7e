"""Every ``type: ignore`` outside tests/ names its error code and says why on
the same line (issue 26): ``# type: ignore[code]  # why``.

A bare ignore hides every error on its line, this one and the next one
written there; the code limits it to the error meant, and the reason lets
the next reader judge whether it still holds (mypy's warn_unused_ignores,
part of strict, reports one that no longer suppresses anything). Comments
are found with ``tokenize``, so the words inside a string do not count.
"""

from __future__ import annotations

import io
import os
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What the tools make, and the tests (their ignores are checked by mypy alone).
PRUNED = {".git", ".venv", "target", "build", "__pycache__", "node_modules", "tests"}
IGNORE = re.compile(r"type:\s*ignore")
EXPLAINED = re.compile(r"^# type: ignore\[[a-z-]+(, [a-z-]+)*\]  # \S")


def python_files(root: Path = ROOT) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in PRUNED and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath, name)


def unexplained(source: str) -> list[tuple[int, str]]:
    """(line, comment) of each ignore without a code and a reason."""
    return [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
        and IGNORE.search(tok.string)
        and not EXPLAINED.match(tok.string)
    ]


def test_the_check_finds_bare_and_unexplained_ignores() -> None:
    source = (
        "a = f()  # type: ignore\n"
        "b = f()  # type: ignore[arg-type]\n"
        "c = f()  # type: ignore[arg-type]  #\n"
        "d = f()  # type: ignore  # no code\n"
        "e = f()  # type: ignore[arg-type]  # the stubs want a Literal\n"
        "g = f()  # type: ignore[arg-type, union-attr]  # both, from the same call\n"
        "h = 'type: ignore'\n"
    )
    assert [line for line, _ in unexplained(source)] == [1, 2, 3, 4]


def test_every_type_ignore_outside_tests_has_a_code_and_a_reason() -> None:
    sources = {path: path.read_text(encoding="utf-8") for path in python_files()}
    found = [
        f"{path.relative_to(ROOT)}:{line}: {comment}"
        for path, source in sources.items()
        if IGNORE.search(source)  # tokenize only the files that may hold one
        for line, comment in unexplained(source)
    ]
    assert not found, "write `# type: ignore[code]  # why`:\n" + "\n".join(found)
