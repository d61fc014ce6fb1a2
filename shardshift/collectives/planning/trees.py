"""The result of tree packing as plain data: `Tree`, `Piece` and `Packing` (see planning/packing).

Kept apart from the solvers so that schedules, checkers and executors can use packings without
importing scipy. Both dataclasses are frozen and validated when built: every tree spans all ranks,
directions and roots match the op, and the rate agrees with the weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardshift.collectives.planning.ops import Collective, Direction

_REL = 1e-6  # relative tolerance for rates recomputed from float weights


@dataclass(frozen=True)
class Tree:
    """A spanning tree over the ranks, with the rate of the data it carries."""

    root: int
    direction: Direction  # OUT: edges point away from root; IN: towards it (child → parent)
    edges: tuple[tuple[int, int], ...]  # (sender rank, receiver rank)
    weight: float  # bytes/s carried by this tree
    # paths[i] = physical nodes that edge i crosses: (sender, switch, ..., receiver); a direct
    # link gives (sender, receiver). Informational: a schedule sends rank to rank.
    paths: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "direction", Direction(self.direction))
        object.__setattr__(self, "edges", tuple((int(a), int(b)) for a, b in self.edges))
        object.__setattr__(self, "paths", tuple(tuple(int(x) for x in p) for p in self.paths))
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"tree at root {self.root} has weight {self.weight}; give a rate > 0")
        if self.paths and len(self.paths) != len(self.edges):
            raise ValueError(f"tree at root {self.root}: {len(self.paths)} paths for {len(self.edges)} edges")
        for (a, b), path in zip(self.edges, self.paths):
            if path[0] != a or path[-1] != b:
                raise ValueError(f"path {path} does not go from rank {a} to rank {b}")

    def parent(self) -> dict[int, int]:
        """Each non-root rank → its neighbour one step closer to the root."""
        if self.direction is Direction.OUT:
            return {b: a for a, b in self.edges}
        return {a: b for a, b in self.edges}

    def check_spans(self, num_ranks: int) -> None:
        """Raise ValueError unless this is a spanning tree of ranks 0..num_ranks-1."""
        where = f"{self.direction.value}-tree at root {self.root}"
        if not 0 <= self.root < num_ranks:
            raise ValueError(f"{where}: root is not a rank (0..{num_ranks - 1})")
        if len(self.edges) != num_ranks - 1:
            raise ValueError(f"{where}: {len(self.edges)} edges, a spanning tree has {num_ranks - 1}")
        parent = self.parent()
        if len(parent) != num_ranks - 1 or self.root in parent:
            raise ValueError(f"{where}: every rank but the root needs exactly one parent edge")
        connected = {self.root}  # each rank's walk stops at one already known to reach the root
        for v in range(num_ranks):
            walk, u = set(), v
            while u not in connected:
                if u not in parent or u in walk:
                    raise ValueError(f"{where}: rank {v} is not connected to the root")
                walk.add(u)
                u = parent[u]
            connected |= walk

    def levels(self) -> dict[int, int]:
        """OUT: depth (root 0, its children 1, …). IN: height (leaves 0, parent = 1 + max child)."""
        parent = self.parent()
        if self.direction is Direction.OUT:
            depth = {self.root: 0}

            def d(v: int) -> int:
                if v not in depth:
                    depth[v] = d(parent[v]) + 1
                return depth[v]

            return {v: d(v) for v in list(parent) + [self.root]}
        children: dict[int, list[int]] = {}
        for c, p in parent.items():
            children.setdefault(p, []).append(c)
        height: dict[int, int] = {}

        def h(v: int) -> int:
            if v not in height:
                height[v] = 1 + max(h(c) for c in children[v]) if v in children else 0
            return height[v]

        return {v: h(v) for v in list(parent) + [self.root]}

    @property
    def depth(self) -> int:
        """Hops from the farthest rank to the root (or from the root to it): the chain a pipeline fills."""
        return max(self.levels().values())


@dataclass(frozen=True)
class Piece:
    """A unit of data in a packing: carried by one tree, or an (IN, OUT) pair for all-reduce."""

    root: int
    weight: float  # bytes/s
    trees: tuple[int, ...]  # indices into Packing.trees


@dataclass(frozen=True)
class Packing:
    """Weighted trees for one collective on one topology, with rate and bound (algbw, bytes/s)."""

    op: Collective
    num_ranks: int
    trees: tuple[Tree, ...]
    rate: float  # algbw, bytes/s, achieved by these trees
    bound: float  # algbw, bytes/s, from bounds.py (max-flow / min-cut), independent of the trees
    solve_seconds: float
    root: int | None = None  # broadcast / reduce only
    method: str = "lp"  # "lp" or "mwu"
    construction: str = ""  # "multiroot" or "rs+ag" (all-reduce), else the op name; "/shallow": depth <= 2
    candidates: tuple[tuple[str, float], ...] = ()  # rate of every construction solved
    topology_name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "op", Collective.parse(self.op))
        object.__setattr__(self, "trees", tuple(self.trees))
        op, n = self.op, self.num_ranks
        if n < 2 or not self.trees:
            raise ValueError(f"a packing needs >= 2 ranks and >= 1 tree, got {n} and {len(self.trees)}")
        if op.rooted != (self.root is not None):
            raise ValueError(f"{op.value}: root must be {'given' if op.rooted else 'None'}")
        for tree in self.trees:
            tree.check_spans(n)
        want = {Collective.BROADCAST: Direction.OUT, Collective.ALLGATHER: Direction.OUT,
                Collective.REDUCE: Direction.IN, Collective.REDUCESCATTER: Direction.IN}  # fmt: skip
        if op is Collective.ALLREDUCE:
            if len(self.trees) % 2:
                raise ValueError("allreduce trees come in (IN, OUT) pairs; got an odd count")
            for i in range(0, len(self.trees), 2):
                t_in, t_out = self.trees[i], self.trees[i + 1]
                if (t_in.direction, t_out.direction) != (Direction.IN, Direction.OUT) or (
                    t_in.root != t_out.root or not math.isclose(t_in.weight, t_out.weight, rel_tol=_REL)
                ):
                    raise ValueError(f"allreduce trees {i}, {i + 1} must be an IN and an OUT tree "
                                     "with the same root and weight")  # fmt: skip
            expected = sum(t.weight for t in self.trees[::2])
        else:
            for tree in self.trees:
                if tree.direction is not want[op] or (op.rooted and tree.root != self.root):
                    raise ValueError(f"{op.value} needs {want[op].value}-trees"
                                     + (f" at root {self.root}" if op.rooted else ""))  # fmt: skip
            if op.sharded:
                totals = [sum(t.weight for t in self.trees if t.root == r) for r in range(n)]
                if min(totals) <= 0 or not math.isclose(min(totals), max(totals), rel_tol=1e-4):
                    raise ValueError(f"{op.value}: every rank's trees must carry the same rate, got {totals}")
                expected = n * min(totals)
            else:
                expected = sum(t.weight for t in self.trees)
        if not math.isclose(self.rate, expected, rel_tol=_REL):
            raise ValueError(f"rate {self.rate} does not match the trees' weights ({expected})")
        assert self.rate <= self.bound * (1 + 1e-6), f"rate {self.rate} above bound {self.bound}"

    @property
    def depth(self) -> int:
        """See `packing_depth`."""
        return packing_depth(self.op, self.trees)

    def pieces(self) -> tuple[Piece, ...]:
        """The data units: one per tree, or one per (IN, OUT) pair for all-reduce."""
        if self.op is Collective.ALLREDUCE:
            return tuple(Piece(self.trees[i].root, self.trees[i].weight, (i, i + 1))
                         for i in range(0, len(self.trees), 2))  # fmt: skip
        return tuple(Piece(t.root, t.weight, (i,)) for i, t in enumerate(self.trees))


def packing_depth(op: Collective, trees: tuple[Tree, ...]) -> int:
    """Longest chain of hops one piece's data takes: a tree's depth, or for all-reduce (trees in
    (IN, OUT) pairs) the depth of the IN tree plus that of the OUT tree. Pipelines lose about
    depth - 1 chunk times to filling and draining (execution/program.py, chunks_per_tree)."""
    if op is Collective.ALLREDUCE:
        return max(trees[i].depth + trees[i + 1].depth for i in range(0, len(trees), 2))
    return max(t.depth for t in trees)


def combine_pairs(rs: tuple[Tree, ...], ag: tuple[Tree, ...], num_ranks: int) -> tuple[Tree, ...]:
    """Reduce-scatter IN trees + all-gather OUT trees → concurrent all-reduce (IN, OUT) pairs.

    At root r, with in-rate a_r and out-rate b_r, running both at once at rate ρ_r = a_r b_r /
    (a_r + b_r) uses the fraction ρ_r/a_r + ρ_r/b_r = 1 of their capacity: the two-phase time.
    The IN trees' weights and the OUT trees' weights (each summing to ρ_r) are then matched by a
    common refinement of their cumulative shares, giving pairs of equal weight.
    """
    pairs: list[Tree] = []
    for r in range(num_ranks):
        ins = [t for t in rs if t.root == r]
        outs = [t for t in ag if t.root == r]
        a, b = sum(t.weight for t in ins), sum(t.weight for t in outs)
        rho = a * b / (a + b)
        i = j = 0
        used_i = used_j = 0.0  # share of ins[i] / outs[j] already paired
        while i < len(ins) and j < len(outs):
            left_i = ins[i].weight / a - used_i
            left_j = outs[j].weight / b - used_j
            share = min(left_i, left_j)
            if share > 1e-12:
                pairs.append(Tree(r, Direction.IN, ins[i].edges, rho * share, ins[i].paths))
                pairs.append(Tree(r, Direction.OUT, outs[j].edges, rho * share, outs[j].paths))
            if left_i <= left_j:
                i, used_i, used_j = i + 1, 0.0, used_j + share
            else:
                j, used_j, used_i = j + 1, 0.0, used_i + share
    return tuple(pairs)
