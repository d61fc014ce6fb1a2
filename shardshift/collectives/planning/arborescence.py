"""Minimum-cost spanning arborescences (Chu–Liu/Edmonds) on a dense cost matrix.

This is the pricing oracle of the tree-packing LP and of the multiplicative-weights loop, called
thousands of times, so it avoids graph objects: small matrices (the common case, up to
`_SMALL` ranks) go through plain Python lists, contracting every cycle of a level at once,
where numpy's per-call overhead would dominate; larger ones through numpy rows, one cycle at a
time, which bounds the work by n² whatever the costs (1,024 ranks: about 20 ms a call). Tests
check both against `networkx.minimum_spanning_arborescence`; among trees of equal cost they may
pick different ones.
"""

from __future__ import annotations

import math

import numpy as np

SHALLOW_MAX_RANKS = 8  # 2^(n-1) sets per oracle call; the DGX-1 has 8 GPUs
_SMALL = 24  # up to this many nodes the list version is faster (measured: ~4x at n = 8)


def min_out_tree(cost: np.ndarray, root: int) -> np.ndarray:
    """Cheapest spanning arborescence rooted at `root`, edges pointing away from it.

    cost: (n, n) array, cost[u, v] = price of edge u→v; np.inf where there is no edge; the diagonal
    and column `root` are ignored. Returns parent: (n,) int array, parent[v] = u for the tree edge
    u→v, parent[root] = -1. Raises ValueError when some node cannot be reached from the root.
    """
    cost = np.asarray(cost, dtype=float)
    n = cost.shape[0]
    if cost.shape != (n, n) or not 0 <= root < n:
        raise ValueError(f"cost must be square with 0 <= root < n, got shape {cost.shape}, root {root}")
    if n == 1:
        return np.array([-1])
    if n <= _SMALL:
        w = cost.copy()  # the caller's matrix is not touched
        np.fill_diagonal(w, np.inf)
        w[:, root] = np.inf
        return np.array(_edmonds_lists(w.tolist(), root))
    into = np.array(cost.T, order="C")  # a copy, transposed: into[v, u] = price of u→v
    np.fill_diagonal(into, np.inf)
    into[root] = np.inf
    return _edmonds(into, root)


def min_in_tree(cost: np.ndarray, root: int) -> np.ndarray:
    """Cheapest spanning in-arborescence towards `root` (every node has one path *to* the root).

    Same cost convention as `min_out_tree`. Returns parent: parent[v] = u means tree edge v→u (v
    sends to u, one step closer to the root); parent[root] = -1.
    """
    # An in-tree of G is an out-tree of G with every edge reversed, i.e. of cost.T.
    return min_out_tree(np.asarray(cost).T, root)


def tree_cost(cost: np.ndarray, parent: np.ndarray, inward: bool = False) -> float:
    """Total cost of the tree given by `parent` (out-tree; `inward=True` for an in-tree)."""
    child = np.flatnonzero(parent >= 0)
    if inward:
        return float(np.sum(cost[child, parent[child]]))
    return float(np.sum(cost[parent[child], child]))


def _edmonds(into: np.ndarray, root: int) -> np.ndarray:
    """Chu–Liu/Edmonds, one cycle at a time (Tarjan's dense version): O(n²) work whatever the
    costs. (Contracting every cycle of a level at once instead takes a level per few nodes when
    the cycles are small, as under the multiplicative weights' prices: n levels of n² each.)

    into[v, u] = price of the edge u→v (transposed: a node's entering edges are one contiguous
    row), diagonal and the root's row already inf; modified in place. A path grows backwards from
    a node along cheapest entering edges until it reaches the root's side (done) or closes a
    cycle, which is merged into one node (`_Contraction.merge`) and the path goes on from it.
    """
    n = into.shape[0]
    graph = _Contraction(into)
    chosen: dict[int, tuple[float, int, int]] = {}  # slot -> (price, tail, head) of its entering edge
    done = np.zeros(n, dtype=bool)
    done[root] = True
    on_path = np.zeros(n, dtype=bool)
    for start in range(n):
        if done[start] or graph.node[start] != start:
            continue
        path, v = [], start
        while not done[v]:
            if on_path[v]:  # closed a cycle: merge it and go on from the merged node
                at = path.index(v)
                cycle = path[at:]
                del path[at:]
                for c in cycle:
                    on_path[c] = False
                graph.merge(cycle, [chosen[c] for c in cycle])
            row = into[v]
            column = int(graph.first[v] if graph.whole[v] else np.argmin(row))
            if row[column] == np.inf:
                raise ValueError(f"nodes {graph.originals(v).tolist()} cannot be reached from root {root}")
            chosen[v] = (float(row[column]), column, graph.head(v, column))
            on_path[v] = True
            path.append(v)
            v = int(graph.owner[column])
        done[path] = True
        on_path[path] = False
    return graph.expand([(v, *chosen[v][1:]) for v in range(n) if v != root and graph.node[v] >= 0], root)


