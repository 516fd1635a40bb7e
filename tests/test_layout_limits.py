"""Size limits of the code (issue 26): no function over 120 lines and no
module over 1,000 lines outside tests, bench/ and the migrations.

A long function is split into named steps, a long module by subject (the
way quinn-proto keeps a large connection livable: one file per concern).
Python is measured with ``ast`` (a function from its ``def`` line to its
last line, docstring and comments included); Rust by a scan that blanks
comments and literals and matches braces (a function from its ``fn`` line
to its closing brace; a file without its ``#[cfg(test)]`` modules, inline
or in their own file). Code under a ``tests`` folder (this one, a crate's
integration tests) is a test and is not measured.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 120
MAX_MODULE_LINES = 1000

# Not measured: tests and benchmarks, the migrations (each a dated record of
# a schema change, never edited), and what the tools make (git's own
# folder, virtual environments, caches, cargo's target/, build/'s packages).
SKIPPED_TOP = {"tests", "bench"}
SKIPPED_PATHS = {Path("db/migrations")}
PRUNED = {".git", ".venv", "target", "build", "__pycache__", "node_modules"}

# What may still exceed a limit, each while the split it waits for is in
# progress: remove an entry when its split lands. Keyed by path (the
# module's size) or path::function (that function's).
ALLOWED: dict[str, str] = {}


@dataclass(frozen=True)
class Span:
    """A function's or a module's measured length."""

    where: str  # path, or path::name
    line: int
    lines: int


def measured_files(root: Path = ROOT) -> Iterator[Path]:
    """Every .py and .rs file the limits apply to, relative to ``root``."""
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        dirnames[:] = sorted(
            d
            for d in dirnames
            if d not in PRUNED
            and not d.startswith(".")
            and d != "tests"
            and not (rel_dir == Path() and d in SKIPPED_TOP)
            and rel_dir / d not in SKIPPED_PATHS
        )
        for name in sorted(filenames):
            if name.endswith((".py", ".rs")):
                yield rel_dir / name


# -- Python ------------------------------------------------------------------


def python_functions(path: str, source: str) -> list[Span]:
    """Every def (methods and nested functions too) with its length."""
    return [
        Span(
            f"{path}::{node.name}", node.lineno, (node.end_lineno or node.lineno) - node.lineno + 1
        )
        for node in ast.walk(ast.parse(source, filename=path))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    ]


# -- Rust --------------------------------------------------------------------

_RAW_STRING = re.compile(r'b?r(#*)"')
_CHAR = re.compile(r"b?'(\\(x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]{1,6}\}|.)|[^\\'\n])'")
_FN = re.compile(r"\bfn\s+([A-Za-z_][A-Za-z0-9_]*)")
_CFG_TEST_MOD = re.compile(
    r"#\s*\[\s*cfg\s*\(\s*test\s*\)\s*\]\s*(?:pub(?:\s*\([^)]*\))?\s+)?mod\s+([A-Za-z_]\w*)\s*([{;])"
)


def blank_rust(source: str) -> str:
    """``source`` with comments, strings and char literals turned to spaces
    (newlines kept), so braces and keywords are only code's."""
    out = list(source)
    i, n = 0, len(source)

    def blank(a: int, b: int) -> None:
        for k in range(a, min(b, n)):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = source[i]
        if source.startswith("//", i):
            end = source.find("\n", i)
            end = n if end < 0 else end
            blank(i, end)
            i = end
        elif source.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if source.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif source.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            blank(i, j)
            i = j
        elif (c in "rb") and (m := _RAW_STRING.match(source, i)) and not _ident(source, i - 1):
            close = '"' + m.group(1)
            end = source.find(close, m.end())
            end = n if end < 0 else end + len(close)
            blank(i, end)
            i = end
        elif c == '"' or (c == "b" and source.startswith('b"', i) and not _ident(source, i - 1)):
            j = i + (2 if c == "b" else 1)
            while j < n and source[j] != '"':
                j += 2 if source[j] == "\\" else 1
            blank(i, j + 1)
            i = j + 1
        elif c in "'b" and (m := _CHAR.match(source, i)) and not _ident(source, i - 1):
            blank(i, m.end())
            i = m.end()
        else:
            i += 1
    return "".join(out)


