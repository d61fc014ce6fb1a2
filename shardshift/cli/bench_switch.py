"""`shardshift bench switch`: the online layout switch beside DCP, a restart and the physical limit.

    shardshift bench switch --nproc 4 --suite                  # the default chain, model base
    shardshift bench switch --nproc 4 --model tiny --from dp=4 --to fsdp=2,tp=2
    shardshift bench switch --nproc 2 --model test --suite 'dp=2;fsdp=2;pp=2' --json

Columns, for each transition A → B (train/bench_switch.py says exactly what each one includes;
every time is the slowest rank's):

  switch   `Trainer.switch(B)`: plan, build B's model, move the state, ready to step
  dcp      DCP save under A + DCP load into a trainer already built under B, same processes
  restart  DCP save + a fresh `shardshift train --resume` job under B until its first step starts
  limit    the most bytes one rank must receive ÷ the all-pairs point-to-point rate measured in
           the same run: no switch can be faster
  moved    bytes sent between ranks / all state under B (replicas counted)
  peak     the most state + buffers a rank held during the switch; extra: beyond
           max(its old state, its new state), which the budget bounds

and the ratios dcp/switch, restart/switch, switch/limit, with their geometric means over the
transitions. The chain starts from one trainer under its first layout that has taken one step;
each transition starts where the previous one ended, and one step is trained after each switch.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from shardshift.layout import Layout
from shardshift.runtime import in_worker

# Every kind of boundary on 4 ranks: replication to sharding, fsdp to fsdp x tp, tp to pipeline
# stages, stages to replicas of shards, shards to tp, tp back to replication.
DEFAULT_SUITE = "dp=4;fsdp=4;fsdp=2,tp=2;tp=2,pp=2;pp=4;dp=2,fsdp=2;tp=4;dp=4"


def register(subparsers) -> None:
    p = subparsers.add_parser("switch", help="online layout switch vs DCP vs restart vs the link limit")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--from", dest="source", default=None, help="the layout switched from, e.g. dp=4")
    p.add_argument("--to", dest="target", default=None, help="the layout switched to, e.g. fsdp=2,tp=2")
    p.add_argument("--suite", nargs="?", const=DEFAULT_SUITE, default=None,
                   help=f"a chain of layouts separated by ';', each switched to from the one before "
                        f"(default, for 4 ranks: {DEFAULT_SUITE})")
    p.add_argument("--model", default="base", help="model size: test, tiny, small, medium, base")
    p.add_argument("--dtype", default="float32", help="float32, float64 or bfloat16")
    p.add_argument("--global-batch", type=int, default=8,
                   help="sequences per step (8 is the least pp=4 takes with its 8 micro-batches)")
    p.add_argument("--budget", default="256M", help="bytes a rank moves per switch round, e.g. 64M")
    p.add_argument("--p2p-size", default="64M", help="message per ordered rank pair in the link-rate measurement")
    p.add_argument("--no-restart", dest="restart", action="store_false",
                   help="skip the restart column (it starts a fresh job per transition: the slow part)")
    p.add_argument("--json", action="store_true", help='print one JSON object {"transitions": [...], ...}')
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a stuck collective fails the run")
    p.set_defaults(func=run)


def chain_from_args(args: argparse.Namespace) -> list[Layout]:
    """The layouts walked, first to last; ValueError with what to change."""
    if args.nproc < 2:
        raise ValueError(f"--nproc {args.nproc}: a switch moves state between ranks; give --nproc >= 2")
    if args.suite is not None:
        if args.source is not None or args.target is not None:
            raise ValueError("give either --suite or --from and --to, not both")
        if args.suite == DEFAULT_SUITE and args.nproc != 4:
            raise ValueError(f"the default suite is for 4 ranks, not --nproc {args.nproc}; give a chain "
                             f"of layouts of {args.nproc} ranks, e.g. --suite 'dp={args.nproc};fsdp={args.nproc}'")
        chain = [Layout.parse(text) for text in args.suite.split(";") if text.strip()]
    elif args.source is None or args.target is None:
        raise ValueError("give --from LAYOUT and --to LAYOUT, or --suite for the default chain")
    else:
        chain = [Layout.parse(args.source), Layout.parse(args.target)]
    if len(chain) < 2:
        raise ValueError(f"--suite {args.suite!r} names {len(chain)} layout; a switch needs at least two")
    for a, b in zip(chain, chain[1:]):
        if a == b:
            raise ValueError(f"the chain switches from {a} to itself; drop the repeated layout")
    return chain


def _config(args: argparse.Namespace, chain: list[Layout]):
    from shardshift.train.config import TrainConfig, model_config

    if args.timeout <= 0:
        raise ValueError(f"--timeout {args.timeout} must be > 0 seconds")
    for layout in chain:
        layout.check_world(args.nproc)
    # One step under the first layout, then one after each switch: the LR schedule's horizon.
    cfg = TrainConfig(layout=chain[0], model=model_config(args.model), model_name=args.model,
                      steps=len(chain), dtype=args.dtype, global_batch=args.global_batch)
    for layout in chain[1:]:
        cfg.with_layout(layout)  # refuses a layout the model or the batch cannot take
    return cfg


def run(args: argparse.Namespace) -> int:
    from shardshift.reshard.schedule import MIN_BUDGET, parse_size

    try:
        chain = chain_from_args(args)
        cfg = _config(args, chain)
        budget, p2p_bytes = parse_size(args.budget), parse_size(args.p2p_size)
        if budget < MIN_BUDGET:
            raise ValueError(f"--budget {args.budget} is {budget} bytes; give at least {MIN_BUDGET} (4K)")
    except ValueError as err:
        print(f"shardshift: error: {err}", file=sys.stderr)
        return 2
    if not in_worker():
        from shardshift.launch import launch

        return launch(args.nproc, args.argv)

    import torch.distributed as dist

    from shardshift.runtime import init_distributed
    from shardshift.train.bench_switch import BenchOptions, run_switch_bench

    opts = BenchOptions(budget=budget, p2p_bytes=p2p_bytes, restart=args.restart, timeout_s=args.timeout)
    proc = init_distributed(args.timeout)
    try:
        records = run_switch_bench(cfg, chain, proc.rank, proc.device_type, opts)
    finally:
        dist.destroy_process_group()
    if proc.rank == 0:
        _print(records, cfg, args, proc.device_type)
    return 0


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def _geomean(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def _size(n: float) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _restart_cell(r: dict) -> str:
    return "failed" if r.get("restart_error") else _fmt(r["restart_seconds"], ".2f")


def _print(records: list[dict], cfg, args: argparse.Namespace, device_type: str) -> None:
    for r in records:
        r["dcp_over_switch"] = _ratio(r["dcp_seconds"], r["switch_seconds"])
        r["restart_over_switch"] = _ratio(r["restart_seconds"], r["switch_seconds"])
        r["switch_over_limit"] = _ratio(r["switch_seconds"], r["limit_seconds"])
    means = {key: _geomean([r[key] for r in records])
             for key in ("dcp_over_switch", "restart_over_switch", "switch_over_limit")}
    if args.json:
        print(json.dumps({
            "model": cfg.model_name, "params": cfg.model.num_params(), "nproc": args.nproc,
            "device": device_type, "dtype": cfg.dtype, "global_batch": cfg.global_batch,
            "budget": records[0]["budget"], "transitions": records, "geomean": means,
        }))
        return
    print(f"model {cfg.model_name} ({cfg.model.num_params():,} parameters, {cfg.dtype}), {args.nproc} "
          f"{device_type} ranks, budget {_size(records[0]['budget'])} per round; seconds, slowest rank")
    head = (f"{'transition':<28}{'switch':>8}{'dcp':>8}{'restart':>9}{'limit':>8} |{'dcp/sw':>8}"
            f"{'rst/sw':>8}{'sw/lim':>8} |{'moved':>9}{'of all':>9}{'peak':>9}{'extra':>9}{'link/s':>9}{'bad':>4}")
    print(head)
    print("-" * len(head))
    for r in records:
        print(f"{r['from'] + ' -> ' + r['to']:<28}{r['switch_seconds']:>8.2f}{r['dcp_seconds']:>8.2f}"
              f"{_restart_cell(r):>9}{r['limit_seconds']:>8.2f} |"
              f"{_fmt(r['dcp_over_switch'], '.2f'):>8}{_fmt(r['restart_over_switch'], '.2f'):>8}"
              f"{_fmt(r['switch_over_limit'], '.2f'):>8} |{_size(r['bytes_moved']):>9}"
              f"{_size(r['bytes_total']):>9}{_size(r['peak_mem_bytes']):>9}{_size(r['extra_mem_bytes']):>9}"
              f"{_size(r['link_bytes_per_s']):>9}{r['state_mismatches']:>4}")
    print("-" * len(head))
    print(f"{'geometric mean':<61}|{_fmt(means['dcp_over_switch'], '.2f'):>8}"
          f"{_fmt(means['restart_over_switch'], '.2f'):>8}{_fmt(means['switch_over_limit'], '.2f'):>8} |")
    for r in records:
        if r.get("restart_error"):
            print(f"restart failed for {r['from']} -> {r['to']}: {r['restart_error']}")
