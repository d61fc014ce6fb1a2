"""The network a collective runs on: compute ranks, optional switches, and directed links.

Node numbering (used everywhere in the planner):

    node 0 .. num_ranks-1                      compute ranks (they hold data, send, receive, reduce)
    node num_ranks .. num_ranks+num_switches-1 switches (they only forward; they never copy a stream
                                               to two outputs, never reduce, and hold no data)

A `Link` is one direction of a physical connection: `capacity` in bytes/s, `latency` in seconds.
A full-duplex cable is two links. At most one link per ordered pair of nodes: parallel cables are one
link whose capacity is their sum (the DGX-1 "double NVLink" is one 50 GB/s link each way).

Topologies come from presets (`shardshift.collectives.topology.presets`), from a YAML file
(`shardshift.collectives.topology.io`, format in docs/topology.md), or are built directly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Link:
    """One direction of a connection between two nodes."""

    src: int  # node id
    dst: int  # node id
    capacity: float  # bytes/s, > 0
    latency: float = 0.0  # seconds, >= 0

    def __post_init__(self) -> None:
        for name in ("src", "dst"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"link {name}={value!r} must be a node id (an int >= 0)")
            object.__setattr__(self, name, int(value))
        if self.src == self.dst:
            raise ValueError(f"link {self.src}->{self.dst} is a self-loop; remove it")
        cap = float(self.capacity)
        if not (math.isfinite(cap) and cap > 0):
            raise ValueError(
                f"link {self.src}->{self.dst} has capacity {self.capacity!r}; give a finite rate > 0"
                " in bytes/s (leave the link out if there is none)"
            )
        lat = float(self.latency)
        if not (math.isfinite(lat) and lat >= 0):
            raise ValueError(
                f"link {self.src}->{self.dst} has latency {self.latency!r}; give seconds >= 0"
            )
        object.__setattr__(self, "capacity", cap)
        object.__setattr__(self, "latency", lat)


@dataclass(frozen=True)
class Topology:
    """Compute ranks, switches and directed links (see the module docstring for numbering)."""

    num_ranks: int  # compute ranks, numbered 0..num_ranks-1
    links: tuple[Link, ...]
    num_switches: int = 0  # switch nodes, numbered after the ranks
    # One display name per node, ranks first ("0", "1", … and "sw0", … when not given).
    names: tuple[str, ...] = ()
    # Rate of one "link unit" in bytes/s (25e9 for a DGX-1 NVLink), for reporting; None when the
    # topology has no natural unit.
    link_unit: float | None = None
    name: str = "custom"
    _index: dict = field(default=None, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.num_ranks, bool) or not isinstance(self.num_ranks, int) or self.num_ranks < 1:
            raise ValueError(f"num_ranks={self.num_ranks!r}: a topology needs at least 1 compute rank")
        if (
            isinstance(self.num_switches, bool)
            or not isinstance(self.num_switches, int)
            or self.num_switches < 0
        ):
            raise ValueError(f"num_switches={self.num_switches!r}: give an int >= 0")
        links = tuple(self.links)
        object.__setattr__(self, "links", links)
        n_nodes = self.num_nodes
        index: dict[tuple[int, int], int] = {}
        for i, link in enumerate(links):
            if not isinstance(link, Link):
                raise ValueError(f"links[{i}] is {type(link).__name__}; build it with Link(...)")
            if link.src >= n_nodes or link.dst >= n_nodes:
                raise ValueError(
                    f"link {link.src}->{link.dst} names a node >= {n_nodes}; this topology has "
                    f"{self.num_ranks} ranks and {self.num_switches} switches (nodes 0..{n_nodes - 1})"
                )
            key = (link.src, link.dst)
            if key in index:
                raise ValueError(
                    f"two links {link.src}->{link.dst}; merge parallel links into one whose "
                    "capacity is the sum"
                )
            index[key] = i
        object.__setattr__(self, "_index", index)
        names = tuple(self.names) or tuple(
            [str(r) for r in range(self.num_ranks)] + [f"sw{s}" for s in range(self.num_switches)]
        )
        if len(names) != n_nodes:
            raise ValueError(f"names has {len(names)} entries; give one per node ({n_nodes})")
        if len(set(names)) != len(names):
            raise ValueError(f"node names must be distinct, got {list(names)}")
        object.__setattr__(self, "names", names)
        if self.link_unit is not None:
            unit = float(self.link_unit)
            if not (math.isfinite(unit) and unit > 0):
                raise ValueError(f"link_unit={self.link_unit!r}: give a rate > 0 in bytes/s or None")
            object.__setattr__(self, "link_unit", unit)

    # ---------------------------------------------------------------- structure
    @property
    def num_nodes(self) -> int:
        """Ranks plus switches."""
        return self.num_ranks + self.num_switches

    def is_switch(self, node: int) -> bool:
        """True when `node` is a switch (not a compute rank)."""
        return node >= self.num_ranks

    def link(self, src: int, dst: int) -> Link | None:
        """The link src→dst, or None when there is none."""
        i = self._index.get((src, dst))
        return None if i is None else self.links[i]

    def link_id(self, src: int, dst: int) -> int:
        """Position of the link src→dst in `links`; -1 when there is none."""
        return self._index.get((src, dst), -1)

    def capacities(self) -> np.ndarray:
        """Capacity of every link in `links` order, bytes/s. Shape (num_links,)."""
        return np.array([link.capacity for link in self.links], dtype=float)

    def capacity_matrix(self) -> np.ndarray:
        """cap[u, v] = capacity of link u→v in bytes/s (0 when absent). Shape (nodes, nodes)."""
        cap = np.zeros((self.num_nodes, self.num_nodes))
        for link in self.links:
            cap[link.src, link.dst] = link.capacity
        return cap

    def out_capacity(self, node: int) -> float:
        """Total capacity of the links leaving `node`, bytes/s."""
        return sum(link.capacity for link in self.links if link.src == node)

    def in_capacity(self, node: int) -> float:
        """Total capacity of the links entering `node`, bytes/s."""
        return sum(link.capacity for link in self.links if link.dst == node)

    def reversed(self) -> Topology:
        """The same network with every link turned around (reduce on G = broadcast on reversed G)."""
        links = tuple(Link(l.dst, l.src, l.capacity, l.latency) for l in self.links)
        return Topology(
            self.num_ranks, links, self.num_switches, self.names, self.link_unit, f"{self.name}^R"
        )

    def restricted(self, ranks: Sequence[int]) -> Topology:
        """The network as a group of some of its ranks sees it: rank i of the result is
        `ranks[i]` here; every switch stays, and every link between the nodes that stay. The
        other ranks are gone: they relay nothing for a group they are not in. Raises ValueError
        when some member cannot reach another that way."""
        ranks = [int(r) for r in ranks]
        if len(set(ranks)) != len(ranks) or not all(0 <= r < self.num_ranks for r in ranks):
            raise ValueError(f"ranks {ranks}: give distinct ranks of {self.name} (0..{self.num_ranks - 1})")
        switches = range(self.num_ranks, self.num_nodes)
        node = {old: new for new, old in enumerate([*ranks, *switches])}
        links = tuple(Link(node[l.src], node[l.dst], l.capacity, l.latency)
                      for l in self.links if l.src in node and l.dst in node)
        names = tuple(self.names[old] for old in node)
        sub = Topology(len(ranks), links, self.num_switches, names, self.link_unit,
                       f"{self.name}[{','.join(map(str, ranks))}]")
        for direction in (sub, sub.reversed()):
            unreached = set(range(sub.num_ranks)) - direction.reachable(0)
            if unreached:
                cut = ", ".join(str(ranks[r]) for r in sorted(unreached))
                raise ValueError(f"in {self.name}, ranks {cut} and {ranks[0]} of the group of ranks "
                                 f"{ranks} are not joined by links among the group's ranks and the "
                                 "switches (other ranks relay nothing for the group)")
        return sub

    def reachable(self, source: int) -> set[int]:
        """The nodes reached from `source` along links."""
        seen, frontier = {source}, [source]
        while frontier:
            u = frontier.pop()
            for link in self.links:
                if link.src == u and link.dst not in seen:
                    seen.add(link.dst)
                    frontier.append(link.dst)
        return seen

    def describe(self) -> str:
        """One line: name, ranks, switches, links."""
        return (
            f"{self.name}: {self.num_ranks} ranks, {self.num_switches} switches, "
            f"{len(self.links)} directed links"
        )


def pair_rates(topology: Topology) -> dict[tuple[int, int], float]:
    """Point-to-point rate of every ordered pair of compute ranks, bytes/s.

    The rate of (u, v) is the capacity of the direct link u→v when there is one; otherwise the
    bottleneck (widest-path) capacity over paths whose intermediate nodes are all switches.
    Compute ranks are not relays here: a rank does not forward another pair's point-to-point
    traffic, so a pair whose only paths pass through other ranks is *absent* from the result
    (it has no point-to-point route). Links shared by several pairs are not divided: each pair gets
    the rate it would have alone, which is what per-pair shaping (link emulation) can express.
    """
    n, n_nodes = topology.num_ranks, topology.num_nodes
    cap = topology.capacity_matrix()  # (nodes, nodes), 0 = no link
    sw = np.arange(n, n_nodes)
    # widest[a, b]: best bottleneck from switch a to switch b through switches only (inf on a == b).
    widest = cap[np.ix_(sw, sw)].copy()
    np.fill_diagonal(widest, np.inf)
    for k in range(len(sw)):  # Floyd–Warshall in the (max, min) semiring
        widest = np.maximum(widest, np.minimum(widest[:, k : k + 1], widest[k : k + 1, :]))
    up = cap[:n, n:]  # (ranks, switches)
    down = cap[n:, :n]  # (switches, ranks)
    rates: dict[tuple[int, int], float] = {}
    for u in range(n):
        if len(sw):
            # best[b] = widest bottleneck from u into switch b; then out of b to each rank.
            best = np.max(np.minimum(up[u][:, None], widest), axis=0)  # (switches,)
            via = np.max(np.minimum(best[:, None], down), axis=0)  # (ranks,)
        else:
            via = np.zeros(n)
        for v in range(n):
            if v == u:
                continue
            direct = cap[u, v]
            rate = direct if direct > 0 else via[v]
            if rate > 0:
                rates[(u, v)] = float(rate)
    return rates
