"""Minimum-cost spanning arborescences (Chu–Liu/Edmonds) on a dense cost matrix.

This is the pricing oracle of the tree-packing LP and of the multiplicative-weights loop, called
thousands of times, so it avoids graph objects: small matrices (the common case, up to
`_SMALL` ranks) go through plain Python lists, where numpy's per-call overhead would dominate;
larger ones through numpy, one vectorised pass per contraction level. Both are the same algorithm;
tests check both against `networkx.minimum_spanning_arborescence`.
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
    w = np.array(cost, dtype=float)  # copy: the caller's matrix is not touched
    n = w.shape[0]
    if w.shape != (n, n) or not 0 <= root < n:
        raise ValueError(f"cost must be square with 0 <= root < n, got shape {w.shape}, root {root}")
    if n == 1:
        return np.array([-1])
    np.fill_diagonal(w, np.inf)
    w[:, root] = np.inf
    if n <= _SMALL:
        return np.array(_edmonds_lists(w.tolist(), root))
    return _edmonds(w, root)


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


def _edmonds(w: np.ndarray, root: int) -> np.ndarray:
    """Chu–Liu/Edmonds on w (diagonal and root column already inf)."""
    n = w.shape[0]
    cols = np.arange(n)
    parent = np.argmin(w, axis=0)  # cheapest way into every node
    best = w[parent, cols]
    best[root] = 0.0
    parent[root] = -1
    if not np.all(np.isfinite(best)):
        missing = np.flatnonzero(~np.isfinite(best)).tolist()
        raise ValueError(f"nodes {missing} cannot be reached from root {root}")
    label, num_cycles = _cycle_labels(parent, root)
    if num_cycles == 0:
        return parent
    # Contract every cycle to one node. Entering a cycle at v replaces v's cycle edge, so the price
    # of an edge into v is reduced by best[v]; subtracting best[v] for every column (not only
    # cycle members) shifts each single node's column by a constant, which changes nothing.
    singles = np.flatnonzero(label < 0)
    label[singles] = np.arange(num_cycles, num_cycles + len(singles))
    adjusted = w - best[None, :]  # (n, n)
    order = np.argsort(label, kind="stable")
    starts = np.flatnonzero(np.r_[True, np.diff(label[order]) != 0])
    block = adjusted[order][:, order]
    small = np.minimum.reduceat(np.minimum.reduceat(block, starts, axis=0), starts, axis=1)  # (k, k)
    np.fill_diagonal(small, np.inf)
    small[:, label[root]] = np.inf
    small_parent = _edmonds(small, int(label[root]))
    # Expand: for every node v, the cheapest edge into v from the group that the contracted tree
    # makes the parent of v's group; then, per group, the cheapest of its members' entries.
    from_group = small_parent[label]  # (n,) parent group of v's group, -1 for the root's group
    masked = np.where(label[:, None] == from_group[None, :], adjusted, np.inf)  # (n, n)
    entry_u = np.argmin(masked, axis=0)  # (n,)
    entry_cost = masked[entry_u, cols]
    result = parent.copy()  # inside a cycle, keep the cycle edges
    singles_in = singles[from_group[singles] >= 0]
    result[singles_in] = entry_u[singles_in]
    in_cycle = np.flatnonzero(label < num_cycles)  # cycle members, grouped by label below
    order_c = in_cycle[np.lexsort((entry_cost[in_cycle], label[in_cycle]))]
    firsts = order_c[np.r_[True, np.diff(label[order_c]) != 0]]  # cheapest entry of each cycle
    firsts = firsts[from_group[firsts] >= 0]
    result[firsts] = entry_u[firsts]  # the edge entering a cycle replaces that node's cycle edge
    result[root] = -1
    return result


def _cycle_labels(parent: np.ndarray, root: int) -> tuple[np.ndarray, int]:
    """Label the cycles of v → parent[v] 0..k-1 (others -1), vectorised by pointer doubling."""
    n = len(parent)
    step = parent.copy()
    step[root] = root
    rounds = max(1, int(np.ceil(np.log2(n))) + 1)
    far = step
    for _ in range(rounds):  # far = step applied 2**rounds >= n times: every walk is on its cycle
        far = far[far]
    on_cycle = np.zeros(n, dtype=bool)
    on_cycle[far] = True  # a cycle is closed under `step`, so all its nodes are hit
    on_cycle[root] = False
    if not on_cycle.any():
        return np.full(n, -1), 0
    smallest = np.where(on_cycle, np.arange(n), n)  # propagate the smallest id around each cycle
    jump = step
    for _ in range(rounds):
        smallest = np.minimum(smallest, smallest[jump])
        jump = jump[jump]
    ids, label = np.unique(smallest[on_cycle], return_inverse=True)
    labels = np.full(n, -1)
    labels[on_cycle] = label
    return labels, len(ids)


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

