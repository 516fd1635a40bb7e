"""kickass-probe.pyz, the one-file volunteer client (issue 20, item 5).

What must hold, and where it is shown:

- The archive (``probe-client/build_zipapp.py``, ``make zipapp``) holds only
  Python sources (nothing compiled), starts with ``#!/usr/bin/env python3``
  and is reproducible: a copy of the sources with other times, modes and a
  shuffled directory order, built under another umask and time zone, gives
  the same bytes.
- Python 3.9: every module in it parses as 3.9 (``ast.parse(...,
  feature_version=(3, 9))``) and imports under Debian's ``pypy3`` (a Python
  3.9) with ``-I -S``; a static scan finds no 3.10+ construct that parses
  fine and fails only when run (a standard-library name 3.9 lacks, checked
  by pypy3 itself; ``zip(strict=)``, ``dataclass(slots=)``, ``|`` between
  types outside annotations, ...), and the scan is shown to catch each.
- A real study against a real ``kickass server`` on loopback (root: the
  server's raw socket) from ``pypy3 -I -S`` and from the venv's 3.11 with
  ``-I -S``: the session completes with the plan's counts. The same with the
  Linux-only facilities unavailable (``sys.platform`` set to ``darwin``
  before the client starts, as on macOS): the study completes and the summary
  and the JSON say what could not be told.
- 3.9's ``socket.timeout`` is not ``TimeoutError``: a server that never
  answers is still "did not reply" there, not a traceback; bad arguments are
  ERROR lines.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import os
import pty
import random
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kickass_core.plan import ProbePlan
from kickass_probe.output import (
    LineProgress,
    cannot_tell,
    format_summary,
    make_progress,
    result_json,
)
from kickass_probe.reassembly import Limits, ReassemblyBudget, Sample, read_limits, read_sample
from kickass_testbed.pg import create_database, drop_database
from support.live_server import free_port, server
from test_probe_client_output import local_counts, run_result

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "probe-client" / "build_zipapp.py"
PYPY = shutil.which("pypy3")
VENV_PYTHON = sys.executable
QUICK = ProbePlan.quick()
STUDY_TIMEOUT_S = 120
# Run as the README says, under another system: sys.platform is set before
# the client's first import, so every Linux-only facility is gated off.
# urllib.request is imported first because its own import reads sys.platform
# (on macOS it loads _scproxy, which a Linux Python lacks): the stdlib is not
# what is being emulated.
EMULATE = (
    "import runpy, sys, urllib.request\n"
    "sys.platform = sys.argv[1]\n"
    "path = sys.argv[2]\n"
    "sys.argv = [path, *sys.argv[3:]]\n"
    "runpy.run_path(path, run_name='__main__')\n"
)
CANNOT_TELL_ITEMS = {"fragment_sizes", "reassembly_limit", "reassembly_memory", "refused_fragments"}

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="the real server's probe engine needs a raw socket (root)"
)


def _pypy() -> str:
    if PYPY is None:
        pytest.fail("pypy3 (Debian's Python 3.9) is missing: tools/setup-system.sh installs it")
    return PYPY


def _env() -> dict[str, str]:
    """A volunteer's environment: no KICKASS_* settings, a UTF-8 locale."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KICKASS_", "PYTHON"))}
    env["LC_ALL"] = "C.UTF-8"
    return env


