"""`shardshift bench ...`: benchmarks that print ratios measured side by side in one run."""

from __future__ import annotations

import importlib

# (name, module): each module defines `register(subparsers)` for `shardshift bench <name>`.
_BENCHES = (
    ("train", "shardshift.cli.bench_train"),
    ("collectives", "shardshift.cli.bench_collectives"),
    ("packing", "shardshift.cli.bench_packing"),
)


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks (ratios measured in one run)")
    sub = parser.add_subparsers(dest="bench", required=True)
    for _name, module in _BENCHES:
        importlib.import_module(module).register(sub)
