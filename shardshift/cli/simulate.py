"""`shardshift simulate switch`: plan, schedule and time a layout switch of a large model over
thousands of ranks, with no tensors and no processes (`simulate.switch`)."""

from __future__ import annotations

import argparse
import json
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser("simulate", help="plan and time switches of large models over many ranks (no processes)")
    sims = p.add_subparsers(dest="simulation", required=True)
    s = sims.add_parser("switch", help="a layout switch: bytes moved and kept, rounds, memory, links, predicted time")
    s.add_argument("--model", required=True,
                   help="a shipped spec (llama3-70b, llama3-405b, qwen3-235b-a22b), a config file (YAML or a "
                        "Hugging Face config.json), or a model of `shardshift train` (tiny, llama-base, moe-tiny, ..., "
                        "hf:DIR, FILE.py:NAME)")
    s.add_argument("--ranks", type=int, required=True, help="processes of the job (the layouts' size)")
    s.add_argument("--from", dest="old", required=True, metavar="LAYOUT", help="e.g. dp=8,ep=16,tp=4,pp=8")
    s.add_argument("--to", dest="new", required=True, metavar="LAYOUT", help="e.g. dp=16,ep=8,tp=4,pp=8")
    s.add_argument("--cluster", default=None, metavar="FILE",
                   help="a topology YAML of 'preset: cluster' (docs/topology.md); default: hosts of 8 GPUs, "
                        "450 GB/s NVLink class, 8 x 400 Gbit/s NICs, as many hosts as the ranks need")
    s.add_argument("--budget", default="256M", help="memory a switch may use beyond max(old, new) per rank")
    s.add_argument("--dtype", default="float32", help="dtype of parameters and moments (float32, bfloat16, ...)")
    s.add_argument("--memory-per-rank", default=None, metavar="SIZE",
                   help="refuse a layout whose state does not fit, e.g. 141G")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=_run_switch)


def _run_switch(args: argparse.Namespace) -> int:
    from shardshift.layout import Layout
    from shardshift.units import parse_size

    try:
        old, new = Layout.parse(args.old), Layout.parse(args.new)
        if args.ranks < 1 or old.world_size != args.ranks:
            raise ValueError(f"--from {old} has {old.world_size} ranks, not --ranks {args.ranks}")
        budget = parse_size(args.budget, "--budget")
        memory = None if args.memory_per_rank is None else parse_size(args.memory_per_rank, "--memory-per-rank")
        cluster = _cluster(args.cluster, args.ranks)
        from shardshift.simulate.switch import model_space, simulate_switch

        space = model_space(args.model, args.dtype)
        result = simulate_switch(space, old, new, cluster, budget, memory)
    except ValueError as err:
        print(f"shardshift: error: {err}", file=sys.stderr)
        return 2
    report = {"model": args.model, **result.report()}
    print(json.dumps(report) if args.json else _text(report), flush=True)
    return 0


def _cluster(path: str | None, ranks: int):
    from shardshift.simulate.cluster import Cluster, load_cluster

    if path is None:
        return Cluster(hosts=-(-ranks // 8), name="default cluster")
    cluster = load_cluster(path)
    if cluster.ranks < ranks:
        raise ValueError(f"--cluster {path} has {cluster.ranks} GPUs, fewer than --ranks {ranks}")
    return cluster


def _text(r: dict) -> str:
    from shardshift.units import format_size

    def size(key: str) -> str:
        return format_size(r[key])

    return "\n".join([
        f"{r['model']}: {r['from']} -> {r['to']} on {r['ranks']:,} ranks ({r['tensors']:,} logical tensors)",
        f"  moved {size('bytes_moved')} (lower bound {size('bytes_lower_bound')}), kept {size('bytes_kept')} in place, "
        f"of {size('bytes_total')} of state",
        f"  busiest rank receives {size('most_received_bytes')}, sends {size('most_sent_bytes')}; "
        f"{r['rounds']} round(s) within {size('budget_bytes')}, peak {size('peak_extra_bytes')} above the old state",
        f"  links: {size('intra_host_bytes')} inside hosts, {size('inter_host_bytes')} between hosts, "
        f"busiest NIC {size('busiest_nic_bytes')}",
        f"  executor, busiest rank: {r['pieces_per_rank']:,} pieces, {r['host_calls_per_rank']:,} host calls "
        f"({r['host_calls_per_rank_before']:,} copying piece by piece)",
        f"  predicted {r['predicted_seconds']:.3f} s on {r['cluster']} (no schedule below {r['limit_seconds']:.3f} s)",
        f"  planned in {r['plan_seconds']:.2f} s, scheduled in {r['schedule_seconds']:.2f} s, timed in "
        f"{r['predict_seconds']:.2f} s; {format_size(r['max_rss_bytes'])} of memory at most",
    ])
