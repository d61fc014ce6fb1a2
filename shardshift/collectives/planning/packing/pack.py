"""Tree packings: weighted spanning trees over the ranks that reach a topology's bandwidth bound.

`pack(topology, op, root)` returns a `Packing`: its trees, its rate, and the bound for the op
computed independently by `planning/bounds.py`, so any gap is visible. Rates are algbw in bytes/s
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
                 `PackOptions.roots` roots the pieces at fewer ranks, multiroot only (large
                 topologies: a round prices a tree pair per root).

Depth. A pipelined tree loses about (depth - 1) chunk times to filling and draining, and the
LP's optimum is usually degenerate: on hetero4 it reached the all-reduce bound with Hamiltonian
chains (an IN and an OUT tree of depth 3 each, 6 hops per piece) where trees of depth <= 2 (4 hops)
reach it too. So for up to `SHALLOW_MAX_RANKS` ranks `pack` also solves every construction over
trees of depth <= 2 only (an exact oracle, arborescence.shallow_out_tree) and, among the
constructions within `keep` of the best rate, keeps the one whose pieces are shallowest
(`Packing.depth`), then the fastest. `PackOptions.depth` forces either kind.

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

import numpy as np

from shardshift.collectives.planning.arborescence import SHALLOW_MAX_RANKS, shallow_in_tree, shallow_out_tree
from shardshift.collectives.planning.bounds import allgather_bound, collective_bound, reducescatter_bound
from shardshift.collectives.planning.ops import Collective, Direction
from shardshift.collectives.planning.packing.lp import column_generation, prune
from shardshift.collectives.planning.packing.mwu import multiplicative_weights
from shardshift.collectives.planning.packing.problem import Bundle, Family, LPResult, PackingProblem
from shardshift.collectives.planning.routing import RoutePricer, check_reachable
from shardshift.collectives.planning.trees import Packing, Tree, combine_pairs, packing_depth
from shardshift.collectives.topology.model import Topology

__all__ = ["Depth", "Method", "PackOptions", "Packing", "Tree", "pack"]


# The direction of each op's trees: data flows out from its root, or in to it (all-reduce: both).
_DIRECTIONS = {Collective.BROADCAST: (Direction.OUT,), Collective.ALLGATHER: (Direction.OUT,),
               Collective.REDUCE: (Direction.IN,), Collective.REDUCESCATTER: (Direction.IN,),
               Collective.ALLREDUCE: (Direction.IN, Direction.OUT)}  # fmt: skip


class Method(Enum):
    """How the packing LP is solved."""

    LP = "lp"  # column generation, exact
    MWU = "mwu"  # multiplicative weights, approximate, for large topologies


class Depth(Enum):
    """Which trees `pack` may use (see module docstring, Depth)."""

    AUTO = "auto"  # solve both kinds (shallow up to SHALLOW_MAX_RANKS ranks), keep the shallowest within `keep`
    ANY = "any"  # any depth: the plain LP
    SHALLOW = "shallow"  # depth <= 2 only; a topology without such trees is refused


@dataclass(frozen=True)
class PackOptions:
    """Knobs of `pack`, documented where declared."""

    method: Method = Method.LP
    keep: float = 0.995  # pruning keeps >= keep × the solved rate (1.0: no pruning)
    max_trees: int | None = None  # at most this many trees, even below `keep`
    tol: float = 1e-6  # column generation stops within this relative gap of optimal
    max_seconds: float = 60.0  # per LP / MWU solve
    depth: Depth = Depth.AUTO
    # All-reduce: root the pieces at this many ranks, spread evenly (None: at every rank). Fewer
    # roots leave out rs+ag (it roots a piece at every rank) and cut the work of a round, which
    # prices a tree pair per root: on 1,024 ranks, every rank is 2,048 arborescences a round.
    roots: int | None = None
    # MWU: also stop once this many re-weightings in a row (25 rounds each) gained less than 0.1%
    # (None: never). Where the max-flow bound cannot be met (all-reduce on a rail cluster, whose
    # hosts' NICs bind first) the restricted LPs' duals may certify nothing close, and the value,
    # long at its best, would otherwise run on to `max_seconds`.
    patience: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", Method(self.method))
        object.__setattr__(self, "depth", Depth(self.depth))
        if not 0 < self.keep <= 1:
            raise ValueError(f"keep={self.keep}: give a fraction in (0, 1], e.g. 0.99")
        if self.max_trees is not None and self.max_trees < 1:
            raise ValueError(f"max_trees={self.max_trees}: give at least 1 (or None for no cap)")
        if not 0 < self.tol < 0.1:
            raise ValueError(f"tol={self.tol}: give a small relative gap such as 1e-6")
        for name, what in (("roots", "ranks"), ("patience", "re-weightings")):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r}: give a number of {what} >= 1 (or None)")


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
        check_reachable(topology, [root], _DIRECTIONS[op][0])
    else:  # every rank must reach every other: all from rank 0, and rank 0 from all
        check_reachable(topology, [0], Direction.OUT)
        check_reachable(topology, [0], Direction.IN)
    if options.roots is not None and options.roots > n:
        raise ValueError(f"roots={options.roots}: {topology.name} has {n} ranks; give at most {n}")
    if options.depth is Depth.SHALLOW and n > SHALLOW_MAX_RANKS:
        raise ValueError(f"depth='shallow' is solved for up to {SHALLOW_MAX_RANKS} ranks, not {n}; "
                         "use depth='any' or 'auto'")  # fmt: skip
    # solve_seconds counts the packing only: the bounds are computed independently, above.
    start = time.perf_counter()
    kinds = {Depth.ANY: [False], Depth.SHALLOW: [True],
             Depth.AUTO: [False, True] if n <= SHALLOW_MAX_RANKS else [False]}[options.depth]  # fmt: skip
    candidates: list[tuple[str, float, tuple[Tree, ...]]] = []
    solved: dict[str, LPResult] = {}  # shallow solutions seed the unrestricted LPs (they are feasible there)
    for shallow in sorted(kinds, reverse=True):  # shallow first
        if shallow and not _has_shallow_trees(topology, op, root):
            if options.depth is Depth.SHALLOW:
                raise ValueError(f"{topology.name} has no spanning trees of depth <= 2 for {op.value}; "
                                 "use depth='any' or 'auto'")  # fmt: skip
            continue
        found = _constructions(topology, op, root, options, bound, shallow, solved)
        candidates += [(name + ("/shallow" if shallow else ""), rate, trees) for name, rate, trees in found]
    best = max(rate for _, rate, _ in candidates)
    near = [c for c in candidates if c[1] >= options.keep * best]
    name, rate, trees = min(near, key=lambda c: (packing_depth(op, c[2]), -c[1]))
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


def _constructions(topology: Topology, op: Collective, root: int, options: PackOptions, bound: float,
                   shallow: bool, solved: dict[str, LPResult]) -> list[tuple[str, float, tuple[Tree, ...]]]:
    """(name, rate, trees) of every construction of `op`, over trees of depth <= 2 if `shallow`.
    `solved`: LP solutions by role, read as seeds and replaced by this pass's."""

    def solve(role, families, concurrent, target, options=options, seeds=()):
        earlier = solved.get(role)
        seeds = list(seeds) + (list(zip(earlier.bundles, earlier.families)) if earlier else [])
        solved[role] = _solve(topology, families, concurrent, options, target, seeds, shallow)
        return solved[role]

    n = topology.num_ranks
    if op is Collective.BROADCAST or op is Collective.REDUCE:
        (direction,) = _DIRECTIONS[op]
        trees = _trees(topology, solve("single", [Family(root, (direction,))], False, bound))
        return [(op.value, sum(t.weight for t in trees), trees)]
    if op.sharded:
        (direction,) = _DIRECTIONS[op]
        families = [Family(r, (direction,)) for r in range(n)]
        trees = _trees(topology, solve("forest", families, True, bound / n))
        return [(op.value, n * min(_per_root(trees, n)), trees)]
    roots = range(n) if options.roots is None else [i * n // options.roots for i in range(options.roots)]
    both = [Family(r, (Direction.IN, Direction.OUT)) for r in roots]
    if len(both) < n:
        trees = _trees(topology, solve("multiroot", both, False, bound))
        return [("multiroot", sum(t.weight for t in trees) / 2, trees)]
    ins = [Family(r, (Direction.IN,)) for r in range(n)]
    outs = [Family(r, (Direction.OUT,)) for r in range(n)]
    # The forests are pruned by `keep` only: combined they take >= 2n trees, and the
    # construction is left out when that exceeds max_trees.
    halves = replace(options, max_trees=None)
    rs = solve("rs", ins, True, reducescatter_bound(topology) / n, halves)
    ag = solve("ag", outs, True, allgather_bound(topology) / n, halves)
    # Every (reduce-scatter tree, all-gather tree) pair at a root is a column of the joint LP,
    # and the rs+ag solution is a mix of them: starting there, the joint LP is never worse.
    seeds = [((a[0], b[0]), fa) for a, fa in zip(rs.bundles, rs.families)
             for b, fb in zip(ag.bundles, ag.families) if fa == fb]  # fmt: skip
    trees = _trees(topology, solve("multiroot", both, False, bound, seeds=seeds))
    found = [("multiroot", sum(t.weight for t in trees) / 2, trees)]
    pairs = combine_pairs(_trees(topology, rs), _trees(topology, ag), n)
    if options.max_trees is None or len(pairs) <= options.max_trees:
        found.append(("rs+ag", sum(t.weight for t in pairs) / 2, pairs))
    return found


def _has_shallow_trees(topology: Topology, op: Collective, root: int) -> bool:
    """Whether every root the op needs has spanning trees of depth <= 2 in its directions."""
    prices = RoutePricer(topology).price(np.ones(len(topology.links)))
    roots = [root] if op.rooted else range(topology.num_ranks)
    find = {Direction.OUT: shallow_out_tree, Direction.IN: shallow_in_tree}
    return all(find[d](prices.cost, r) is not None for r in roots for d in _DIRECTIONS[op])


def _solve(
    topology: Topology,
    families: list[Family],
    concurrent: bool,
    options: PackOptions,
    target: float,
    seeds: list[tuple[Bundle, int]] = (),
    shallow: bool = False,
) -> LPResult:
    """Solve one master problem; `target` (bytes/s) is its max-flow bound, which ends the search;
    `seeds` are (bundle, family) columns to start from (LP method); `shallow`: trees of depth <= 2."""
    problem = PackingProblem(topology, families, concurrent, shallow)
    if options.method is Method.LP:
        result = column_generation(
            problem, options.tol, max_seconds=options.max_seconds, target=target, seeds=seeds
        )
    else:
        goal = target / problem.scale
        result = multiplicative_weights(problem, max_seconds=options.max_seconds, target=goal,
                                        patience=options.patience)  # fmt: skip
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
        f"  trees  {len(packing.trees)}   depth {packing.depth}   solve {packing.solve_seconds:.3f} s   "
        f"method {packing.method}",
    ]
    if len(packing.candidates) > 1:
        parts = ", ".join(f"{name} {rate / gb:.3f} GB/s" for name, rate in packing.candidates)
        lines.append(f"  constructions: {parts} (kept {packing.construction})")
    return "\n".join(lines)


def _units(rate: float, link_unit: float | None) -> str:
    return f"  = {rate / link_unit:7.3f} link units" if link_unit else ""
