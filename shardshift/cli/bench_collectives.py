"""`shardshift bench collectives`: gloo's own collective, a ring and ShardShift's packed trees, side by
side in one run, nccl-tests style.

    shardshift bench collectives --op allreduce --sizes 1M:64M --nproc 4
    shardshift bench collectives --op broadcast --sizes 16M:64M --topology lab.yaml --emulate --json
    shardshift bench collectives --op allgather --preset dgx1v --gpus 0,1,2,3,4 --emulate

Rows: size (bytes), count (elements), type, redop, root, impl, time (us, median over --iters of the
slowest rank), algbw (GB/s, 1e9 bytes; for all-gather and reduce-scatter the whole gathered
buffer), busbw (algbw × 2(n-1)/n for all-reduce, (n-1)/n for all-gather and reduce-scatter, 1 for
broadcast and reduce), #wrong (elements that differ from the locally computed result, summed over
ranks and runs), the bound of the topology (bounds.py) where one is given, and cpu: the share of
the host's CPUs busy during the timed calls (rank 0's host, from /proc/stat). Emulated ranks
share one host: where cpu is near 1, the CPUs, not the links, set the times.

  gloo   torch.distributed's own collective on the gloo group
  ring   the ring algorithm (ring.py) on the best ring of the topology, run by the tree executor
  trees  the packed trees (packing.py) run by the tree executor

Without --preset/--topology the trees are packed on a uniform `full` topology and no bound is
printed. --emulate runs the ranks in network namespaces whose every ordered pair is shaped to the
topology's pair rate × --emulate-scale (emulate_topology.py; `auto`, the default, maps the
fastest pair to 1 Gbit/s so that rates stay in the range shaped accurately here, REFERENCE.md
§5); the ranks then plan on the scaled topology, the network they really run on, and bounds are
in emulated units. --probe packs ring and trees on the topology the ranks measure when they
start (probe.py) and prints that topology's bound. Without --emulate the ranks talk over
loopback: CPU-bound and noisy, compare ratios only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from shardshift.cli.topo import add_topology_arguments, topology_from_args
from shardshift.collectives.exec_plan import CHUNK_SECONDS, MAX_CHUNKS_PER_TREE, MAX_CHUNKS_TOTAL, MIN_CHUNK_BYTES
from shardshift.collectives.ops import Collective

# auto: the shardshift backend with algorithm="auto" (picks trees or gloo per size by timing both).
_IMPLS = ("gloo", "ring", "trees", "auto")
_TYPES = ("float32", "float64", "bfloat16", "float16", "int32", "int64")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def register(subparsers) -> None:
    p = subparsers.add_parser("collectives", help="gloo vs ring vs packed trees, nccl-tests style")
    p.add_argument("--op", required=True, choices=[op.value for op in Collective])
    p.add_argument("--sizes", default="1M:64M",
                   help="bytes: LO:HI (powers of two, like nccl-tests -b LO -e HI -f 2) or a "
                        "comma list; units K, M, G (of 1024)")
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: the topology's)")
    add_topology_arguments(p)
    p.add_argument("--emulate", action="store_true", help="run the ranks on emulated links (root)")
    p.add_argument("--probe", action="store_true",
                   help="pack ring and trees on the topology the ranks measure (probe.py); the bound "
                        "printed is the probed topology's")
    p.add_argument("--emulate-scale", default="auto",
                   help="emulated rate = topology pair rate × this; 'auto' maps the fastest pair to 1 Gbit/s")
    p.add_argument("--tcp-slow-start-after-idle", action="store_true",
                   help="emulate: keep the kernel's default of restarting TCP slow start after an idle period")
    p.add_argument("--root", type=int, default=0, help="root of broadcast / reduce")
    p.add_argument("--dtype", default="float32", choices=_TYPES)
    p.add_argument("--redop", default="sum", choices=["sum", "product", "min", "max", "avg"])
    p.add_argument("--iters", type=int, default=3, help="timed rounds per size (median reported)")
    p.add_argument("--impls", default=",".join(_IMPLS), help="comma list of gloo, ring, trees, auto")
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
    p.set_defaults(func=run)


def parse_sizes(text: str) -> list[int]:
    """'1M:64M' → 1 MiB, 2 MiB, ..., 64 MiB; '1M,3M' → those; bytes."""
    def one(word: str) -> int:
        word = word.strip().upper().removesuffix("B")
        unit = word[-1] if word and word[-1] in "KMG" else ""
        try:
            value = float(word[: len(word) - len(unit)]) * _UNITS[unit]
        except ValueError:
            raise ValueError(f"--sizes: {word!r} is not a size; write e.g. 512K, 16M or 1G") from None
        if value < 1:
            raise ValueError(f"--sizes: {word!r} must be at least 1 byte")
        return int(value)

    if ":" in text:
        lo, hi = (one(w) for w in text.split(":", 1))
        if hi < lo:
            raise ValueError(f"--sizes {text}: the upper end is below the lower one")
        sizes = [lo]
        while sizes[-1] * 2 <= hi:
            sizes.append(sizes[-1] * 2)
        return sizes
    return [one(w) for w in text.split(",") if w.strip()]


def _topology(args):
    """The topology (or None) and the number of ranks."""
    if args.preset is None and args.topology is None:
        if args.nproc is None:
            raise ValueError("give --nproc N, or a topology (--preset / --topology) to take it from")
        return None, args.nproc
    if args.preset in ("ring", "full") and args.ranks is None:
        args.ranks = args.nproc
    if args.preset == "fat-tree" and args.hosts is None:
        args.hosts = args.nproc
    topology = topology_from_args(args)
    if args.nproc is not None and args.nproc != topology.num_ranks:
        raise ValueError(f"--nproc {args.nproc} but the topology has {topology.num_ranks} ranks; "
                         "drop --nproc or give a matching topology")  # fmt: skip
    return topology, topology.num_ranks


def run(args: argparse.Namespace) -> int:
    from shardshift.collectives.bounds import collective_bound
    from shardshift.collectives.emulate_topology import auto_scale, emulation_rates, scaled
    from shardshift.collectives.packing import PackOptions
    from shardshift.collectives.topology_spec import topology_to_dict

    try:
        sizes = parse_sizes(args.sizes)
        impls = [i.strip() for i in args.impls.split(",") if i.strip()]
        if not impls or set(impls) - set(_IMPLS):
            raise ValueError(f"--impls {args.impls!r}: choose from {', '.join(_IMPLS)}")
        topology, n = _topology(args)
        if n < 2:
            raise ValueError(f"{n} rank: a collective benchmark needs at least 2")
        if args.emulate and topology is None:
            raise ValueError("--emulate needs a topology to shape the links (--preset or --topology)")
        scale = 1.0
        if args.emulate:
            scale = auto_scale(topology) if args.emulate_scale == "auto" else float(args.emulate_scale)
        if args.iters < 1:
            raise ValueError("--iters must be >= 1")
        PackOptions(keep=args.keep, max_trees=args.max_trees, depth=args.depth)  # says which value to change
    except ValueError as err:
        print(f"shardshift: error: {err}", file=sys.stderr)
        return 2
    op = Collective.parse(args.op)
    if topology is not None and scale != 1.0:
        topology = scaled(topology, scale)  # what the emulated network is: plans see its rates
    bound = collective_bound(topology, op, args.root) if topology is not None else None
    with tempfile.TemporaryDirectory(prefix="shardshift-bench-") as tmp:
        config = {
            "op": op.value, "sizes": sizes, "root": args.root, "dtype": args.dtype,
            "redop": args.redop, "iters": args.iters, "impls": impls, "mode": args.mode,
            "timeout": args.timeout, "min_chunk_bytes": args.min_chunk_bytes,
            "max_chunks": args.max_chunks, "max_total_chunks": args.max_total_chunks, "window": args.window, "chunk_seconds": args.chunk_seconds,
            "keep": args.keep, "max_trees": args.max_trees, "depth": args.depth,
            "topology": topology_to_dict(topology) if topology is not None else None,
            "probe": args.probe,
            "out": os.path.join(tmp, "rows.json"),
        }  # fmt: skip
        config_path = os.path.join(tmp, "config.json")
        Path(config_path).write_text(json.dumps(config))
        argv = [sys.executable, "-m", "shardshift.cli.bench_collectives_worker", config_path]
        try:
            if args.emulate:
                _run_emulated(argv, emulation_rates(topology, 1.0), n, args.timeout,
                              args.tcp_slow_start_after_idle)
            else:
                _run_local(argv, n, tmp, args.timeout)
            result = json.loads(Path(config["out"]).read_text())
        except (RuntimeError, TimeoutError, OSError, ValueError) as err:
            print(f"shardshift: error: the benchmark ranks failed: {err}", file=sys.stderr)
            return 1
    if args.probe:
        bound = result["probed_bound"]
        if not args.json:
            print(f"# probed pair rates (GB/s): " + ", ".join(
                f"{u}->{v} {r / 1e9:.3f}" for u, v, r in result["probed_rates"]))
    rows = [_row(r, op, args, n, bound, scale) for r in result["rows"]]
    if args.json:
        print(json.dumps({"rows": rows}))
    else:
        _print_table(rows, op, topology, n, scale, args)
    return 0 if all(r["wrong"] == 0 for r in rows) else 1


def _run_local(argv: list[str], n: int, tmp: str, timeout: float) -> None:
    from shardshift.collectives.emulate import wait_all

    store = os.path.join(tmp, "store")
    procs = [subprocess.Popen(argv, env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r),
                                         "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n),
                                         "SHARDSHIFT_STORE": store})
             for r in range(n)]  # fmt: skip
    codes = wait_all(procs, timeout_s=timeout)
    if any(codes):
        raise RuntimeError(f"exit codes {codes}")


def _run_emulated(argv: list[str], rates: dict, n: int, timeout: float,
                  slow_start_after_idle: bool) -> None:
    from shardshift.collectives.emulate import EmulatedNetwork, netns_unavailable_reason, wait_all

    reason = netns_unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    with EmulatedNetwork(rates, n, slow_start_after_idle=slow_start_after_idle) as net:
        codes = wait_all(net.launch(argv), timeout_s=timeout)
    if any(codes):
        raise RuntimeError(f"exit codes {codes}")


def _row(r: dict, op: Collective, args, n: int, bound: float | None, scale: float) -> dict:
    algbw = r["bytes"] / r["seconds"] / 1e9
    row = {
        "op": op.value, "bytes": r["bytes"], "count": r["count"], "type": args.dtype,
        "redop": args.redop if op in (Collective.REDUCE, Collective.ALLREDUCE, Collective.REDUCESCATTER) else None,
        "root": args.root if op.rooted else None, "impl": r["impl"], "time_us": r["seconds"] * 1e6,
        "algbw_gbps": algbw, "busbw_gbps": algbw * op.busbw_factor(n), "wrong": r["wrong"],
        "times_us": [t * 1e6 for t in r["all_seconds"]], "num_trees": r["num_trees"],
        "plan_algbw_gbps": r["packing_rate"] / 1e9 if r["packing_rate"] else None,
        "nproc": n, "emulate_scale": scale if args.emulate else None, "cpu_busy": r["cpu_busy"],
    }  # fmt: skip
    if "picked" in r:
        row["picked"] = r["picked"]  # auto: what the backend chose for this size
    if bound is not None:
        row["bound_algbw_gbps"] = bound / 1e9
        row["of_bound"] = algbw / row["bound_algbw_gbps"]
    return row


def _print_table(rows: list[dict], op: Collective, topology, n: int, scale: float, args) -> None:
    emulated = args.emulate
    where = topology.name if topology is not None else (
        "the probed topology" if args.probe else f"no topology (trees on full{n})")
    print(f"# {op.value} on {where}, {n} ranks"
          + (f", emulated links at {scale:.4g} × the topology's rates" if emulated else ", loopback"))
    head = (f"{'size':>10} {'count':>10} {'type':>8} {'redop':>6} {'root':>4} {'impl':>6} "
            f"{'time(us)':>11} {'algbw':>8} {'busbw':>8} {'#wrong':>6} {'bound':>8} {'of bound':>8} {'vs gloo':>7} {'cpu':>5}")
    print(head)
    gloo = {r["bytes"]: r["time_us"] for r in rows if r["impl"] == "gloo"}
    for r in rows:
        bound = f"{r['bound_algbw_gbps']:8.4f} {r['of_bound']:8.3f}" if "bound_algbw_gbps" in r else f"{'-':>8} {'-':>8}"
        speedup = f"{gloo[r['bytes']] / r['time_us']:7.2f}" if r["bytes"] in gloo else f"{'-':>7}"
        cpu = f"{r['cpu_busy']:5.2f}" if r["cpu_busy"] is not None else f"{'-':>5}"
        print(f"{r['bytes']:>10} {r['count']:>10} {r['type']:>8} {r['redop'] or '-':>6} "
              f"{'-' if r['root'] is None else r['root']:>4} {r['impl']:>6} {r['time_us']:11.1f} "
              f"{r['algbw_gbps']:8.4f} {r['busbw_gbps']:8.4f} {r['wrong']:>6} {bound} {speedup} {cpu}")  # fmt: skip
    picks = [f"{r['bytes']}: {r['picked']}" for r in rows if r.get("picked")]
    if picks:
        print("# auto picked " + ", ".join(picks))
    print("# algbw, busbw, bound: GB/s (1e9 bytes/s); vs gloo: gloo's time / this time")
    print("# cpu: share of this host's CPUs busy during the timed calls; near 1 the CPUs, not the "
          "links, set the times")
