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

Solve times are wall-clock on a shared machine: compare them with the targets, not across runs.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
import time

import networkx as nx

from shardshift.collectives.planning.ops import Collective

_OPS = [op.value for op in Collective]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackingBenchOptions:
    """What `shardshift bench packing` solves; validated when built."""

    sizes: tuple[int, int] = (3, 8)  # DGX-1 subset sizes, inclusive
    pcie: bool = False  # include the PCIe/QPI fallback (then every subset is connected)
    ops: tuple[Collective, ...] = tuple(Collective)
    limit: int = 0  # at most this many DGX-1 subsets, spread over the list (0: all)
    skip_large: bool = False  # skip the 256-host multiplicative-weights case
    json: bool = False

    def __post_init__(self) -> None:
        lo, hi = self.sizes
        if not 1 <= lo <= hi <= 8:
            raise ValueError(f"--sizes {lo}:{hi}: give DGX-1 subset sizes 'lo:hi' with 1 <= lo <= hi <= 8")
        if self.limit < 0:
            raise ValueError(f"--limit {self.limit} must be >= 0 (0: every subset)")
        if not self.ops:
            raise ValueError("--ops names no collective; give e.g. broadcast,allreduce")


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
