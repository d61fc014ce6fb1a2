"""Entry point of the `shardshift` command.

The command tree is the table below; each leaf module defines `register(subparsers)`, which adds its
parser and sets `func` on it. Only the modules of the command being run are imported, so a
command's heavy imports (torch, scipy) are paid only by the commands that use them, and a broken
module breaks only its own command.
"""

from __future__ import annotations

import argparse
import importlib
import sys

_COMMANDS = (
    ("train", "shardshift.cli.train"),
    ("topo", "shardshift.cli.topo"),
)
# `shardshift bench <name>`: benchmarks that print ratios measured side by side in one run.
_BENCHES = (
    ("train", "shardshift.cli.bench_train"),
    ("packing", "shardshift.cli.bench_packing"),
    ("collectives", "shardshift.cli.bench_collectives"),
    ("switch", "shardshift.cli.bench_switch"),
)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """A parser that knows the command `argv` names, or every command when it names none."""
    parser = argparse.ArgumentParser(
        prog="shardshift",
        description="Elastic multi-dimensional parallel training and topology-aware collectives.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    command = argv[0] if argv else None
    known = {name for name, _ in _COMMANDS} | {"bench"}
    for name, module in _COMMANDS:
        if command not in known or command == name:
            importlib.import_module(module).register(sub)
    if command not in known or command == "bench":
        bench = sub.add_parser("bench", help="benchmarks (ratios measured in one run)")
        benches = bench.add_subparsers(dest="bench", required=True)
        chosen = argv[1] if command == "bench" and len(argv) > 1 else None
        for name, module in _BENCHES:
            if chosen not in {n for n, _ in _BENCHES} or chosen == name:
                importlib.import_module(module).register(benches)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    args.argv = argv  # for launchers that re-run the same command in worker processes
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
