"""Execution plans: a schedule compiled, for one rank and one buffer length, into what an executor runs.

A `CollectiveSchedule` (planning/schedule.py) is the same on every rank and speaks in fractions of the buffer.
`compile_plan(schedule, count, rank)` fixes the buffer length (`count` elements), turns every chunk
into an integer element range, drops the transfers of empty chunks (every rank computes the same
ranges, so both ends of a transfer drop it), and keeps the transfers `rank` takes part in, in the
global order, each annotated with the dependencies that make it safe to start:

  SendOp.after_writes   writes (received COPYs or REDUCEs) into this chunk on this rank that come
                        earlier in the global order and must be applied before the chunk is read
                        (read-after-write: the schedule's causality rule);
  RecvOp.ordinal        how many writes into this chunk on this rank come earlier: writes are
                        applied in global order (deterministic sums, COPY after earlier writes);
  RecvOp.after_sends    sends of this chunk from this rank that come earlier and must have
                        completed before it is overwritten (write-after-read).

Every dependency points to a transfer earlier in the global order. That is what makes both ways of
running a plan deadlock-free (executor.py): the first unfinished transfer in the global order has
all its dependencies done, so both of its ranks can post it, and it completes.

`sends` and `recvs` group the ops into queues by (peer, lane), each queue in global order. The lane
is the transfer's tree (`lane_of`) and is used as the message tag, so every (pair of ranks, tree)
is its own first-in first-out stream: both sides post its messages in that order, and the k-th
send from a to b on a lane is the k-th receive at b from a on that lane, of equal size (the
schedule's rule 1, applied per tag). Separate lanes keep a chunk of one tree from waiting behind a
late chunk of another tree that happens to cross the same pair.

Pure data: no torch.distributed here (docs/architecture.md: plans are data).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardshift.collectives.planning.ops import Collective, TransferKind
from shardshift.collectives.planning.schedule import CollectiveSchedule, element_ranges

MIN_CHUNK_BYTES = 128 * 1024  # per tree: below this, per-message overhead outweighs pipelining
MAX_CHUNKS_PER_TREE = 64  # docs/background.md §4: 64 chunks were enough (256 gained 1%)
MAX_CHUNKS_TOTAL = 256  # chunks of all pieces together: each one is a message per hop (CPU)
CHUNK_SECONDS = 0.002  # target time of one chunk on its links (see chunks_per_tree)


@dataclass(frozen=True)
class SendOp:
    """Send elements [begin, end) of the buffer (chunk `chunk`) to `peer`."""

    index: int  # position in the schedule's global transfer list
    step: int
    peer: int
    lane: int  # the transfer's tree (lane_of): the message tag
    chunk: int
    begin: int
    end: int
    after_writes: int  # applied writes into `chunk` needed before reading it


@dataclass(frozen=True)
class RecvOp:
    """Receive chunk `chunk` (elements [begin, end)) from `peer`; overwrite it, or combine into it."""

    index: int
    step: int
    peer: int
    lane: int
    chunk: int
    begin: int
    end: int
    reduce: bool  # True: combine into the chunk (REDUCE); False: overwrite it (COPY)
    ordinal: int  # earlier writes into `chunk` that must be applied first
    after_sends: int  # completed sends of `chunk` needed before overwriting it

    @property
    def numel(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class RankProgram:
    """What one rank executes, in three views of the same ops (see module docstring)."""

    rank: int
    num_chunks: int
    ops: tuple[SendOp | RecvOp, ...]  # global order
    sends: tuple[tuple[int, int, tuple[SendOp, ...]], ...]  # (peer, lane, FIFO) per send queue
    recvs: tuple[tuple[int, int, tuple[RecvOp, ...]], ...]  # (peer, lane, FIFO) per receive queue
    steps: tuple[tuple[SendOp | RecvOp, ...], ...]  # ops grouped by schedule step, global order
    # touching[c]: the queues holding an op on chunk c, as indices into sends + recvs
    touching: tuple[tuple[int, ...], ...]
    max_reduce_numel: int  # largest chunk received with REDUCE (scratch per posted receive)
    step_reduce_numel: int  # most REDUCE elements received within one step (step-batched scratch)


@dataclass(frozen=True)
class ExecutionPlan:
    """A schedule fixed to `count` elements, compiled for one rank."""

    op: Collective
    num_ranks: int
    root: int | None
    count: int  # elements in the buffer (for all-gather / reduce-scatter: n × per-rank count)
    chunks_per_tree: int
    ranges: tuple[tuple[int, int], ...]  # element range of every chunk
    program: RankProgram
    rate: float  # algbw of the packing, bytes/s (informational)
    num_trees: int

    def __post_init__(self) -> None:
        assert len(self.ranges) == self.program.num_chunks
        assert not self.ranges or (self.ranges[0][0] == 0 and self.ranges[-1][1] == self.count)

    def shard(self, rank: int) -> tuple[int, int]:
        """Element range of `rank`'s shard (all-gather / reduce-scatter)."""
        per_rank = self.count // self.num_ranks
        return rank * per_rank, (rank + 1) * per_rank

    def digest(self) -> tuple:
        """What every rank's plan must agree on: checked across ranks before a plan first runs."""
        return (self.op.value, self.num_ranks, self.root, self.count, self.chunks_per_tree,
                self.ranges, self.num_trees)  # fmt: skip


