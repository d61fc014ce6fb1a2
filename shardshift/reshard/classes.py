"""Coordinates grouped by what they hold: the planner's answer to worlds of thousands of ranks.

Under a layout, the box of one logical tensor at a coordinate depends on a few of the coordinate's
axes only: the pipeline stage decides whether the rank holds the tensor at all, and each `Split`
of its sharding takes its chunk index from one axis (tensor parallelism from ``tp``, FSDP2 from
``fsdp``); every other axis holds replicas. So the ranks of a layout fall into a few *classes* per
tensor, one per distinct box, and every question the planner asks of all ranks (which box, how many
bytes kept if a process takes a coordinate) can be asked once per class and spread over the ranks
with numpy.

`TensorClasses` holds, for one tensor and layout, the distinct boxes and the class of every
coordinate (in the layout's rank order). `classes_of` finds the axes a tensor depends on by asking
the space's sharding at coordinates that differ in one axis (a split's index changes exactly when
its axis does), then evaluates `holding` once per class.

Nothing here imports ``torch.distributed``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from shardshift.layout import AXES, Coord, Layout
from shardshift.reshard.space import Box, LogicalTensor, StateSpace, holding

NOTHING = -1  # the class of a coordinate that holds none of the tensor (another pipeline stage)


@dataclasses.dataclass(frozen=True, eq=False)
class TensorClasses:
    """The coordinates of a layout grouped by the box of one tensor they hold."""

    boxes: tuple[Box, ...]  # the distinct boxes, by class
    of_coord: np.ndarray  # int64[world]: the class of each coordinate in rank order, NOTHING for none
    signature: tuple  # equal for tensors whose classes split the coordinates alike (`of_coord` equal)

    def box(self, coord: int) -> Box | None:
        cls = int(self.of_coord[coord])
        return None if cls == NOTHING else self.boxes[cls]


def coordinates(layout: Layout) -> np.ndarray:
    """int64[world, len(AXES)]: every coordinate of `layout`, in rank order."""
    return np.indices(layout.shape).reshape(len(AXES), -1).T


def class_at(of_coord: np.ndarray, coords: np.ndarray) -> np.ndarray:
    """The class of each entry of `coords` (a coordinate, or NOTHING for a process holding none)."""
    coords = np.asarray(coords)
    return np.where(coords == NOTHING, NOTHING, of_coord[np.maximum(coords, 0)])


def classes_of(space: StateSpace, layout: Layout, tensor: LogicalTensor, coords: np.ndarray | None = None,
               cache: dict | None = None) -> TensorClasses:
    """The classes of `tensor`'s boxes over the coordinates of `layout` (module docstring).

    `cache` (one dict per layout, as `all_classes` keeps): tensors of one shape sharded alike (the
    same splits at the first coordinate, taking their indices from the same axes) share their
    boxes, and tensors depending on the same axes and stage share the class of every coordinate,
    so a model of thousands of tensors evaluates `holding` once per kind of tensor and stage."""
    coords = coordinates(layout) if coords is None else coords
    cache = {} if cache is None else cache
    if "probes" not in cache:  # the first coordinate, and one step along each axis that has a degree
        shape = layout.shape
        cache["probes"] = (Coord(*(0,) * len(AXES)), shape, [
            (a, Coord(*(int(i == a) for i in range(len(AXES))))) for a, axis in enumerate(AXES)
            if axis != "pp" and shape[a] > 1])
    base, shape, probes = cache["probes"]
    sharding = space.sharding(layout, base, tensor)
    axes, moves = [], []
    for a, probe in probes:
        moved = space.sharding(layout, probe, tensor).splits
        if moved != sharding.splits:
            axes.append(a)
            moves.append(tuple(i for i, (x, y) in enumerate(zip(moved, sharding.splits)) if x != y))
    signature = (tuple(axes), sharding.stage)
    degrees = [shape[a] for a in axes]
    boxes_key = ("boxes", tensor.shape, sharding, tuple(moves), signature)
    if boxes_key not in cache:
        boxes = []
        for key in range(math.prod(degrees)):
            index = np.unravel_index(key, degrees) if axes else ()
            coord = dataclasses.replace(base, pp=sharding.stage or 0, **{AXES[a]: int(i) for a, i in zip(axes, index)})
            boxes.append(holding(space, layout, coord, tensor))
        cache[boxes_key] = tuple(boxes)
    if signature not in cache:
        keys = np.ravel_multi_index(tuple(coords[:, a] for a in axes), degrees) if axes else np.zeros(len(coords), np.int64)
        if sharding.stage is not None:
            keys = np.where(coords[:, 0] == sharding.stage, keys, NOTHING)
        keys = keys.astype(np.int64)
        keys.setflags(write=False)  # shared by every tensor of this signature
        cache[signature] = keys
    return TensorClasses(cache[boxes_key], cache[signature], signature)


def all_classes(space: StateSpace, layout: Layout) -> list[TensorClasses]:
    """`classes_of` every tensor of `space`, in its order (sharing boxes and class arrays)."""
    coords, cache = coordinates(layout), {}
    return [classes_of(space, layout, t, coords, cache) for t in space.tensors]


class PieceSizes:
    """numel[old class, new class]: the elements of each old box inside each new box of a tensor,
    worked out once per pair of box lists (tensors of one shape and sharding share theirs)."""

    def __init__(self) -> None:
        self.cache: dict[tuple[int, int], tuple[TensorClasses, TensorClasses, np.ndarray]] = {}

    def __call__(self, old: TensorClasses, new: TensorClasses) -> np.ndarray:
        key = (id(old.boxes), id(new.boxes))
        if key not in self.cache:  # the classes are kept with the sizes, so the ids stay theirs
            self.cache[key] = (old, new, overlaps(old.boxes, new.boxes))
        return self.cache[key][2]


def overlaps(a: Sequence[Box | None], b: Sequence[Box | None]) -> np.ndarray:
    """int64[len(a), len(b)]: the elements each box of `a` shares with each box of `b` (boxes of
    one tensor; None holds nothing), all pairs at once."""
    def bounds(boxes):
        dims = next((len(x.sizes) for x in boxes if x is not None), 0)
        lo = np.array([x.offsets if x is not None else (0,) * dims for x in boxes], dtype=np.int64).reshape(len(boxes), dims)
        size = np.array([x.sizes if x is not None else (0,) * dims for x in boxes], dtype=np.int64).reshape(len(boxes), dims)
        return lo, lo + size

    (alo, ahi), (blo, bhi) = bounds(a), bounds(b)
    side = np.minimum(ahi[:, None], bhi[None]) - np.maximum(alo[:, None], blo[None])
    held = np.array([x is not None for x in a])[:, None] & np.array([y is not None for y in b])[None]
    return np.clip(side, 0, None).prod(axis=2) * held


class KeptBytes:
    """The bytes a process keeps in place if it takes a coordinate of the new layout, summed over
    tensors, from their classes under the old and the new layout.

    Tensors whose classes split both layouts' coordinates alike (equal signatures) share one
    class-to-class matrix of kept bytes, so the work grows with the number of such groups (a few
    per kind of tensor and pair of stages), not with the number of tensors or ranks squared.
    A process is named by the old coordinate it held (NOTHING: it held nothing)."""

    def __init__(self, tensors: Sequence[LogicalTensor], old: Sequence[TensorClasses],
                 new: Sequence[TensorClasses], pieces: PieceSizes | None = None) -> None:
        pieces = PieceSizes() if pieces is None else pieces
        groups: dict[tuple, list] = {}
        for t, a, b in zip(tensors, old, new):
            group = groups.setdefault((a.signature, b.signature), [a.of_coord, b.of_coord, 0])
            group[2] = group[2] + t.itemsize * pieces(a, b)
        # Each matrix gets a last row and column of zeros: the class NOTHING (-1) indexes them.
        self.groups = [(a, b, np.pad(m, ((0, 1), (0, 1)))) for a, b, m in groups.values()]

    def matrix(self, held: Sequence[int], coords: Sequence[int]) -> np.ndarray:
        """kept[p, i] for the processes that held old coordinates `held` and new `coords`."""
        held, coords = np.asarray(held), np.asarray(coords)
        kept = np.zeros((len(held), len(coords)), dtype=np.int64)
        for old_cls, new_cls, matrix in self.groups:
            kept += matrix[class_at(old_cls, held)[:, None], new_cls[coords][None, :]]
        return kept

    def total(self, held: Sequence[int]) -> int:
        """The bytes kept when new coordinate i goes to the process that held old coordinate
        ``held[i]``."""
        held = np.asarray(held)
        return int(sum(m[class_at(a, held), b].sum() for a, b, m in self.groups))

    def kept(self, held: np.ndarray, placed: np.ndarray) -> int:
        """The bytes kept in place when process p holds old coordinate ``held[p]`` and takes new
        coordinate ``placed[p]`` (either NOTHING: none)."""
        on = placed != NOTHING
        return int(sum(m[class_at(a, held[on]), b[placed[on]]].sum() for a, b, m in self.groups))


