"""Transition plans: which box of which logical tensor goes from which process to which.

A switch from an old `Assignment` (a layout and the process at each of its coordinates) to a new
layout is planned in three steps, all pure metadata:

1. **Assignment.** Which process takes which coordinate of the new layout. Process p keeps
   ``|old box of p ∩ new box of c|`` bytes of every tensor if it takes coordinate c. In the same
   world the best of the orders PyTorch's meshes handle correctly (every axis in increasing rank
   order, `axis_orders`) is taken; ties keep the current order, so a switch to the same layout
   keeps everything. A world of another size numbers its ranks afresh, and the best placement is
   a linear assignment problem (`choose_ranks`). Kept bytes are counted per class of coordinates
   (`classes.py`), not per pair of process and coordinate.
2. **Sources.** Each process's new box of a tensor is cut by the distinct old boxes of that tensor
   (replicas hold identical boxes; distinct boxes never overlap, which is checked). A piece the
   process already holds is a local copy; any other piece comes from the replica that has been
   asked for the fewest bytes so far, so replicas share the sending.
3. **Validation.** Every element of every new box is covered exactly once, by a box inside the
   source's old box; bytes moved equal the lower bound for the chosen assignment (every byte a
   process needs and does not hold must reach it once, and no more).

The plan is frozen data; `schedule.py` cuts it into memory-bounded rounds and `execute.py` runs it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Iterator, Sequence

import numpy as np

from shardshift.layout import Coord, Layout
from shardshift.reshard.classes import NOTHING, KeptBytes, PieceSizes, TensorClasses, all_classes, class_at, overlaps
from shardshift.reshard.space import Box, LogicalTensor, StateSpace

Holdings = tuple[tuple[Box | None, ...], ...]  # [process rank][tensor index]
PieceCopies = tuple[tuple[int, int, int], ...]  # (holder, of, tensor): `holder` keeps a copy of `of`'s old piece


@dataclasses.dataclass(frozen=True)
class Assignment:
    """A layout placed on processes: ``ranks[i]`` is the process at the layout's i-th coordinate.

    `processes` is how many processes the transition it belongs to involves (0: the layout's world,
    each process taking one coordinate). A world that grows or shrinks plans over the processes of
    the old world and the new one together: a process not in `ranks` holds nothing.
    """

    layout: Layout
    ranks: tuple[int, ...]
    processes: int = 0

    def __post_init__(self) -> None:
        n = self.layout.world_size
        if not self.processes:
            if sorted(self.ranks) != list(range(n)):
                raise ValueError(
                    f"an assignment of {self.layout} needs each of processes 0..{n - 1} exactly once, "
                    f"got {list(self.ranks)}"
                )
        elif len(self.ranks) != n or len(set(self.ranks)) != n or not all(0 <= r < self.processes for r in self.ranks):
            raise ValueError(
                f"an assignment of {self.layout} needs {n} distinct processes of 0..{self.processes - 1}, "
                f"got {list(self.ranks)}"
            )

    @property
    def world(self) -> int:
        """The processes of the transition: those holding state under this assignment, and others."""
        return self.processes or self.layout.world_size

    @classmethod
    def identity(cls, layout: Layout) -> "Assignment":
        return cls(layout, tuple(range(layout.world_size)))

    def coord(self, rank: int) -> Coord:
        return self.layout.coord(self.ranks.index(rank))

    def __str__(self) -> str:
        if self.ranks == tuple(range(len(self.ranks))):
            return str(self.layout)
        return f"{self.layout} on ranks {list(self.ranks)}"


@dataclasses.dataclass(frozen=True)
class Segment:
    """Copy `box` of tensor `tensor` from process `src`'s old piece into process `dst`'s new piece
    (or, with `copy_of`, from the copy `src` keeps of that lost process's old piece)."""

    tensor: int  # index into the plan's tensors
    src: int
    dst: int
    box: Box
    copy_of: int | None = None  # the lost process whose piece `src` keeps a copy of

    @property
    def local(self) -> bool:
        return self.src == self.dst


def coord_holdings(space: StateSpace, layout: Layout, classes: Sequence[TensorClasses] | None = None) -> Holdings:
    """The box of every tensor held at each coordinate of `layout`, in rank order (from the
    tensors' classes: `holding` is evaluated once per distinct box)."""
    classes = all_classes(space, layout) if classes is None else classes
    columns = [[None if k == NOTHING else c.boxes[k] for k in c.of_coord.tolist()] for c in classes]
    return tuple(zip(*columns)) if columns else tuple(() for _ in range(layout.world_size))


def holdings_of(space: StateSpace, assignment: Assignment, by_coord: Holdings | None = None) -> Holdings:
    """The box of every tensor held by every process of `assignment.world` (None where it holds
    nothing)."""
    by_coord = coord_holdings(space, assignment.layout) if by_coord is None else by_coord
    index = {rank: i for i, rank in enumerate(assignment.ranks)}
    nothing = (None,) * len(space.tensors)
    return tuple(by_coord[index[rank]] if rank in index else nothing for rank in range(assignment.world))


def axis_orders(layout: Layout) -> list[tuple[int, ...]]:
    """Rank orders in which every axis of the mesh runs in increasing process rank.

    These are the orders PyTorch 2.13 can use: ``new_group`` sorts a group's ranks, so on a mesh
    where some axis runs backwards a process's rank in that axis's group differs from its mesh
    coordinate, and FSDP2 (which shards by group rank) disagrees with DTensor's placement metadata
    (which uses the coordinate). Each order here comes from nesting the axes differently (any axis
    may be innermost); the identity comes first.
    """
    shape = [size for size in layout.shape if size > 1]  # axes of degree 1 nest anywhere alike
    orders: dict[tuple[int, ...], None] = {}
    for perm in itertools.permutations(range(len(shape))):
        # Process rank of a coordinate: row-major over the axes taken in the order `perm`.
        ranks = np.arange(layout.world_size).reshape([shape[a] for a in perm]).transpose(np.argsort(perm))
        orders.setdefault(tuple(ranks.reshape(-1).tolist()), None)
    return list(orders)


def increasing_on_every_axis(layout: Layout, ranks: Sequence[int]) -> bool:
    mesh = np.asarray(ranks).reshape(layout.shape)
    return all(np.all(np.diff(mesh, axis=a) > 0) for a, size in enumerate(layout.shape) if size > 1)


def choose_ranks(
    space: StateSpace, old: Assignment, layout: Layout, members: Sequence[int] | None = None,
    old_classes: Sequence[TensorClasses] | None = None, new_classes: Sequence[TensorClasses] | None = None,
    pieces: PieceSizes | None = None,
) -> Assignment:
    """The placement of `layout` on the processes that keeps the most bytes where they are.

    Process p keeps ``kept[p, i]`` bytes if it takes coordinate i: maximising the sum is a linear
    assignment problem. In the same world its optimum is taken when every axis runs in increasing
    rank order (see `axis_orders`), otherwise the best of the axis orders is; ties go to the
    earliest axis order (the identity first, so a switch to the same layout keeps everything).

    `members`: the processes (of `old.world`) that make up a new world of another size. Its ranks
    are numbered afresh, by coordinate, so any placement is one PyTorch's meshes take: the optimum
    is used as it is.

    The matrix is built over kinds of processes and coordinates (`_Placement`), and the solver runs
    only when no axis order keeps as much as the best placement could.
    """
    n = layout.world_size
    old_classes = all_classes(space, old.layout) if old_classes is None else old_classes
    new_classes = all_classes(space, layout) if new_classes is None else new_classes
    kept = KeptBytes(space.tensors, old_classes, new_classes, pieces)
    held = np.full(old.world, NOTHING)  # process -> the old coordinate it holds
    held[list(old.ranks)] = np.arange(len(old.ranks))
    processes = np.arange(n) if members is None else np.asarray(members)
    assert len(processes) == n, (members, layout)
    problem = _Placement(kept, held[processes])
    if members is not None:
        return Assignment(layout, tuple(int(p) for p in processes[next(problem.solutions())]), old.world)
    assert n == old.layout.world_size and old.world == n, "a new world of another size needs `members`"
    candidates = axis_orders(layout)
    score = [kept.total(held[list(order)]) for order in candidates]
    if max(score) < problem.bound():  # some placement may keep more: the first optimum PyTorch takes
        best = next((tuple(int(p) for p in processes[solution]) for solution in problem.solutions()
                     if increasing_on_every_axis(layout, processes[solution])), None)
        if best is not None:
            candidates.append(best)
            score.append(kept.total(held[list(best)]))
    return Assignment(layout, candidates[score.index(max(score))])


class _Placement:
    """Which process takes each new coordinate, keeping the most bytes in place: a linear
    assignment problem.

    Processes that held coordinates of the same classes for every tensor keep the same bytes
    anywhere, and new coordinates of the same classes are worth the same to anyone: the matrix of
    kept bytes is worked out between those kinds (a few hundred at most for any layout), and spread
    over the processes and coordinates by indexing only when the solver runs."""

    def __init__(self, kept: KeptBytes, held: np.ndarray) -> None:
        self.p_kind, p_first = _kinds(np.stack([class_at(a, held) for a, _, _ in kept.groups], axis=1))
        self.c_kind, c_first = _kinds(np.stack([b for _, b, _ in kept.groups], axis=1))
        self.profit = kept.matrix(held[p_first], c_first)

    def bound(self) -> int:
        """No placement keeps more: every coordinate with the process that keeps the most of it."""
        return int(self.profit.max(axis=0)[self.c_kind].sum())

    def solutions(self) -> Iterator[np.ndarray]:
        """Optimal placements: for each new coordinate, the index of the process (into `held`)
        taking it. First, when every coordinate can go to a process keeping the most of it, such a
        placement (a flow between the kinds along those best pairs: it reaches `bound`); then the
        linear assignment over every process and coordinate."""
        tight = self._along_best_pairs()
        if tight is not None:
            yield tight
        from scipy.optimize import linear_sum_assignment  # here: a run that never switches never loads scipy

        procs, coords = linear_sum_assignment(self.profit[np.ix_(self.p_kind, self.c_kind)], maximize=True)
        out = np.empty(len(self.c_kind), dtype=np.int64)
        out[coords] = procs
        yield out

    def _along_best_pairs(self) -> np.ndarray | None:
        """A placement in which every coordinate's process keeps the most any could, or None.

        The processes a kind of coordinate gets are given to its coordinates in increasing order,
        so the placement runs in rank order along every axis wherever the kinds allow."""
        from scipy.sparse import csr_array
        from scipy.sparse.csgraph import maximum_flow

        supply, demand = np.bincount(self.p_kind), np.bincount(self.c_kind)
        k, m = self.profit.shape
        rows, cols = np.nonzero(self.profit == self.profit.max(axis=0))  # the best pairs of kinds
        source, sink = k + m, k + m + 1  # nodes: process kinds, coordinate kinds, source, sink
        graph = csr_array((np.concatenate([supply, np.full(len(rows), len(self.c_kind)), demand]).astype(np.int32),
                           (np.concatenate([np.full(k, source), rows, k + np.arange(m)]),
                            np.concatenate([np.arange(k), k + cols, np.full(m, sink)]))), shape=(k + m + 2,) * 2)
        result = maximum_flow(graph, source, sink)
        if result.flow_value < len(self.c_kind):
            return None
        flow = result.flow.tocoo()
        members = [list(np.flatnonzero(self.p_kind == i)) for i in range(k)]
        given: list[list[int]] = [[] for _ in range(m)]
        for i, j, count in sorted(zip(flow.row.tolist(), flow.col.tolist(), flow.data.tolist()), key=lambda e: e[1]):
            if i < k and k <= j < k + m and count > 0:
                given[j - k] += members[i][:count]
                del members[i][:count]
        out = np.empty(len(self.c_kind), dtype=np.int64)
        for j in range(m):
            out[np.flatnonzero(self.c_kind == j)] = sorted(given[j])
        return out


def _kinds(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(kind of each row, the first row of each kind): equal rows are one kind."""
    _, first, kind = np.unique(rows, axis=0, return_index=True, return_inverse=True)
    return kind.reshape(-1), first


@dataclasses.dataclass(frozen=True, eq=False)
class Flow:
    """The pieces of some tensors that go from their old class `a` to their new class `b`: process
    ``dst[i]`` receives them from ``src[i]`` (itself: a local copy), out of the copy it keeps of lost
    process ``copy_of[i]``'s piece when that is not NOTHING. The tensors of a flow are alike (the
    same classes on both sides), so one choice of sources serves them all and their pieces between
    two processes travel together."""

    tensors: tuple[int, ...]
    a: int
    b: int
    dst: np.ndarray
    src: np.ndarray
    copy_of: np.ndarray
    nbytes: int  # of the pieces of all `tensors`, per destination

    @functools.cached_property
    def message_ends(self) -> tuple[np.ndarray, np.ndarray]:
        """(processes, how many of this flow's messages each sends or receives), local copies aside."""
        moving = self.src != self.dst
        return np.unique(np.concatenate([self.src[moving], self.dst[moving]]), return_counts=True)


@dataclasses.dataclass(frozen=True, eq=False)
class TransitionPlan:
    """Who sends which piece of which tensor to whom, kept per class of coordinates (`flows`);
    `segments` spells it out per process, for a world small enough to run here."""

    tensors: tuple[LogicalTensor, ...]
    old: Assignment
    new: Assignment
    old_classes: tuple[TensorClasses, ...]
    new_classes: tuple[TensorClasses, ...]
    held: np.ndarray  # int64[process]: the old coordinate whose state it holds (NOTHING: none, or lost)
    placed: np.ndarray  # int64[process]: the new coordinate it takes (NOTHING: none)
    flows: tuple[Flow, ...]
    copies: PieceCopies = ()  # the copies of lost processes' pieces that survivors keep
    copied: dict[tuple[int, int], Box] = dataclasses.field(default_factory=dict)  # (of, tensor): the copied box
    pieces: PieceSizes = dataclasses.field(default_factory=PieceSizes)  # shared with the planner

    def __post_init__(self) -> None:
        self.validate()

    @property
    def world_size(self) -> int:
        return len(self.held)

    # ---- boxes, per process (small worlds) ------------------------------------------------------

    def old_box(self, rank: int, tensor: int) -> Box | None:
        return _box(self.old_classes[tensor], int(self.held[rank]))

    def new_box(self, rank: int, tensor: int) -> Box | None:
        return _box(self.new_classes[tensor], int(self.placed[rank]))

    @functools.cached_property
    def old_boxes(self) -> Holdings:
        return _holdings(self.old_classes, self.held)

    @functools.cached_property
    def new_boxes(self) -> Holdings:
        return _holdings(self.new_classes, self.placed)

    def source_box(self, seg: Segment) -> Box:
        """The old box `seg` is read from: its source's piece, or the copy it keeps."""
        if seg.copy_of is None:
            return self.old_box(seg.src, seg.tensor)
        return self.copied[(seg.copy_of, seg.tensor)]

    @functools.cached_property
    def segments(self) -> tuple[Segment, ...]:
        """Every piece from its source to its destination, grouped by tensor in tensor order (within
        a tensor: by destination, then by the old box's offsets)."""
        out = []
        for flow in self.flows:
            for t in flow.tensors:
                box = self.old_classes[t].boxes[flow.a].intersect(self.new_classes[t].boxes[flow.b])
                for dst, src, of in zip(flow.dst.tolist(), flow.src.tolist(), flow.copy_of.tolist()):
                    out.append(Segment(t, src, dst, box, None if of == NOTHING else of))
        out.sort(key=lambda seg: (seg.tensor, seg.dst, seg.box.offsets))
        return tuple(out)

    def segment_bytes(self, seg: Segment) -> int:
        return seg.box.numel * self.tensors[seg.tensor].itemsize

    def piece_bytes(self, boxes: Holdings, rank: int, tensor: int) -> int:
        """Bytes of the piece of `tensor` that `rank` holds in `boxes` (0 for none)."""
        box = boxes[rank][tensor]
        return 0 if box is None else box.numel * self.tensors[tensor].itemsize

    def held_bytes(self, boxes: Holdings, rank: int) -> int:
        return sum(self.piece_bytes(boxes, rank, t) for t in range(len(self.tensors)))

    # ---- totals, from the classes (any world) ---------------------------------------------------

    @functools.cached_property
    def received(self) -> np.ndarray:
        """int64[process]: bytes each process receives from others."""
        return self._per_process(lambda f: f.dst)

    @functools.cached_property
    def sent(self) -> np.ndarray:
        """int64[process]: bytes each process sends to others."""
        return self._per_process(lambda f: f.src)

    def _per_process(self, side) -> np.ndarray:
        out = np.zeros(self.world_size, dtype=np.int64)
        for f in self.flows:
            moving = f.src != f.dst
            np.add.at(out, side(f)[moving], f.nbytes)
        return out

    def sent_bytes(self, rank: int) -> int:
        return int(self.sent[rank])

    @property
    def bytes_moved(self) -> int:
        return int(self.received.sum())

    @property
    def bytes_kept(self) -> int:
        return sum(f.nbytes * int((f.src == f.dst).sum()) for f in self.flows)

    @functools.cached_property
    def bytes_total(self) -> int:
        """All state under the new layout, summed over processes (replicas counted each time)."""
        return _state_bytes(self.tensors, self.new_classes, self.placed)

    @property
    def bytes_lower_bound(self) -> int:
        """Bytes that must move for this assignment: what each process needs and holds neither
        itself nor as a copy of a lost process's piece."""
        kept = int(KeptBytes(self.tensors, self.old_classes, self.new_classes, self.pieces).kept(self.held, self.placed))
        counted = set()
        for holder, of, tensor in self.copies:  # each distinct box once: distinct boxes are disjoint
            box, need = self.copied[(of, tensor)], self.new_box(holder, tensor)
            if need is not None and box != self.old_box(holder, tensor) and (holder, tensor, box) not in counted:
                counted.add((holder, tensor, box))
                kept += self.tensors[tensor].itemsize * box.intersect(need).numel
        return self.bytes_total - kept

    def validate(self) -> None:
        """Every element of every new box is covered once, from inside the source's old box.

        The pieces of a new class are its intersections with the distinct old boxes: those must
        not overlap and must fill it (checked once per pair of box lists); each process of the new
        class gets each piece exactly once, from a process that holds the old class or keeps a copy
        of that box (checked once per flow)."""
        copies = set(self.copies)
        pairs: dict[tuple[int, ...], set[tuple[int, int]]] = {}  # the flows of each bundle of tensors, as (a, b)
        bundle_of: dict[int, tuple[int, ...]] = {}
        old_of, new_of = _ClassesAt(self.held), _ClassesAt(self.placed)
        for f in self.flows:
            old, new = self.old_classes[f.tensors[0]], self.new_classes[f.tensors[0]]
            assert np.array_equal(f.dst, new_of.members(new, f.b)), (
                f"{self.tensors[f.tensors[0]].key}: a piece misses or repeats a process")
            own = f.copy_of == NOTHING
            assert (old_of(old)[f.src[own]] == f.a).all(), f"{self.tensors[f.tensors[0]].key}: a source does not hold its piece"
            if f.tensors not in pairs:
                bundle_of.update((t, f.tensors) for t in f.tensors)
            pairs.setdefault(f.tensors, set()).add((f.a, f.b))
            for t in f.tensors if not own.all() else ():
                for src, of in zip(f.src[~own].tolist(), f.copy_of[~own].tolist()):
                    assert (src, of, t) in copies and self.copied[(of, t)] == self.old_classes[t].boxes[f.a], "no such copy"
        needs: dict[tuple[int, ...], set[tuple[int, int]]] = {}  # per kind of tensor: the pieces someone takes
        for t, (old, new) in enumerate(zip(self.old_classes, self.new_classes)):
            key = (id(old.boxes), id(new.boxes), id(new.of_coord))
            if key not in needs:
                taken = np.unique(new_of(new))
                needs[key] = {(int(a), int(b)) for a, b in zip(*np.nonzero(self.pieces(old, new))) if b in taken}
                _check_cover(self.tensors[t], old.boxes, new.boxes, taken)
            got = pairs[bundle_of[t]] if t in bundle_of else set()
            assert got == needs[key], f"{self.tensors[t].key}: pieces without a flow, or flows without one"


class _ClassesAt:
    """The class of each process (at `coords`) for tensors of one class array, worked out once."""

    def __init__(self, coords: np.ndarray) -> None:
        self.coords, self.cache = coords, {}

    def __call__(self, classes: TensorClasses) -> np.ndarray:
        key = id(classes.of_coord)
        if key not in self.cache:
            self.cache[key] = (classes.of_coord, class_at(classes.of_coord, self.coords), {})
        return self.cache[key][1]

    def members(self, classes: TensorClasses, cls: int) -> np.ndarray:
        """The processes of class `cls`, in increasing order."""
        of = self(classes)
        found = self.cache[id(classes.of_coord)][2]
        if cls not in found:
            found[cls] = np.flatnonzero(of == cls)
        return found[cls]


def _check_cover(tensor: LogicalTensor, old: Sequence[Box], new: Sequence[Box], taken: np.ndarray) -> None:
    """The distinct old boxes do not overlap, and fill every new box some process takes."""
    distinct = list(dict.fromkeys(x for x in old if x is not None))
    shared = overlaps(distinct, distinct)
    np.fill_diagonal(shared, 0)
    assert not shared.any(), f"{tensor.key}: old pieces overlap without being replicas"
    taken = [b for b in taken.tolist() if b != NOTHING and new[b] is not None]
    if taken:
        got = overlaps(distinct, [new[b] for b in taken]).sum(axis=0)
        need = np.array([new[b].numel for b in taken])
        assert (got == need).all(), f"{tensor.key}: pieces cover {got.tolist()} of {need.tolist()} elements"


def _box(classes: TensorClasses, coord: int) -> Box | None:
    return None if coord == NOTHING else classes.box(coord)


def _holdings(classes: Sequence[TensorClasses], coords: np.ndarray) -> Holdings:
    columns = [[None if k == NOTHING else c.boxes[k] for k in class_at(c.of_coord, coords).tolist()] for c in classes]
    return tuple(zip(*columns)) if columns else tuple(() for _ in coords)


def _state_bytes(tensors: Sequence[LogicalTensor], classes: Sequence[TensorClasses], coords: np.ndarray) -> int:
    """Bytes the processes at `coords` hold in all, from the classes: each box times how many hold it."""
    total, holders = 0, {}
    for t, c in zip(tensors, classes):
        key = id(c.of_coord)
        if key not in holders:  # how many processes hold each class (the last entry: NOTHING)
            holders[key] = np.bincount(class_at(c.of_coord, coords) + 1, minlength=len(c.boxes) + 1)[1:]
        sizes = np.array([0 if b is None else b.numel for b in c.boxes], dtype=np.int64)
        total += t.itemsize * int(sizes @ holders[key])
    return total


class _Planner:
    """The sources of every piece, chosen per flow (see `plan_transition`)."""

    def __init__(self, tensors, old_classes, new_classes, original, placed, lost, copies, pieces) -> None:
        self.tensors, self.old_classes, self.new_classes = tensors, old_classes, new_classes
        self.original, self.placed, self.lost = original, placed, lost  # `original`: held before the crash
        self.held = original.copy()
        self.held[list(lost)] = NOTHING
        self.sent = np.zeros(len(original), dtype=np.int64)
        self.copies_of: dict[int, list[tuple[int, int]]] = {}  # tensor -> [(holder, of)]
        for holder, of, t in copies:
            self.copies_of.setdefault(t, []).append((holder, of))
        self.pattern = pieces

    def bundles(self) -> list[list[int]]:
        """Tensors that plan alike: the same classes on both sides, the same pieces between them,
        the same copies kept; in the order of their first tensor."""
        out: dict[tuple, list[int]] = {}
        for t, (a, b) in enumerate(zip(self.old_classes, self.new_classes)):
            key = (id(a.of_coord), id(b.of_coord), self.pattern(a, b).tobytes(), tuple(self.copies_of.get(t, ())))
            out.setdefault(key, []).append(t)
        return list(out.values())

    def flows(self, bundle: list[int]) -> list[Flow]:
        first_old, first_new = self.old_classes[bundle[0]], self.new_classes[bundle[0]]
        old_of, new_of = class_at(first_old.of_coord, self.held), class_at(first_new.of_coord, self.placed)
        weights = sum(self.tensors[t].itemsize * self.pattern(self.old_classes[t], self.new_classes[t]) for t in bundle)
        copy_holders = self.copy_holders(bundle, first_old)
        out = []
        for a, b in zip(*np.nonzero(self.pattern(first_old, first_new))):
            dst = np.flatnonzero(new_of == b)
            if not len(dst):
                continue
            src, copy_of = self.sources(dst, np.flatnonzero(old_of == a), copy_holders.get(int(a), []), int(weights[a, b]))
            if src is None:
                self.refuse(bundle[0], int(b), int(dst[0]), old_of, copy_holders)
            out.append(Flow(tuple(bundle), int(a), int(b), dst, src, copy_of, int(weights[a, b])))
        return out

    def copy_holders(self, bundle: list[int], old: TensorClasses) -> dict[int, list[tuple[int, int]]]:
        """Old class -> (holder, lost process) for the copies of this bundle's lost pieces."""
        out: dict[int, list[tuple[int, int]]] = {}
        for holder, of in self.copies_of.get(bundle[0], ()):
            out.setdefault(int(old.of_coord[self.original[of]]), []).append((holder, of))
        return out

    def sources(self, dst: np.ndarray, own: np.ndarray, copies: list[tuple[int, int]], nbytes: int):
        """(src, copy_of) for every process of `dst`: itself when it holds the piece (or a copy of
        it), else the holder asked for the fewest bytes so far (own pieces before copies; ties to the
        lower process), taking the holders in turn. None when nobody holds the piece."""
        src = np.full(len(dst), NOTHING)
        copy_of = np.full(len(dst), NOTHING)
        local = np.isin(dst, own)
        src[local] = dst[local]
        copy_at = {holder: of for holder, of in reversed(copies)}
        for i in np.flatnonzero(~local):
            if int(dst[i]) in copy_at:
                src[i], copy_of[i] = dst[i], copy_at[int(dst[i])]
        need = np.flatnonzero(src == NOTHING)
        if not len(need):
            return src, copy_of
        if len(own):
            holders, of = own, np.full(len(own), NOTHING)
        elif copies:
            holders, of = np.array([h for h, _ in copies]), np.array([o for _, o in copies])
        else:
            return None, None
        order = np.lexsort((holders, self.sent[holders]))  # fewest bytes first, then the lower process
        pick = order[np.arange(len(need)) % len(holders)]
        src[need], copy_of[need] = holders[pick], of[pick]
        np.add.at(self.sent, holders[pick], nbytes)
        return src, copy_of

    def refuse(self, t: int, b: int, dst: int, old_of: np.ndarray, copy_holders: dict) -> None:
        need = self.new_classes[t].boxes[b]
        pieces = self.pattern(self.old_classes[t], self.new_classes[t])[:, b]
        missing = sum(int(pieces[a]) for a in range(len(pieces)) if not (old_of == a).any() and a not in copy_holders)
        raise ValueError(
            f"{self.tensors[t].key}: {missing} of the {need.numel} elements process {dst} needs are held by no "
            f"surviving process (lost: {sorted(self.lost)}); they can only come from a checkpoint"
        )


def plan_transition(
    space: StateSpace, old: Assignment, layout: Layout, ranks: Sequence[int] | None = None,
    members: Sequence[int] | None = None, lost: Sequence[int] = (), copies: PieceCopies = (),
) -> TransitionPlan:
    """Plan the switch from `old` to `layout` (placed by `choose_ranks` unless `ranks` is given).

    For a world that changes size, `old` is placed on the processes of the old and new worlds
    together (`Assignment.processes`) and `members` names the processes of the new world: those
    that are not in `old` arrive with nothing, and those of `old` that are not members only send.
    `lost`: processes of `old` whose state is gone (they crashed): every piece is taken from
    another copy, and a piece no surviving process holds is a ValueError naming it.
    `copies`: (holder, of, tensor): process `holder` keeps a copy of process `of`'s old piece of
    `tensor` (`elastic.redundancy`); a lost process's piece may come from such a copy.

    Planning works on classes of coordinates (`classes.py`): the pieces of a tensor are the
    intersections of its old and new classes' boxes, and the sources of one piece are chosen for
    every process of its new class at once, so the cost grows with the classes and the tensors,
    and only linearly with the processes.

    Raises ValueError, before anything moves, if the state cannot take `layout`.
    """
    space.check(layout)
    if members is None and layout.world_size != old.layout.world_size:
        raise ValueError(
            f"layout {layout} has {layout.world_size} ranks but the job has {old.layout.world_size}; "
            f"choose degrees whose product is {old.layout.world_size}"
        )
    if members is not None and len(members) != layout.world_size:
        raise ValueError(f"layout {layout} has {layout.world_size} ranks but the new world has {len(members)} processes")
    tensors, pieces = tuple(space.tensors), PieceSizes()
    old_classes, new_classes = tuple(all_classes(space, old.layout)), tuple(all_classes(space, layout))
    if ranks is not None:
        new = Assignment(layout, tuple(ranks), old.processes)
    else:
        new = choose_ranks(space, old, layout, members, old_classes, new_classes, pieces)
    if members is None and not increasing_on_every_axis(layout, new.ranks):
        raise ValueError(f"rank order {list(new.ranks)} runs backwards along an axis of {layout}; use one of `axis_orders`")
    original, placed = _coords_of(old, old.world), _coords_of(new, old.world)
    copies = tuple(c for c in copies if c[1] in lost and c[0] not in lost and original[c[1]] != NOTHING
                   and old_classes[c[2]].of_coord[original[c[1]]] != NOTHING)
    copied = {(of, t): old_classes[t].box(int(original[of])) for _, of, t in copies}
    planner = _Planner(tensors, old_classes, new_classes, original, placed, lost, copies, pieces)
    flows = [flow for bundle in planner.bundles() for flow in planner.flows(bundle)]
    plan = TransitionPlan(tensors, old, new, old_classes, new_classes, planner.held, placed, tuple(flows), copies,
                          copied, pieces)
    assert plan.bytes_moved == plan.bytes_lower_bound, (plan.bytes_moved, plan.bytes_lower_bound)
    return plan


def _coords_of(assignment: Assignment, world: int) -> np.ndarray:
    """int64[process]: the coordinate each process takes under `assignment` (NOTHING: none)."""
    out = np.full(world, NOTHING)
    out[list(assignment.ranks)] = np.arange(len(assignment.ranks))
    return out
