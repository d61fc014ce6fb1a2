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
    """Prices rank→rank edges from link prices and builds routed trees (see module docstring).

    Built for large networks, where a rank has links to a few switches only (its leaf, its host's
    NVSwitch): the price of a route through switches is taken over the switches each rank can
    enter and leave by, never over all pairs of switches (which would be ranks² × switches), and
    switch-to-switch distances are computed among the *core* switches only, those linked to
    another switch (leaves and spines; a host's NVSwitch sees ranks only).
    """

    def __init__(self, topology: Topology):
        self.topology = topology
        n, s = topology.num_ranks, topology.num_switches
        self.num_ranks, self.num_switches = n, s
        links = topology.links
        src = np.array([l.src for l in links], dtype=int)
        dst = np.array([l.dst for l in links], dtype=int)
        self._direct = np.flatnonzero((src < n) & (dst < n))  # rank → rank links
        self._direct_ends = (src[self._direct], dst[self._direct])
        self._trunks = np.flatnonzero((src >= n) & (dst >= n))  # switch → switch links
        self._trunk_ends = (src[self._trunks] - n, dst[self._trunks] - n)
        self._core = np.unique(np.r_[self._trunk_ends])  # switches linked to switches
        # Per rank, the switches it can enter (links u→a) and leave (links b→v) by, ascending, as
        # padded (ranks, k) tables of switch and link ids; padding has link id -1.
        self.up = _attachments(src, dst, n, s, outgoing=True)
        self.down = _attachments(src, dst, n, s, outgoing=False)

    def price(self, link_prices: np.ndarray) -> EdgePrices:
        """Cheapest route price of every rank pair under `link_prices` (shape (num_links,), >= 0)."""
        n, s = self.num_ranks, self.num_switches
        prices = np.asarray(link_prices, dtype=float)
        cost = np.full((n, n), np.inf)  # the direct links first
        cost[self._direct_ends] = prices[self._direct]
        if s == 0:
            return EdgePrices(self, prices, cost, None, None, None, None)
        dist, middle = self._switch_distances(prices)
        # reach[u, b]: cheapest from rank u into switch b; via[u, v]: from u through switches to v.
        reach = _cheapest(entering[:, None] + dist[a] for a, entering in self._attached(self.up, prices))
        via = _cheapest(reach[:, b] + leaving[None, :] for b, leaving in self._attached(self.down, prices))
        np.minimum(via, cost, out=cost)
        return EdgePrices(self, prices, cost, via, reach, dist, middle)

    def _attached(self, table: tuple[np.ndarray, np.ndarray], prices: np.ndarray):
        """(switch, link price) of every rank's j-th attached switch, for each j."""
        for switches, links in zip(table[0].T, table[1].T):
            yield switches, _priced(links, prices)

    def _switch_distances(self, prices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dist, middle): cheapest switch-to-switch prices through switches only, (s, s), and an
        intermediate switch of each best path (-1: the direct switch link). Floyd–Warshall over
        the core switches; a switch linked to ranks only is on no switch-to-switch path."""
        s, core = self.num_switches, self._core
        dist = np.full((s, s), np.inf)
        dist[self._trunk_ends] = prices[self._trunks]
        np.fill_diagonal(dist, 0.0)
        middle = np.full((s, s), -1)
        sub = dist[np.ix_(core, core)]
        sub_middle = np.full(sub.shape, -1)
        for i, k in enumerate(core):
            # Only pairs that reach k and that k reaches can improve: in a leaf-spine network a
            # leaf's step touches the spines only.
            rows, cols = np.flatnonzero(sub[:, i] < np.inf), np.flatnonzero(sub[i] < np.inf)
            block = np.s_[:, :] if len(rows) == len(cols) == len(core) else np.ix_(rows, cols)
            alt = sub[rows, i][:, None] + sub[i, cols][None, :]
            better = alt < sub[block]
            if better.any():
                sub[block] = np.where(better, alt, sub[block])
                sub_middle[block] = np.where(better, k, sub_middle[block])
        dist[np.ix_(core, core)] = sub
        middle[np.ix_(core, core)] = sub_middle
        return dist, middle


def _priced(links: np.ndarray, prices: np.ndarray) -> np.ndarray:
    """The price of every link id in `links`; inf for -1 (no link)."""
    return np.where(links >= 0, prices[links], np.inf)


def _cheapest(candidates) -> np.ndarray:
    """The elementwise minimum of the arrays `candidates` yields."""
    best = None
    for candidate in candidates:
        best = candidate if best is None else np.minimum(best, candidate)
    return best


def _attachments(src: np.ndarray, dst: np.ndarray, n: int, s: int, outgoing: bool):
    """(switches, links): per rank, the switches it has a link to (outgoing) or from, ascending,
    padded to a (ranks, k) table; padding repeats switch 0 with link id -1."""
    rank, switch = (src, dst) if outgoing else (dst, src)
    ids = np.flatnonzero((rank < n) & (switch >= n))
    ids = ids[np.lexsort((switch[ids], rank[ids]))]  # by rank, then switch
    counts = np.bincount(rank[ids], minlength=n)
    width = max(1, int(counts.max(initial=0)))
    slot = np.arange(len(ids)) - np.repeat(np.cumsum(counts) - counts, counts)
    switches = np.zeros((n, width), dtype=int)
    links = np.full((n, width), -1)
    switches[rank[ids], slot] = switch[ids] - n
    links[rank[ids], slot] = ids
    return switches, links


@dataclass(frozen=True, eq=False)
class EdgePrices:
    """Output of `RoutePricer.price`: cost[u, v] of every rank pair, and what `route` needs to
    find the route of the few pairs a tree uses (only those are worked out)."""

    pricer: RoutePricer
    prices: np.ndarray  # (links,) the link prices
    cost: np.ndarray  # (n, n), inf where u cannot reach v without passing another rank
    via: np.ndarray | None  # (n, n) the cheapest route through switches (None: there are none)
    reach: np.ndarray | None  # (n, s) the cheapest from rank u into switch b
    dist: np.ndarray | None  # (s, s) switch to switch, through switches only
    middle: np.ndarray | None  # (s, s) Floyd–Warshall intermediate, -1 = direct switch link

    def routes(self, edges: list[tuple[int, int]]) -> list[tuple[int, ...]]:
        """Link ids of the cheapest route of every edge (u, v): the direct link when it is no
        dearer than the switches, else through the switches, entering and leaving them at the
        lowest-numbered switches among equals. Worked out for these edges only, together."""
        topology, n = self.pricer.topology, self.pricer.num_ranks
        tails = np.array([u for u, _ in edges], dtype=int)
        heads = np.array([v for _, v in edges], dtype=int)
        direct = np.array([topology.link_id(u, v) for u, v in edges], dtype=int)
        if self.via is None:
            through = np.zeros(len(edges), dtype=bool)
        else:
            through = self.via[tails, heads] < _priced(direct, self.prices)
            entries, exits = self._switch_ends(tails, heads)
        assert np.all(through | (direct >= 0)), "an edge has no route"
        out = []
        for i, (u, v) in enumerate(edges):
            if not through[i]:
                out.append((int(direct[i]),))
                continue
            nodes = [u] + [n + x for x in self._switch_path(int(entries[i]), int(exits[i]))] + [v]
            out.append(tuple(topology.link_id(x, y) for x, y in zip(nodes, nodes[1:])))
        return out

    def _switch_ends(self, tails: np.ndarray, heads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(entry, exit) switch of the cheapest route through switches of every edge: the exit b
        minimises reach[u, b] + p(b→v), then the entry a p(u→a) + dist(a, b) (argmin: the first
        of a rank's ascending switches among equals)."""
        pr, rows = self.pricer, np.arange(len(tails))
        switches, links = pr.down[0][heads], pr.down[1][heads]  # (edges, k)
        exits = switches[rows, np.argmin(self.reach[tails[:, None], switches] + _priced(links, self.prices), axis=1)]
        switches, links = pr.up[0][tails], pr.up[1][tails]
        entries = switches[rows, np.argmin(_priced(links, self.prices) + self.dist[switches, exits[:, None]], axis=1)]
        return entries, exits

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
        return make_column(root, direction, edges, self.routes(edges)), price


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
