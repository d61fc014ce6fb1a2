"""Ring collectives as packings, so the same schedule and executor run them (the `ring` baseline).

A ring is a cyclic order of the ranks; data moves from each rank to the next. As trees:

  broadcast      one chain from the root around the ring (n-1 edges), pipelined by the schedule
  reduce         one chain that ends at the root
  allgather      for every rank r, a chain from r carrying shard r  (the classic ring all-gather)
  reducescatter  for every rank r, a chain ending at r reducing shard r
  allreduce      for every rank r, the reduce-scatter chain into r paired with the all-gather chain
                 out of r: a pipelined ring all-reduce (2(n-1)/n of the data over every link)

Rates: with c the slowest ring link (point-to-point rate, topology.pair_rates), broadcast and
reduce run at c, all-gather and reduce-scatter at n·c/(n-1), all-reduce at n·c/(2(n-1)). Every
ring link carries the same load, so the ring is as fast as its slowest link.

`best_ring(topology)` picks, among all rings (n <= 8; rank order beyond), one whose slowest link is
fastest, preferring rank order on ties: what NCCL and gloo would build on a uniform network.
`ring_rate` gives a ring's rate without building its trees (2n chains of n-1 edges for all-reduce).
"""

from __future__ import annotations

import itertools

from shardshift.collectives.planning.bounds import collective_bound
from shardshift.collectives.planning.ops import Collective, Direction
from shardshift.collectives.planning.trees import Packing, Tree
from shardshift.collectives.topology.model import Topology, pair_rates

_SEARCH_LIMIT = 8  # rings searched exhaustively up to this many ranks ((n-1)! orders)


def ring_bottleneck(topology: Topology, order: tuple[int, ...]) -> float:
    """The slowest point-to-point rate along the ring `order` (0 when a pair has no route)."""
    rates = pair_rates(topology)
    return min(rates.get((a, b), 0.0) for a, b in zip(order, order[1:] + order[:1]))


def best_ring(topology: Topology) -> tuple[int, ...]:
    """A ring order whose slowest link is fastest (rank order when it is among the best)."""
    n = topology.num_ranks
    rates = pair_rates(topology)
    best, best_rate = tuple(range(n)), -1.0
    orders = ((0, *p) for p in itertools.permutations(range(1, n))) if n <= _SEARCH_LIMIT else [best]
    for order in orders:
        rate = min(rates.get((a, b), 0.0) for a, b in zip(order, order[1:] + order[:1]))
        if rate > best_rate:
            best, best_rate = order, rate
    if best_rate <= 0:
        raise ValueError(f"{topology.name}: no ring connects all {n} ranks point to point; "
                         "give a topology where every rank can reach the next one")  # fmt: skip
    return best


def ring_packing(topology: Topology, op: Collective | str, root: int = 0,
                 order: tuple[int, ...] | None = None) -> Packing:
    """The ring algorithm for `op` on `order` (default `best_ring`), as a Packing."""
    op = Collective.parse(op)
    n = topology.num_ranks
    if n < 2:
        raise ValueError(f"{topology.name} has {n} rank; a ring needs at least 2")
    order = tuple(best_ring(topology) if order is None else order)
    if sorted(order) != list(range(n)):
        raise ValueError(f"ring order {order} must list every rank 0..{n - 1} once")
    c = _bottleneck(topology, order)

    def chain_from(r: int) -> tuple[tuple[int, int], ...]:
        i = order.index(r)
        walk = [order[(i + k) % n] for k in range(n)]
        return tuple(zip(walk, walk[1:]))

    def chain_into(r: int) -> tuple[tuple[int, int], ...]:
        i = order.index(r)
        walk = [order[(i + 1 + k) % n] for k in range(n)]  # starts after r, ends at r
        return tuple(zip(walk, walk[1:]))

    rate = _uncapped_rate(op, n, c)
    w = rate if op.rooted else rate / n  # the rate of each chain (each pair for all-reduce)
    if op is Collective.BROADCAST:
        trees = (Tree(root, Direction.OUT, chain_from(root), w),)
    elif op is Collective.REDUCE:
        trees = (Tree(root, Direction.IN, chain_into(root), w),)
    elif op is Collective.ALLGATHER:
        trees = tuple(Tree(r, Direction.OUT, chain_from(r), w) for r in range(n))
    elif op is Collective.REDUCESCATTER:
        trees = tuple(Tree(r, Direction.IN, chain_into(r), w) for r in range(n))
    else:
        trees = tuple(t for r in range(n) for t in (Tree(r, Direction.IN, chain_into(r), w),
                                                      Tree(r, Direction.OUT, chain_from(r), w)))  # fmt: skip
    bound = collective_bound(topology, op, root)
    scale = _capped(rate, bound) / rate  # scale the (informational) weights down to the bound
    trees = tuple(Tree(t.root, t.direction, t.edges, t.weight * scale) for t in trees)
    return Packing(op=op, num_ranks=n, trees=trees, rate=rate * scale, bound=bound, solve_seconds=0.0,
                   root=root if op.rooted else None, method="ring", construction="ring",
                   topology_name=topology.name)  # fmt: skip


def ring_rate(topology: Topology, op: Collective | str, root: int = 0, order: tuple[int, ...] | None = None) -> float:
    """The rate (algbw, bytes/s) of `ring_packing(topology, op, root, order)`, its trees not built."""
    op = Collective.parse(op)
    n = topology.num_ranks
    order = tuple(best_ring(topology) if order is None else order)
    rate = _uncapped_rate(op, n, _bottleneck(topology, order))
    return _capped(rate, collective_bound(topology, op, root))


def _uncapped_rate(op: Collective, n: int, c: float) -> float:
    """The ring's rate with slowest link c (module docstring)."""
    if op.rooted:
        return c
    return n * c / (n - 1) if op.sharded else n * c / (2 * (n - 1))


def _bottleneck(topology: Topology, order: tuple[int, ...]) -> float:
    c = ring_bottleneck(topology, order)
    if c <= 0:
        raise ValueError(f"ring {order} crosses a pair with no point-to-point route on {topology.name}")
    return c


def _capped(rate: float, bound: float) -> float:
    """Pair rates ignore links shared through switches, so a ring can look faster than the bound
    there; it cannot really be, so its rate is capped at the bound."""
    return min(rate, bound)