class _Contraction:
    """The graph of `_edmonds` as cycles are merged. A merged node takes the slot (row) of its
    first member: entering it at member c costs the edge's price minus c's own entering price, so
    its row is the minimum of its members' rows so reduced. Leaving it costs what leaving its
    cheapest member costs, so columns are never merged: column u stays original node u, held by
    slot owner[u]."""

    def __init__(self, into: np.ndarray):
        n = into.shape[0]
        self.into = into
        self.owner = np.arange(n)  # original node -> the slot that holds it
        self.held: dict[int, np.ndarray] = {}  # merged slot -> the original nodes it holds
        self.node = list(range(n))  # slot -> its node: original u, n + i for the i-th merge, -1 freed
        self.whole = np.ones(n, dtype=bool)  # slot u holds original node u alone
        self.first = into.argmin(axis=1)  # cheapest column into each slot (rows of whole slots never change)
        self.heads: dict[int, np.ndarray] = {}  # merged slot -> original head of its edge from each column
        # Per merge: its members' nodes, their cycle edges (tail, head) and the original nodes each
        # holds, None for one of them (it holds those no other member does).
        self.merges: list[tuple[list[int], list[tuple[int, int]], list]] = []

    def head(self, slot: int, column: int) -> int:
        """The original node that the edge from `column` into `slot` enters."""
        heads = self.heads.get(slot)
        return slot if heads is None else int(heads[column])

    def originals(self, slot: int) -> np.ndarray:
        return np.sort(self.held.get(slot, [slot]))

    def merge(self, cycle: list[int], entering: list[tuple[float, int, int]]) -> None:
        """Merge the slots of `cycle`, each entered by (price, tail, head), into its first.
        Members are folded in order and a later one wins only when strictly cheaper (argmin's rule)."""
        into, x = self.into, cycle[0]
        row, heads = into[x], self.heads.get(x, x)  # row: a view, updated in place
        row -= entering[0][0]
        for c, (price, _, _) in zip(cycle[1:], entering[1:]):
            candidate = into[c]  # slot c is freed below: its row may be overwritten
            candidate -= price
            cheaper = candidate < row
            np.copyto(row, candidate, where=cheaper)
            heads = np.where(cheaper, self.heads.pop(c, c), heads)
        held = [self.held.pop(c) if c in self.held else [c] for c in cycle]  # a list: an original node
        largest = max(range(len(held)), key=lambda j: len(held[j]))
        self.merges.append(([self.node[c] for c in cycle], [e[1:] for e in entering],
                            [None if j == largest else h for j, h in enumerate(held)]))  # fmt: skip
        inside = np.concatenate(held)
        self.owner[inside] = x
        row[inside] = np.inf  # edges within the merged node
        self.held[x], self.heads[x] = inside, heads
        self.node[x] = len(self.node) + len(self.merges) - 1
        for c in cycle:
            self.whole[c] = False
        for c in cycle[1:]:
            self.node[c] = -1  # slot freed

    def expand(self, top: list[tuple[int, int, int]], root: int) -> np.ndarray:
        """Parents of the original nodes from the entering edge (slot, tail, head) of every
        outermost node: undo the merges last first; inside a cycle every member keeps its cycle
        edge except the one the merged node is entered through."""
        n = len(self.node)
        parent = np.full(n, -1)
        entered: dict[int, int] = {}  # node -> original head of the edge entering it
        for slot, t, h in top:
            parent[h] = t
            entered[self.node[slot]] = h
        for i in range(len(self.merges) - 1, -1, -1):
            members, edges, held = self.merges[i]
            h_star = entered[n + i]
            searched = [j for j, inside in enumerate(held) if inside is not None and h_star in inside]
            through = searched[0] if searched else next(j for j, inside in enumerate(held) if inside is None)
            for j, (member, (t, h)) in enumerate(zip(members, edges)):
                if j == through:
                    entered[member] = h_star
                else:
                    parent[h] = t
                    entered[member] = h
        parent[root] = -1
        return parent


