"""Tree packings: weighted spanning trees over the ranks that reach a topology's bandwidth bound.

`pack(topology, op, root)` returns a `Packing`: its trees, its rate, and the bound for the op
computed independently by `bounds.py`, so any gap is visible. Rates are algbw in bytes/s
(nccl-tests: for all-gather and reduce-scatter, the whole gathered buffer over the time).

What the trees mean, per op (a tree's `weight` is the rate, bytes/s, of the data it carries):

  broadcast      OUT trees from the root; the buffer is split among them in proportion to weight.
                 rate = Σ weights.
  reduce         IN trees towards the root (edges child → parent); rate = Σ weights.
  allgather      OUT trees from every rank r, carrying r's shard (1/n of the buffer), split among
                 r's trees by weight; every rank's trees weigh the same x in total; rate = n·x.
  reducescatter  IN trees towards every rank r, reducing shard r; rate = n·x likewise.
  allreduce      pairs: trees[2i] is an IN tree and trees[2i+1] an OUT tree with the same root and
                 weight; piece i of the buffer is reduced up the first to the root and broadcast
                 down the second, all pieces at once. rate = Σ pair weights. Two constructions are
                 solved and the faster kept (both rates are in `candidates`):
                   multiroot  one LP over all roots' (IN, OUT) pairs sharing the links; the share
                              of each root is free;
                   rs+ag      reduce-scatter forests then all-gather forests (each root 1/n),
                              combined into pairs that run concurrently at the two-phase rate.

Methods: `Method.LP` is exact (column generation, see packing_lp.py); `Method.MWU` is the
multiplicative-weights approximation for large topologies (packing_mwu.py). Both end with a pass
that keeps the fewest trees whose re-solved LP is >= `keep` × the value found (default 0.995), or
at most `max_trees` trees. `solve_seconds` counts this work, not the bound computations.

Switches are not tree nodes: tree edges are rank→rank transfers routed over links and through
switches (routing.py); `Tree.paths` gives each edge's physical path.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from enum import Enum

from shardshift.collectives.bounds import allgather_bound, collective_bound, reducescatter_bound
from shardshift.collectives.ops import Collective, Direction
from shardshift.collectives.packing_lp import column_generation, prune
from shardshift.collectives.packing_mwu import multiplicative_weights
from shardshift.collectives.packing_problem import Bundle, Family, LPResult, PackingProblem
from shardshift.collectives.routing import check_reachable
from shardshift.collectives.topology import Topology
from shardshift.collectives.tree import Packing, Tree, combine_pairs

__all__ = ["Method", "PackOptions", "Packing", "Tree", "pack"]


class Method(Enum):
    """How the packing LP is solved."""

    LP = "lp"  # column generation, exact
    MWU = "mwu"  # multiplicative weights, approximate, for large topologies


@dataclass(frozen=True)
class PackOptions:
    """Knobs of `pack`, documented where declared."""

    method: Method = Method.LP
    keep: float = 0.995  # pruning keeps >= keep × the solved rate (1.0: no pruning)
    max_trees: int | None = None  # at most this many trees, even below `keep`
    tol: float = 1e-6  # column generation stops within this relative gap of optimal
    max_seconds: float = 60.0  # per LP / MWU solve

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", Method(self.method))
        if not 0 < self.keep <= 1:
            raise ValueError(f"keep={self.keep}: give a fraction in (0, 1], e.g. 0.99")
        if self.max_trees is not None and self.max_trees < 1:
            raise ValueError(f"max_trees={self.max_trees}: give at least 1 (or None for no cap)")
        if not 0 < self.tol < 0.1:
            raise ValueError(f"tol={self.tol}: give a small relative gap such as 1e-6")


def pack(
    topology: Topology, op: Collective | str, root: int = 0, options: PackOptions | None = None
) -> Packing:
    """Pack trees for `op` on `topology` (root used by broadcast and reduce). See module doc."""
    options = options or PackOptions()
    op = Collective.parse(op)
    n = topology.num_ranks
    if n < 2:
        raise ValueError(f"{topology.name} has {n} rank; a collective plan needs at least 2")
    bound = collective_bound(topology, op, root)  # also validates root
    fewest = {Collective.ALLGATHER: n, Collective.REDUCESCATTER: n, Collective.ALLREDUCE: 2}.get(op, 1)
    if options.max_trees is not None and options.max_trees < fewest:
        raise ValueError(f"{op.value} on {n} ranks needs at least {fewest} trees; "
                         f"give max_trees >= {fewest}")  # fmt: skip
    if op.rooted:
        check_reachable(topology, [root], Direction.OUT if op is Collective.BROADCAST else Direction.IN)
    else:
        check_reachable(topology, range(n), Direction.OUT)  # every rank must reach every other
    if op is Collective.ALLREDUCE:  # targets of the two forests of the rs+ag construction
        forest_bounds = (reducescatter_bound(topology), allgather_bound(topology))
    # solve_seconds counts the packing only: the bounds are computed independently, above.
    start = time.perf_counter()
    candidates: list[tuple[str, float, tuple[Tree, ...]]] = []
    if op is Collective.BROADCAST or op is Collective.REDUCE:
        direction = Direction.OUT if op is Collective.BROADCAST else Direction.IN
        result = _solve(topology, [Family(root, (direction,))], False, options, bound)
        trees = _trees(topology, result)
        candidates.append((op.value, sum(t.weight for t in trees), trees))
    elif op.sharded:
        direction = Direction.OUT if op is Collective.ALLGATHER else Direction.IN
        families = [Family(r, (direction,)) for r in range(n)]
        result = _solve(topology, families, True, options, bound / n)
        trees = _trees(topology, result)
        candidates.append((op.value, n * min(_per_root(trees, n)), trees))
    else:
        both = [Family(r, (Direction.IN, Direction.OUT)) for r in range(n)]
        ins = [Family(r, (Direction.IN,)) for r in range(n)]
        outs = [Family(r, (Direction.OUT,)) for r in range(n)]
        # The forests are pruned by `keep` only: combined they take >= 2n trees, and the
        # construction is left out when that exceeds max_trees.
        halves = replace(options, max_trees=None)
        rs = _solve(topology, ins, True, halves, forest_bounds[0] / n)
        ag = _solve(topology, outs, True, halves, forest_bounds[1] / n)
        # Every (reduce-scatter tree, all-gather tree) pair at a root is a column of the joint LP,
        # and the rs+ag solution is a mix of them: starting there, the joint LP is never worse.
        seeds = [((a[0], b[0]), fa) for a, fa in zip(rs.bundles, rs.families)
                 for b, fb in zip(ag.bundles, ag.families) if fa == fb]  # fmt: skip
        trees = _trees(topology, _solve(topology, both, False, options, bound, seeds))
        candidates.append(("multiroot", sum(t.weight for t in trees) / 2, trees))
        pairs = combine_pairs(_trees(topology, rs), _trees(topology, ag), n)
        if options.max_trees is None or len(pairs) <= options.max_trees:
            candidates.append(("rs+ag", sum(t.weight for t in pairs) / 2, pairs))
    name, rate, trees = max(candidates, key=lambda c: c[1])
    return Packing(
        op=op,
        num_ranks=n,
        trees=trees,
        rate=rate,
        bound=bound,
        solve_seconds=time.perf_counter() - start,
        root=root if op.rooted else None,
        method=options.method.value,
        construction=name,
        candidates=tuple((c[0], c[1]) for c in candidates),
        topology_name=topology.name,
    )


def _solve(
    topology: Topology,
    families: list[Family],
    concurrent: bool,
    options: PackOptions,
    target: float,
    seeds: list[tuple[Bundle, int]] = (),
) -> LPResult:
    """Solve one master problem; `target` (bytes/s) is its max-flow bound, which ends the search;
    `seeds` are (bundle, family) columns to start from (LP method)."""
    problem = PackingProblem(topology, families, concurrent)
    if options.method is Method.LP:
        result = column_generation(
            problem, options.tol, max_seconds=options.max_seconds, target=target, seeds=seeds
        )
    else:
        goal = target / problem.scale
        result = multiplicative_weights(problem, max_seconds=options.max_seconds, target=goal)
    if options.keep < 1 or options.max_trees is not None:
        result = prune(problem, result, options.keep, options.max_trees)
    return result


def _trees(topology: Topology, result: LPResult) -> tuple[Tree, ...]:
    """Bundles with weights → Trees (an all-reduce bundle gives its IN tree then its OUT tree)."""
    trees = []
    for bundle, weight in zip(result.bundles, result.weights):
        for column in bundle:
            paths = tuple(
                (topology.links[route[0]].src,) + tuple(topology.links[i].dst for i in route)
                for route in column.routes
            )
            trees.append(Tree(column.root, column.direction, column.edges, weight, paths))
    return tuple(trees)


def _per_root(trees: tuple[Tree, ...], n: int) -> list[float]:
    totals = [0.0] * n
    for t in trees:
        totals[t.root] += t.weight
    return totals if all(totals) else [0.0]


def describe(packing: Packing, link_unit: float | None) -> str:
    """A few human-readable lines about a packing."""
    gb = 1e9
    lines = [
        f"{packing.op.value} on {packing.topology_name} ({packing.num_ranks} ranks"
        + (f", root {packing.root})" if packing.root is not None else ")"),
        f"  rate   {packing.rate / gb:10.3f} GB/s" + _units(packing.rate, link_unit),
        f"  bound  {packing.bound / gb:10.3f} GB/s" + _units(packing.bound, link_unit)
        + (f"   rate/bound {packing.rate / packing.bound:.4f}" if math.isfinite(packing.bound) else ""),
        f"  trees  {len(packing.trees)}   solve {packing.solve_seconds:.3f} s   method {packing.method}",
    ]
    if len(packing.candidates) > 1:
        parts = ", ".join(f"{name} {rate / gb:.3f} GB/s" for name, rate in packing.candidates)
        lines.append(f"  constructions: {parts} (kept {packing.construction})")
    return "\n".join(lines)


def _units(rate: float, link_unit: float | None) -> str:
    return f"  = {rate / link_unit:7.3f} link units" if link_unit else ""