def _build(output: Path, root: Path = REPO, **env: str) -> str:
    proc = subprocess.run(
        [VENV_PYTHON, str(BUILD), "--output", str(output), "--root", str(root)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**_env(), **env},
    )
    assert proc.returncode == 0, proc.stderr
    assert output.is_file()
    return hashlib.sha256(output.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def pyz(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("zipapp") / "kickass-probe.pyz"
    _build(path)
    return path


def _modules(pyz: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(pyz) as z:
        return {n: z.read(n) for n in z.namelist() if n.endswith(".py")}


def _module_names(pyz: Path) -> list[str]:
    names = []
    for n in _modules(pyz):
        if n == "__main__.py" or n.endswith("/__main__.py"):
            continue
        mod = n[: -len(".py")].replace("/", ".")
        names.append(mod.removesuffix(".__init__"))
    return sorted(names)


# -- the archive ---------------------------------------------------------------------------


def test_archive_is_python_sources_behind_the_interpreter_line(pyz: Path) -> None:
    data = pyz.read_bytes()
    assert data.startswith(b"#!/usr/bin/env python3\n")
    assert os.stat(pyz).st_mode & stat.S_IXUSR
    with zipfile.ZipFile(pyz) as z:
        infos = z.infolist()
        names = [i.filename for i in infos]
        assert z.testzip() is None
    # Nothing compiled (no .so/.pyd/.pyc), nothing but the two packages and __main__.
    assert all(n.endswith(".py") for n in names), names
    assert names == sorted(names)
    assert {n.split("/")[0] for n in names} == {"__main__.py", "kickass_core", "kickass_probe"}
    for pkg in ("core/kickass_core", "probe-client/kickass_probe"):
        for src in (REPO / pkg).glob("*.py"):
            assert f"{src.parent.name}/{src.name}" in names
    assert {i.date_time for i in infos} == {(1980, 1, 1, 0, 0, 0)}
    # Small: the sources only (rich is not bundled; the progress bar is stdlib).
    assert len(data) < 200_000, len(data)


def test_archive_is_reproducible(pyz: Path, tmp_path: Path) -> None:
    """Other file times, modes, directory order, umask and time zone: same bytes."""
    copy = tmp_path / "copy"
    for pkg in ("core/kickass_core", "probe-client/kickass_probe"):
        files = sorted((REPO / pkg).glob("*.py"))
        random.Random(7).shuffle(files)  # another creation order: another directory order
        (copy / pkg).mkdir(parents=True)
        for f in files:
            target = copy / pkg / f.name
            target.write_bytes(f.read_bytes())
            target.chmod(0o600)
            stamp = time.time() - random.Random(f.name).randrange(10**8)
            os.utime(target, (stamp, stamp))
    other = tmp_path / "other.pyz"
    first = hashlib.sha256(pyz.read_bytes()).hexdigest()
    assert _build(other, copy, TZ="America/Los_Angeles") == first
    old = os.umask(0o077)
    try:
        assert _build(tmp_path / "again.pyz", REPO, TZ="Asia/Kolkata") == first
    finally:
        os.umask(old)
    # A source edit shows in the hash.
    (copy / "probe-client/kickass_probe/__init__.py").write_text('__version__ = "0.1.1"\n')
    assert _build(other, copy) != first


def test_build_refuses_python_3_10_syntax(tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    for pkg in ("core/kickass_core", "probe-client/kickass_probe"):
        shutil.copytree(REPO / pkg, copy / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "core/kickass_core/rate.py").write_text(
        "def f(x):\n    match x:\n        case 1:\n            return 1\n"
    )
    proc = subprocess.run(
        [VENV_PYTHON, str(BUILD), "--output", str(tmp_path / "x.pyz"), "--root", str(copy)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("ERROR: cannot build kickass-probe.pyz: kickass_core/rate.py:")
    assert "not Python 3.9 syntax (Pattern matching is only supported in Python 3.10" in (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "x.pyz").exists()


# -- Python 3.9 ----------------------------------------------------------------------------


def test_every_module_parses_as_python_3_9(pyz: Path) -> None:
    """Parsed in a fresh interpreter: CPython 3.11's AST recursion-depth
    counter is shared between threads (the SystemError of gh-106905), and a
    thread another test had left running (a loopback server printing a
    traceback, whose carets parse the source line) made ``ast.parse`` raise
    it in CI."""
    code = (
        "import ast, sys, zipfile\n"
        "names = [n for n in zipfile.ZipFile(sys.argv[1]).namelist() if n.endswith('.py')]\n"
        "for n in names:\n"
        "    src = zipfile.ZipFile(sys.argv[1]).read(n)\n"
        "    try:\n"
        "        ast.parse(src, filename=n, feature_version=(3, 9))\n"
        "    except SyntaxError as e:\n"
        "        sys.exit(f'{n}: not Python 3.9 syntax: {e}')\n"
        "print(len(names))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-I", "-c", code, str(pyz)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) == len(_modules(pyz)) > 20


def test_every_module_imports_under_pypy3(pyz: Path, tmp_path: Path) -> None:
    """pypy3 is a Python 3.9: a 3.10+ construct evaluated at import time fails here."""
    py = _pypy()
    names = _module_names(pyz)
    code = (
        "import importlib, sys\n"
        "assert sys.version_info[:2] == (3, 9), sys.version\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "for name in sys.argv[2:]:\n"
        "    importlib.import_module(name)\n"
        "print(len(sys.argv) - 2)\n"
    )
    proc = subprocess.run(
        [py, "-I", "-S", "-c", code, str(pyz), *names],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) == len(names) > 20


def test_core_on_python_3_9_without_a_toml_parser(pyz: Path, tmp_path: Path) -> None:
    """The configuration file is optional for the volunteer: without tomllib
    (3.9) and tomli, giving one is a clear KickassError; the rest of core runs."""
    toml = tmp_path / "kickass.toml"
    toml.write_text('database_url = "postgresql:///x"\n')
    code = (
        "import sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from kickass_core.config import load_file, resolve\n"
        "from kickass_core.errors import KickassError\n"
        "from kickass_core import cli, study_events, strictjson\n"
        "assert load_file(None) == {}\n"
        "assert resolve('x', None, default=3, environ={}) == 3\n"
        "cli.build_parser()\n"
        "a = study_events.ClockAnchor(86400.0, 10.0)\n"
        "assert str(a.utc(10.0)) == '1970-01-02 00:00:00+00:00'\n"
        "b = study_events.OutcomeBatch('s', ()).stamped(a)\n"
        "assert study_events.from_json(study_events.to_json(b)) == b\n"
        "try:\n"
        "    strictjson.loads('1' * 5000)\n"
        "except ValueError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('a 5000-digit integer was accepted')\n"
        "try:\n"
        "    load_file(sys.argv[2])\n"
        "except KickassError as exc:\n"
        "    print(exc.render())\n"
    )
    proc = subprocess.run(
        [_pypy(), "-I", "-S", "-c", code, str(pyz), str(toml)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(
        f"ERROR: cannot read configuration file {toml}: this Python (3.9) has no TOML parser\n"
        "hint: use Python 3.11 or newer, install tomli"
    ), proc.stdout


# The static scan: constructs that Python 3.9 parses but fails on when they run.

# Keywords that calls gained after 3.9: (function name, keyword, version).
NEW_KEYWORDS = {
    ("zip", "strict"): "3.10",
    ("dataclass", "slots"): "3.10",
    ("dataclass", "kw_only"): "3.10",
    ("dataclass", "match_args"): "3.10",
    ("dataclass", "weakref_slot"): "3.11",
    ("field", "kw_only"): "3.10",
    ("entry_points", "group"): "3.10",
    ("entry_points", "name"): "3.10",
    ("bisect_left", "key"): "3.10",
    ("bisect_right", "key"): "3.10",
    ("insort_left", "key"): "3.10",
    ("insort_right", "key"): "3.10",
}
TYPE_NAMES = {"int", "float", "str", "bytes", "bool", "list", "dict", "tuple", "set", "type"}


class _Scan(ast.NodeVisitor):
    """Findings in one module, and the standard-library names it uses
    (dotted, for pypy3 to resolve). Code under ``if TYPE_CHECKING``,
    ``if sys.version_info >= ...`` and ``try: ... except ImportError`` is
    skipped: it is not run on 3.9."""

    def __init__(self, name: str, tree: ast.Module) -> None:
        self.name = name
        self.findings: list[str] = []
        self.names: set[str] = set()
        self.modules: dict[str, str] = {}  # local name -> module bound by `import`
        self.classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        self.future_annotations = any(
            isinstance(n, ast.ImportFrom)
            and n.module == "__future__"
            and any(a.name == "annotations" for a in n.names)
            for n in tree.body
        )
        self._depth = 0  # functions entered (their local annotations never run)

    def _flag(self, node: ast.AST, what: str) -> None:
        self.findings.append(f"{self.name}:{getattr(node, 'lineno', '?')}: {what}")

    # -- what is not run on 3.9 --

    @staticmethod
    def _guarded(test: ast.expr) -> bool:
        text = ast.unparse(test)
        return text == "TYPE_CHECKING" or text.startswith("sys.version_info >=")

    def visit_If(self, node: ast.If) -> None:
        self.visit(node.test)
        if not self._guarded(node.test):
            for s in node.body:
                self.visit(s)
        for s in node.orelse:
            self.visit(s)

    def visit_Try(self, node: ast.Try) -> None:
        caught = {
            ast.unparse(t)
            for h in node.handlers
            if h.type is not None
            for t in (h.type.elts if isinstance(h.type, ast.Tuple) else [h.type])
        }
        if not caught & {"ImportError", "ModuleNotFoundError", "AttributeError"}:
            for stmt in node.body:
                self.visit(stmt)
        for handler in node.handlers:
            self.visit(handler)
        for stmt in [*node.orelse, *node.finalbody]:
            self.visit(stmt)

    # -- names of the standard library --

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self.names.add(a.name)
            # `import a.b` binds a; `import a.b as c` binds c to a.b.
            self.modules[a.asname or a.name.split(".")[0]] = (
                a.name if a.asname else a.name.split(".")[0]
            )

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and node.module and node.module != "__future__":
            for a in node.names:
                self.names.add(f"{node.module}:{a.name}")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        parts: list[str] = []
        cur: ast.expr = node
        while isinstance(cur, ast.Attribute):
            parts.append(cur.attr)
            cur = cur.value
        if isinstance(cur, ast.Name) and cur.id in self.modules:
            self.names.add(".".join([self.modules[cur.id], *reversed(parts)]))
            return
        self.generic_visit(node)

    # -- calls --

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        fname = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        for kw in node.keywords:
            version = NEW_KEYWORDS.get((fname, kw.arg or ""))
            if version:
                self._flag(node, f"{fname}({kw.arg}=...) needs Python {version}")
        unpacked = any(isinstance(a, ast.Starred) for a in node.args) or any(
            k.arg is None for k in node.keywords
        )
        n_args = len(node.args) + len(node.keywords)
        if isinstance(func, ast.Attribute) and not unpacked:
            if fname in ("to_bytes", "from_bytes") and n_args < 2:
                self._flag(node, f"{fname}() without length and byteorder needs Python 3.11")
            if fname in ("print_exception", "format_exception") and n_args == 1:
                self._flag(node, f"{fname}(exc) with one argument needs Python 3.10")
        self.generic_visit(node)

    # -- `|` between types, evaluated at run time --

    def _is_type_name(self, name: str) -> bool:
        # A builtin type, a class of this module, or a CapWords name (Mapping,
        # Callable; ALL_CAPS constants are not types).
        return (
            name in TYPE_NAMES
            or name in self.classes
            or (name[:1].isupper() and not name.isupper())
        )

    def _is_type(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Constant) and node.value is None:
            return True
        if isinstance(node, ast.Name):
            return self._is_type_name(node.id)
        if isinstance(node, ast.Attribute):
            return self._is_type_name(node.attr)
        if isinstance(node, ast.Subscript):  # list[int], Callable[...]
            return self._is_type(node.value)
        return isinstance(node, ast.BinOp) and self._is_type_union(node)

    def _is_type_union(self, node: ast.expr) -> bool:
        return (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.BitOr)
            and (self._is_type(node.left) or self._is_type(node.right))
        )

    def visit_BinOp(self, node: ast.BinOp) -> None:
        if self._is_type_union(node):
            self._flag(node, f"`{ast.unparse(node)}` evaluated at run time needs Python 3.10")
            return
        self.generic_visit(node)

    def _annotation(self, node: ast.expr | None, evaluated: bool) -> None:
        if node is None or not evaluated:
            return
        if any(self._is_type_union(n) for n in ast.walk(node) if isinstance(n, ast.BinOp)):
            self._flag(node, "a `|` annotation evaluated at run time (no `from __future__ import "
                       "annotations`) needs Python 3.10")  # fmt: skip

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        evaluated = not self.future_annotations
        a = node.args
        for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
            if arg is not None:
                self._annotation(arg.annotation, evaluated)
        self._annotation(node.returns, evaluated)
        for decorator in node.decorator_list:
            self.visit(decorator)
        for default in [*a.defaults, *a.kw_defaults]:
            if default is not None:
                self.visit(default)
        self._depth += 1
        for s in node.body:
            self.visit(s)
        self._depth -= 1

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        # Module and class annotations are evaluated without the future import.
        self._annotation(node.annotation, not self.future_annotations and self._depth == 0)
        if node.value is not None:
            self.visit(node.value)


def scan(name: str, source: str | bytes) -> _Scan:
    tree = ast.parse(source, filename=name, feature_version=(3, 9))
    s = _Scan(name, tree)
    s.visit(tree)
    return s


# Run by pypy3: which of these names its standard library lacks. "m:n" is
# `from m import n`; "a.b.c" an attribute chain from `import a` (a submodule
# where an attribute is missing).
RESOLVE = """\
import importlib, json, sys

def resolve(dotted):
    module, _, name = dotted.partition(":")
    if name:
        obj = importlib.import_module(module)
        if not hasattr(obj, name):
            importlib.import_module(module + "." + name)
        return
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i in range(1, len(parts)):
        try:
            obj = getattr(obj, parts[i])
        except AttributeError:
            obj = importlib.import_module(".".join(parts[: i + 1]))

missing = []
for dotted in json.load(sys.stdin):
    try:
        resolve(dotted)
    except ImportError:
        missing.append(dotted)
print(json.dumps(missing))
"""


def _missing_on_pypy3(names: set[str], pyz: Path | None, cwd: Path) -> list[str]:
    code = ("import sys; sys.path.insert(0, sys.argv[1])\n" if pyz else "") + RESOLVE
    proc = subprocess.run(
        [_pypy(), "-I", "-S", "-c", code, *([str(pyz)] if pyz else [])],
        input=json.dumps(sorted(names)),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stderr
    return list(json.loads(proc.stdout))


BAD_39 = """\
from __future__ import annotations
import dataclasses, itertools, sys
from dataclasses import dataclass
from datetime import UTC
from typing import TYPE_CHECKING, TypeGuard
if TYPE_CHECKING:
    from typing import Self  # fine: never run
if sys.version_info >= (3, 11):
    import tomllib  # fine: never run on 3.9
try:
    import tomli  # fine: guarded
except ImportError:
    tomli = None

class A: ...
class B: ...

Alias = A | B
@dataclass(frozen=True, slots=True)
class C:
    x: int | None  # fine: not evaluated
def f(x: int | None) -> list[int] | None:  # fine
    y: A | None = None  # fine
    for a, b in zip([1], [2], strict=True):
        pass
    if isinstance(x, int | float):
        pass
    n = (5).to_bytes()
    m = int.from_bytes(b"x")
    p = itertools.pairwise([1, 2])
    q = dataclasses.KW_ONLY
    return [x or 0] if y is None else None
def g(x):
    return x | 1  # fine: not a type
"""


def test_the_scan_catches_what_3_9_parses_but_cannot_run(tmp_path: Path) -> None:
    s = scan("bad.py", BAD_39)
    found = "\n".join(s.findings)
    for what in (
        "bad.py:18: `A | B` evaluated at run time needs Python 3.10",
        "bad.py:19: dataclass(slots=...) needs Python 3.10",
        "bad.py:24: zip(strict=...) needs Python 3.10",
        "bad.py:26: `int | float` evaluated at run time needs Python 3.10",
        "bad.py:28: to_bytes() without length and byteorder needs Python 3.11",
        "bad.py:29: from_bytes() without length and byteorder needs Python 3.11",
    ):
        assert what in found, found
    assert len(s.findings) == 6, found
    missing = _missing_on_pypy3(s.names, None, tmp_path)
    assert sorted(missing) == [
        "dataclasses.KW_ONLY",
        "datetime:UTC",
        "itertools.pairwise",
        "typing:TypeGuard",
    ], missing
    # Without the future import, a `|` annotation is evaluated (at module and
    # class level and in signatures) and caught.
    old = scan("old.py", "class A: ...\nx: A | None = None\ndef f(a: int | None): ...\n")
    assert len(old.findings) == 2, old.findings


def test_no_module_uses_what_3_9_cannot_run(pyz: Path, tmp_path: Path) -> None:
    findings: list[str] = []
    names: set[str] = set()
    for name, source in _modules(pyz).items():
        s = scan(name, source)
        findings += s.findings
        names |= s.names
    assert findings == []
    assert {"socket.timeout", "urllib.request.urlopen", "typing:TYPE_CHECKING"} <= names
    # What is neither the standard library nor in the archive: rich, which
    # output.RichProgress imports and the one-file client never constructs
    # (its __main__ calls main(use_rich=False)).
    bundled = {"kickass_core", "kickass_probe"}
    outside = {n for n in names if n.split(":")[0].split(".")[0] not in sys.stdlib_module_names}
    assert {n.split(":")[0].split(".")[0] for n in outside} == {"rich", *bundled}
    names -= {n for n in outside if n.startswith("rich")}
    assert _missing_on_pypy3(names, pyz, tmp_path) == []
    main = _modules(pyz)["__main__.py"].decode()
    assert "sys.exit(main(use_rich=False))" in main


# -- the Linux-only facilities, gated on sys.platform --------------------------------------


def test_not_on_linux_nothing_is_read_from_proc(monkeypatch: pytest.MonkeyPatch) -> None:
    assert read_limits().high_thresh is not None  # this machine is Linux
    assert read_sample(0.0).memory is not None
    monkeypatch.setattr(sys, "platform", "darwin")
    limits = read_limits()
    sample = read_sample(1.0)
    assert limits.to_json() == {"high_thresh": None, "low_thresh": None, "time_s": None}
    assert set(sample.to_json().values()) == {None}


def test_cannot_tell_names_only_what_is_missing() -> None:
    """A Linux whose kernel refuses IP_RECVFRAGSIZE (older than 4.10): only the
    fragment sizes are unknown; the reassembly numbers are told as before."""
    limits = Limits(high_thresh=4 << 20, low_thresh=3 << 20, time_s=30)
    budget = ReassemblyBudget(limits, 250, 480, 8, start=Sample(0.0, fails=3, memory=0, queues=0))
    budget.on_sample(Sample(1.0, fails=3, timeouts=0, overlaps=0, memory=8192, queues=2), 300)
    local = local_counts()
    local.frag_size_supported = False
    result = run_result(local=local, reassembly=budget.summary())
    assert [c["item"] for c in cannot_tell(result)] == ["fragment_sizes"]
    assert result_json(result)["local"]["split_largest_fragment_as_sent"] is None
    text = " ".join(format_summary(result).split())
    assert "Largest fragment as sent: cannot tell on this system" in text
    assert "Reassembly memory of this system: peak 0.0 MB of 4.2 MB; no fragment refused" in text
    # And with everything told, nothing is listed.
    told = run_result(reassembly=budget.summary())
    assert cannot_tell(told) == [] and result_json(told)["cannot_tell"] == []


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_plain_progress_bar_on_a_terminal() -> None:
    clock = iter([0.0, 0.1, 10.0, 10.05, 20.0, 21.0])
    out = _Tty()
    p = LineProgress(out, clock=lambda: next(clock), width=120)
    p.update(0, 480, "waiting for probes")
    p.update(10, 480, "whole 108 B")  # within REDRAW_S: not drawn
    p.update(120, 480, "whole 1000 B")
    p.note("a note")
    p.update(240, 480, "split, leading 44 B")  # 10.05: too soon, skipped
    p.update(480, 480, "done")  # the end is always drawn
    p.close()
    text = out.getvalue()
    assert "whole 108 B" not in text and "split, leading" not in text
    assert "[######------------------] 120/480 probes 0:00:10 ETA 0:00:30" in text
    assert "\ra note\n" in text  # the bar cleared, the note, the bar again
    assert "[########################] 480/480 probes 0:00:20 ETA 0:00:00" in text
    assert text.endswith("\n")
    assert isinstance(make_progress(_Tty(), use_rich=False), LineProgress)
    # A narrow terminal: the line is cut one column short (a wrapped line
    # could not be redrawn in place).
    narrow = _Tty()
    q = LineProgress(narrow, clock=lambda: 0.0, width=60)
    q.update(1, 480, "whole 44 B")
    assert len(narrow.getvalue()) == 1 + 59 and narrow.getvalue().startswith("\rwhole 44 B")


# -- runs of the archive, no server needed ------------------------------------------------


def _interpreters() -> list[Any]:
    return [pytest.param("pypy3", id="pypy3.9"), pytest.param("venv", id="python3.11")]


def _python(which: str) -> str:
    return _pypy() if which == "pypy3" else VENV_PYTHON


@pytest.mark.parametrize("which", _interpreters())
def test_bad_arguments_are_error_lines(which: str, pyz: Path, tmp_path: Path) -> None:
    py = _python(which)
    for args, code, line in (
        ([], 2, "ERROR: no measurement server given"),
        (["--server", "ftp://x"], 2, "ERROR: --server must be an http:// or https:// URL"),
        (["--server", "http://127.0.0.1:9", "--quick", "-n", "3"], 2, "ERROR: --quick cannot"),
        (["--server", "http://127.0.0.1:9", "--window", "x"], 2, "--window/-w: not a whole"),
    ):
        proc = subprocess.run(
            [py, "-I", "-S", str(pyz), *args],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
            env=_env(),
        )
        assert proc.returncode == code, (args, proc.stderr)
        assert line in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.parametrize("which", _interpreters())
def test_a_server_that_never_answers_is_a_timeout(which: str, pyz: Path, tmp_path: Path) -> None:
    """On 3.9 a read timeout is socket.timeout, not TimeoutError."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)  # connections complete, and nobody ever answers
        port = listener.getsockname()[1]
        started = time.monotonic()
        proc = subprocess.run(
            [
                _python(which), "-I", "-S", str(pyz), "--server", f"http://127.0.0.1:{port}",
                "--yes", "--quick", "--timeout", "0.5",
            ],
            capture_output=True, text=True, timeout=60, cwd=tmp_path, env=_env(),
        )  # fmt: skip
        took = time.monotonic() - started
    assert proc.returncode == 1, proc.stderr
    assert (
        f"ERROR: the server at http://127.0.0.1:{port} did not reply within 0.5 s (3 attempts)"
        in proc.stderr
    ), proc.stderr
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr
    assert took < 30


def test_the_interpreter_line_finds_python3(pyz: Path, tmp_path: Path) -> None:
    if shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") is None:
        pytest.skip("no python3 on the standard PATH")
    proc = subprocess.run(
        [str(pyz), "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LC_ALL": "C.UTF-8"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("kickass-probe ")


# -- real studies against a real server ----------------------------------------------------


@pytest.fixture(scope="module")
def live_database(pg_server_url: str, _migrated_template: str) -> Iterator[str]:
    """The database of this module's server."""
    name = f"test_zipapp_{secrets.token_hex(4)}"
    database_url = create_database(pg_server_url, name, template=_migrated_template)
    try:
        yield database_url
    finally:
        drop_database(pg_server_url, name)


@pytest.fixture(scope="module")
def live_server(live_database: str) -> Iterator[str]:
    """One real `kickass server` on loopback for this module's studies."""
    if os.geteuid() != 0:
        pytest.skip("the real server's probe engine needs a raw socket (root)")
    probe_port, http_port = free_port(socket.SOCK_DGRAM), free_port(socket.SOCK_STREAM)
    with server(live_database, probe_port, http_port):
        yield f"http://127.0.0.1:{http_port}"


def _frag_sizes_stored(database_url: str, session_id: str) -> tuple[int, int]:
    """(probe outcomes, those with a fragment size) stored for the session."""
    import kickass_db as db
    from sqlalchemy import text

    engine = db.make_engine(database_url)
    try:
        with engine.connect() as conn:
            row = conn.execute(
                text(
                    "SELECT count(*), count(o.observed_frag_size) FROM probe_outcomes o "
                    "JOIN sessions s ON s.id = o.session_pk WHERE s.session_id = :sid"
                ),
                {"sid": session_id},
            ).one()
            return int(row[0]), int(row[1])
    finally:
        engine.dispose()


def _study(
    py: str,
    pyz: Path,
    url: str,
    cwd: Path,
    *,
    platform: str | None,
    as_json: bool = True,
    tty: bool = False,
) -> subprocess.CompletedProcess[str]:
    """One quick study; ``tty``: stderr is a terminal (a pseudo-terminal), so
    the progress bar is the one drawn in place."""
    args = ["--server", url, "--yes", "--quick", *(["--json"] if as_json else [])]
    if platform is None:
        cmd = [py, "-I", "-S", str(pyz), *args]
    else:
        cmd = [py, "-I", "-S", "-c", EMULATE, platform, str(pyz), *args]
    if not tty:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=STUDY_TIMEOUT_S, cwd=cwd, env=_env()
        )
    else:
        proc = _run_on_a_terminal(cmd, cwd)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "ERROR" not in proc.stderr, proc.stderr
    return proc


def _run_on_a_terminal(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    master, slave = pty.openpty()
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child's side closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        with subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL, cwd=cwd,
            env={**_env(), "COLUMNS": "100"},
        ) as child:  # fmt: skip
            os.close(slave)
            slave = -1
            try:
                out, _ = child.communicate(timeout=STUDY_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                child.kill()
                raise
        reader.join(10)
    finally:
        if slave >= 0:
            os.close(slave)
        os.close(master)
    err = b"".join(chunks).decode("utf-8", "replace")
    return subprocess.CompletedProcess(cmd, child.returncode, out.decode(), err)


def _server_view(url: str, session_id: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/api/v1/sessions/{session_id}", timeout=10) as resp:
        return dict(json.load(resp))


def _check_counts(out: dict[str, Any], url: str) -> None:
    """The session completed with the quick plan's counts, as the server stored it."""
    n_whole = QUICK.repetitions * len(QUICK.whole)
    n_split = QUICK.repetitions * len(QUICK.split)
    assert (out["state"], out["outcome"], out["source"]) == ("complete", "complete", "server")
    assert out["incomplete"] is False and out["note"] is None
    assert out["total_probes"] == QUICK.total_probes == n_whole + n_split == 480
    assert out["pooled"]["whole"]["sent"] == n_whole
    assert out["pooled"]["split"]["sent"] == n_split
    assert [r["ip_len"] for r in out["whole"]] == list(QUICK.whole)
    assert [r["leading_ip_len"] for r in out["split"]] == list(QUICK.split)
    assert {r["sent"] for r in out["whole"] + out["split"]} == {QUICK.repetitions}
    # Loopback loses nothing: every probe reached the client, once and intact,
    # and each was acknowledged (in time, or late on a busy machine).
    local = out["local"]
    assert local["received"] == 480 and local["highest_seq"] == 479
    assert (local["duplicates"], local["corrupted"], local["wrong_length"]) == (0, 0, 0)
    for row in out["whole"] + out["split"]:
        assert row["acked"] + row.get("late", 0) == row["sent"], row
    assert out["verdict"] in ("fragments-ok", "inconclusive")
    if out["pooled"]["split"]["acked"] == n_split and out["pooled"]["whole"]["acked"] == n_whole:
        assert out["verdict"] == "fragments-ok"
    stored = _server_view(url, out["session_id"])
    assert stored["state"] == "complete" and stored["total_probes"] == 480
    assert stored["sent"] == 480
    assert stored["verdict"] == out["verdict"]


@needs_root
@pytest.mark.parametrize("which", _interpreters())
def test_a_real_study(
    which: str, pyz: Path, live_server: str, live_database: str, tmp_path: Path
) -> None:
    proc = _study(_python(which), pyz, live_server, tmp_path, platform=None)
    out = json.loads(proc.stdout)
    _check_counts(out, live_server)
    # Linux: everything is told.
    assert out["cannot_tell"] == []
    local = out["local"]
    assert local["frag_size_supported"] is True
    assert local["split_largest_fragment_as_sent"] == out["pooled"]["split"]["sent"]
    reasm = out["reassembly"]
    assert reasm["limits"]["high_thresh"] > 0 and reasm["budget"]["memory_in_use"] == "measured"
    assert isinstance(reasm["during"]["max_memory"], int)
    assert reasm["during"]["refused"] == 0
    assert "progress: 100% (480 of 480 probes)" in proc.stderr
    # Every acknowledged probe's fragment size is known (0: arrived whole).
    stored, known = _frag_sizes_stored(live_database, out["session_id"])
    answered = sum(r["acked"] + r.get("late", 0) for r in out["whole"] + out["split"])
    assert stored == 480 and known == answered


@needs_root
@pytest.mark.parametrize("which", _interpreters())
def test_a_real_study_without_linux_facilities(
    which: str, pyz: Path, live_server: str, live_database: str, tmp_path: Path
) -> None:
    """As on macOS: no /proc, no IP_RECVFRAGSIZE. The study completes, and the
    JSON says what could not be told (null, never 0)."""
    proc = _study(_python(which), pyz, live_server, tmp_path, platform="darwin")
    out = json.loads(proc.stdout)
    _check_counts(out, live_server)
    assert {c["item"] for c in out["cannot_tell"]} == CANNOT_TELL_ITEMS
    for item in out["cannot_tell"]:
        assert item["needs"].startswith("Linux ") and item["unknown"]
    local = out["local"]
    assert local["frag_size_supported"] is False
    for key in ("split_largest_fragment_as_sent", "split_reassembled", "whole_fragmented"):
        assert local[key] is None, key
    assert {r["largest_fragment_as_sent"] for r in local["split"]} == {None}
    reasm = out["reassembly"]
    assert set(reasm["limits"].values()) == {None}
    assert set(reasm["before"].values()) == {None}
    assert reasm["during"]["max_memory"] is None and reasm["during"]["refused"] is None
    assert reasm["budget"]["memory_in_use"] == "estimated"
    # The server stored what the client could not tell as unknown, not "whole".
    assert _frag_sizes_stored(live_database, out["session_id"]) == (480, 0)


@needs_root
@pytest.mark.parametrize("which", _interpreters())
def test_the_summary_says_what_it_cannot_tell(
    which: str, pyz: Path, live_server: str, tmp_path: Path
) -> None:
    proc = _study(
        _python(which), pyz, live_server, tmp_path, platform="darwin", as_json=False, tty=True
    )
    # On a terminal, the one-file client's own progress bar (no rich), redrawn in place.
    assert "\r" in proc.stderr and "] 480/480 probes " in proc.stderr, proc.stderr
    assert proc.stderr.replace("\r\n", "\n").rstrip().endswith("ETA 0:00:00")
    text = " ".join(proc.stdout.split())  # the summary wraps long lines
    assert text.startswith("Kick-Ass fragment viability Verdict: ")
    assert "whole packets 250 " in text and "split datagrams 230 " in text
    for line in (
        "Largest fragment as sent: cannot tell on this system (needs Linux IP_RECVFRAGSIZE)",
        "Whole packets arrived fragmented: cannot tell on this system (needs Linux "
        "IP_RECVFRAGSIZE)",
        "Reassembly memory of this system: cannot tell (needs Linux /proc); the split phase was "
        "paced by an estimate from the splits that did not arrive; fragments refused by its "
        "kernel: cannot tell (a probe lost that way counts as lost on the path)",
        "This client received 480 distinct probes",
    ):
        assert line in text, text
    assert "(complete):" in text
    assert "no fragment refused" not in text and "peak 0.0 MB" not in text
