"""Upper bounds on collective bandwidth, from max-flow / min-cut alone (independent of packing).

All bounds are algorithm bandwidths in bytes/s, nccl-tests convention (algbw = S / t, where S is the
whole gathered buffer for all-gather and reduce-scatter). With B⁺(S) the capacity leaving node set
S, C the compute ranks and n = |C| (docs/background.md §1):

  broadcast from r       min over ranks v != r of maxflow(r → v)                 (Edmonds)
  reduce to r            min over ranks v != r of maxflow(v → r)
  all-gather             n · min over S with C∩S != ∅, C ⊄ S of B⁺(S) / |S ∩ C|  (ForestColl)
  reduce-scatter         the all-gather bound of the reversed network
  all-reduce             min( min_S B⁺(S),  min(Σ_C out-capacity, Σ_C in-capacity) / (2(n-1)) )

For all-reduce: every cut between ranks must carry the whole result (M bytes) one way, hence
T ≥ M / min_S B⁺(S); and without in-network reduction every rank receives at least 2(n-1)/n · M
bytes and every received byte was sent by a rank, hence T ≥ 2(n-1)M / (capacity into, or out of,
the ranks). On a rank-only network both capacity sums are the total capacity, as in docs/background.md §1.

Switches take part in the flows as nodes that forward; they are never sources or sinks.

Max flows use scipy's integer Dinic when every capacity is an integer multiple of a common unit
that keeps the sums under 2**31 (true for every preset), which makes the results exact; otherwise
networkx's float preflow-push. The all-gather minimum over all node sets is exact: Dinkelbach's
iteration over min cuts with a super source (at most a handful of rounds of n max flows).
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import reduce

import networkx as nx
import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import breadth_first_order, maximum_flow

from shardshift.collectives.planning.ops import Collective
from shardshift.collectives.topology.model import Topology

_INT_LIMIT = 2**31 - 1


def broadcast_bound(topology: Topology, root: int) -> float:
    """Best broadcast rate from `root`, bytes/s: min over ranks v of maxflow(root → v)."""
    _check_root(topology, root)
    network = _FlowNetwork(topology.capacity_matrix())
    return min((network.max_flow(root, v) for v in range(topology.num_ranks) if v != root), default=math.inf)


def reduce_bound(topology: Topology, root: int) -> float:
    """Best reduce rate to `root`, bytes/s: min over ranks v of maxflow(v → root)."""
    _check_root(topology, root)
    return broadcast_bound(topology.reversed(), root)


def cut_bound(topology: Topology) -> float:
    """min_S B⁺(S) over node sets S that split the ranks: the global rank-to-rank min cut."""
    network = _FlowNetwork(topology.capacity_matrix())
    values = [network.max_flow(a, b) for v in range(1, topology.num_ranks) for a, b in ((0, v), (v, 0))]
    return min(values, default=math.inf)


def allgather_bound(topology: Topology) -> float:
    """ForestColl bound, as algbw: n · min over S of B⁺(S) / |S ∩ C| (exact, Dinkelbach)."""
    n, n_nodes = topology.num_ranks, topology.num_nodes
    if n < 2:
        return math.inf
    cap = topology.capacity_matrix()
    unit = _common_unit(cap)
    # Work in exact integers when the capacities allow it (Fraction ratio p / q, scale by q).
    base = np.rint(cap / unit).astype(np.int64) if unit else cap
    ratio = min(_out_of(base, [c]) for c in range(n))  # start from single ranks
    ratio = Fraction(int(ratio)) if unit else float(ratio)
    grown = np.zeros((n_nodes + 1, n_nodes + 1), dtype=base.dtype)
    grown[:n_nodes, :n_nodes] = base
    sigma = n_nodes  # super source with an edge of capacity `ratio` to every rank
    while True:
        if unit:
            scaled = grown * ratio.denominator
            scaled[sigma, :n] = ratio.numerator
            target = n * ratio.numerator
        else:
            scaled = grown.astype(float)
            scaled[sigma, :n] = ratio
            target = n * ratio * (1 - 1e-12)
        best_value, best_side = None, None
        network = _FlowNetwork(scaled.astype(float))
        for v in range(n):
            value, side = network.min_cut(sigma, v)
            if best_value is None or value < best_value:
                best_value, best_side = value, side
        if best_value >= target:
            break
        # The most violated set: B⁺(S) - ratio·|S ∩ C| < 0 there. Dinkelbach: move to its ratio.
        members = [u for u in np.flatnonzero(best_side) if u != sigma]
        ranks_in = sum(1 for u in members if u < n)
        new = _out_of(base, members)
        new = Fraction(int(new), ranks_in) if unit else new / ranks_in
        if not new < ratio:  # float fallback: no progress means rounding, stop
            break
        ratio = new
    return float(ratio) * (unit or 1.0) * n


def reducescatter_bound(topology: Topology) -> float:
    """The all-gather bound of the reversed network (reduce-scatter runs the trees backwards)."""
    return allgather_bound(topology.reversed())


def allreduce_bound(topology: Topology) -> float:
    """min( global min cut, min(capacity out of, into the ranks) / (2(n-1)) ), as algbw."""
    n = topology.num_ranks
    if n < 2:
        return math.inf
    out_total = sum(l.capacity for l in topology.links if not topology.is_switch(l.src))
    in_total = sum(l.capacity for l in topology.links if not topology.is_switch(l.dst))
    return min(cut_bound(topology), min(out_total, in_total) / (2 * (n - 1)))


def collective_bound(topology: Topology, op: Collective, root: int = 0) -> float:
    """The bound for `op` (algbw, bytes/s); `root` is used by broadcast and reduce only."""
    op = Collective.parse(op)
    if op is Collective.BROADCAST:
        return broadcast_bound(topology, root)
    if op is Collective.REDUCE:
        return reduce_bound(topology, root)
    if op is Collective.ALLGATHER:
        return allgather_bound(topology)
    if op is Collective.REDUCESCATTER:
        return reducescatter_bound(topology)
    return allreduce_bound(topology)


def _check_root(topology: Topology, root: int) -> None:
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
        raise ValueError(f"root={root!r} must be a rank number")
    if not 0 <= root < topology.num_ranks:
        raise ValueError(f"root={root} is not a rank; choose one of 0..{topology.num_ranks - 1}")


def _out_of(cap: np.ndarray, members) -> float:
    """B⁺(S): capacity from `members` to the other nodes (cap is a nodes × nodes matrix)."""
    inside = np.zeros(cap.shape[0], dtype=bool)
    inside[list(members)] = True
    return cap[np.ix_(inside, ~inside)].sum()


def _common_unit(cap: np.ndarray) -> float | None:
    """Largest integer unit dividing every capacity, if they are all integers; else None."""
    values = cap[cap > 0]
    if values.size == 0 or not np.all(values == np.rint(values)) or values.max() >= 2**62:
        return None
    unit = reduce(math.gcd, (int(v) for v in values))
    return float(unit)


class _FlowNetwork:
    """Max flows between the nodes of one capacity matrix (nodes × nodes), the graph built once:
    scipy's integer Dinic on a sparse graph when the capacities are multiples of a common unit
    whose sum fits (exact), else networkx's float preflow-push."""

    def __init__(self, cap: np.ndarray):
        self.cap = cap
        unit = _common_unit(cap)
        ints = None if unit is None else np.rint(cap / unit).astype(np.int64)
        if ints is None or ints.sum() > _INT_LIMIT:
            self.unit, self.graph = None, nx.DiGraph()
            self.graph.add_nodes_from(range(cap.shape[0]))
            for u, v in zip(*np.nonzero(cap)):
                self.graph.add_edge(int(u), int(v), capacity=float(cap[u, v]))
        else:
            self.unit, self.graph = unit, sp.csr_array(ints.astype(np.int32))

    def max_flow(self, s: int, t: int) -> float:
        """The max flow value s→t."""
        if self.unit is None:
            return float(nx.maximum_flow_value(self.graph, s, t))
        return float(maximum_flow(self.graph, s, t, method="dinic").flow_value) * self.unit

    def min_cut(self, s: int, t: int) -> tuple[float, np.ndarray]:
        """Max flow value s→t and the source side of a minimum cut (bool mask over nodes)."""
        side = np.zeros(self.cap.shape[0], dtype=bool)
        if self.unit is None:
            value, (source_side, _) = nx.minimum_cut(self.graph, s, t)
            side[list(source_side)] = True
            return float(value), side
        result = maximum_flow(self.graph, s, t, method="dinic")
        residual = (self.graph - result.flow).tocsr()
        residual.data[residual.data < 0] = 0
        residual.eliminate_zeros()
        side[breadth_first_order(residual, s, directed=True, return_predecessors=False)] = True
        return float(result.flow_value) * self.unit, side
