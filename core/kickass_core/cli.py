"""`kickass`: the operator command.

Subcommands register themselves: each installed package lists its modules in
the ``kickass.commands`` entry-point group (see its pyproject.toml), and each
module exposes ``add_parser(subparsers)`` setting ``func`` on its parser (a
command of commands opens with ``group``, a program with ``program``). So
the agents, trials and Atlas packages add commands without editing anyone
else's code. Domain failures raise KickassError and are printed as
``ERROR: ...`` with a hint and a non-zero exit, never as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Iterable
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from kickass_core.errors import KickassError

from . import __version__

GROUP = "kickass.commands"


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command tree; with ``only``, just that subcommand's module is
    imported (a command run from cron every minute should not pay for the
    imports of every other room: they cost half a second)."""
    parser = program(
        "kickass",
        __version__,
        description="Kick-Ass measurement platform: run the measurement server, manage the "
        "database, run the namespace demo, testbed and trials.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    eps = sorted(_commands(), key=lambda e: e.name)
    if only is not None and any(ep.name == only for ep in eps):
        eps = [ep for ep in eps if ep.name == only]
    for ep in eps:
        try:
            module = importlib.import_module(ep.value)
        except Exception as exc:  # noqa: BLE001 - one broken package must not hide the others
            _broken(sub, ep.name, ep.value, exc)
            continue
        module.add_parser(sub)
    return parser


def program(prog: str, version: str, **kwargs: Any) -> argparse.ArgumentParser:
    """The opening every program here shares (``kickass``, ``kickass-agent``,
    ``kickass-probe``): its parser (``kwargs``: ``description``...) with
    ``--version`` saying ``PROG VERSION``."""
    parser = argparse.ArgumentParser(prog=prog, **kwargs)
    parser.add_argument("--version", action="version", version=f"{prog} {version}")
    return parser


def group(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    **kwargs: Any,
) -> argparse._SubParsersAction[argparse.ArgumentParser]:
    """The opening every command of commands shares (``kickass NAME ACTION ...``):
    its parser (``kwargs``: ``help``, ``description``...) and, returned, its
    actions' subparsers, the action named in ``args.<NAME>_command``. Run
    without an action, it prints its help and exits 2."""
    parser = subparsers.add_parser(name, **kwargs)

    def usage(_args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=usage)
    actions = parser.add_subparsers(dest=f"{name}_command", metavar=f"{name.upper()}_COMMAND")
    return actions


def entry_points_of(group: str) -> Iterable[EntryPoint]:
    """The entry points of ``group`` (the commands', the study sources'), on
    every Python the probe client runs on."""
    if sys.version_info >= (3, 10):
        return entry_points(group=group)
    # Python 3.9: entry_points() takes no selection and returns a dict by group.
    return entry_points().get(group, ())  # pragma: no cover


def _commands() -> Iterable[EntryPoint]:
    """The entry points of the ``kickass.commands`` group."""
    return entry_points_of(GROUP)


def _broken(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, module: str, exc: Exception
) -> None:
    """A subcommand whose module cannot be imported: listed, and an ERROR when run."""
    reason = f"{type(exc).__name__}: {exc}"
    p = sub.add_parser(name, help=f"(unavailable: {module} failed to import)", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)

    def fail(_args: argparse.Namespace) -> int:
        raise KickassError(
            f"the `{name}` command cannot load: {reason}",
            hint=f"reinstall the package that provides {module} (make install)",
        )

    p.set_defaults(func=fail)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    first = next((a for a in argv if not a.startswith("-")), None)
    # Options before the command (--help, --version) need the whole tree.
    parser = build_parser(first if argv and argv[0] == first else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KickassError as exc:
        print(exc.render(), file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `kickass ... | head`: the reader left; say nothing more (Python docs'
        # recipe: point stdout at devnull so the exit flush cannot fail again).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
