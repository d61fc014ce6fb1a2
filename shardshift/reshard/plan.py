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
import heapq
import itertools
from typing import Sequence

import numpy as np

from shardshift.layout import Coord, Layout
from shardshift.reshard.classes import NOTHING, KeptBytes, TensorClasses, all_classes
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


def _kept_bytes(tensors: Sequence[LogicalTensor], old: tuple[Box | None, ...], new: tuple[Box | None, ...]) -> int:
    return sum(
        t.itemsize * a.intersect(b).numel
        for t, a, b in zip(tensors, old, new)
        if a is not None and b is not None
    )


def axis_orders(layout: Layout) -> list[tuple[int, ...]]:
    """Rank orders in which every axis of the mesh runs in increasing process rank.

    These are the orders PyTorch 2.13 can use: ``new_group`` sorts a group's ranks, so on a mesh
    where some axis runs backwards a process's rank in that axis's group differs from its mesh
    coordinate, and FSDP2 (which shards by group rank) disagrees with DTensor's placement metadata
    (which uses the coordinate). Each order here comes from nesting the axes differently (any axis
    may be innermost); the identity comes first.
    """
    shape = layout.shape
    orders: list[tuple[int, ...]] = []
    for perm in itertools.permutations(range(len(shape))):
        # Process rank of a coordinate: row-major over the axes taken in the order `perm`.
        ranks = np.arange(layout.world_size).reshape([shape[a] for a in perm]).transpose(np.argsort(perm))
        order = tuple(int(r) for r in ranks.reshape(-1))
        if order not in orders:
            orders.append(order)
    return orders


def increasing_on_every_axis(layout: Layout, ranks: Sequence[int]) -> bool:
    mesh = np.asarray(ranks).reshape(layout.shape)
    return all(np.all(np.diff(mesh, axis=a) > 0) for a, size in enumerate(layout.shape) if size > 1)


def choose_ranks(
    space: StateSpace, old: Assignment, layout: Layout, members: Sequence[int] | None = None,
    old_classes: Sequence[TensorClasses] | None = None, new_classes: Sequence[TensorClasses] | None = None,
) -> Assignment:
    """The placement of `layout` on the processes that keeps the most bytes where they are.

    Process p keeps ``kept[p, i]`` bytes if it takes coordinate i: maximising the sum is a linear
    assignment problem. In the same world its optimum is taken when every axis runs in increasing
    rank order (see `axis_orders`), otherwise the best of the axis orders is; ties go to the
    earliest axis order (the identity first, so a switch to the same layout keeps everything).

    `members`: the processes (of `old.world`) that make up a new world of another size. Its ranks
    are numbered afresh, by coordinate, so any placement is one PyTorch's meshes take: the optimum
    is used as it is.

    Kept bytes come from the tensors' classes (`classes.KeptBytes`), not from every pair of
    process and coordinate.
    """
    n = layout.world_size
    old_classes = all_classes(space, old.layout) if old_classes is None else old_classes
    new_classes = all_classes(space, layout) if new_classes is None else new_classes
    kept = KeptBytes(space.tensors, old_classes, new_classes)
    held = np.full(old.world, NOTHING)  # process -> the old coordinate it holds
    held[list(old.ranks)] = np.arange(len(old.ranks))
    processes = list(range(n)) if members is None else list(members)
    assert len(processes) == n, (members, layout)
    from scipy.optimize import linear_sum_assignment  # here: a run that never switches never loads scipy

    procs, coords = linear_sum_assignment(kept.matrix(held[processes], range(n)), maximize=True)
    best = [0] * n
    for p, i in zip(procs, coords):
        best[i] = int(processes[p])
    if members is not None:
        return Assignment(layout, tuple(best), old.world)
    assert n == old.layout.world_size and old.world == n, "a new world of another size needs `members`"
    candidates = axis_orders(layout)
    if increasing_on_every_axis(layout, best):
        candidates.append(tuple(best))
    score = [kept.total(held[list(order)]) for order in candidates]
    return Assignment(layout, candidates[score.index(max(score))])