def chunks_per_tree(nbytes: int, num_pieces: int, *, trees_per_piece: int = 1, seconds: float | None = None,
                    chunk_seconds: float = CHUNK_SECONDS, min_chunk_bytes: int = MIN_CHUNK_BYTES,
                    max_chunks: int = MAX_CHUNKS_PER_TREE, max_total: int = MAX_CHUNKS_TOTAL) -> int:
    """Pipeline depth for a buffer of `nbytes` split into `num_pieces` pieces, each of which
    crosses `trees_per_piece` trees (2 for all-reduce: its IN and its OUT tree).

    With the packing's rate R, a collective takes about `seconds` = nbytes / R and every chunk of
    every tree takes seconds / k on its links (chunks are sized by tree weight). A pipeline of
    depth-d trees loses about d - 1 chunk times to filling and draining, while each message costs
    a fixed hand-off (about 2 ms per hop measured on the 2-core test machine, loopback or
    emulated) and CPU. So k aims at chunks of `chunk_seconds`, never below `min_chunk_bytes` per
    chunk and tree on average, never above `max_chunks` per piece nor `max_total` over all pieces
    (packings of many trees, as all-reduce's, would otherwise send more messages than the CPUs can
    hand off); without `seconds`, only the byte floor and the caps apply. The floor counts trees
    because every tree hop of a chunk is a message: an all-reduce chunk crosses two trees, so its
    floor is twice a broadcast's, and both send about the same messages per byte."""
    if min(num_pieces, trees_per_piece, min_chunk_bytes, max_chunks, max_total) < 1 or chunk_seconds <= 0:
        raise ValueError(f"num_pieces={num_pieces}, trees_per_piece={trees_per_piece}, "
                         f"min_chunk_bytes={min_chunk_bytes}, max_chunks={max_chunks}, "
                         f"max_total={max_total}, chunk_seconds={chunk_seconds}: all must be > 0")  # fmt: skip
    k = min(nbytes // (num_pieces * trees_per_piece * min_chunk_bytes), max_total // num_pieces)
    if seconds is not None:
        k = min(k, round(seconds / chunk_seconds))
    return max(1, min(max_chunks, k))


def lane_of(piece: int, kind: TransferKind) -> int:
    """The lane (message tag) of a transfer of `piece`: one per tree. A piece is one tree, except
    for all-reduce, where it is an IN tree (its REDUCE transfers) and an OUT tree (its COPYs).
    Those two get lanes of their own: in one lane the reduction of chunk j + d waited, first in
    first out, behind the broadcast of chunk j wherever both trees cross the same pair, which tied
    each piece's reduction to the round trip through its root (docs/collectives.md)."""
    return 2 * piece + (kind is TransferKind.COPY)


def compile_plan(schedule: CollectiveSchedule, count: int, rank: int, num_trees: int = 0) -> ExecutionPlan:
    """Compile `schedule` for a buffer of `count` elements, as executed by `rank`."""
    n = schedule.num_ranks
    if not 0 <= rank < n:
        raise ValueError(f"rank {rank} is not in the schedule's group of {n} ranks (0..{n - 1})")
    ranges = element_ranges(schedule, count)  # validates count
    writes = [0] * len(ranges)  # writes into each chunk seen so far, on this rank
    sends = [0] * len(ranges)  # sends of each chunk seen so far, from this rank
    ops: list[SendOp | RecvOp] = []
    for index, t in enumerate(schedule.transfers):
        begin, end = ranges[t.chunk]
        if begin == end or rank not in (t.src, t.dst):
            continue
        lane = lane_of(schedule.chunks[t.chunk].piece, t.kind)
        if t.src == rank:
            ops.append(SendOp(index, t.step, t.dst, lane, t.chunk, begin, end, writes[t.chunk]))
            sends[t.chunk] += 1
        else:
            reduce = t.kind is TransferKind.REDUCE
            ops.append(RecvOp(index, t.step, t.src, lane, t.chunk, begin, end, reduce,
                              writes[t.chunk], sends[t.chunk]))  # fmt: skip
            writes[t.chunk] += 1
    by_queue: dict[tuple[bool, int, int], list] = {}
    by_step: dict[int, list] = {}
    step_reduce: dict[int, int] = {}
    for op in ops:
        by_queue.setdefault((isinstance(op, SendOp), op.peer, op.lane), []).append(op)
        by_step.setdefault(op.step, []).append(op)
        if isinstance(op, RecvOp) and op.reduce:
            step_reduce[op.step] = step_reduce.get(op.step, 0) + op.numel
    queues = sorted(by_queue.items())  # receives first (is_send False), then by (peer, lane)
    sends = tuple((p, lane, tuple(q)) for (is_send, p, lane), q in queues if is_send)
    recvs = tuple((p, lane, tuple(q)) for (is_send, p, lane), q in queues if not is_send)
    touching: list[set[int]] = [set() for _ in ranges]
    for i, (_, _, queue) in enumerate(sends + recvs):
        for op in queue:
            touching[op.chunk].add(i)
    program = RankProgram(
        rank=rank,
        num_chunks=len(ranges),
        ops=tuple(ops),
        sends=sends,
        recvs=recvs,
        steps=tuple(tuple(by_step[s]) for s in sorted(by_step)),
        touching=tuple(tuple(sorted(found)) for found in touching),
        max_reduce_numel=max((op.numel for op in ops if isinstance(op, RecvOp) and op.reduce), default=0),
        step_reduce_numel=max(step_reduce.values(), default=0),
    )
    k = len(schedule.chunks) // max(1, len({c.piece for c in schedule.chunks}))
    return ExecutionPlan(schedule.op, n, schedule.root, count, k, tuple(ranges), program,
                         schedule.rate, num_trees)  # fmt: skip
