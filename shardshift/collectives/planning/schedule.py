"""Collective schedules: a packing cut into chunks and pipelined transfers, as plain data.

`make_schedule(packing, num_chunks_per_tree=k)` splits the buffer into one piece per tree (per
(IN, OUT) pair for all-reduce), sized in proportion to the tree's weight, and every piece into k
chunks that flow down (or up) the tree one step apart, so all links of all trees are busy at once.

The buffer
  broadcast, reduce, allreduce  the tensor itself, N elements, on every rank.
  allgather                     the *output* tensor, N = n·m elements; rank r starts with its input
                                in shard r = elements [r·m, (r+1)·m) (the executor copies it there).
  reducescatter                 a scratch copy of the *input* tensor, N = n·m elements, on every
                                rank; afterwards rank r's output is shard r of it.
  After a reduce, non-root buffers hold partial sums (and after a reduce-scatter, every shard but
  a rank's own): run on a scratch copy where the caller's tensor must stay as it was.
  Chunk boundaries are exact fractions of N (`Chunk.start`, `Chunk.stop`); `element_ranges(s, N)`
  turns them into integer [begin, end) ranges, floor(fraction·N) for both ends, so the ranges
  partition [0, N) for any N, including odd N and N smaller than the number of chunks (some ranges
  are then empty). For allgather and reducescatter N must be a multiple of n, and every chunk then
  lies inside one shard.

Transfers: `ChunkTransfer(step, src, dst, chunk, kind)` means "at step `step`, rank src sends its
current content of `chunk` to rank dst"; with kind COPY, dst overwrites its chunk with it; with
kind REDUCE, dst adds it into its chunk (every rank's buffer starts with its own contribution).
The sender's content is read as it is after all transfers of earlier steps.

Ordering rule (what an executor must follow, and why it cannot deadlock):
  1. `CollectiveSchedule.transfers` is in one global order, sorted by (step, src, dst, chunk). Every rank
     takes the transfers it is part of (as src or dst) in that order: for a given (src, dst) pair
     both sides post their sends/receives in the same order, so point-to-point messages between
     two ranks match in FIFO order (no tags needed; `index` in the list is a valid unique tag).
  2. Causality: within a step, a rank only sends what it held at the end of the previous step;
     relays forward a chunk one step after receiving it; a reducing node sends its partial sum up
     one step after the last of its children's contributions arrived.
  3. Hazards, within one step: no (rank, chunk) is both sent and received; a (rank, chunk) gets
     at most one COPY and never a COPY together with a REDUCE. Several REDUCEs into one (rank,
     chunk) in the same step are allowed: receive each into scratch space and add them in list
     order after they complete (deterministic float sums).
  Two executions are deadlock-free by construction:
   (a) blocking: each rank performs its transfers one at a time, in list order, with blocking
       send/recv. The first unfinished transfer in the global order has all earlier ones done, so
       both of its ranks are at it and it completes; by induction all do.
   (b) step-batched (recommended): for step t = 0, 1, ...: post all of this rank's transfers of
       step t in list order (isend / irecv), wait for all of them, apply the REDUCE additions,
       go to t+1. By induction on t every rank reaches every step, every posted send has its
       receive posted in the same step, and (2) makes every sent value final.
  Empty chunks (for small N) may be skipped by both sides: they compute the same ranges.
  `checker.check_schedule` verifies (2), (3) and the op's result for every rank and chunk.

Switches never appear: a tree edge through switches is one transfer from rank to rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from shardshift.collectives.planning.ops import Collective, Direction, TransferKind
from shardshift.collectives.planning.trees import Packing, Tree

_GRID = 2**20  # piece boundaries are multiples of region / _GRID (exact fractions)


@dataclass(frozen=True)
class Chunk:
    """A contiguous slice [start, stop) of the buffer, as exact fractions of its length."""

    index: int
    start: Fraction
    stop: Fraction
    root: int  # the rank the piece belongs to (broadcast/reduce root, shard owner, all-reduce root)
    piece: int  # index into Packing.pieces()


@dataclass(frozen=True)
class ChunkTransfer:
    """At `step`, rank `src` sends its content of `chunk` to rank `dst` (see module docstring)."""

    step: int
    src: int
    dst: int
    chunk: int
    kind: TransferKind

    @property
    def order_key(self) -> tuple[int, int, int, int]:
        """The global order of transfers."""
        return (self.step, self.src, self.dst, self.chunk)


@dataclass(frozen=True)
class CollectiveSchedule:
    """Chunks and globally ordered transfers for one collective (see module docstring)."""

    op: Collective
    num_ranks: int
    chunks: tuple[Chunk, ...]
    transfers: tuple[ChunkTransfer, ...]
    root: int | None = None  # broadcast / reduce only
    rate: float = 0.0  # algbw of the packing it came from, bytes/s (informational)

    def __post_init__(self) -> None:
        object.__setattr__(self, "op", Collective.parse(self.op))
        object.__setattr__(self, "chunks", tuple(self.chunks))
        object.__setattr__(self, "transfers", tuple(self.transfers))
        n = self.num_ranks
        if n < 2:
            raise ValueError(f"num_ranks={n}: a schedule needs at least 2 ranks")
        has_root = self.root is not None
        if self.op.rooted != has_root or (has_root and not 0 <= self.root < n):
            raise ValueError(
                f"{self.op.value}: root {self.root!r} must be a rank exactly when the op is rooted"
            )
        if not self.chunks:
            raise ValueError("a schedule needs at least one chunk")
        edge = Fraction(0)
        for i, c in enumerate(self.chunks):
            if c.index != i or c.start != edge or c.stop < c.start or not 0 <= c.root < n:
                raise ValueError(f"chunk {i} ({c.start}..{c.stop}, root {c.root}) breaks the "
                                 f"partition of [0, 1); chunk {i} must start at {edge}")  # fmt: skip
            inside = Fraction(c.root, n) <= c.start and c.stop <= Fraction(c.root + 1, n)
            if self.op.sharded and not inside:
                raise ValueError(f"chunk {i} lies outside shard {c.root} of {n}")
            edge = c.stop
        if edge != 1:
            raise ValueError(f"chunks cover [0, {edge}); they must cover the whole buffer [0, 1)")
        previous = (-1, -1, -1, -1)
        for t in self.transfers:
            ranks_ok = 0 <= t.src < n and 0 <= t.dst < n and t.src != t.dst
            if not (ranks_ok and 0 <= t.chunk < len(self.chunks)):
                raise ValueError(f"transfer {t} names a rank outside 0..{n - 1} or a missing chunk")
            if t.step < 0 or t.order_key < previous or not isinstance(t.kind, TransferKind):
                raise ValueError(f"transfer {t} is out of the global (step, src, dst, chunk) order")
            previous = t.order_key

    @property
    def num_steps(self) -> int:
        """Steps from the first transfer to the last (0 when there are none)."""
        return self.transfers[-1].step + 1 if self.transfers else 0

    def transfers_of(self, rank: int) -> tuple[ChunkTransfer, ...]:
        """The transfers `rank` takes part in, in the global order (what it executes)."""
        return tuple(t for t in self.transfers if rank in (t.src, t.dst))


def make_schedule(packing: Packing, num_chunks_per_tree: int = 8) -> CollectiveSchedule:
    """Chunked, pipelined schedule for `packing` (see the module docstring for the contract)."""
    k = num_chunks_per_tree
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"num_chunks_per_tree={num_chunks_per_tree!r}: give an int >= 1")
    n, op = packing.num_ranks, packing.op
    pieces = packing.pieces()
    # Regions: each shard for the sharded ops, the whole buffer otherwise; pieces in root order.
    order = sorted(range(len(pieces)), key=lambda p: (pieces[p].root if op.sharded else 0, p))
    regions: dict[int, list[int]] = {}
    for p in order:
        regions.setdefault(pieces[p].root if op.sharded else -1, []).append(p)
    chunks: list[Chunk] = []
    first_chunk: dict[int, int] = {}
    for region, members in regions.items():
        lo = Fraction(region, n) if op.sharded else Fraction(0)
        width = Fraction(1, n) if op.sharded else Fraction(1)
        total = sum(pieces[p].weight for p in members)
        cumulative = 0.0
        start = lo
        for i, p in enumerate(members):
            cumulative += pieces[p].weight
            last = i == len(members) - 1
            share = Fraction(1) if last else Fraction(round(cumulative / total * _GRID), _GRID)
            stop = lo + width * share
            first_chunk[p] = len(chunks)
            for j in range(k):
                a = start + (stop - start) * j / k
                b = start + (stop - start) * (j + 1) / k
                chunks.append(Chunk(len(chunks), a, b, pieces[p].root, p))
            start = stop
    transfers: list[ChunkTransfer] = []
    for p, piece in enumerate(pieces):
        trees = [packing.trees[i] for i in piece.trees]
        for j in range(k):
            transfers += _piece_transfers(trees, first_chunk[p] + j, j)
    transfers.sort(key=lambda t: t.order_key)
    return CollectiveSchedule(op, n, tuple(chunks), tuple(transfers), packing.root, packing.rate)


def _piece_transfers(trees: list[Tree], chunk: int, j: int) -> list[ChunkTransfer]:
    """Transfers of pipeline chunk j of one piece: up an IN tree and/or down an OUT tree."""
    out: list[ChunkTransfer] = []
    offset = j
    for tree in trees:
        levels = tree.levels()
        if tree.direction is Direction.IN:
            # A rank of height h sends its partial sum at step j + h: all its children (height
            # <= h-1) delivered by step j + h - 1.
            out += [
                ChunkTransfer(j + levels[a], a, b, chunk, TransferKind.REDUCE) for a, b in tree.edges
            ]
            offset = j + levels[tree.root]  # the root holds the full sum after step j + h(root) - 1
        else:
            # The edge into a rank at depth d runs at step offset + d - 1: one step after its parent
            # received the chunk (the root holds it from the start, or from the IN tree).
            out += [
                ChunkTransfer(offset + levels[b] - 1, a, b, chunk, TransferKind.COPY) for a, b in tree.edges
            ]
    return out


def element_ranges(schedule: CollectiveSchedule, count: int) -> list[tuple[int, int]]:
    """Integer [begin, end) element range of every chunk for a buffer of `count` elements.

    For allgather and reducescatter, `count` is the whole buffer (n × per-rank count) and must be a
    multiple of n. Ranges partition [0, count); some may be empty when count is small.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count={count!r}: give the buffer length in elements (an int >= 0)")
    n = schedule.num_ranks
    if schedule.op.sharded and count % n:
        raise ValueError(
            f"{schedule.op.value} buffer of {count} elements is not {n} equal shards; give "
            f"count = {n} × elements per rank (e.g. {n * (count // n + 1)})"
        )
    return [(int(c.start * count), int(c.stop * count)) for c in schedule.chunks]
