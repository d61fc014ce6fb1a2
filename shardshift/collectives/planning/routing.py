"""Rank-to-rank edges routed over the physical links, and trees built from them.

Trees are spanned over the compute ranks only. An edge u→v of a tree is a point-to-point transfer
from rank u to rank v, carried either by the direct link u→v or by a path whose intermediate nodes
are all switches (u→leaf→spine→leaf→v). Switches never appear as tree nodes: they cannot copy one
stream to two outputs, so a tree that branched at a switch would really be its sender sending twice
over the same first link. Routing each edge as a unicast path charges every physical link exactly
the bytes that cross it, which keeps the packing's capacity accounting sound; and since the pricing
step below always picks the cheapest route, the LP optimises over route choices as well as trees.

With link prices p (one per physical link), the price of edge u→v is the cheaper of p(u→v) and
the cheapest switch-only path; `RoutePricer.price` computes all of them at once:

    cost[u, v] = min( p[u→v],  min over switches a, b of  p[u→a] + dist_switches(a, b) + p[b→v] )
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardshift.collectives.planning.arborescence import min_in_tree, min_out_tree, shallow_in_tree, shallow_out_tree
from shardshift.collectives.planning.ops import Direction
from shardshift.collectives.topology.model import Topology


@dataclass(frozen=True, eq=False)
class TreeColumn:
    """One spanning tree over the ranks with its edges routed: a column of the packing LP."""

    root: int
    direction: Direction  # OUT: edges point away from the root; IN: towards it
    edges: tuple[tuple[int, int], ...]  # (sender rank, receiver rank), sorted
    routes: tuple[tuple[int, ...], ...]  # link ids carrying each edge, in path order
    link_ids: np.ndarray  # (k,) distinct link ids the tree uses
    link_uses: np.ndarray  # (k,) how many of its edges cross each of them

    @property
    def key(self) -> tuple:
        """Identity for de-duplication: same root, direction, edges and routes."""
        return (self.root, self.direction, self.routes)


class RoutePricer:
    """Prices rank→rank edges from link prices and builds routed trees (see module docstring)."""

    def __init__(self, topology: Topology):
        self.topology = topology
        n, n_nodes = topology.num_ranks, topology.num_nodes
        self.num_ranks, self.num_switches = n, topology.num_switches
        self.link_of = np.full((n_nodes, n_nodes), -1)  # link id of u→v, -1 when none
        for i, link in enumerate(topology.links):
            self.link_of[link.src, link.dst] = i
        self._src = np.array([l.src for l in topology.links], dtype=int)
        self._dst = np.array([l.dst for l in topology.links], dtype=int)

    def price(self, link_prices: np.ndarray) -> EdgePrices:
        """Cheapest route price of every rank pair under `link_prices` (shape (num_links,), >= 0)."""
        n, s = self.num_ranks, self.num_switches
        p = np.full((n + s, n + s), np.inf)
        p[self._src, self._dst] = link_prices
        direct = p[:n, :n]
        if s == 0:
            return EdgePrices(self, direct.copy(), None, None, None, None)
        dist = p[n:, n:].copy()  # (s, s) switch-to-switch, through switches only
        np.fill_diagonal(dist, 0.0)
        middle = np.full((s, s), -1)  # Floyd–Warshall: an intermediate switch of the best path
        for k in range(s):
            alt = dist[:, k : k + 1] + dist[k : k + 1, :]
            better = alt < dist
            if better.any():
                dist = np.where(better, alt, dist)
                middle = np.where(better, k, middle)
        up, down = p[:n, n:], p[n:, :n]  # (n, s) rank→switch, (s, n) switch→rank
        into = up[:, :, None] + dist[None, :, :]  # (n, a, b): enter at a, reach b
        first = np.argmin(into, axis=1)  # (n, s) best entry switch a for each (u, b)
        reach = np.min(into, axis=1)  # (n, s)
        out = reach[:, :, None] + down[None, :, :]  # (n, b, v): leave from b to v
        last = np.argmin(out, axis=1)  # (n, n) best exit switch b for (u, v)
        via = np.min(out, axis=1)  # (n, n)
        use_switch = via < direct  # ties go to the direct link
        cost = np.where(use_switch, via, direct)
        return EdgePrices(self, cost, use_switch, first, last, middle)


@dataclass(frozen=True, eq=False)
class EdgePrices:
    """Output of `RoutePricer.price`: cost[u, v] of every rank pair and how to route it."""

    pricer: RoutePricer
    cost: np.ndarray  # (n, n), inf where u cannot reach v without passing another rank
    use_switch: np.ndarray | None  # (n, n) bool: route through switches (else the direct link)
    first: np.ndarray | None  # (n, s) entry switch for (u, exit switch)
    last: np.ndarray | None  # (n, n) exit switch for (u, v)
    middle: np.ndarray | None  # (s, s) Floyd–Warshall intermediate, -1 = direct switch link

    def route(self, u: int, v: int) -> tuple[int, ...]:
        """Link ids of the cheapest route from rank u to rank v."""
        pr = self.pricer
        if self.use_switch is None or not self.use_switch[u, v]:
            link = pr.link_of[u, v]
            assert link >= 0, f"no route {u}->{v}"
            return (int(link),)
        n = pr.num_ranks
        b = int(self.last[u, v])
        a = int(self.first[u, b])
        nodes = [u] + [n + x for x in self._switch_path(a, b)] + [v]
        return tuple(int(pr.link_of[x, y]) for x, y in zip(nodes, nodes[1:]))

    def _switch_path(self, a: int, b: int) -> list[int]:
        if a == b:
            return [a]
        k = int(self.middle[a, b])
        if k < 0:
            return [a, b]
        return self._switch_path(a, k) + self._switch_path(k, b)[1:]

    def cheapest_tree(self, root: int, direction: Direction, shallow: bool = False
                      ) -> tuple[TreeColumn, float]:
        """The cheapest spanning tree of the ranks for this root and direction, and its price;
        `shallow`: the cheapest of depth at most 2 (ValueError when there is none)."""
        if shallow:
            find = shallow_out_tree if direction is Direction.OUT else shallow_in_tree
        else:
            find = min_out_tree if direction is Direction.OUT else min_in_tree
        parent = find(self.cost, root)
        if parent is None:
            raise ValueError(f"no spanning tree of depth <= 2 {'from' if direction is Direction.OUT else 'to'} "
                             f"rank {root} over the routed edges")  # fmt: skip
        if direction is Direction.OUT:
            edges = [(int(parent[v]), v) for v in range(len(parent)) if parent[v] >= 0]
        else:
            edges = [(v, int(parent[v])) for v in range(len(parent)) if parent[v] >= 0]
        edges.sort()
        price = float(sum(self.cost[u, v] for u, v in edges))
        return make_column(root, direction, edges, [self.route(u, v) for u, v in edges]), price


def make_column(
    root: int, direction: Direction, edges: list[tuple[int, int]], routes: list[tuple[int, ...]]
) -> TreeColumn:
    """A TreeColumn from edges and their routes (link ids)."""
    all_links = np.array([link for route in routes for link in route], dtype=int)
    link_ids, link_uses = np.unique(all_links, return_counts=True)
    return TreeColumn(root, direction, tuple(edges), tuple(routes), link_ids, link_uses.astype(float))


def check_reachable(topology: Topology, roots, direction: Direction) -> None:
    """Raise a ValueError naming ranks that trees from (OUT) or to (IN) `roots` could not span."""
    cost = RoutePricer(topology).price(np.ones(len(topology.links))).cost
    edge = np.isfinite(cost)
    if direction is Direction.IN:
        edge = edge.T
    for root in roots:
        seen, frontier = {root}, [root]
        while frontier:
            for v in np.flatnonzero(edge[frontier.pop()]):
                if int(v) not in seen:
                    seen.add(int(v))
                    frontier.append(int(v))
        missing = sorted(set(range(topology.num_ranks)) - seen)
        if missing:
            what = f"be reached from rank {root}" if direction is Direction.OUT else f"reach rank {root}"
            raise ValueError(
                f"ranks {missing} cannot {what} in {topology.name} (over links and through "
                "switches); add links or leave those ranks out"
            )
