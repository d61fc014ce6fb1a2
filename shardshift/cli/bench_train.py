"""`shardshift bench train`: ShardShift's training throughput beside plain DDP, in one run."""

from __future__ import annotations

import argparse
import json
import sys

from shardshift.layout import Layout
from shardshift.runtime import in_worker


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="tokens/s of layouts vs plain PyTorch DDP, side by side")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--layout", default="dp=4", help="the layout compared with DDP")
    p.add_argument("--also", default="fsdp=4;tp=4;pp=4;fsdp=2,tp=2",
                   help="more layouts reported beside it, separated by ';' (empty for none)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--timeout", type=float, default=600.0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shardshift.train.config import TrainConfig, model_config

    try:
        layouts = [Layout.parse(args.layout)]
        layouts += [Layout.parse(t) for t in args.also.split(";") if t.strip()]
        for layout in layouts:
            layout.check_world(args.nproc)
        base = TrainConfig(
            layout=layouts[0], model=model_config(args.model), model_name=args.model,
            steps=args.warmup + args.steps * args.rounds, dtype=args.dtype, global_batch=args.global_batch,
        )
        for layout in layouts:
            TrainConfig(**{**base.__dict__, "layout": layout, "micro_batches": 0})
    except ValueError as err:
        print(f"shardshift: error: {err}", file=sys.stderr)
        return 2
    if not in_worker():
        from shardshift.launch import launch

        return launch(args.nproc, args.argv)

    import torch.distributed as dist

    from shardshift.runtime import init_distributed
    from shardshift.train.bench import run_bench

    proc = init_distributed(args.timeout)
    try:
        results = run_bench(base, layouts, proc.rank, proc.device_type, args.steps, args.rounds, args.warmup)
    finally:
        dist.destroy_process_group()
    if proc.rank == 0:
        _print(results, args, proc.device_type)
    return 0


def _print(results, args, device_type: str) -> None:
    ddp = results[0]
    rows = [
        {"impl": r.name, "tokens_per_s": r.tokens_per_s, "seconds": r.seconds, "steps": r.steps,
         "ratio_vs_ddp": r.tokens_per_s / ddp.tokens_per_s}
        for r in results
    ]
    if args.json:
        print(json.dumps({"model": args.model, "nproc": args.nproc, "device": device_type, "rows": rows}))
        return
    print(f"model {args.model}, {args.nproc} {device_type} ranks, global batch {args.global_batch}, "
          f"{ddp.steps} timed steps per variant")
    print(f"{'impl':<16}{'tokens/s':>12}{'vs DDP':>9}")
    for row in rows:
        print(f"{row['impl']:<16}{row['tokens_per_s']:>12,.0f}{row['ratio_vs_ddp']:>9.3f}")