def _ident(source: str, k: int) -> bool:
    return k >= 0 and (source[k].isalnum() or source[k] == "_")


def _closing_brace(code: str, open_at: int) -> int:
    depth = 0
    for k in range(open_at, len(code)):
        if code[k] == "{":
            depth += 1
        elif code[k] == "}":
            depth -= 1
            if depth == 0:
                return k
    raise ValueError(f"unbalanced braces from offset {open_at}")


def rust_test_modules(code: str) -> tuple[list[tuple[int, int]], list[str]]:
    """The ``#[cfg(test)]`` modules of blanked ``code``: the offsets of the
    inline ones, the names of those in their own file (``mod tests;``)."""
    inline, files = [], []
    for m in _CFG_TEST_MOD.finditer(code):
        if m.group(2) == "{":
            inline.append((m.start(), _closing_brace(code, m.end() - 1)))
        else:
            files.append(m.group(1))
    return inline, files


def rust_functions(path: str, code: str, skip: list[tuple[int, int]]) -> list[Span]:
    """Every fn with a body in blanked ``code`` outside the ``skip`` ranges."""
    spans = []
    for m in _FN.finditer(code):
        if any(a <= m.start() <= b for a, b in skip):
            continue
        # The body's brace: the first { (or ; for a declaration) outside the
        # signature's parentheses and brackets ([u8; 4] holds a ;).
        depth, k = 0, m.end()
        while k < len(code):
            c = code[k]
            if c in "([":
                depth += 1
            elif c in ")]":
                depth -= 1
            elif depth == 0 and c in "{;":
                break
            k += 1
        if k == len(code) or code[k] == ";":
            continue
        first = code.count("\n", 0, m.start()) + 1
        last = code.count("\n", 0, _closing_brace(code, k)) + 1
        spans.append(Span(f"{path}::{m.group(1)}", first, last - first + 1))
    return spans


def rust_module_lines(code: str, skip: list[tuple[int, int]]) -> int:
    lines = code.count("\n") + (0 if code.endswith("\n") else 1)
    for a, b in skip:
        lines -= code.count("\n", a, b) + 1
    return lines


def _module_file(declaring: Path, name: str) -> list[Path]:
    """Where ``mod name;`` in ``declaring`` may live (Rust 2018 paths)."""
    stem = declaring.stem
    base = declaring.parent if stem in ("lib", "main", "mod") else declaring.parent / stem
    return [base / f"{name}.rs", base / name / "mod.rs"]


# -- the whole tree ------------------------------------------------------------


def measure(root: Path = ROOT) -> tuple[list[Span], list[Span]]:
    """(functions, modules) of every measured file under ``root``."""
    functions: list[Span] = []
    modules: list[Span] = []
    rust_test_files: set[Path] = set()
    rust: list[tuple[Path, str, list[tuple[int, int]]]] = []
    for rel in measured_files(root):
        source = (root / rel).read_text(encoding="utf-8")
        if rel.suffix == ".py":
            functions += python_functions(rel.as_posix(), source)
            lines = source.count("\n") + (0 if source.endswith("\n") else 1)
            modules.append(Span(rel.as_posix(), 1, lines))
        else:
            code = blank_rust(source)
            inline, files = rust_test_modules(code)
            for name in files:
                rust_test_files.update(_module_file(rel, name))
            rust.append((rel, code, inline))
    for rel, code, inline in rust:
        if rel in rust_test_files:
            continue
        functions += rust_functions(rel.as_posix(), code, inline)
        modules.append(Span(rel.as_posix(), 1, rust_module_lines(code, inline)))
    return functions, modules


def _allowed(span: Span) -> bool:
    return span.where in ALLOWED


def _listing(spans: list[Span]) -> str:
    rows = []
    for s in sorted(spans, key=lambda s: -s.lines):
        path, _, name = s.where.partition("::")
        rows.append(f"  {path}:{s.line} {name or '(module)'}: {s.lines} lines")
    return "\n".join(rows)


