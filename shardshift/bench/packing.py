"""`shardshift bench packing`: how close packed trees come to the bound, and how fast they solve
(planning only: no processes).

Three parts, each printed as ratios (rate / bound) and solve times measured in this run:

  dgx1v     every GPU subset of a DGX-1 (V100) whose NVLink graph is connected, sizes --sizes
            (default 3:8), NVLink only (the setting of the published worked values,
            docs/background.md; --pcie adds the PCIe/QPI
            fallback switch and then takes every subset); all five ops, root 0 for broadcast and
            reduce. Targets: broadcast, reduce, allgather, reducescatter >= 0.99 of the bound;
            allreduce is reported against its bound (not always reachable) and both constructions.
  sixteen   LP packing on 16-rank topologies (full, ring, 4-leaf fat tree): target < 1 s each.
  large     multiplicative weights, broadcast on a 256-host fat tree: target >= 0.95 of the LP in
            < 30 s. The LP optimum is at most the max-flow bound, so rate / bound >= 0.95 implies
            it (the ratio reported is the stricter one).

`--scale` runs another part instead (minutes, so not by default):

  scale     multiplicative weights on 256 to 1,024 ranks of three families (`SCALE_FAMILIES`):
            broadcast and all-reduce (its pieces rooted at one rank: a round prices one tree pair,
            not one per rank), each solved `--runs` times. Besides rate / bound and trees, every row
            predicts a 1 GiB call on the packing and on a ring in rank order (planning/rings.py),
            with the latency models of `predicted_seconds` and `ring_cost`, and on a ring per NIC.

Solve times are wall-clock on a shared machine: compare them with the targets, not across runs.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
import sys
import time

import networkx as nx
import numpy as np

from shardshift.collectives.planning.ops import Collective, Direction

_OPS = [op.value for op in Collective]

# `--scale`: the kinds of network, each (what it is, its default numbers of hosts, GPUs (ranks) and
# NICs a host).
SCALE_FAMILIES = {
    "fat-tree": ("the fat-tree preset: a rank per host, 8 hosts a leaf, 8 spines", (256, 512, 1024), 1, 1),
    "rails": ("the cluster preset with 2 GPUs and 2 NICs a host (2 rails), a rank per GPU", (128, 256, 512), 2, 2),
    "rails-gpu": ("the cluster preset with DynaTrain's hosts: 8 GPUs and 8 NICs, a rank per GPU", (32, 64, 128), 8, 8),
    "rails-host": ("the cluster preset with a rank per host, its 8 NICs on 8 rails", (64, 128, 256), 1, 8),
}
DEFAULT_SCALE_FAMILIES = ("fat-tree", "rails", "rails-gpu")
SCALE_OPS = (Collective.BROADCAST, Collective.REDUCE, Collective.ALLREDUCE)  # one family of trees
SCALE_BYTES = 1 << 30  # the call whose time `--scale` predicts: 1 GiB
SCALE_PATIENCE = 8  # re-weightings without gain that end a `--scale` solve (see `_scale_row`)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackingBenchOptions:
    """What `shardshift bench packing` solves; validated when built."""

    sizes: tuple[int, int] = (3, 8)  # DGX-1 subset sizes, inclusive
    pcie: bool = False  # include the PCIe/QPI fallback (then every subset is connected)
    ops: tuple[Collective, ...] = tuple(Collective)
    limit: int = 0  # at most this many DGX-1 subsets, spread over the list (0: all)
    skip_large: bool = False  # skip the 256-host multiplicative-weights case
    scale: bool = False  # run the scale part instead of the others
    families: tuple[str, ...] = DEFAULT_SCALE_FAMILIES  # scale
    hosts: tuple[int, ...] | None = None  # scale: numbers of hosts of every family (None: its own)
    runs: int = 1  # scale: solves of every row
    json: bool = False

    def __post_init__(self) -> None:
        lo, hi = self.sizes
        if not 1 <= lo <= hi <= 8:
            raise ValueError(f"--sizes {lo}:{hi}: give DGX-1 subset sizes 'lo:hi' with 1 <= lo <= hi <= 8")
        if self.limit < 0:
            raise ValueError(f"--limit {self.limit} must be >= 0 (0: every subset)")
        if not self.ops:
            raise ValueError("--ops names no collective; give e.g. broadcast,allreduce")
        if self.scale:
            self._check_scale()

    def _check_scale(self) -> None:
        wide = [op.value for op in self.ops if op not in SCALE_OPS]
        if wide:
            raise ValueError(f"--ops {','.join(wide)}: --scale packs {', '.join(op.value for op in SCALE_OPS)} "
                             "(all-gather and reduce-scatter price a tree per rank each round)")  # fmt: skip
        unknown = [f for f in self.families if f not in SCALE_FAMILIES]
        if unknown or not self.families:
            raise ValueError(f"--families {','.join(self.families)}: choose from {', '.join(SCALE_FAMILIES)}")
        if self.hosts is not None and (not self.hosts or min(self.hosts) < 2):
            raise ValueError(f"--hosts {','.join(map(str, self.hosts))}: give numbers of hosts >= 2")
        if self.runs < 1:
            raise ValueError(f"--runs {self.runs}: give at least 1")


def dgx1v_subsets(lo: int, hi: int, pcie: bool) -> list[tuple[int, ...]]:
    """GPU subsets of sizes lo..hi; NVLink-connected ones only unless `pcie`."""
    from shardshift.collectives.topology.presets import DGX1V_NVLINKS

    graph = nx.Graph((a, b) for a, b, _ in DGX1V_NVLINKS)
    return [
        subset
        for k in range(lo, hi + 1)
        for subset in itertools.combinations(range(8), k)
        if pcie or nx.is_connected(graph.subgraph(subset))
    ]


def _row(topology, op: str, **kw) -> dict:
    from shardshift.collectives.planning.packing import PackOptions, pack

    options = PackOptions(**kw)
    packing = pack(topology, op, root=0, options=options)
    row = {
        "topology": topology.name,
        "op": op,
        "rate_gbps": packing.rate / 1e9,
        "bound_gbps": packing.bound / 1e9,
        "ratio": packing.rate / packing.bound,
        "num_trees": len(packing.trees),
        "depth": packing.depth,
        "solve_seconds": packing.solve_seconds,
        "method": packing.method,
    }
    if op == "allreduce":
        row["candidates_gbps"] = {name: rate / 1e9 for name, rate in packing.candidates}
        row["construction"] = packing.construction
        # The kept construction is the shallowest within `keep` of the best (planning/packing, Depth),
        # so this ratio is >= keep, and 1 when no shallower construction came close.
        row["vs_best_construction"] = packing.rate / max(rate for _, rate in packing.candidates)
    return row


def _summary(rows: list[dict]) -> dict:
    out = {}
    for op in sorted({r["op"] for r in rows}, key=_OPS.index):
        mine = [r for r in rows if r["op"] == op]
        ratios = [r["ratio"] for r in mine]
        times = [r["solve_seconds"] for r in mine]
        entry = {
            "cases": len(mine),
            "min_ratio": min(ratios),
            "mean_ratio": statistics.fmean(ratios),
            "below_0.99": sum(1 for x in ratios if x < 0.99),
            "max_seconds": max(times),
            "mean_seconds": statistics.fmean(times),
            "mean_trees": statistics.fmean(r["num_trees"] for r in mine),
        }
        if op == "allreduce":
            multi = [r["candidates_gbps"]["multiroot"] / r["bound_gbps"] for r in mine]
            split = [r["candidates_gbps"]["rs+ag"] / r["bound_gbps"] for r in mine]
            entry["multiroot_mean_ratio"] = statistics.fmean(multi)
            entry["rs+ag_mean_ratio"] = statistics.fmean(split)
            entry["multiroot_better"] = sum(1 for a, b in zip(multi, split) if a > b * (1 + 1e-6))
            entry["reaches_bound"] = sum(1 for x in ratios if x >= 0.99)
        out[op] = entry
    return out


def run(opts: PackingBenchOptions) -> int:
    if opts.scale:
        return _run_scale(opts)
    from shardshift.collectives.planning.packing import Method
    from shardshift.collectives.topology.presets import dgx1v, fat_tree, full, ring

    ops = [op.value for op in opts.ops]
    subsets = dgx1v_subsets(*opts.sizes, opts.pcie)
    if opts.limit:
        subsets = subsets[:: max(1, len(subsets) // opts.limit)][: opts.limit]
    started = time.perf_counter()
    dgx_rows = []
    for gpus in subsets:
        topology = dgx1v(gpus, pcie=opts.pcie)
        for op in ops:
            dgx_rows.append({"gpus": list(gpus), **_row(topology, op)})
    sixteen_rows = [
        _row(topology, op)
        for topology in (full(16), ring(16), fat_tree(16, hosts_per_leaf=4))
        for op in ops
    ]
    large_rows = []
    if not opts.skip_large:
        large_rows.append(_row(fat_tree(256), "broadcast", method=Method.MWU))
    result = {
        "dgx1v": {"pcie": opts.pcie, "subsets": len(subsets), "summary": _summary(dgx_rows), "rows": dgx_rows},
        "sixteen": {"summary": _summary(sixteen_rows), "rows": sixteen_rows},
        "large": {"rows": large_rows},
        "seconds": time.perf_counter() - started,
    }
    if opts.json:
        print(json.dumps(result))
    else:
        _print(result)
    return 0


def _print(result: dict) -> None:
    d = result["dgx1v"]
    print(f"DGX-1 subsets ({d['subsets']}, {'with' if d['pcie'] else 'without'} PCIe fallback): "
          "rate / bound and solve seconds")  # fmt: skip
    _print_summary(d["summary"])
    worst = sorted((r for r in d["rows"] if r["op"] != "allreduce"), key=lambda r: r["ratio"])[:3]
    for r in worst:
        print(f"  lowest: {r['op']:<13} gpus {r['gpus']}  ratio {r['ratio']:.4f}")
    print("16-rank topologies (LP):")
    _print_summary(result["sixteen"]["summary"])
    for r in result["sixteen"]["rows"]:
        print(f"  {r['topology']:<12} {r['op']:<13} ratio {r['ratio']:.4f}  {r['solve_seconds']:.3f} s"
              f"  trees {r['num_trees']}")  # fmt: skip
    for r in result["large"]["rows"]:
        print(f"256-host fat tree, {r['op']} by {r['method']}: ratio to bound {r['ratio']:.4f} "
              f"(>= ratio to LP), {r['solve_seconds']:.1f} s, {r['num_trees']} trees")  # fmt: skip
    print(f"total {result['seconds']:.1f} s")


def _print_summary(summary: dict) -> None:
    for op, s in summary.items():
        line = (f"  {op:<13} cases {s['cases']:4d}  min {s['min_ratio']:.4f}  mean {s['mean_ratio']:.4f}"
                f"  <0.99: {s['below_0.99']:3d}  solve max {s['max_seconds']:.3f} s"
                f" mean {s['mean_seconds']:.3f} s  trees {s['mean_trees']:.1f}")  # fmt: skip
        if op == "allreduce":
            line += (f"\n  {'':13} multiroot {s['multiroot_mean_ratio']:.4f}  rs+ag {s['rs+ag_mean_ratio']:.4f}"
                     f"  (of bound, mean); multiroot better in {s['multiroot_better']}")  # fmt: skip
        print(line)


# ---- scale ----------------------------------------------------------------------------------------

def scale_topology(family: str, hosts: int):
    """The topology of a `--scale` row: `hosts` hosts of `family` (SCALE_FAMILIES)."""
    from shardshift.collectives.topology.presets import cluster, fat_tree

    if family == "fat-tree":
        return fat_tree(hosts)
    _, _, gpus, nics = SCALE_FAMILIES[family]
    return cluster(hosts, gpus_per_host=gpus, nics_per_host=nics)


def predicted_seconds(topology, packing, nbytes: int) -> float:
    """Time of an `nbytes` call on `packing`: the bytes at its rate, plus the latency of its longest
    chain (the deepest route of a piece's tree, its IN tree then its OUT tree for all-reduce): a
    pipeline whose chunks are small enough that filling it costs no bandwidth, and no per-message
    overhead."""
    tree_latency = [_tree_latency(topology, tree) for tree in packing.trees]
    chain = max(sum(tree_latency[i] for i in piece.trees) for piece in packing.pieces())
    return nbytes / packing.rate + chain


def ring_cost(topology, op: Collective) -> tuple[float, float]:
    """(rate, latency) of a call on the ring of planning/rings.py (rank order beyond 8 ranks): an
    S-byte call takes S / rate + latency. The latency is a hop latency α per step, 2(n-1) steps
    for all-reduce and n-1 for the other ops (a pipelined chain), α the slowest hop's: the latency
    of the quickest route between ring neighbours. For all-reduce this is the classic
    2(n-1)/n · S / c + 2(n-1)·α, c the ring's slowest link."""
    from shardshift.collectives.planning.rings import best_ring, ring_rate
    from shardshift.collectives.planning.routing import RoutePricer

    n = topology.num_ranks
    order = best_ring(topology)
    latency = RoutePricer(topology).price(_link_latencies(topology)).cost
    alpha = max(latency[a, b] for a, b in zip(order, order[1:] + order[:1]))
    steps = 2 * (n - 1) if op is Collective.ALLREDUCE else n - 1
    return ring_rate(topology, op, order=order), steps * alpha


def _link_latencies(topology) -> np.ndarray:
    return np.array([link.latency for link in topology.links])


def _tree_latency(topology, tree) -> float:
    """Seconds from the root to the farthest rank of an OUT tree, or from the farthest rank to the
    root of an IN tree, along its edges' routes (`Tree.paths`)."""
    parent = tree.parent()
    to_parent = {}  # rank -> latency of the route between it and its parent
    for (a, b), path in zip(tree.edges, tree.paths):
        child = b if tree.direction is Direction.OUT else a
        to_parent[child] = sum(topology.link(x, y).latency for x, y in zip(path, path[1:]))
    distance = {tree.root: 0.0}
    for v in parent:
        chain = []
        while v not in distance:
            chain.append(v)
            v = parent[v]
        for u in reversed(chain):
            distance[u] = distance[parent[u]] + to_parent[u]
    return max(distance.values())


def _scale_row(family: str, hosts: int, topology, op: Collective, runs: int) -> dict:
    from shardshift.collectives.planning.packing import Method, PackOptions, pack

    # Every tree found is kept (keep=1): cutting them re-solves the LP about log2(trees) times,
    # some 10 s at 1,024 ranks, to drop a tenth of them. A run also ends after 8 re-weightings
    # (200 rounds) in a row that gained under 0.1% each: on the rail clusters all-reduce reaches
    # the hosts' NIC limit, below the cut bound, and nothing certifies it (PackOptions.patience).
    options = PackOptions(method=Method.MWU, keep=1.0, patience=SCALE_PATIENCE,
                          roots=1 if op is Collective.ALLREDUCE else None)  # fmt: skip
    packings = [pack(topology, op, options=options) for _ in range(runs)]
    times = [p.solve_seconds for p in packings]
    ratios = [p.rate / p.bound for p in packings]
    packing = packings[0]
    trees_s = predicted_seconds(topology, packing, SCALE_BYTES)
    ring, ring_latency = ring_cost(topology, op)
    ring_s = SCALE_BYTES / ring + ring_latency
    # NCCL runs a ring per NIC (channels); at best they share no link and split the bytes.
    nics = SCALE_FAMILIES[family][3]
    rings_s = SCALE_BYTES / min(nics * ring, packing.bound) + ring_latency
    return {
        "family": family,
        "topology": topology.name,
        "hosts": hosts,
        "ranks": topology.num_ranks,
        "op": op.value,
        "solve_seconds": statistics.median(times),
        "solve_seconds_runs": times,
        "ratio": statistics.median(ratios),
        "ratio_runs": ratios,
        "rate_gbps": packing.rate / 1e9,
        "bound_gbps": packing.bound / 1e9,
        "num_trees": len(packing.trees),
        "depth": packing.depth,
        "predicted_ms": trees_s * 1e3,
        "ring_rate_gbps": ring / 1e9,
        "ring_ms": ring_s * 1e3,
        "ring_over_trees": ring_s / trees_s,
        "rings_per_nic": nics,
        "rings_ms": rings_s * 1e3,
        "rings_over_trees": rings_s / trees_s,
    }


def _run_scale(opts: PackingBenchOptions) -> int:
    started = time.perf_counter()
    out = sys.stderr if opts.json else sys.stdout  # rows as they come: a run takes minutes
    _print_scale_header(opts.runs, out)
    rows = []
    for family in opts.families:
        for hosts in opts.hosts or SCALE_FAMILIES[family][1]:
            topology = scale_topology(family, hosts)
            for op in opts.ops:
                rows.append(_scale_row(family, hosts, topology, op, opts.runs))
                _print_scale_row(rows[-1], out)
    families = {f: SCALE_FAMILIES[f][0] for f in opts.families}
    settings = {"method": "mwu", "keep": 1.0, "patience": SCALE_PATIENCE, "allreduce_roots": 1}
    result = {"scale": {"bytes": SCALE_BYTES, "runs": opts.runs, "families": families, "settings": settings,
                        "rows": rows}, "seconds": time.perf_counter() - started}  # fmt: skip
    if opts.json:
        print(json.dumps(result))
    else:
        print(f"total {result['seconds']:.1f} s")
    return 0


def _print_scale_header(runs: int, out) -> None:
    print(f"Packing at scale: multiplicative weights, {runs} solve(s) a row (median, min-max); a 1 GiB "
          "call predicted on the trees, on one ring in rank order, and on a ring per NIC", file=out)  # fmt: skip
    print(f"{'family':<10} {'topology':<20} {'hosts':>5} {'ranks':>5} {'op':<9} {'solve s':>17} {'rate/bound':>10}"
          f" {'trees':>5} {'depth':>5} {'trees ms':>8} {'ring ms':>8} {'rings ms':>8}", file=out, flush=True)  # fmt: skip


def _print_scale_row(r: dict, out) -> None:
    times = r["solve_seconds_runs"]
    solve = f"{r['solve_seconds']:.1f} ({min(times):.1f}-{max(times):.1f})"
    print(f"{r['family']:<10} {r['topology']:<20} {r['hosts']:>5} {r['ranks']:>5} {r['op']:<9} {solve:>17}"
          f" {r['ratio']:>10.4f} {r['num_trees']:>5} {r['depth']:>5} {r['predicted_ms']:>8.1f} {r['ring_ms']:>8.1f}"
          f" {r['rings_ms']:>8.1f}", file=out, flush=True)  # fmt: skip
