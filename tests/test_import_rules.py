"""ARCHITECTURE.md's import rules, checked from the code (issue 26).

Each package section of ARCHITECTURE.md ends with what it must never import;
``RULES`` below is the same list as data, and the first test holds the two
to each other (a rule changed in one place and not the other fails). The
other tests read every module of every package with ``ast`` (nothing is
imported) and find:

- no import a rule forbids, at module level or inside a function (where a
  rule says "at module level", a function may: that is how a runner host
  without the database still loads the module);
- the pure modules' own rules (the Atlas parse/join, the receiver's side of
  ``kickass_wan``);
- no cycle between packages among the imports that run when a module loads
  (``if TYPE_CHECKING:`` blocks do not run), so the packages stack in one
  order, the code map's.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "ARCHITECTURE.md"

# The installable Python packages: folder -> import name.
PACKAGES = {
    "core/kickass_core": "kickass_core",
    "db/kickass_db": "kickass_db",
    "server/kickass_server": "kickass_server",
    "atlas/kickass_atlas": "kickass_atlas",
    "analysis/kickass_analysis": "kickass_analysis",
    "operations/kickass_operations": "kickass_operations",
    "probe-client/kickass_probe": "kickass_probe",
    "wan-agents/kickass_wan": "kickass_wan",
    "testbed/kickass_testbed": "kickass_testbed",
}


@dataclass(frozen=True)
class Rule:
    """One package's "Must never import" line."""

    heading: str  # how its ARCHITECTURE.md section starts
    never: frozenset[str] = frozenset()  # top-level names (or dotted prefixes)
    only: frozenset[str] | None = None  # the only non-stdlib names allowed
    module_level_only: bool = False  # the rule binds module-level imports only
    # Modules (relative to the package) that may import a forbidden name
    # inside a function, and which names: the documented exceptions.
    lazily: dict[str, frozenset[str]] = field(default_factory=dict)
    # Imported only where the standard library lacks the module (the doc says
    # so in parentheses).
    backports: frozenset[str] = frozenset()


RULES: dict[str, Rule] = {
    # tomllib's backport, for the probe client's 3.9 and 3.10 (config.py).
    "kickass_core": Rule("### `core/`", only=frozenset(), backports=frozenset({"tomli"})),
    "kickass_db": Rule(
        "### `db/`",
        frozenset(
            {"kickass_server", "kickass_atlas", "kickass_probe", "kickass_wan", "kickass_testbed"}
        ),
    ),  # fmt: skip
    "kickass_server": Rule(
        "### `server/kickass_server`",
        frozenset({"kickass_atlas", "kickass_probe", "kickass_wan", "kickass_testbed"}),
    ),
    "kickass_atlas": Rule("### `atlas/kickass_atlas`", frozenset({"kickass_server", "flask"})),
    "kickass_analysis": Rule(
        "### `analysis/kickass_analysis`", frozenset({"kickass_server", "flask"})
    ),
    "kickass_operations": Rule(
        "### `operations/kickass_operations`",
        frozenset({"kickass_db", "kickass_atlas", "kickass_analysis", "kickass_server"}),
        module_level_only=True,
    ),
    "kickass_probe": Rule(
        "### `probe-client/kickass_probe`", only=frozenset({"kickass_core", "rich"})
    ),
    "kickass_wan": Rule(
        "### `wan-agents/`",
        frozenset({"kickass_server", "kickass_atlas", "kickass_db"}),
        lazily={"cli.py": frozenset({"kickass_db"})},
    ),
}

# Modules that stay pure (relative to their package) and what they never import.
PURE: dict[tuple[str, str], frozenset[str]] = {
    **{
        ("kickass_atlas", f"ingest/{m}.py"): frozenset(
            {
                "kickass_atlas.store",
                "kickass_atlas.client",
                "sqlalchemy",
                "psycopg",
                "ripe.atlas.cousteau",
            }
        )  # fmt: skip
        for m in ("parse", "check", "join")
    },
    # The receiver's side: a receiver host runs no trials.
    **{
        ("kickass_wan", f"{m}.py"): frozenset({"kickass_wan.trials"})
        for m in ("agent", "token", "tcpflow", "environment")
    },
}


