"""Entry point of the `shardshift` command: one subcommand per module, registered below."""

from __future__ import annotations

import argparse
import importlib
import sys

# (command, module): each module defines `register(subparsers)`, which adds its parser and sets
# `func` on it. Only the module of the command being run is imported, so a command's heavy imports
# (torch, scipy) are paid only by the commands that use them.
_COMMANDS = (
    ("train", "shardshift.cli.train"),
    ("bench", "shardshift.cli.bench"),
    ("topo", "shardshift.cli.topo"),
)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser for `command`, or for every command when it is None (for --help)."""
    parser = argparse.ArgumentParser(
        prog="shardshift",
        description="Elastic multi-dimensional parallel training and topology-aware collectives.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in _COMMANDS:
        if command in (None, name):
            importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = {name for name, _ in _COMMANDS}
    command = argv[0] if argv and argv[0] in names else None
    args = build_parser(command).parse_args(argv)
    args.argv = argv  # for launchers that re-run the same command in worker processes
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
