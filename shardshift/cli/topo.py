"""`shardshift topo ...`: inspect topologies and pack trees on them (planning only, no processes).

    shardshift topo pack --preset dgx1v --gpus 0,1,2,3,4,5 --op allreduce [--json]
    shardshift topo pack --topology lab.yaml --op broadcast --root 2
    shardshift topo show --preset fat-tree --hosts 16 --hosts-per-leaf 4 [--json]
    shardshift topo draw --preset dgx1v --gpus 0,1,2,3 --op broadcast [-o FILE.png] [--size WxH] [--trees N]
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from shardshift.collectives.planning.ops import Collective


def register(subparsers) -> None:
    parser = subparsers.add_parser("topo", help="topologies and tree packing")
    sub = parser.add_subparsers(dest="topo", required=True)
    pack = sub.add_parser("pack", help="pack spanning trees for a collective; print rate and bound")
    add_topology_arguments(pack)
    _add_packing_arguments(pack)
    pack.add_argument("--json", action="store_true", help="print one JSON object")
    pack.set_defaults(func=run_pack)
    show = sub.add_parser("show", help="print a topology's links and point-to-point pair rates")
    add_topology_arguments(show)
    show.add_argument("--json", action="store_true", help="print one JSON object")
    show.set_defaults(func=run_show)
    draw = sub.add_parser("draw", help="draw the load a collective's packed trees put on each link, and "
                                       "the heaviest trees (PNG)")
    add_topology_arguments(draw)
    _add_packing_arguments(draw)
    _add_picture_arguments(draw)
    draw.add_argument("--trees", type=int, default=6, metavar="N",
                      help="draw the N heaviest trees (all-reduce: tree pairs) in panels of their own (default 6)")
    draw.set_defaults(func=run_draw)


def _add_packing_arguments(p: argparse.ArgumentParser) -> None:
    """--op, --root and the packing's options (`pack` and `draw`)."""
    p.add_argument("--op", required=True, choices=[op.value for op in Collective])
    p.add_argument("--root", type=int, default=0, help="root rank of broadcast / reduce (default 0)")
    p.add_argument("--method", choices=["lp", "mwu"], default="lp",
                   help="lp: exact column generation; mwu: multiplicative weights (large topologies)")
    p.add_argument("--keep", type=float, default=0.995,
                   help="cut trees while keeping >= this fraction of the solved rate (1: no cut)")
    p.add_argument("--max-trees", type=int, default=None, help="at most this many trees")
    p.add_argument("--depth", choices=["auto", "any", "shallow"], default="auto",
                   help="tree depth: auto (the shallowest packing within --keep of the best, "
                        "depth <= 2 tried up to 8 ranks), any, or shallow (depth <= 2 only)")


def _add_picture_arguments(p: argparse.ArgumentParser) -> None:
    from shardshift.plots.canvas import DEFAULT_PIXELS

    width, height = DEFAULT_PIXELS
    p.add_argument("-o", "--output", default=None, metavar="FILE.png",
                   help="the picture (default: topology-OP.png in the current directory)")
    p.add_argument("--size", default=f"{width}x{height}", metavar="WxH",
                   help=f"the picture's size in pixels (default {width}x{height})")


def add_topology_arguments(p: argparse.ArgumentParser) -> None:
    """--preset/--topology and the preset parameters (shared with `bench`)."""
    p.add_argument("--preset", default=None, help="dgx1v, ring, full or fat-tree")
    p.add_argument("--topology", default=None, help="YAML topology file (docs/topology.md)")
    p.add_argument("--gpus", default=None, help="dgx1v: GPU numbers, e.g. 0,1,2,3 (rank i = i-th GPU)")
    p.add_argument("--no-pcie", action="store_true", help="dgx1v: NVLink only, no PCIe/QPI fallback")
    p.add_argument("--ranks", type=int, default=None, help="ring, full: number of ranks")
    p.add_argument("--hosts", type=int, default=None, help="fat-tree: number of hosts")
    p.add_argument("--hosts-per-leaf", type=int, default=None, help="fat-tree: hosts under each leaf")
    p.add_argument("--bandwidth", default=None,
                   help="ring, full, fat-tree: link rate, e.g. '1 Gbit/s' or 25e9 (bytes/s)")


def pack_options_from_args(args: argparse.Namespace):
    """The packing options of `--method` (where the command has it), `--keep`, `--max-trees`, `--depth`."""
    from shardshift.collectives.planning.packing import PackOptions

    if not 0 < args.keep <= 1:
        raise ValueError(f"--keep {args.keep}: give a fraction in (0, 1], e.g. 0.99")
    if args.max_trees is not None and args.max_trees < 1:
        raise ValueError(f"--max-trees {args.max_trees}: give at least 1 (or leave it out: no cap)")
    return PackOptions(method=getattr(args, "method", "lp"), keep=args.keep, max_trees=args.max_trees,
                       depth=args.depth)


