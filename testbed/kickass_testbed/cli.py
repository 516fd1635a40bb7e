"""Subcommands contributed by kickass_testbed to the `kickass` command."""

from __future__ import annotations

import argparse

from . import demo, wan


def add_parser(sub: argparse._SubParsersAction) -> None:
    demo.add_parser(sub)
    wan.add_parser(sub)
