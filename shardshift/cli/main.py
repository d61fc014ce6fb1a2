"""Entry point of the `shardshift` command.

The command tree is the table below; each module defines `register(subparsers)`, which adds its
parser (and the parsers of its subcommands) and sets `func` on them. Only the module of the
command being run is imported, and each imports what a subcommand needs only when it runs, so a
command's heavy imports (torch, scipy) are paid only by the commands that use them, and a broken
module breaks only its own command.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

_COMMANDS = (
    ("train", "shardshift.cli.train"),
    ("join", "shardshift.cli.join"),
    ("sample", "shardshift.cli.sample"),
    ("export", "shardshift.cli.export"),  # a checkpoint as a Hugging Face model directory
    ("topo", "shardshift.cli.topo"),
    ("bench", "shardshift.cli.bench"),  # benchmarks that print ratios measured side by side in one run
    ("plot", "shardshift.cli.plot"),  # pictures of training runs from their --metrics files
    ("simulate", "shardshift.cli.simulate"),  # switches of large models over many ranks, planned and timed
    ("data", "shardshift.cli.data"),  # text and JSON lines tokenized into token shards
)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """A parser that knows the command `argv` names, or every command when it names none."""
    parser = argparse.ArgumentParser(
        prog="shardshift",
        description="Elastic multi-dimensional parallel training and topology-aware collectives.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    command = argv[0] if argv else None
    known = {name for name, _ in _COMMANDS}
    for name, module in _COMMANDS:
        if command not in known or command == name:
            importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    args.argv = argv  # for launchers that re-run the same command in worker processes
    if getattr(args, "device", None):
        from shardshift.runtime import DEVICE_ENV

        os.environ[DEVICE_ENV] = args.device  # the ranks, forked or started by torchrun, read it
    code = int(args.func(args) or 0)
    from shardshift.runtime import in_worker, leave

    if in_worker():
        leave(code)  # a rank ends without the interpreter's teardown (`leave` says why)
    return code


if __name__ == "__main__":
    sys.exit(main())