@dataclass(frozen=True)
class Import:
    module: str  # the absolute module imported (a from-import's module)
    names: tuple[str, ...]  # a from-import's names ("" for a plain import)
    line: int
    at_load: bool  # runs when the module loads (module level, not TYPE_CHECKING)
    module_level: bool


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(path: Path, module: str, is_package: bool) -> Iterator[Import]:
    """Every import in ``path`` (module ``module``), relative ones made absolute."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    here = module.split(".") if is_package else module.split(".")[:-1]

    def walk(node: ast.AST, module_level: bool, at_load: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for a in child.names:
                    yield Import(a.name, ("",), child.lineno, at_load, module_level)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = here[: len(here) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                names = tuple(a.name for a in child.names)
                yield Import(target, names, child.lineno, at_load, module_level)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, False, False)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), module_level, False)
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), module_level, at_load)
            else:
                # Class bodies run at load; so do try/with/if at module level.
                yield from walk(child, module_level, at_load)

    yield from walk(tree, True, True)


@dataclass(frozen=True)
class Module:
    package: str
    rel: str  # path inside the package folder
    name: str
    imports: tuple[Import, ...]


def modules() -> list[Module]:
    out = []
    for folder, package in PACKAGES.items():
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).as_posix()
            parts = [package, *Path(rel).with_suffix("").parts]
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            name = ".".join(parts)
            out.append(Module(package, rel, name, tuple(imports_of(path, name, is_package))))
    return out


@pytest.fixture(scope="module")
def code() -> list[Module]:
    return modules()


def _targets(imp: Import) -> Iterator[str]:
    """The modules an import may name: the module, and module.name for each
    from-imported name (``from kickass_wan import trials`` is the subpackage)."""
    yield imp.module
    for n in imp.names:
        if n and n != "*":
            yield f"{imp.module}.{n}"


def _matches(target: str, forbidden: str) -> bool:
    return target == forbidden or target.startswith(forbidden + ".")


def _stdlib(top: str) -> bool:
    return top in sys.stdlib_module_names or top == "__future__"


def test_the_rules_are_architecture_md_s() -> None:
    """Each rule's names are the backticked names of its section's "Must
    never import" sentence, and the other way round."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    for package, rule in RULES.items():
        start = text.index(rule.heading)
        end = text.find("\n### ", start + 1)
        section = text[start : end if end >= 0 else len(text)]
        m = re.search(
            r"[Mm]ust never import( at module level)?:(.*?)(?:\.\s|\.$|\(|;)", section, re.S
        )
        assert m, f"{package}: no 'Must never import' line under {rule.heading}"
        assert bool(m.group(1)) == rule.module_level_only, package
        said = m.group(2)
        named = {n.lower() for n in re.findall(r"`([A-Za-z_.]+)`", said)}
        named |= {w.lower() for w in re.findall(r"\b(Flask)\b", said)}
        if rule.only is not None:
            words = "anything but" if rule.only else "anything outside the standard library"
            assert words in said, (package, said)
            assert named == set(rule.only), (package, named)
        else:
            assert named == set(rule.never), (package, named, said)


def test_no_package_imports_what_its_rule_forbids(code: list[Module]) -> None:
    broken = []
    for mod in code:
        rule = RULES.get(mod.package)
        if rule is None:
            continue
        for imp in mod.imports:
            if rule.module_level_only and not imp.module_level:
                continue
            top = imp.module.split(".")[0]
            if rule.only is not None:
                allowed_tops = rule.only | rule.backports
                if top != mod.package and not _stdlib(top) and top not in allowed_tops:
                    broken.append(f"{mod.package}/{mod.rel}:{imp.line} imports {imp.module}")
                continue
            for forbidden in rule.never:
                if not any(_matches(t.lower(), forbidden) for t in _targets(imp)):
                    continue
                allowed = rule.lazily.get(mod.rel, frozenset())
                if not imp.module_level and forbidden in allowed:
                    continue
                broken.append(f"{mod.package}/{mod.rel}:{imp.line} imports {imp.module}")
    assert not broken, "imports ARCHITECTURE.md forbids:\n" + "\n".join(broken)


def test_pure_modules_stay_pure(code: list[Module]) -> None:
    found = {(m.package, m.rel): m for m in code}
    broken = []
    for key, forbidden in PURE.items():
        assert key in found, f"{key}: no such module (moved? update PURE)"
        mod = found[key]
        for imp in mod.imports:
            if any(_matches(t, f) for t in _targets(imp) for f in forbidden):
                broken.append(f"{key[0]}/{key[1]}:{imp.line} imports {imp.module}")
    assert not broken, "\n".join(broken)


def _package_graph(code: list[Module]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {p: set() for p in PACKAGES.values()}
    for mod in code:
        for imp in mod.imports:
            top = imp.module.split(".")[0]
            if imp.at_load and top in graph and top != mod.package:
                graph[mod.package].add(top)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return [*stack[stack.index(m) :], m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_cycle_between_packages(code: list[Module]) -> None:
    graph = _package_graph(code)
    cycle = _cycle(graph)
    assert cycle is None, "packages import each other at load: " + " -> ".join(cycle or [])
    # Only the testbed stands on everything; the core on nothing.
    assert graph["kickass_core"] == set()
    assert "kickass_testbed" not in set().union(*graph.values())


def test_the_checks_find_what_they_look_for(tmp_path: Path) -> None:
    """The scanner resolves relative imports, sees imports inside functions
    and TYPE_CHECKING blocks for what they are, and the cycle finder finds one."""
    pkg = tmp_path / "kickass_x" / "sub"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from ..store import S\n"
        "if TYPE_CHECKING:\n    import kickass_db\n"
        "def f():\n    import kickass_server\n"
    )
    got = list(imports_of(pkg / "a.py", "kickass_x.sub.a", False))
    assert [(i.module, i.at_load, i.module_level) for i in got] == [
        ("typing", True, True),
        ("kickass_x.store", True, True),
        ("kickass_db", False, True),
        ("kickass_server", False, False),
    ]
    init = list(imports_of(pkg / "__init__.py", "kickass_x.sub", True))
    assert [(i.module, i.names) for i in init] == [("kickass_x.sub", ("a",))]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
