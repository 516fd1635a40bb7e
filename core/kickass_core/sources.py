"""The study's sources: who measured a row of the fragment viability study.

A source is a package's ``Source`` registered in the ``kickass.sources``
entry-point group (its pyproject.toml), as packages register their commands
in ``kickass.commands``: volunteers (``kickass_db.source``: the study's own
tables, which every host reading the database has) and RIPE Atlas
(``kickass_atlas.source``). Everything that names sources derives from
``sources()``: the export's ``--source`` and its per-source views, the
figures' colours, the report's rows, the schedule file's kinds. So a third
source is a package of its own (ARCHITECTURE.md, "Adding a study source").

A host knows the sources whose packages it has installed: a trial runner
host (core, wan-agents, operations) knows none, and leaves their schedule
items to the hosts that do. Standard library only (every package imports it).
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kickass_core.cli import entry_points_of
from kickass_core.errors import KickassError

GROUP = "kickass.sources"
# A source's name is the word in every ``source`` column, ``--source`` and
# the figures' series; a schedule kind is an item's ``kind``.
NAME_PATTERN = r"^[a-z][a-z0-9_]{0,31}$"
_COLOUR = re.compile(r"^#[0-9a-f]{6}$")


@dataclass(frozen=True)
class SourceView:
    """An export view whose every row is the source's, and what dates a row:
    ``time``, the view's column; ``session_time``, its session's
    ``created_at``; neither, the view pools all time."""

    name: str
    time: str | None = None
    session_time: bool = False


@dataclass(frozen=True)
class Source:
    """One study source.

    ``title``: how the report and the figures name it; ``colour``: its
    series in every figure (``#rrggbb``); ``order``: where it stands among
    the others (tables, figures, hints). ``views``: the export views that hold
    only its rows (the views with a ``source`` column are filtered on it).
    ``item_kind``: the schedule item kind it brings, run by ``item_runner``
    (``module:function``, ``(item, context) -> Result`` of
    ``kickass_operations.items``, imported when an item of the kind runs),
    with the item settings it needs (``item_needs``: names of the schedule
    item's fields) and whether it runs only where the database is.
    """

    name: str
    title: str
    colour: str
    order: int = 100
    views: tuple[SourceView, ...] = ()
    item_kind: str | None = None
    item_runner: str | None = None
    item_needs: tuple[str, ...] = ()
    item_needs_database: bool = True

    def __post_init__(self) -> None:
        for what, value in (("name", self.name), ("item_kind", self.item_kind)):
            if value is not None and not re.match(NAME_PATTERN, value):
                raise KickassError(
                    f"study source {self.name!r}: {what} {value!r} is not a name "
                    "(a lower-case letter, then up to 31 letters, digits or '_')"
                )
        if not _COLOUR.match(self.colour):
            raise KickassError(
                f"study source {self.name!r}: colour {self.colour!r} is not #rrggbb (lower case)"
            )
        if (self.item_kind is None) != (self.item_runner is None):
            raise KickassError(f"study source {self.name!r}: item_kind and item_runner go together")

    def runner(self) -> Callable[..., Any]:
        """The function that runs an item of this source's kind."""
        if self.item_runner is None:
            raise KickassError(f"study source {self.name!r} brings no schedule item kind")
        module, _, attr = self.item_runner.partition(":")
        try:
            run: Callable[..., Any] = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise KickassError(
                f"study source {self.name!r}: its item runner {self.item_runner} "
                f"cannot be loaded: {exc}",
                hint="reinstall the source's package",
            ) from None
        return run


@functools.cache
def sources() -> tuple[Source, ...]:
    """Every source registered on this host, in their order (then by name).
    Loaded once per process; two sources of one name (or one item kind) are
    an error naming both packages."""
    found: list[tuple[Source, str]] = []
    for ep in entry_points_of(GROUP):
        # EntryPoint.dist: Python 3.10 on (the zipapp's core runs on 3.9).
        dist = getattr(ep, "dist", None)
        package = dist.name if dist is not None else ep.value
        try:
            value = ep.load()
        except Exception as exc:  # noqa: BLE001 - any failure of a package's import is its own
            raise KickassError(
                f"the study source {ep.name!r} ({ep.value}, package {package}) "
                f"cannot be loaded: {type(exc).__name__}: {exc}",
                hint="reinstall that package, or uninstall it",
            ) from None
        if not isinstance(value, Source):
            raise KickassError(
                f"the study source {ep.name!r} ({ep.value}, package {package}) "
                f"is a {type(value).__name__}, not a kickass_core.sources.Source"
            )
        if value.name != ep.name:
            raise KickassError(
                f"the study source {ep.value} (package {package}) is registered as "
                f"{ep.name!r} but is named {value.name!r}",
                hint=f'register it as {value.name} = "{ep.value}" in [{GROUP}]',
            )
        found.append((value, package))
    for key in ("name", "item_kind"):
        seen: dict[str, str] = {}
        for src, package in found:
            k = getattr(src, key)
            if k is None:
                continue
            if k in seen:
                raise KickassError(
                    f"two study sources register the {key.replace('_', ' ')} {k!r}: "
                    f"packages {seen[k]} and {package}",
                    hint="uninstall one of them",
                )
            seen[k] = package
    return tuple(sorted((s for s, _ in found), key=lambda s: (s.order, s.name)))


def names() -> tuple[str, ...]:
    """The registered sources' names, in their order."""
    return tuple(s.name for s in sources())


def find(name: str) -> Source | None:
    """The source called ``name``; None where none is installed (a reader of
    stored rows meets names of sources this host does not have)."""
    return next((s for s in sources() if s.name == name), None)


def get(name: str) -> Source:
    """The source called ``name``; an unknown one is a KickassError listing
    the known ones."""
    found = find(name)
    if found is not None:
        return found
    raise KickassError(
        f"no study source {name!r} on this host",
        hint="known here: "
        + (", ".join(names()) or "none")
        + " (a source is known where its package is installed)",
    )


def by_kind(kind: str) -> Source | None:
    """The source that brings the schedule item kind ``kind`` (None: none here)."""
    return next((s for s in sources() if s.item_kind == kind), None)