def _cycles(parent: np.ndarray) -> list[list[int]]:
    """Cycles of the functional graph v → parent[v] (the root has parent -1)."""
    n = len(parent)
    state = np.zeros(n, dtype=np.int8)  # 0 new, 1 on the current walk, 2 finished
    cycles = []
    for start in range(n):
        walk = []
        v = start
        while v >= 0 and state[v] == 0:
            state[v] = 1
            walk.append(v)
            v = int(parent[v])
        if v >= 0 and state[v] == 1:
            cycles.append(walk[walk.index(v) :])
        for u in walk:
            state[u] = 2
    return cycles


def _edmonds_lists(w: list[list[float]], root: int) -> list[int]:
    """Chu–Liu/Edmonds on nested lists (diagonal and root column already inf)."""
    n = len(w)
    parent, best = [-1] * n, [0.0] * n
    for v, column in enumerate(zip(*w)):  # column[u] = w[u][v]
        if v == root:
            continue
        low = min(column)
        if low == math.inf:
            raise ValueError(f"node {v} cannot be reached from root {root}")
        parent[v], best[v] = column.index(low), low
    cycles = _cycles(np.asarray(parent)) if n > 1 else []
    if not cycles:
        return parent
    label = [-1] * n
    for k, cycle in enumerate(cycles):
        for v in cycle:
            label[v] = k
    k = len(cycles)
    for v in range(n):
        if label[v] < 0:
            label[v], k = k, k + 1
    small = [[math.inf] * k for _ in range(k)]
    entry: list[list[tuple[int, int] | None]] = [[None] * k for _ in range(k)]
    for u in range(n):
        lu, row, small_row, entry_row = label[u], w[u], small[label[u]], entry[label[u]]
        for v in range(n):
            lv = label[v]
            if lv != lu:
                x = row[v] - best[v]  # entering v's group at v replaces v's chosen edge
                if x < small_row[lv]:
                    small_row[lv], entry_row[lv] = x, (u, v)
    for g in range(k):
        small[g][label[root]] = math.inf
    small_parent = _edmonds_lists(small, label[root])
    result = parent[:]
    for g, pg in enumerate(small_parent):
        if pg >= 0:
            u, v = entry[pg][g]
            result[v] = u
    result[root] = -1
    return result


def shallow_out_tree(cost: np.ndarray, root: int) -> np.ndarray | None:
    """Cheapest arborescence from `root` of depth at most 2, or None when there is none.

    Exact, by enumerating the set S of the root's children: every other node then hangs from its
    cheapest parent in S. 2^(n-1) sets, so only for small n (see `SHALLOW_MAX_RANKS`).
    Same conventions as `min_out_tree`.
    """
    w = np.array(cost, dtype=float)
    n = w.shape[0]
    if n > SHALLOW_MAX_RANKS:
        raise ValueError(f"shallow trees are enumerated up to {SHALLOW_MAX_RANKS} ranks, got {n}")
    if n == 1:
        return np.array([-1])
    np.fill_diagonal(w, np.inf)
    others = np.array([v for v in range(n) if v != root])
    m = len(others)
    sets = (np.arange(1, 2**m)[:, None] >> np.arange(m)[None, :]) & 1 == 1  # (K, m) S membership
    first = w[root, others]  # (m,) root → child
    inner = w[np.ix_(others, others)]  # (m, m) child → grandchild
    via = np.where(sets[:, :, None], inner[None, :, :], np.inf)  # (K, s, v)
    best_parent = via.argmin(axis=1)  # (K, m) cheapest s in S for every v
    hang = np.take_along_axis(via, best_parent[:, None, :], axis=1)[:, 0, :]  # (K, m)
    with np.errstate(invalid="ignore"):
        total = np.where(sets, first[None, :], hang).sum(axis=1)
    k = int(np.argmin(total))
    if not np.isfinite(total[k]):
        return None
    parent = np.full(n, -1)
    for j, v in enumerate(others):
        parent[v] = root if sets[k, j] else others[best_parent[k, j]]
    return parent


def shallow_in_tree(cost: np.ndarray, root: int) -> np.ndarray | None:
    """Cheapest in-arborescence towards `root` of depth at most 2 (see `shallow_out_tree`)."""
    return shallow_out_tree(np.asarray(cost).T, root)