@dataclasses.dataclass(frozen=True)
class TransitionPlan:
    tensors: tuple[LogicalTensor, ...]
    old: Assignment
    new: Assignment
    old_boxes: Holdings
    new_boxes: Holdings
    segments: tuple[Segment, ...]  # grouped by tensor, in tensor order
    copies: PieceCopies = ()  # the copies of lost processes' pieces that survivors keep
    copied: dict[tuple[int, int], Box] = dataclasses.field(default_factory=dict)  # (of, tensor): the copied box

    def __post_init__(self) -> None:
        self.validate()

    def source_box(self, seg: Segment) -> Box:
        """The old box `seg` is read from: its source's piece, or the copy it keeps."""
        if seg.copy_of is None:
            return self.old_boxes[seg.src][seg.tensor]
        return self.copied[(seg.copy_of, seg.tensor)]

    @property
    def world_size(self) -> int:
        return len(self.old_boxes)

    def segment_bytes(self, seg: Segment) -> int:
        return seg.box.numel * self.tensors[seg.tensor].itemsize

    @property
    def bytes_moved(self) -> int:
        return sum(self.segment_bytes(s) for s in self.segments if not s.local)

    @property
    def bytes_kept(self) -> int:
        return sum(self.segment_bytes(s) for s in self.segments if s.local)

    @property
    def bytes_total(self) -> int:
        """All state under the new layout, summed over processes (replicas counted each time)."""
        return sum(self.held_bytes(self.new_boxes, rank) for rank in range(self.world_size))

    @property
    def bytes_lower_bound(self) -> int:
        """Bytes that must move for this assignment: what each process needs and holds neither
        itself nor as a copy of a lost process's piece."""
        kept = sum(_kept_bytes(self.tensors, self.old_boxes[r], self.new_boxes[r]) for r in range(self.world_size))
        counted = set()
        for holder, of, tensor in self.copies:  # each distinct box once: distinct boxes are disjoint
            box, need = self.copied[(of, tensor)], self.new_boxes[holder][tensor]
            if need is not None and box != self.old_boxes[holder][tensor] and (holder, tensor, box) not in counted:
                counted.add((holder, tensor, box))
                kept += self.tensors[tensor].itemsize * box.intersect(need).numel
        return self.bytes_total - kept

    def piece_bytes(self, boxes: Holdings, rank: int, tensor: int) -> int:
        """Bytes of the piece of `tensor` that `rank` holds in `boxes` (0 for none)."""
        box = boxes[rank][tensor]
        return 0 if box is None else box.numel * self.tensors[tensor].itemsize

    def held_bytes(self, boxes: Holdings, rank: int) -> int:
        return sum(self.piece_bytes(boxes, rank, t) for t in range(len(self.tensors)))

    def sent_bytes(self, rank: int) -> int:
        return sum(self.segment_bytes(s) for s in self.segments if s.src == rank and not s.local)

    def validate(self) -> None:
        """Every element of every new box is covered once, from inside the source's old box."""
        covered: dict[tuple[int, int], list[Box]] = {}
        copies = set(self.copies)
        for seg in self.segments:
            assert not seg.box.empty, seg
            assert seg.copy_of is None or (seg.src, seg.copy_of, seg.tensor) in copies, f"{seg}: no such copy"
            source = self.source_box(seg)
            target = self.new_boxes[seg.dst][seg.tensor]
            assert source is not None and source.contains(seg.box), f"{seg} is not held by its source"
            assert target is not None and target.contains(seg.box), f"{seg} is outside its destination"
            covered.setdefault((seg.dst, seg.tensor), []).append(seg.box)
        for rank, boxes in enumerate(self.new_boxes):
            for index, box in enumerate(boxes):
                pieces = covered.pop((rank, index), [])
                if box is None or box.empty:
                    assert not pieces
                    continue
                assert sum(p.numel for p in pieces) == box.numel, (
                    f"{self.tensors[index].key} on rank {rank}: pieces cover "
                    f"{sum(p.numel for p in pieces)} of {box.numel} elements"
                )
                for a, b in itertools.combinations(pieces, 2):
                    assert a.intersect(b).empty, f"{self.tensors[index].key} on rank {rank}: {a} overlaps {b}"
        assert not covered


Holder = tuple[int, "int | None"]  # (process, the lost process whose piece it keeps a copy of; None: its own)


def _replica_classes(boxes: list[tuple[Holder, Box]]) -> list[tuple[Box, list[Holder]]]:
    """Group the holders of one tensor by identical box; distinct boxes must not overlap."""
    classes: dict[Box, list[Holder]] = {}
    for holder, box in boxes:
        if not box.empty:
            classes.setdefault(box, []).append(holder)
    out = sorted(classes.items(), key=lambda item: item[0].offsets)
    for (a, _), (b, _) in itertools.combinations(out, 2):
        assert a.intersect(b).empty, f"old pieces {a} and {b} overlap without being replicas"
    return out


