"""`shardshift bench ...`: argument parsing of the benchmarks; what they run is in `shardshift.bench`.

    shardshift bench train --nproc 4 --layout dp=4          # tokens/s beside plain DDP
    shardshift bench switch --nproc 4 --suite               # online switch vs DCP vs restart vs the limit
    shardshift bench elastic --nproc 4 --suite              # joins, leaves, crashes vs restarts
    shardshift bench packing                                # tree packings vs their bounds
    shardshift bench packing --scale --runs 3               # fat trees and rail clusters, 256-1,024 hosts
    shardshift bench collectives --op allreduce --nproc 4   # gloo vs ring vs trees vs auto
    shardshift bench data                                   # prepare vs tokenizers; training from shards vs memory

`--plot FILE.png` (train, switch, collectives) also draws the report (`shardshift.plots.bench`).

Each parser builds the bench's typed options, which refuse bad input before any process starts
(exit 2 with one line). A multi-process bench then starts its ranks through `shardshift.launch`;
each rank runs the same command again, finds itself a rank of a job, and runs its part.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from shardshift.cli import add_device_argument, model_help
from shardshift.cli.topo import add_topology_arguments, pack_options_from_args, topology_from_args
from shardshift.collectives.planning.ops import Collective
from shardshift.layout import Layout

# `bench switch --suite`: every kind of boundary on 4 ranks (replication to sharding, fsdp to
# fsdp x tp, tp to pipeline stages, stages to replicas of shards, shards to tp, tp back to
# replication). Here, not in `shardshift.bench.switch`: building the parser must not import
# torch, which every rank of every bench would then pay.
DEFAULT_SUITE = "dp=4;fsdp=4;fsdp=2,tp=2;tp=2,pp=2;pp=4;dp=2,fsdp=2;tp=4;dp=4"
# The default suite of a model with experts: into expert parallelism from sharding, ep with each
# other axis, and out of it to pipeline stages and replication.
EXPERT_SUITE = "dp=4;fsdp=4;fsdp=2,ep=2;ep=4;ep=2,tp=2;ep=2,pp=2;tp=2,pp=2;ep=4;dp=4"


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks (ratios measured side by side in one run)")
    benches = parser.add_subparsers(dest="bench", required=True)
    _add_train(benches)
    _add_switch(benches)
    _add_elastic(benches)
    _add_packing(benches)
    _add_collectives(benches)
    _add_data(benches)


def _refused(build: Callable[[], object]):
    """(options, None), or (None, 2) after printing the error of input `build` refused."""
    try:
        return build(), None
    except ValueError as err:
        print(f"shardshift: error: {err}", file=sys.stderr)
        return None, 2


def _job(args: argparse.Namespace, build: Callable[[], object], rank_main: Callable[[object], int],
         start: Callable[[object, list[str]], int] | None = None) -> int:
    """Run a multi-process bench: as a rank, its part; else start its ranks, each running the
    same command (`start(opts, argv)`, by default `nproc` local ranks through the launcher)."""
    from shardshift.runtime import in_worker

    opts, code = _refused(build)
    if opts is None:
        return code
    if in_worker():
        return rank_main(opts)
    from shardshift.launch import launch

    try:
        if getattr(args, "device", None) == "cuda":
            from shardshift.runtime import resolve_device

            resolve_device("cuda", opts.nproc)  # a GPU per rank, or the error says what to do
        if start is not None:
            return start(opts, args.argv)
        return launch(opts.nproc, args.argv, preload=(rank_main.__module__,))
    except ValueError as err:  # e.g. an emulated network that cannot be built here
        print(f"shardshift: error: {err}", file=sys.stderr)
        return 2


def _positive(text: str, flag: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{flag} {text!r} is not a number") from None
    if not value > 0:
        raise ValueError(f"{flag} {text} must be > 0")
    return value


def _layouts(text: str) -> tuple[Layout, ...]:
    return tuple(Layout.parse(part) for part in text.split(";") if part.strip())


def _add_plot_argument(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--plot", type=Path, default=None, metavar="FILE.png",
                   help=f"also draw {what} into this PNG (needs matplotlib: pip install 'shardshift[plot]')")


# ---- train ----------------------------------------------------------------------------------------

def _add_train(benches) -> None:
    p = benches.add_parser("train", help="tokens/s of layouts vs plain PyTorch DDP, side by side")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--layout", default="dp=4", help="the layout compared with DDP")
    p.add_argument("--also", default="fsdp=4;tp=4;pp=4;fsdp=2,tp=2",
                   help="more variants reported beside it, separated by ';' (empty for none): a layout, and "
                        "optionally train's --activation-checkpointing, --compile, --mixed-precision or "
                        "--micro-batch-size after it ('fsdp=2 --compile;fsdp=2 --activation-checkpointing full')")
    p.add_argument("--model", default="tiny", help=model_help("tiny"))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--topology", default=None, metavar="FILE",
                   help="a YAML topology: train every layout on gloo and on trees packed on it (--collectives trees)")
    p.add_argument("--emulate", action="store_true", help="run the ranks on --topology's links, emulated (root)")
    p.add_argument("--emulate-scale", default="auto",
                   help="emulated rate = topology pair rate × this; 'auto' maps the fastest pair to 1 Gbit/s")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    _add_plot_argument(p, "tokens/s per layout as bars")
    p.add_argument("--timeout", type=float, default=600.0)
    add_device_argument(p)
    p.set_defaults(func=_run_train)


def _train_options(args: argparse.Namespace):
    from shardshift.bench.train import TrainBenchOptions, Variant
    from shardshift.models import model_spec
    from shardshift.train.config import TrainConfig

    layout = Layout.parse(args.layout)
    layout.check_world(args.nproc)  # before the batch is split for it: the mismatch is the error
    base = TrainConfig(layout=layout, model=model_spec(args.model),
                       steps=args.warmup + args.steps * args.rounds, dtype=args.dtype,
                       global_batch=args.global_batch)
    scale = 1.0
    if args.emulate and args.topology is not None:
        from shardshift.collectives.topology.io import load_topology
        from shardshift.netemu.topology import auto_scale

        scale = (auto_scale(load_topology(args.topology)) if args.emulate_scale == "auto"
                 else _positive(args.emulate_scale, "--emulate-scale"))
    also = tuple(Variant.parse(part) for part in args.also.split(";") if part.strip())
    return TrainBenchOptions(base=base, also=also, nproc=args.nproc, steps=args.steps,
                             rounds=args.rounds, warmup=args.warmup, timeout_s=args.timeout, json=args.json,
                             topology=args.topology, emulate=args.emulate, emulate_scale=scale, plot=args.plot)


def _run_train(args: argparse.Namespace) -> int:
    from shardshift.bench.train import run_rank, start

    return _job(args, lambda: _train_options(args), run_rank, start)


# ---- switch ---------------------------------------------------------------------------------------

def _add_switch(benches) -> None:
    p = benches.add_parser("switch", help="online layout switch vs DCP vs restart vs the link limit")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--from", dest="source", default=None, help="the layout switched from, e.g. dp=4")
    p.add_argument("--to", dest="target", default=None, help="the layout switched to, e.g. fsdp=2,tp=2")
    p.add_argument("--suite", nargs="?", const=DEFAULT_SUITE, default=None,
                   help=f"a chain of layouts separated by ';', each switched to from the one before "
                        f"(default, for 4 ranks: {DEFAULT_SUITE}; for a model with experts: {EXPERT_SUITE})")
    p.add_argument("--model", default="base", help=model_help("base"))
    p.add_argument("--dtype", default="float32", help="float32, float64 or bfloat16")
    p.add_argument("--global-batch", type=int, default=8,
                   help="sequences per step (8 is the least pp=4 takes with its 8 micro-batches)")
    p.add_argument("--budget", default="256M", help="bytes a rank moves per switch round, e.g. 64M")
    p.add_argument("--p2p-size", default="64M", help="message per ordered rank pair in the link-rate measurement")
    p.add_argument("--repeat", type=int, default=3,
                   help="measure each transition this many times, switching back between them (DCP and restart "
                        "likewise); medians are reported with min-max")
    p.add_argument("--no-restart", dest="restart", action="store_false",
                   help="skip the restart column (it starts a fresh job per transition: the slow part)")
    p.add_argument("--predict", action="store_true",
                   help="also predict each switch from its schedule on an alpha-beta model of this machine (the "
                        "link rate, per-message cost and copy rate measured in the run), beside the measured time")
    p.add_argument("--json", action="store_true", help='print one JSON object {"transitions": [...], ...}')
    _add_plot_argument(p, "each transition's seconds, four ways, as bars on a log scale")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a stuck collective fails the run")
    add_device_argument(p)
    p.set_defaults(func=_run_switch)


def _chain(args: argparse.Namespace) -> tuple[Layout, ...]:
    if args.suite is not None:
        if args.source is not None or args.target is not None:
            raise ValueError("give either --suite or --from and --to, not both")
        if args.suite == DEFAULT_SUITE and args.nproc != 4:
            raise ValueError(f"the default suite is for 4 ranks, not --nproc {args.nproc}; give a chain "
                             f"of layouts of {args.nproc} ranks, e.g. --suite 'dp={args.nproc};fsdp={args.nproc}'")
        if args.suite == DEFAULT_SUITE:
            from shardshift.models import model_spec

            return _layouts(EXPERT_SUITE if model_spec(args.model).expert_modules else DEFAULT_SUITE)
        return _layouts(args.suite)
    if args.source is None or args.target is None:
        raise ValueError("give --from LAYOUT and --to LAYOUT, or --suite for the default chain")
    return Layout.parse(args.source), Layout.parse(args.target)


def _switch_options(args: argparse.Namespace):
    from shardshift.bench.switch import SwitchBenchOptions
    from shardshift.models import model_spec
    from shardshift.train.config import TrainConfig
    from shardshift.units import parse_size

    if args.nproc < 2:
        raise ValueError(f"--nproc {args.nproc}: a switch moves state between ranks; give --nproc >= 2")
    chain = _chain(args)
    if len(chain) < 2:
        raise ValueError(f"--suite {args.suite!r} names {len(chain)} layout; a switch needs at least two")
    chain[0].check_world(args.nproc)
    if args.repeat < 1:
        raise ValueError(f"--repeat {args.repeat}: measure each transition at least once")
    # One step under the first layout, then one after each measured switch: the LR schedule's horizon.
    cfg = TrainConfig(layout=chain[0], model=model_spec(args.model),
                      steps=1 + (len(chain) - 1) * args.repeat, dtype=args.dtype, global_batch=args.global_batch)
    return SwitchBenchOptions(chain=chain, cfg=cfg, nproc=args.nproc, budget=parse_size(args.budget, "--budget"),
                              repeat=args.repeat, p2p_bytes=parse_size(args.p2p_size, "--p2p-size"), restart=args.restart,
                              predict=args.predict, timeout_s=args.timeout, json=args.json, plot=args.plot)


def _run_switch(args: argparse.Namespace) -> int:
    from shardshift.bench.switch import run_rank

    return _job(args, lambda: _switch_options(args), run_rank)


# ---- elastic --------------------------------------------------------------------------------------

# `bench elastic --suite` from 4 workers under HSDP (dp=2,fsdp=2: every shard has a replica), worlds
# of 3 and 2 under FSDP: a crash 4->3 (from the replicas), a leave 3->2, joins 2->3->4, a crash 4->3,
# a join 3->4.
ELASTIC_SUITE = ("2:kill=3", "3:leave=2", "4:join=1", "5:join=1", "6:kill=1", "7:join=1")
ELASTIC_SUITE_LAYOUTS = ((4, Layout(dp=2, fsdp=2)), (3, Layout(fsdp=3)), (2, Layout(fsdp=2)))
# `bench elastic --crashes N`: a 3-worker ring that loses a worker inside every other step and gets
# one back after the next.
CRASH_RING_LAYOUTS = ((3, Layout(dp=3)), (2, Layout(dp=2)))


def crash_ring(crashes: int) -> tuple[str, ...]:
    """The events of `--crashes N`: a kill inside steps 2, 4, ... (rank 0, 1, 2, 0, ...), a join
    after steps 3, 5, ..."""
    events = []
    for k in range(crashes):
        events += [f"{2 + 2 * k}:kill={k % 3}", f"{3 + 2 * k}:join=1"]
    return tuple(events)


def _add_elastic(benches) -> None:
    p = benches.add_parser("elastic", help="joins, leaves and crashes in the running job vs a restart from DCP")
    p.add_argument("--nproc", type=int, default=4, help="workers of the first world")
    p.add_argument("--suite", action="store_true",
                   help=f"the default events (for 4 workers): {' '.join(ELASTIC_SUITE)}, with --layout-for "
                        f"{' '.join(f'{n}:{layout}' for n, layout in ELASTIC_SUITE_LAYOUTS)}")
    p.add_argument("--inject", action="append", default=[], metavar="STEP:EVENT",
                   help="an event after step STEP (repeatable): join=N, leave=RANK, kill=RANK")
    p.add_argument("--crashes", type=int, default=0, metavar="N",
                   help="N kills inside a step of a 3-worker ring (dp=3), each followed by a join: the crashes' "
                        "pauses, median and max (no restart column, no overhead jobs)")
    p.add_argument("--layout-for", action="append", default=[], metavar="N:LAYOUT",
                   help="the layout of a world of N workers (otherwise fsdp=N, else dp=N)")
    p.add_argument("--model", default="base", help=model_help("base"))
    p.add_argument("--dtype", default="float32", help="float32, float64 or bfloat16")
    p.add_argument("--global-batch", type=int, default=12, help="sequences per step")
    p.add_argument("--no-restart", dest="restart", action="store_false", help="skip the restart column")
    p.add_argument("--overhead-steps", type=int, default=4,
                   help="steps of each of the two fixed fsdp=N jobs (--redundancy 0 and 1) that measure what "
                        "--redundancy 1 costs per step (0: skip)")
    p.add_argument("--json", action="store_true", help='print one JSON object {"events": [...], ...}')
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a stuck collective fails the run")
    p.set_defaults(func=_run_elastic)


def _elastic_options(args: argparse.Namespace):
    from shardshift.bench.elastic import ElasticBenchOptions
    from shardshift.elastic.config import Inject, parse_layout_for
    from shardshift.models import model_spec
    from shardshift.train.config import TrainConfig

    if sum(map(bool, (args.suite, args.inject, args.crashes))) > 1:
        raise ValueError("give one of --suite, --inject and --crashes")
    if args.crashes < 0:
        raise ValueError(f"--crashes {args.crashes} must be >= 1")
    if args.suite and args.nproc != 4:
        raise ValueError(f"the default suite is for 4 workers, not --nproc {args.nproc}; script events with --inject")
    if args.crashes and (args.nproc, args.layout_for) != (4, []):
        raise ValueError("--crashes runs its own 3-worker ring: leave out --nproc and --layout-for")
    script = ELASTIC_SUITE if args.suite else crash_ring(args.crashes) if args.crashes else args.inject
    injects = tuple(Inject.parse(text) for text in script)
    layouts = tuple(parse_layout_for(text) for text in args.layout_for) or (
        ELASTIC_SUITE_LAYOUTS if args.suite else CRASH_RING_LAYOUTS if args.crashes else ())
    nproc = 3 if args.crashes else args.nproc
    first = dict(layouts).get(nproc, Layout(fsdp=nproc))
    steps = max((i.step for i in injects), default=0) + 2  # one step after the last event, and the one it redoes
    cfg = TrainConfig(layout=first, model=model_spec(args.model), steps=steps,
                      dtype=args.dtype, global_batch=args.global_batch, log_every=0)
    return ElasticBenchOptions(cfg=cfg, nproc=nproc, injects=injects, layouts=layouts,
                               restart=args.restart and not args.crashes,
                               overhead_steps=0 if args.crashes else args.overhead_steps, timeout_s=args.timeout,
                               json=args.json)


def _run_elastic(args: argparse.Namespace) -> int:
    opts, code = _refused(lambda: _elastic_options(args))
    if opts is None:
        return code
    from shardshift.bench.elastic import run_elastic_bench

    return run_elastic_bench(opts)


# ---- packing --------------------------------------------------------------------------------------

def _add_packing(benches) -> None:
    p = benches.add_parser("packing", help="tree packing vs bounds on DGX-1 subsets and large topologies")
    p.add_argument("--sizes", default="3:8", help="DGX-1 subset sizes, 'lo:hi' inclusive (default 3:8)")
    p.add_argument("--pcie", action="store_true", help="include the PCIe/QPI fallback (all subsets)")
    p.add_argument("--ops", default=None, help="comma-separated ops (default: all five; --scale: broadcast,allreduce)")
    p.add_argument("--limit", type=int, default=0, help="at most this many DGX-1 subsets (0: all)")
    p.add_argument("--skip-large", action="store_true", help="skip the 256-host multiplicative-weights case")
    p.add_argument("--scale", action="store_true",
                   help="instead: multiplicative weights on fat trees and rail clusters of up to 1,024 hosts (minutes)")
    p.add_argument("--families", default=None,
                   help="--scale: fat-tree, rails (2 GPUs a host), rails-gpu (8 GPUs a host), rails-host "
                        "(a rank per host, 8 NICs); default the first three")
    p.add_argument("--hosts", default=None,
                   help="--scale: numbers of hosts of every family, e.g. 256,512 (default: the family's own)")
    p.add_argument("--runs", type=int, default=None, help="--scale: solves of every row (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run_packing)


def _packing_options(args: argparse.Namespace):
    from shardshift.bench.packing import PackingBenchOptions

    lo, sep, hi = args.sizes.partition(":")
    try:
        sizes = (int(lo), int(hi or lo))
    except ValueError:
        raise ValueError(f"--sizes {args.sizes!r}: give subset sizes 'lo:hi', e.g. 3:8") from None
    ops_text = args.ops or ("broadcast,allreduce" if args.scale else ",".join(op.value for op in Collective))
    try:
        ops = tuple(Collective.parse(op) for op in ops_text.split(",") if op.strip())
    except ValueError as err:
        raise ValueError(f"--ops {ops_text}: {err}") from None
    scale = {}
    if args.scale:
        if args.hosts is not None:
            try:
                scale["hosts"] = tuple(int(h) for h in args.hosts.split(",") if h.strip())
            except ValueError:
                raise ValueError(f"--hosts {args.hosts!r}: give numbers separated by commas, e.g. 256,512") from None
        if args.families is not None:
            scale["families"] = tuple(f.strip() for f in args.families.split(",") if f.strip())
        if args.runs is not None:
            scale["runs"] = args.runs
    else:
        given = [flag for flag, value in (("--hosts", args.hosts), ("--families", args.families),
                                          ("--runs", args.runs)) if value is not None]  # fmt: skip
        if given:
            raise ValueError(f"{', '.join(given)} apply to --scale; add --scale")
    return PackingBenchOptions(sizes=sizes, pcie=args.pcie, ops=ops, limit=args.limit, skip_large=args.skip_large,
                               scale=args.scale, json=args.json, **scale)  # fmt: skip


def _run_packing(args: argparse.Namespace) -> int:
    from shardshift.bench.packing import run

    opts, code = _refused(lambda: _packing_options(args))
    return code if opts is None else run(opts)


# ---- collectives ----------------------------------------------------------------------------------

def _add_collectives(benches) -> None:
    from shardshift.bench.collectives import DTYPES, IMPLS, REDOPS
    from shardshift.collectives.execution.program import (
        CHUNK_SECONDS,
        MAX_CHUNKS_PER_TREE,
        MAX_CHUNKS_TOTAL,
        MIN_CHUNK_BYTES,
    )

    p = benches.add_parser("collectives", help="gloo vs ring vs packed trees, nccl-tests style")
    p.add_argument("--op", required=True, choices=[op.value for op in Collective])
    p.add_argument("--sizes", default="1M:64M",
                   help="bytes: LO:HI (powers of two, like nccl-tests -b LO -e HI -f 2) or a "
                        "comma list; units K, M, G (of 1024)")
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: the topology's)")
    add_topology_arguments(p)
    p.add_argument("--emulate", action="store_true", help="run the ranks on emulated links (root)")
    p.add_argument("--probe", action="store_true",
                   help="pack ring and trees on the topology the ranks measure (topology/probe.py); the "
                        "bound printed is the probed topology's")
    p.add_argument("--emulate-scale", default="auto",
                   help="emulated rate = topology pair rate × this; 'auto' maps the fastest pair to 1 Gbit/s")
    p.add_argument("--tcp-slow-start-after-idle", action="store_true",
                   help="emulate: keep the kernel's default of restarting TCP slow start after an idle period")
    p.add_argument("--root", type=int, default=0, help="root of broadcast / reduce")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--redop", default="sum", choices=REDOPS)
    p.add_argument("--iters", type=int, default=3, help="timed rounds per size (median reported)")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma list of gloo, ring, trees, auto")
    p.add_argument("--mode", default=None, choices=["dataflow", "stepped"], help="tree executor mode")
    p.add_argument("--min-chunk-bytes", type=int, default=MIN_CHUNK_BYTES,
                   help="pipeline chunk floor, per tree a chunk crosses (an all-reduce chunk crosses two)")
    p.add_argument("--max-chunks", type=int, default=MAX_CHUNKS_PER_TREE, help="pipeline chunks per tree, at most")
    p.add_argument("--max-total-chunks", type=int, default=MAX_CHUNKS_TOTAL,
                   help="pipeline chunks over all pieces together, at most (an all-reduce piece is a tree pair)")
    p.add_argument("--chunk-seconds", type=float, default=CHUNK_SECONDS,
                   help="aimed time of one pipeline chunk at the packing's rate")
    p.add_argument("--window", type=int, default=4, help="messages posted ahead per queue (peer, tree, direction)")
    p.add_argument("--keep", type=float, default=0.995,
                   help="packing: cut trees while keeping >= this fraction of the solved rate")
    p.add_argument("--max-trees", type=int, default=None, help="packing: at most this many trees")
    p.add_argument("--depth", choices=["auto", "any", "shallow"], default="auto",
                   help="packing: tree depth (auto, any, shallow; see `shardshift topo pack`)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    p.add_argument("--json", action="store_true", help='print {"rows": [...]}')
    _add_plot_argument(p, "algbw against message size, a line per implementation")
    p.set_defaults(func=_run_collectives)


def _collectives_options(args: argparse.Namespace):
    from shardshift.bench.collectives import CollectivesBenchOptions
    from shardshift.collectives.execution.runner import RunOptions
    from shardshift.netemu.topology import auto_scale, scaled
    from shardshift.units import parse_size_list

    topology = None
    if args.preset is None and args.topology is None:
        if args.nproc is None:
            raise ValueError("give --nproc N, or a topology (--preset / --topology) to take it from")
    else:
        if args.preset in ("ring", "full") and args.ranks is None:
            args.ranks = args.nproc
        if args.preset == "fat-tree" and args.hosts is None:
            args.hosts = args.nproc
        topology = topology_from_args(args)
    for flag, value in (("--timeout", args.timeout), ("--window", args.window), ("--min-chunk-bytes", args.min_chunk_bytes),
                        ("--max-chunks", args.max_chunks), ("--max-total-chunks", args.max_total_chunks),
                        ("--chunk-seconds", args.chunk_seconds)):
        if not value > 0:
            raise ValueError(f"{flag} {value} must be > 0")
    scale = 1.0
    if args.emulate and topology is not None:
        scale = auto_scale(topology) if args.emulate_scale == "auto" else _positive(args.emulate_scale, "--emulate-scale")
        if scale != 1.0:
            topology = scaled(topology, scale)  # what the emulated network is: plans see its rates
    pack = pack_options_from_args(args)
    run = RunOptions(mode=args.mode, timeout_s=args.timeout, window=args.window, min_chunk_bytes=args.min_chunk_bytes,
                     max_chunks_per_tree=args.max_chunks, max_chunks_total=args.max_total_chunks,
                     chunk_seconds=args.chunk_seconds, pack_options=pack)
    return CollectivesBenchOptions(
        op=Collective.parse(args.op), sizes=tuple(parse_size_list(args.sizes, "--sizes")),
        nproc=args.nproc if args.nproc is not None else topology.num_ranks, topology=topology,
        impls=tuple(i.strip() for i in args.impls.split(",") if i.strip()), root=args.root, dtype=args.dtype,
        redop=args.redop, iters=args.iters, run=run, emulate=args.emulate, emulate_scale=scale,
        tcp_slow_start_after_idle=args.tcp_slow_start_after_idle, probe=args.probe, timeout_s=args.timeout,
        json=args.json, plot=args.plot,
    )  # fmt: skip


def _run_collectives(args: argparse.Namespace) -> int:
    from shardshift.bench import collectives, collectives_rank

    return _job(args, lambda: _collectives_options(args), collectives_rank.run, collectives.run)


# ---- data -----------------------------------------------------------------------------------------

def _add_data(benches) -> None:
    p = benches.add_parser("data", help="data prepare's MB/s vs tokenizers'; training from prepared shards vs memory")
    p.add_argument("--input", nargs="+", action="extend", default=[], metavar="PATH",
                   help="what to prepare, as `data prepare --input` takes it (default: a generated JSON lines "
                        "corpus of --corpus-size, documents cut from the shipped corpus)")
    p.add_argument("--corpus-size", default=None, metavar="SIZE", help="the generated corpus's size (default 32M)")
    p.add_argument("--tokenizer", default="bpe:4096", metavar="T", help="bytes, hf:PATH or bpe:N (default bpe:4096)")
    p.add_argument("--field", default="text", help="the field of each JSON line that holds its text (default text)")
    p.add_argument("--nproc", type=int, default=2, help="ranks of the training part")
    p.add_argument("--layout", default=None, help="the training part's layout (default dp=NPROC)")
    p.add_argument("--model", default="tiny", help=model_help("tiny") + "; it takes the prepared data's vocabulary")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=10, help="timed training steps per variant per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds of both parts; medians are reported with min-max")
    p.add_argument("--warmup", type=int, default=2, help="untimed training steps per variant first")
    p.add_argument("--json", action="store_true", help='print one JSON object {"prepare": ..., "training": ...}')
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a stuck collective fails the run")
    p.add_argument("--workdir", type=Path, default=None, help=argparse.SUPPRESS)  # the launcher's, on its ranks
    add_device_argument(p)
    p.set_defaults(func=_run_data)


def _data_options(args: argparse.Namespace):
    from shardshift.bench.data import DEFAULT_CORPUS_BYTES, DataBenchOptions
    from shardshift.models import model_spec
    from shardshift.train.config import TrainConfig
    from shardshift.units import parse_size

    if args.input and args.corpus_size is not None:
        raise ValueError("--corpus-size sizes the generated corpus; leave it out with --input")
    if args.nproc < 1:
        raise ValueError(f"--nproc {args.nproc} must be >= 1")
    layout = Layout.parse(args.layout) if args.layout is not None else Layout(dp=args.nproc)
    layout.check_world(args.nproc)
    base = TrainConfig(layout=layout, model=model_spec(args.model), steps=args.warmup + args.steps * args.rounds,
                       dtype=args.dtype, global_batch=args.global_batch)
    size = DEFAULT_CORPUS_BYTES if args.corpus_size is None else parse_size(args.corpus_size, "--corpus-size")
    return DataBenchOptions(inputs=tuple(args.input), corpus_bytes=size, tokenizer=args.tokenizer, field=args.field,
                            model=args.model, base=base, nproc=args.nproc, steps=args.steps, rounds=args.rounds,
                            warmup=args.warmup, timeout_s=args.timeout, json=args.json, workdir=args.workdir)


def _run_data(args: argparse.Namespace) -> int:
    from shardshift.bench import data

    return _job(args, lambda: _data_options(args), data.run_rank, data.run)
