"""The `Layout` value: degrees of the parallel axes and their rank order.

A layout is written on the command line as ``dp=2,tp=2``; degrees not written are 1. The axes are
always ordered ``pp, dp, fsdp, ep, tp`` from outermost to innermost, so a rank's coordinate is its
index in a row-major array of that shape (tp ranks are neighbours, pp stages are the farthest apart):

    rank = (((pp_i * dp + dp_i) * fsdp + fsdp_i) * ep + ep_i) * tp + tp_i

``ep`` (expert parallelism) means the same in training and in planning (`shardshift simulate`): the
batch is split over dp x fsdp x ep (ep ranks are data ranks for the dense tensors), dense tensors
are replicated along ep and a layer's experts split along it, then sharded by FSDP like any tensor.
A model with no experts refuses ep > 1.

For ``pp=2,fsdp=2`` that gives::

    rank | pp dp fsdp tp
       0 |  0  0    0  0
       1 |  0  0    1  0
       2 |  1  0    0  0
       3 |  1  0    1  0

Nothing here touches processes: a layout is pure data, validated once when built.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

AXES: tuple[str, ...] = ("pp", "dp", "fsdp", "ep", "tp")
"""Mesh axis names, outermost first. This order is the rank order."""


@dataclasses.dataclass(frozen=True)
class Coord:
    """Where one rank sits in a layout: its index on every axis."""

    pp: int
    dp: int
    fsdp: int
    ep: int
    tp: int


@dataclasses.dataclass(frozen=True)
class Layout:
    """Degrees of the parallel axes. ``world_size`` is their product."""

    dp: int = 1  # replicated data parallel: whole copies of the (fsdp, tp)-sharded state
    fsdp: int = 1  # FSDP2-sharded data parallel (HSDP when dp > 1 too)
    tp: int = 1  # tensor parallel (DTensor parallelize_module)
    pp: int = 1  # pipeline parallel (torch.distributed.pipelining, 1F1B)
    ep: int = 1  # expert parallel: experts split, dense tensors replicated (planning only)

    def __post_init__(self) -> None:
        for axis in AXES:
            value = getattr(self, axis)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"degree {axis}={value!r} is invalid: every degree is an integer >= 1")

    # ---- parsing and printing -------------------------------------------------------------------

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """Parse ``"dp=2,tp=2"``. Empty text, or ``"1"``, is the single-rank layout."""
        text = text.strip()
        if text in ("", "1"):
            return cls()
        degrees: dict[str, int] = {}
        for part in text.split(","):
            name, sep, value = part.strip().partition("=")
            name = name.strip()
            if not sep:
                raise ValueError(
                    f"layout part {part!r} is not of the form axis=degree; write e.g. 'dp=2,tp=2'"
                )
            if name not in AXES:
                raise ValueError(
                    f"unknown axis {name!r} in layout {text!r}; the axes are {', '.join(AXES)}"
                )
            if name in degrees:
                raise ValueError(f"axis {name!r} is given twice in layout {text!r}")
            try:
                degree = int(value)
            except ValueError:
                raise ValueError(
                    f"degree of {name} in layout {text!r} is {value.strip()!r}, not an integer"
                ) from None
            if degree < 1:
                raise ValueError(
                    f"degree {name}={degree} in layout {text!r} is invalid: degrees are integers >= 1"
                )
            degrees[name] = degree
        return cls(**degrees)

    def __str__(self) -> str:
        parts = [f"{axis}={getattr(self, axis)}" for axis in ("dp", "fsdp", "ep", "tp", "pp")]
        kept = [p for p in parts if not p.endswith("=1")]
        return ",".join(kept) if kept else "dp=1"

    # ---- sizes ----------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.fsdp * self.ep * self.tp

    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh shape in `AXES` order."""
        return tuple(getattr(self, axis) for axis in AXES)

    @property
    def data_parallel(self) -> int:
        """Number of ranks the global batch is split among (dp × fsdp × ep)."""
        return self.dp * self.fsdp * self.ep

    # ---- rank <-> coordinate --------------------------------------------------------------------

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside layout {self} of {self.world_size} ranks")
        index = []
        for size in reversed(self.shape):
            index.append(rank % size)
            rank //= size
        return Coord(*reversed(index))

    def rank(self, coord: Coord) -> int:
        rank = 0
        for axis, size in zip(AXES, self.shape):
            value = getattr(coord, axis)
            assert 0 <= value < size, (axis, value, size)
            rank = rank * size + value
        return rank

    def data_rank(self, coord: Coord) -> int:
        """Which slice of the global batch a rank reads: dp index outermost, then fsdp, then ep."""
        return (coord.dp * self.fsdp + coord.fsdp) * self.ep + coord.ep

    def coords(self) -> Iterator[Coord]:
        for rank in range(self.world_size):
            yield self.coord(rank)

    # ---- validation against a run ---------------------------------------------------------------

    def check_world(self, nproc: int) -> None:
        if self.world_size != nproc:
            raise ValueError(
                f"layout {self} has {self.world_size} ranks (product of its degrees) but "
                f"{nproc} processes were asked for; {_suggest(nproc)}"
            )


def _suggest(nproc: int) -> str:
    examples = [f"dp={nproc}", f"fsdp={nproc}", f"tp={nproc}", f"pp={nproc}"]
    for a in range(2, nproc):
        if nproc % a == 0:
            examples.append(f"fsdp={a},tp={nproc // a}")
            break
    return f"for {nproc} processes choose degrees whose product is {nproc}, e.g. {' or '.join(examples[:3])}"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def all_layouts(world_size: int, with_ep: bool = False) -> list[Layout]:
    """Every training layout of exactly `world_size` ranks: all degree combinations, with ep = 1
    unless `with_ep` (a model with experts)."""
    out = []
    for pp in divisors(world_size):
        for dp in divisors(world_size // pp):
            for fsdp in divisors(world_size // (pp * dp)):
                for ep in divisors(world_size // (pp * dp * fsdp)) if with_ep else (1,):
                    tp = world_size // (pp * dp * fsdp * ep)
                    out.append(Layout(dp=dp, fsdp=fsdp, ep=ep, tp=tp, pp=pp))
    return out