class _Sources:
    """The holders of one old box of a tensor, asked in order: the destination itself (its own
    piece, then a copy it keeps), then the holder asked for the fewest bytes so far (own pieces
    before copies; ties to the lower process, then the earlier holder). A heap per kind keeps
    that order as `sent` grows (entries are refreshed when found stale: `sent` only grows), so
    choosing costs log(holders), not holders: a tensor replicated over a thousand ranks is
    planned in time linear in the ranks."""

    def __init__(self, holders: list[Holder], sent: list[int]) -> None:
        self.own = {h[0] for h in holders if h[1] is None}
        self.copy_at: dict[int, int] = {}
        for holder, of in holders:
            if of is not None:
                self.copy_at.setdefault(holder, of)
        entries = [(sent[h[0]], h[0], i, h) for i, h in enumerate(holders)]
        self.heaps = ([e for e in entries if e[3][1] is None], [e for e in entries if e[3][1] is not None])
        for heap in self.heaps:
            heapq.heapify(heap)

    def pick(self, dst: int, sent: list[int]) -> Holder:
        if dst in self.own:
            return (dst, None)
        if dst in self.copy_at:
            return (dst, self.copy_at[dst])
        for heap in self.heaps:
            while heap:
                count, rank, i, holder = heap[0]
                if count == sent[rank]:
                    return holder
                heapq.heapreplace(heap, (sent[rank], rank, i, holder))
        raise AssertionError("an old box without holders")


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
    tensors = tuple(space.tensors)
    old_classes, new_classes = all_classes(space, old.layout), all_classes(space, layout)
    old_boxes = holdings_of(space, old, coord_holdings(space, old.layout, old_classes))
    by_coord = coord_holdings(space, layout, new_classes)
    if ranks is not None:
        new = Assignment(layout, tuple(ranks), old.processes)
    else:
        new = choose_ranks(space, old, layout, members, old_classes, new_classes)
    if members is None and not increasing_on_every_axis(layout, new.ranks):
        raise ValueError(f"rank order {list(new.ranks)} runs backwards along an axis of {layout}; use one of `axis_orders`")
    new_boxes = holdings_of(space, new, by_coord)
    n = old.world
    copied: dict[tuple[int, int], Box] = {}
    copies = tuple(c for c in copies if c[1] in lost and c[0] not in lost and old_boxes[c[1]][c[2]] is not None)
    extra: dict[int, list[tuple[Holder, Box]]] = {}
    for holder, of, index in copies:
        copied[(of, index)] = old_boxes[of][index]
        extra.setdefault(index, []).append(((holder, of), old_boxes[of][index]))
    if lost:
        gone = (None,) * len(tensors)
        old_boxes = tuple(gone if rank in lost else boxes for rank, boxes in enumerate(old_boxes))
    sent = [0] * n
    segments: list[Segment] = []
    for index, tensor in enumerate(tensors):
        own = [((r, None), old_boxes[r][index]) for r in range(n) if old_boxes[r][index] is not None]
        classes = [(box, _Sources(holders, sent)) for box, holders in _replica_classes(own + extra.get(index, []))]
        for dst in range(n):
            need = new_boxes[dst][index]
            if need is None or need.empty:
                continue
            covered = 0
            for source_box, sources in classes:
                piece = source_box.intersect(need)
                if piece.empty:
                    continue
                src, copy_of = sources.pick(dst, sent)
                if src != dst:
                    sent[src] += piece.numel * tensor.itemsize
                segments.append(Segment(index, src, dst, piece, copy_of))
                covered += piece.numel
            if covered != need.numel:
                raise ValueError(
                    f"{tensor.key}: {need.numel - covered} of the {need.numel} elements process {dst} needs are held "
                    f"by no surviving process (lost: {sorted(lost)}); they can only come from a checkpoint"
                )
    plan = TransitionPlan(tensors, old, new, old_boxes, new_boxes, tuple(segments), copies, copied)
    assert plan.bytes_moved == plan.bytes_lower_bound, (plan.bytes_moved, plan.bytes_lower_bound)
    return plan
