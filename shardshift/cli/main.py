"""Entry point of the `shardshift` command: one subcommand per module, registered below."""

from __future__ import annotations

import argparse
import importlib
import sys

# (command, module): each module defines `register(subparsers)`, which adds its parser and sets
# `func` on it. Modules are imported when the command line is parsed, so a command's heavy imports
# (torch, scipy) are paid only by the commands that use them.
_COMMANDS = (
    ("train", "shardshift.cli.train"),
    ("bench", "shardshift.cli.bench"),
    ("topo", "shardshift.cli.topo"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardshift", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for _name, module in _COMMANDS:
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
