"""The virtual parameter space: logical tensors, boxes, and the rule that places them on ranks.

Every piece of training state is a `LogicalTensor`: a name, a kind (``param``, ``exp_avg``,
``exp_avg_sq``, ``step``, ``progress``, ``rng`` ...), a global shape and a dtype. A layout places each
logical tensor on ranks by a *sharding*: the pipeline stage that owns it (or every rank) and a list of
`Split` steps, each taking one ``torch.chunk`` piece along a dim of what the rank holds so far. That
is exactly how the training code builds its DTensors: tensor parallelism splits the full tensor first,
then FSDP2 chunks the tp-local piece along dim 0, which DTensor writes as ``(_StridedShard(0, sf=tp),
Shard(0))`` when both split dim 0. The result is one `Box` per rank, possibly empty, the same box on
every replica.

A `StateSpace` (implemented by the training code for its model) lists the logical tensors and gives
the sharding of each under a layout. `holding` then answers "which box of tensor T does the rank at
coordinate c hold?" for any layout and any rank, with no process group: the planner's only input.

Nothing here imports ``torch.distributed``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Protocol, Sequence

from shardshift.layout import Coord, Layout

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True)
class Box:
    """A hyper-rectangle of a logical tensor: ``offsets[d] <= index[d] < offsets[d] + sizes[d]``.

    A 0-d tensor has the one box with no dims (``numel == 1``).
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        assert len(self.offsets) == len(self.sizes), self
        assert all(o >= 0 for o in self.offsets) and all(s >= 0 for s in self.sizes), self

    @classmethod
    def full(cls, shape: Sequence[int]) -> "Box":
        return cls(tuple(0 for _ in shape), tuple(shape))

    @functools.cached_property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def empty(self) -> bool:
        return self.numel == 0

    def intersect(self, other: "Box") -> "Box":
        return _intersect(self, other)

    def _intersect(self, other: "Box") -> "Box":
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        hi = tuple(
            min(a + s, b + t) for a, s, b, t in zip(self.offsets, self.sizes, other.offsets, other.sizes)
        )
        return Box(lo, tuple(max(0, h - l) for l, h in zip(lo, hi)))

    def contains(self, other: "Box") -> bool:
        return all(
            a <= b and b + t <= a + s for a, s, b, t in zip(self.offsets, self.sizes, other.offsets, other.sizes)
        )

    def contiguous_in(self, outer: "Box") -> bool:
        """Whether this box, cut out of a row-major tensor holding `outer`, is one run of memory:
        whole in every dim after some dim, and one element wide in every dim before it."""
        sizes, full = self.sizes, outer.sizes
        k = next((d for d in range(len(sizes)) if sizes[d] != 1), len(sizes))
        return all(sizes[d] == full[d] for d in range(k + 1, len(sizes)))

    def relative_to(self, outer: "Box") -> tuple[slice, ...]:
        """Slices that cut this box out of a local tensor holding `outer`."""
        assert outer.contains(self), (self, outer)
        return tuple(slice(o - p, o - p + s) for o, p, s in zip(self.offsets, outer.offsets, self.sizes))

    def split(self, itemsize: int, max_bytes: int) -> list["Box"]:
        """Cut into boxes of at most `max_bytes` (or single elements), along the outermost dims."""
        if self.numel * itemsize <= max_bytes or not self.sizes:
            return [self]
        dim = next((d for d, s in enumerate(self.sizes) if s > 1), None)
        if dim is None:
            return [self]
        inner = itemsize * math.prod(self.sizes[dim + 1 :])
        step = max(1, max_bytes // inner)
        pieces = []
        for start in range(0, self.sizes[dim], step):
            size = min(step, self.sizes[dim] - start)
            offsets = self.offsets[:dim] + (self.offsets[dim] + start,) + self.offsets[dim + 1 :]
            sizes = self.sizes[:dim] + (size,) + self.sizes[dim + 1 :]
            piece = Box(offsets, sizes)
            pieces.extend([piece] if size > 1 or inner <= max_bytes else piece.split(itemsize, max_bytes))
        return pieces


_intersect = functools.lru_cache(maxsize=1 << 16)(Box._intersect)


def chunk_range(start: int, size: int, parts: int, index: int) -> tuple[int, int]:
    """``torch.chunk`` of the range [start, start + size) into `parts`: (start, size) of piece `index`.

    Chunks are ``ceil(size / parts)`` long; trailing ones may be shorter or empty (as in DTensor and
    FSDP2, which both shard this way).
    """
    step = -(-size // parts) if size else 0
    lo = min(size, index * step)
    hi = min(size, lo + step)
    return start + lo, hi - lo


@dataclasses.dataclass(frozen=True)
class Split:
    """Keep chunk `index` of `parts` along tensor dim `dim`."""

    dim: int
    parts: int
    index: int

    def __post_init__(self) -> None:
        assert 0 <= self.index < self.parts, self

    def apply(self, box: Box) -> Box:
        start, size = chunk_range(box.offsets[self.dim], box.sizes[self.dim], self.parts, self.index)
        offsets = box.offsets[: self.dim] + (start,) + box.offsets[self.dim + 1 :]
        sizes = box.sizes[: self.dim] + (size,) + box.sizes[self.dim + 1 :]
        return Box(offsets, sizes)


@dataclasses.dataclass(frozen=True)
class LogicalTensor:
    """One piece of training state, named independently of any layout."""

    name: str  # the parameter's fully qualified name, or a name of its own for non-parameter state
    kind: str  # "param", "exp_avg", "exp_avg_sq", "step", "progress", "rng", ...
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.name}"

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclasses.dataclass(frozen=True)
class Sharding:
    """How a layout places one logical tensor: who holds it, and which splits make their piece."""

    stage: int | None  # the pipeline stage whose ranks hold it; None: every rank
    splits: tuple[Split, ...] = ()  # applied in order; replicated axes add none


class StateSpace(Protocol):
    """The logical tensors of a training state and how any layout places them."""

    @property
    def tensors(self) -> Sequence[LogicalTensor]: ...

    def check(self, layout: Layout) -> None:
        """Raise ValueError (saying what to choose instead) if the state cannot take `layout`."""

    def sharding(self, layout: Layout, coord: Coord, tensor: LogicalTensor) -> Sharding: ...


def holding(space: StateSpace, layout: Layout, coord: Coord, tensor: LogicalTensor) -> Box | None:
    """The box of `tensor` held by the rank at `coord` of `layout`; None if it holds none of it.

    A rank of the owning stage may hold an empty box (an uneven shard of zero rows): it still holds
    the tensor, with no elements.
    """
    sharding = space.sharding(layout, coord, tensor)
    if sharding.stage is not None and sharding.stage != coord.pp:
        return None
    return _sharded_box(tensor.shape, sharding.splits)


@functools.lru_cache(maxsize=65536)
def _sharded_box(shape: tuple[int, ...], splits: tuple[Split, ...]) -> Box:
    box = Box.full(shape)
    for split in splits:
        box = split.apply(box)
    return box