def topology_from_args(args: argparse.Namespace):
    """The topology named on the command line; ValueError says what is missing or wrong."""
    from shardshift.collectives.topology.io import load_topology
    from shardshift.collectives.topology.presets import preset
    from shardshift.units import parse_rate

    if (args.preset is None) == (args.topology is None):
        raise ValueError("give exactly one of --preset NAME or --topology FILE")
    if args.topology is not None:
        return load_topology(args.topology)
    name = args.preset.replace("_", "-").lower()
    params: dict = {}
    if name == "dgx1v":
        if args.gpus:
            try:
                params["gpus"] = [int(g) for g in args.gpus.split(",") if g.strip()]
            except ValueError:
                raise ValueError(f"--gpus {args.gpus!r}: give GPU numbers separated by commas, e.g. 0,1,2,3") from None
        params["pcie"] = not args.no_pcie
    elif name in ("ring", "full"):
        if args.ranks is None:
            raise ValueError(f"--preset {name} needs --ranks N")
        params["n"] = args.ranks
    elif name == "fat-tree":
        if args.hosts is None:
            raise ValueError("--preset fat-tree needs --hosts N")
        params["hosts"] = args.hosts
        if args.hosts_per_leaf is not None:
            params["hosts_per_leaf"] = args.hosts_per_leaf
    if args.bandwidth is not None:
        if name not in ("ring", "full", "fat-tree"):
            raise ValueError(f"--bandwidth applies to ring, full and fat-tree, not {name}")
        try:
            params["host_bandwidth" if name == "fat-tree" else "bandwidth"] = parse_rate(args.bandwidth)
        except ValueError as err:
            raise ValueError(f"--bandwidth: {err}") from None
    flags = {"gpus": "--gpus", "n": "--ranks", "hosts": "--hosts", "hosts_per_leaf": "--hosts-per-leaf",
             "bandwidth": "--bandwidth", "host_bandwidth": "--bandwidth"}
    try:
        return preset(name, **params)
    except ValueError as err:  # name the flags the preset was given
        given = " ".join(f"{flags[k]} {getattr(args, flags[k][2:].replace('-', '_'))}" for k in params if k in flags)
        raise ValueError(f"--preset {name} {given}: {err}") from None


def packing_summary(packing, link_unit: float | None) -> dict:
    """The JSON object of `topo pack`: rates in GB/s (1e9 bytes/s) and link units."""
    gb = 1e9
    finite = math.isfinite(packing.bound)
    out = {
        "op": packing.op.value,
        "topology": packing.topology_name,
        "num_ranks": packing.num_ranks,
        "method": packing.method,
        "construction": packing.construction,
        "rate_gbps": packing.rate / gb,
        "bound_gbps": packing.bound / gb if finite else None,
        "rate_over_bound": packing.rate / packing.bound if finite else None,
        "num_trees": len(packing.trees),
        "depth": packing.depth,
        "solve_seconds": packing.solve_seconds,
        "candidates_gbps": {name: rate / gb for name, rate in packing.candidates},
    }
    if packing.root is not None:
        out["root"] = packing.root
    if link_unit:
        out["link_unit_gbps"] = link_unit / gb
        out["rate_units"] = packing.rate / link_unit
        out["bound_units"] = packing.bound / link_unit if finite else None
    out["trees"] = [
        {"root": t.root, "direction": t.direction.value, "weight_gbps": t.weight / gb,
         "edges": [list(e) for e in t.edges]}
        for t in packing.trees
    ]  # fmt: skip
    return out


def packing_from_args(args: argparse.Namespace):
    """(topology, packing) of the command line's topology, --op, --root and packing options."""
    from shardshift.collectives.planning.packing import pack

    topology = topology_from_args(args)
    if not 0 <= args.root < topology.num_ranks:
        raise ValueError(f"--root {args.root} is not a rank of {topology.name}; choose one of "
                         f"0..{topology.num_ranks - 1}")
    return topology, pack(topology, args.op, root=args.root, options=pack_options_from_args(args))


def run_pack(args: argparse.Namespace) -> int:
    from shardshift.collectives.planning.packing import describe

    try:
        topology, packing = packing_from_args(args)
    except ValueError as err:
        print(f"shardshift: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(packing_summary(packing, topology.link_unit)))
    else:
        print(describe(packing, topology.link_unit))
    return 0


def run_show(args: argparse.Namespace) -> int:
    from shardshift.collectives.topology.model import pair_rates

    try:
        topology = topology_from_args(args)
    except ValueError as err:
        print(f"shardshift: error: {err}", file=sys.stderr)
        return 2
    rates = pair_rates(topology)
    if args.json:
        print(json.dumps({
            "name": topology.name,
            "num_ranks": topology.num_ranks,
            "num_switches": topology.num_switches,
            "names": list(topology.names),
            "link_unit": topology.link_unit,
            "links": [[l.src, l.dst, l.capacity, l.latency] for l in topology.links],
            "pair_rates": [[u, v, r] for (u, v), r in sorted(rates.items())],
        }))  # fmt: skip
        return 0
    print(topology.describe())
    for link in topology.links:
        a, b = topology.names[link.src], topology.names[link.dst]
        print(f"  {a:>8} -> {b:<8} {link.capacity / 1e9:9.3f} GB/s  {link.latency * 1e6:7.2f} us")
    print("point-to-point pair rates (GB/s):")
    for (u, v), r in sorted(rates.items()):
        print(f"  {u:>3} -> {v:<3} {r / 1e9:9.3f}")
    return 0


def run_draw(args: argparse.Namespace) -> int:
    from pathlib import Path

    from shardshift.plots.canvas import check_drawable, parse_pixels
    from shardshift.plots.topology import draw_packing

    out = Path(args.output if args.output is not None else f"topology-{args.op}.png")
    try:
        if args.trees < 1:
            raise ValueError(f"--trees {args.trees}: give at least 1 (the trees drawn in panels of their own)")
        size = parse_pixels(args.size)
        check_drawable(out, "-o")
        topology, packing = packing_from_args(args)
        drawn = draw_packing(topology, packing, out, size, args.trees)
    except ValueError as err:
        print(f"shardshift: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({size[0]}x{size[1]}): {packing.op.value} on {topology.name}, {len(packing.trees)} trees "
          f"({len(drawn.panels)} drawn apart), rate {packing.rate / 1e9:.4g} GB/s")
    return 0
