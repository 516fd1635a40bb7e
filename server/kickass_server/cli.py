"""`kickass`: the operator command (server, database, demo, testbed).

One module per subcommand; each exposes ``add_parser(subparsers)`` and sets
``func`` on its parser. Domain failures raise KickassError and are printed as
``ERROR: ...`` with a hint and exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__
from .errors import KickassError

# (module, needs optional package) — demo/testbed live in kickass_testbed.
SUBCOMMAND_MODULES = (
    "kickass_server.servercli",
    "kickass_server.dbcli",
    "kickass_server.telemetry",
    "kickass_testbed.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kickass",
        description="Kick-Ass measurement platform: run the measurement server, manage the "
        "database, run the namespace demo and testbed.",
    )
    parser.add_argument("--version", action="version", version=f"kickass {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and name.startswith(exc.name):
                continue  # optional package not installed
            raise
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KickassError as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
