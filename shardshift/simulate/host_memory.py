"""The kernel's work on a CPU host's pages during a switch: what `bench switch --predict` adds to
the α–β model (`simulate.cluster`) where the ranks are processes on a CPU host.

There a process's new pieces are memory its allocator hands out and its old pieces memory it
takes back, and the kernel does part of that work in the process's own thread. A new piece is
written into memory the allocator holds free (already mapped) while there is room, and on fresh
pages beyond it, which the kernel maps and zeroes as the copy first writes them; of the old pieces
a process frees, the share its allocator had mapped apart (glibc gives large blocks a mapping of
their own) goes back to the kernel, and the rest stays free, room for the pieces opened after it.

`page_work` replays that account for each process, round by round, over a switch's schedule: a
tensor's new pieces are opened at the start of the first round it moves in, its old pieces freed
at the end of the last; a whole piece kept (new box = old box: its memory handed over) is
neither. What the allocators hold as the switch starts is a `HostMemory`; the kernel's rates are
`PageRates`. The seconds it gives, per round and process, are `cluster.predict`'s `host_work`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from shardshift.reshard.classes import NOTHING, class_at


@dataclasses.dataclass(frozen=True)
class PageRates:
    """Bytes per second of processor time the kernel takes for a process's pages (0: not booked)."""

    fresh_page_bandwidth: float = 0.0  # mapping and zeroing fresh pages as a copy first writes them, beyond the copy
    free_bandwidth: float = 0.0  # taking written pages back when their mapping is released

    def __post_init__(self) -> None:
        for field in ("fresh_page_bandwidth", "free_bandwidth"):
            if not getattr(self, field) >= 0:
                raise ValueError(f"page rate {field}={getattr(self, field)!r} must be >= 0 bytes/s (0: not booked)")


@dataclasses.dataclass(frozen=True)
class HostMemory:
    """What each process's allocator holds as a switch starts (module docstring). The default, no
    room and everything mapped apart, is the costliest case."""

    free_bytes: tuple[float, ...] | float = 0.0  # per process, or one figure for all
    mapped_share: tuple[float, ...] | float = 1.0  # per process, or one figure for all: 0 to 1

    def __post_init__(self) -> None:
        free, share = np.asarray(self.free_bytes, dtype=np.float64), np.asarray(self.mapped_share, dtype=np.float64)
        if not (free >= 0).all():
            raise ValueError(f"host memory free_bytes={self.free_bytes!r} must be >= 0 bytes")
        if not ((share >= 0) & (share <= 1)).all():
            raise ValueError(f"host memory mapped_share={self.mapped_share!r} must lie between 0 and 1")

    def per_process(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(free bytes, mapped share), float[n] each, for a switch of `n` processes."""
        out = []
        for value in (self.free_bytes, self.mapped_share):
            figures = np.asarray(value, dtype=np.float64)
            figures = np.full(n, float(figures)) if figures.ndim == 0 else figures.copy()
            if figures.shape != (n,):
                raise ValueError(f"host memory gives {figures.size} figures for a switch of {n} processes")
            out.append(figures)
        return out[0], out[1]


@dataclasses.dataclass(frozen=True, eq=False)
class PageWork:
    """The kernel's work on pages over a switch (`page_work`)."""

    seconds: np.ndarray  # float[round, process]: processor time, in the process's own thread
    fresh_bytes: int  # new pieces written on fresh pages, all processes
    unmapped_bytes: int  # old pieces' bytes handed back to the kernel, all processes


def page_work(schedule, rates: PageRates, memory: HostMemory | None = None) -> PageWork:
    """The kernel's work on each process's pages in each round of `schedule` (module docstring),
    from what the allocators hold as it starts (`memory`; None: `HostMemory()`)."""
    opened, freed = _lifetimes(schedule)
    room, share = (memory or HostMemory()).per_process(opened.shape[1])
    seconds = np.zeros_like(opened)
    fresh_total, freed_total = np.zeros(opened.shape[1]), np.zeros(opened.shape[1])
    for at, (taken, given) in enumerate(zip(opened, freed)):
        taken, given = np.maximum(taken, 0.0), np.maximum(given, 0.0)
        fresh, unmapped = np.maximum(taken - room, 0.0), given * share
        room = np.maximum(room - taken, 0.0) + given * (1.0 - share)
        if rates.free_bandwidth:
            seconds[at] += unmapped / rates.free_bandwidth
        if rates.fresh_page_bandwidth:
            seconds[at] += fresh / rates.fresh_page_bandwidth
        fresh_total += fresh
        freed_total += unmapped
    return PageWork(seconds, int(fresh_total.sum()), int(freed_total.sum()))


def _lifetimes(schedule) -> tuple[np.ndarray, np.ndarray]:
    """float[round, process], twice: the bytes of the new pieces each process opens at the start of
    each round (every tensor's in the first round it moves in) and of the old pieces it frees at
    the end (in the last), less the whole pieces it keeps (their memory lives on as the new piece)."""
    plan = schedule.plan
    shape = (len(schedule.pieces), plan.world_size)
    opened, freed = np.zeros(shape), np.zeros(shape)
    for tensor, (first, last) in schedule.tensor_rounds.items():
        itemsize = plan.tensors[tensor].itemsize
        for out, at, classes, where in ((opened, first, plan.new_classes[tensor], plan.placed),
                                        (freed, last, plan.old_classes[tensor], plan.held)):
            sizes = np.array([box.numel for box in classes.boxes], dtype=np.float64) * itemsize
            of = class_at(classes.of_coord, where)
            out[at] += np.where(of == NOTHING, 0.0, sizes[np.maximum(of, 0)])
    for pieces in schedule.pieces:
        for piece in pieces:
            old_box = plan.old_classes[piece.tensor].boxes[piece.flow.a]
            new_box = plan.new_classes[piece.tensor].boxes[piece.flow.b]
            if piece.box == old_box == new_box:
                nbytes = piece.box.numel * plan.tensors[piece.tensor].itemsize
                kept = piece.flow.dst[piece.flow.src == piece.flow.dst]
                first, last = schedule.tensor_rounds[piece.tensor]
                np.add.at(opened[first], kept, -nbytes)
                np.add.at(freed[last], kept, -nbytes)
    return opened, freed