@pytest.fixture(scope="module")
def tree() -> tuple[list[Span], list[Span]]:
    return measure()


def test_no_function_over_120_lines(tree: tuple[list[Span], list[Span]]) -> None:
    functions, _ = tree
    assert len(functions) > 1000  # the scan found the code
    long = [f for f in functions if f.lines > MAX_FUNCTION_LINES and not _allowed(f)]
    assert not long, (
        f"functions over {MAX_FUNCTION_LINES} lines (split each into named steps):\n"
        + _listing(long)
    )


def test_no_module_over_1000_lines(tree: tuple[list[Span], list[Span]]) -> None:
    _, modules = tree
    long = [m for m in modules if m.lines > MAX_MODULE_LINES and not _allowed(m)]
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split by subject):\n" + _listing(long)


def test_measured_where_the_limits_apply(tree: tuple[list[Span], list[Span]]) -> None:
    _, modules = tree
    paths = {m.where for m in modules}
    assert "router-edge/ka-edge/src/router_shell.rs" in paths
    assert "testbed/kickass_testbed/demo.py" in paths
    assert not [
        p
        for p in paths
        if p.startswith(("tests/", "bench/", "db/migrations/", ".venv/", "target/"))
        or "/tests/" in p
    ]
    # router.rs's tests live in router/tests.rs, declared #[cfg(test)] mod tests;
    assert "core/ka-core/src/router/tests.rs" not in paths
    assert "core/ka-core/src/router.rs" in paths


# -- the scanners themselves -------------------------------------------------------


def test_python_function_length_is_def_to_last_line() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(119))
    source = f"@decorator\ndef f():\n{body}\n\n\nclass C:\n    def g(self):\n        return 1\n"
    spans = {s.where: s.lines for s in python_functions("m.py", source)}
    assert spans == {"m.py::f": 120, "m.py::g": 2}


def test_rust_scan_ignores_braces_in_literals_and_comments() -> None:
    source = """\
/// A doc { comment
fn short(a: [u8; 4]) -> u8 {
    let s = "}}}";
    let r = r#"{"a": "}"}"#;
    let c = '}';
    let b = b'{';
    /* nested /* } */ } */
    // }
    a[0]
}

fn lifetime<'a>(s: &'a str) -> &'a str {
    s
}

trait T {
    fn declared(&self) -> u8;
}

#[cfg(test)]
mod tests {
    fn in_a_test() {
    }
}
"""
    code = blank_rust(source)
    inline, files = rust_test_modules(code)
    spans = {s.where: (s.line, s.lines) for s in rust_functions("x.rs", code, inline)}
    assert spans == {"x.rs::short": (2, 9), "x.rs::lifetime": (12, 3)}
    assert files == []
    assert rust_module_lines(code, inline) == 19
    _, files = rust_test_modules(blank_rust("#[cfg(test)]\nmod tests;\n"))
    assert files == ["tests"]


def test_a_long_function_and_module_are_found(tmp_path: Path) -> None:
    """The whole-tree check on a small tree: what is over is named; what is
    under tests/, bench/ or the migrations is not measured."""
    body = "\n".join(f"    x{i} = {i}" for i in range(120))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "long.py").write_text(f"def long():\n{body}\n")
    rs = "\n".join(["fn long() {", *["    let _ = 1;"] * 119, "}", *["// filler"] * 880])
    (tmp_path / "pkg" / "long.rs").write_text(rs + "\n")
    for skipped in ("tests", "bench", "db/migrations", "pkg/tests"):
        (tmp_path / skipped).mkdir(parents=True, exist_ok=True)
        (tmp_path / skipped / "t.py").write_text(f"def long():\n{body}\n")
    functions, modules = measure(tmp_path)
    assert {(f.where, f.lines) for f in functions} == {
        ("pkg/long.py::long", 121),
        ("pkg/long.rs::long", 121),
    }
    assert {(m.where, m.lines) for m in modules} == {("pkg/long.py", 121), ("pkg/long.rs", 1001)}
