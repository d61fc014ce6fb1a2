"""A transition plan cut into rounds that respect a memory budget and cannot deadlock.

**Budget.** At no point does a process hold more than max(its old state, its new state) + `budget`
bytes of state and message buffers (unless one piece alone is bigger than the budget). Rounds are
closed by keeping the executor's own account of each process's memory (`build_schedule`), and
segments larger than a quarter of the budget are first cut along their outermost dims.

**Order.** Tensors are taken one after another, and rounds are filled greedily in that order, so a
tensor's pieces occupy a run of consecutive rounds. The unit of filling is a `FlowPiece`: one tensor's
part of a flow of the plan (every destination of the flow gets the same box, each from its
source), cut to a quarter of the budget at most; its cost is counted for every process it touches
at once, so a schedule is built for thousands of processes without listing their segments. The executor allocates a tensor's new piece
at the first round of its run and frees the old piece after the last. The order matters: a process
that gains some tensors and loses others (a pipeline stage moving, say) would, in a bad order,
allocate all its gains before freeing any loss. `memory_order` therefore picks, tensor by tensor,
the next one that keeps every process closest to its allowance, max(old state, new state). Within
that, only the tensors of the current round hold both an old and a new piece, which bounds the
extra memory by the budget plus the one tensor a round boundary can cut.

**No deadlock.** Every process derives the same rounds from the same plan. In a round each process
posts all its receives and sends (one message per peer, every segment for that peer packed into it,
tagged with the round number) before waiting on any, and enters round r + 1 only when its messages
of round r are complete. Every message posted in round r is matched by a receive its peer posts in
round r, so each round completes. On NCCL the round's operations form one group
(`batch_isend_irecv`); on gloo they are separate `isend`/`irecv` calls, since gloo's batched form
is the one known to hang.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from shardshift.reshard.classes import class_at
from shardshift.reshard.plan import Flow, Segment, TransitionPlan
from shardshift.reshard.space import Box

DEFAULT_BUDGET = 256 << 20
MIN_BUDGET = 4 << 10
ALIGN = 16  # bytes: every segment starts aligned in a packed message, so any dtype can view it
DIRECT_BYTES = 64 << 10  # segments this big get a message of their own (see `Message`)


@dataclasses.dataclass(frozen=True)
class Round:
    segments: tuple[Segment, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class FlowPiece:
    """`box` of tensor `tensor` for every destination of `flow`, each from its source."""

    flow: Flow
    tensor: int
    box: Box


@dataclasses.dataclass(frozen=True)
class Message:
    """One message of a round from `src` to `dst`.

    Segments of at least `SwitchSchedule.direct_bytes` travel alone (``direct``): the sender sends its slice of
    the old piece as it is and the receiver receives straight into its new piece, with no copy
    wherever the slice is contiguous. Smaller segments between the same pair are packed together
    at aligned byte offsets into one message.
    """

    src: int
    dst: int
    segments: tuple[Segment, ...]
    offsets: tuple[int, ...]
    nbytes: int
    direct: bool = False


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclasses.dataclass(frozen=True, eq=False)
class SwitchSchedule:
    plan: TransitionPlan
    budget: int
    pieces: tuple[tuple[FlowPiece, ...], ...]  # per round
    peaks: np.ndarray  # int64[process]: the most bytes above its old state each holds, per the builder's account

    @functools.cached_property
    def rounds(self) -> tuple[Round, ...]:
        """The rounds spelt out as segments (ordered by tensor, destination, box), for a world
        small enough to run here."""
        out = []
        for pieces in self.pieces:
            segments = [Segment(p.tensor, src, dst, p.box, None if of < 0 else of)
                        for p in pieces
                        for dst, src, of in zip(p.flow.dst.tolist(), p.flow.src.tolist(), p.flow.copy_of.tolist())]
            segments.sort(key=lambda seg: (seg.tensor, seg.dst, seg.box.offsets))
            out.append(Round(tuple(segments)))
        return tuple(out)

    @property
    def direct_bytes(self) -> int:
        """Segments of this many bytes or more travel as messages of their own."""
        return min(DIRECT_BYTES, max(1, self.budget // 4))

    def memory_peaks(self, rank: int) -> list[int]:
        """Per round, the most bytes above its old state `rank` holds (the executor's account)."""
        return [peak for _, peak in self._memory(rank)]

    def _memory(self, rank: int) -> list[tuple[int, int]]:
        """Per round: (bytes above the old state at its start, the most during it)."""
        plan, out, level = self.plan, [], 0
        opening, closing = self.lifetimes(rank)
        opens = {i: sum(plan.piece_bytes(plan.new_boxes, rank, t) for t in ts) for i, ts in opening.items()}
        frees = {i: sum(plan.piece_bytes(plan.old_boxes, rank, t) for t in ts) for i, ts in closing.items()}
        for index in range(len(self.rounds)):
            sends, recvs, _ = self.messages(index, rank)
            start = level
            level += opens.get(index, 0)
            out.append((start, level + sum(m.nbytes for m in sends) + sum(m.nbytes for m in recvs)))
            level -= frees.get(index, 0)
        return out

    def messages(self, index: int, rank: int) -> tuple[list[Message], list[Message], list[Segment]]:
        """(messages `rank` sends, messages it receives, its local copies) in round `index`."""
        return self._round_messages[index].get(rank, ([], [], []))

    @functools.cached_property
    def _round_messages(self) -> list[dict[int, tuple[list[Message], list[Message], list[Segment]]]]:
        """Per round, per process: `messages`, worked out once for every process."""
        out = []
        for rnd in self.rounds:
            by_pair: dict[tuple[int, int], list[Segment]] = {}
            work: dict[int, tuple[list[Message], list[Message], list[Segment]]] = {}
            for seg in rnd.segments:
                if seg.local:
                    work.setdefault(seg.dst, ([], [], []))[2].append(seg)
                else:
                    by_pair.setdefault((seg.src, seg.dst), []).append(seg)
            for (src, dst), segs in sorted(by_pair.items()):
                messages, offsets, end, packed = [], [], 0, []
                for seg in segs:
                    nbytes = self.plan.segment_bytes(seg)
                    if nbytes >= self.direct_bytes:
                        messages.append(Message(src, dst, (seg,), (0,), align(nbytes), direct=True))
                        continue
                    packed.append(seg)
                    offsets.append(end)
                    end = align(end + nbytes)
                if packed:
                    messages.append(Message(src, dst, tuple(packed), tuple(offsets), end))
                work.setdefault(src, ([], [], []))[0].extend(messages)
                work.setdefault(dst, ([], [], []))[1].extend(messages)
            out.append(work)
        return out

    def _first_cost(self, index: int, rank: int) -> int:
        """What the first piece of round `index` costs `rank`: the new piece it opens, its buffers."""
        piece = self.pieces[index][0]
        opened = self.tensor_rounds[piece.tensor][0] < index
        cost = 0 if opened else self.plan.piece_bytes(self.plan.new_boxes, rank, piece.tensor)
        moving = piece.flow.src != piece.flow.dst
        touches = int((piece.flow.src[moving] == rank).sum() + (piece.flow.dst[moving] == rank).sum())
        return cost + touches * align(piece.box.numel * self.plan.tensors[piece.tensor].itemsize)

    def lifetimes(self, rank: int) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
        """For `rank`: the tensors whose new piece is allocated at the start of each round, and
        those whose old piece is freed at its end (the first and last rounds of each tensor)."""
        opens: dict[int, list[int]] = {}
        closes: dict[int, list[int]] = {}
        for tensor, (first, last) in self.tensor_rounds.items():
            if self.plan.new_boxes[rank][tensor] is not None:
                opens.setdefault(first, []).append(tensor)
            if self.plan.old_boxes[rank][tensor] is not None:
                closes.setdefault(last, []).append(tensor)
        return opens, closes

    @functools.cached_property
    def tensor_rounds(self) -> dict[int, tuple[int, int]]:
        """For every tensor with pieces: (first round, last round) of its run."""
        spans: dict[int, tuple[int, int]] = {}
        for index, pieces in enumerate(self.pieces):
            for piece in pieces:
                first, _ = spans.get(piece.tensor, (index, index))
                spans[piece.tensor] = (first, index)
        return spans

    def validate(self, ranks: Sequence[int] | None = None) -> None:
        """Every flow's box is moved once, in pieces that tile it; each tensor's pieces form one run
        of rounds; and, for `ranks` (default: every process), the executor's account of memory
        keeps to the budget rule: a round stays within the process's limit, except that its first
        piece is taken even when it alone goes over (a piece bigger than what is left of the
        budget)."""
        moved: dict[tuple[int, int], int] = {}
        previous, seen = None, set()
        for piece in (p for pieces in self.pieces for p in pieces):
            key = (id(piece.flow), piece.tensor)
            moved[key] = moved.get(key, 0) + piece.box.numel
            if piece.tensor != previous:
                assert piece.tensor not in seen, f"tensor {piece.tensor}'s pieces are not one run"
                seen.add(piece.tensor)
                previous = piece.tensor
        for flow in self.plan.flows:
            for t in flow.tensors:
                box = self.plan.old_classes[t].boxes[flow.a].intersect(self.plan.new_classes[t].boxes[flow.b])
                assert moved.pop((id(flow), t), 0) == box.numel, "rounds lose or add elements"
        assert not moved, "rounds move pieces of no flow"
        allowances = _allowances(self.plan)
        for rank in range(self.plan.world_size) if ranks is None else ranks:
            limit = int(allowances[rank]) + self.budget
            for index, (start, peak) in enumerate(self._memory(rank)):
                first = self._first_cost(index, rank)
                assert peak <= max(limit, start + first), f"round {index} takes rank {rank} to {peak} > {limit}"


def build_schedule(plan: TransitionPlan, budget: int = DEFAULT_BUDGET, validate: bool = True) -> SwitchSchedule:
    """Cut `plan` into rounds; every process stays within max(old, new) + `budget` bytes.

    The builder keeps, for every process, the account the executor will keep: new pieces are
    allocated at the first round of their tensor, buffers live for one round, old pieces are freed
    at the end of their tensor's last round. A round closes when one more piece would take some
    process above its limit; a piece that alone exceeds it (bigger than the budget) gets a round of
    its own. `validate`: check the result against every process's account (off for worlds too big
    to list; `SwitchSchedule.validate(ranks)` checks a sample).
    """
    if budget < MIN_BUDGET:
        raise ValueError(f"--switch-budget {budget} bytes is too small; give at least {MIN_BUDGET} (4K)")
    n = plan.world_size
    cap = max(1, budget // 4)
    sizes = _PieceSizes(plan)
    limit = _allowances(plan, sizes) + budget
    flows_of: dict[int, list[Flow]] = {}
    for flow in plan.flows:
        for t in flow.tensors:
            flows_of.setdefault(t, []).append(flow)

    rounds: list[tuple[FlowPiece, ...]] = []
    current: list[FlowPiece] = []
    level = np.zeros(n, dtype=np.int64)  # bytes above the old state held at the start of the current round
    opened, buffers, freeing = (np.zeros(n, dtype=np.int64) for _ in range(3))  # within the current round
    peaks = np.zeros(n, dtype=np.int64)
    started: set[int] = set()

    def close() -> None:
        rounds.append(tuple(current))
        current.clear()
        np.maximum(peaks, level + opened + buffers, out=peaks)
        level[:] += opened - freeing
        for account in (opened, buffers, freeing):
            account[:] = 0

    for t in memory_order(plan, sizes):
        itemsize = plan.tensors[t].itemsize
        holders, new_bytes = sizes.new_holders(t)
        for flow in flows_of.get(t, ()):
            ends, times = flow.message_ends
            box = plan.old_classes[t].boxes[flow.a].intersect(plan.new_classes[t].boxes[flow.b])
            for part in box.split(itemsize, cap):
                nbytes = align(part.numel * itemsize)  # as packed in a message
                touched, cost = ends, times * nbytes
                if t not in started:
                    touched, cost = _merge(holders, new_bytes, touched, cost)
                if current and (level[touched] + opened[touched] + buffers[touched] + cost > limit[touched]).any():
                    close()
                if t not in started:
                    started.add(t)
                    opened[holders] += new_bytes
                buffers[ends] += times * nbytes
                current.append(FlowPiece(flow, t, part))
        old_holders, old_bytes = sizes.old_holders(t)
        freeing[old_holders] += old_bytes  # the tensor is done: its old pieces go at the end of this round
    if current:
        close()
    schedule = SwitchSchedule(plan, budget, tuple(rounds), peaks)
    if validate:
        schedule.validate()
    return schedule


def _merge(a: np.ndarray, x: np.ndarray, b: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two sparse vectors (indices, values) summed into one."""
    touched = np.union1d(a, b)
    out = np.zeros(len(touched), dtype=np.int64)
    out[np.searchsorted(touched, a)] += x
    out[np.searchsorted(touched, b)] += y
    return touched, out


class _PieceSizes:
    """Bytes of each tensor's old and new piece at each process, from the classes (worked out once
    per kind of tensor: equal box lists and class arrays)."""

    def __init__(self, plan: TransitionPlan) -> None:
        self.plan = plan
        self.cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def _holders(self, t: int, classes, coords) -> tuple[np.ndarray, np.ndarray]:
        key = (id(classes.boxes), id(classes.of_coord), id(coords), self.plan.tensors[t].itemsize)
        if key not in self.cache:
            numel = np.array([0 if b is None else b.numel for b in classes.boxes] + [0], dtype=np.int64)
            nbytes = numel[class_at(classes.of_coord, coords)] * self.plan.tensors[t].itemsize
            holders = np.flatnonzero(nbytes)
            self.cache[key] = (holders, nbytes[holders])
        return self.cache[key]

    def old_holders(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """(processes holding a non-empty old piece of tensor t, its bytes at each)."""
        return self._holders(t, self.plan.old_classes[t], self.plan.held)

    def new_holders(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        return self._holders(t, self.plan.new_classes[t], self.plan.placed)

    def totals(self) -> tuple[np.ndarray, np.ndarray]:
        """int64[process]: all old state, all new state."""
        n = self.plan.world_size
        old, new = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        for t in range(len(self.plan.tensors)):
            for total, (holders, nbytes) in ((old, self.old_holders(t)), (new, self.new_holders(t))):
                total[holders] += nbytes
        return old, new


def _allowances(plan: TransitionPlan, sizes: _PieceSizes | None = None) -> np.ndarray:
    """How far above its old state each process may go without exceeding max(old, new)."""
    old, new = (_PieceSizes(plan) if sizes is None else sizes).totals()
    return np.maximum(new - old, 0)


def memory_order(plan: TransitionPlan, sizes: _PieceSizes | None = None) -> list[int]:
    """An order of the tensors that keeps each process's state near max(old, new) throughout.

    Process r starts at its old state and, after tensor T, holds ``new[T, r] - old[T, r]`` more;
    while T is being moved it holds both pieces. Greedily, the next tensor is the one whose move
    leaves the worst process least above its allowance ``max(old, new) - old``. Tensors of one
    kind (the same boxes at the same processes) keep their relative order, and only the first
    waiting tensor of each kind is a candidate; processes that hold alike for every kind are
    counted once. So this is fast for any model and any world.
    """
    sizes = _PieceSizes(plan) if sizes is None else sizes
    kinds: dict[tuple, list[int]] = {}
    for t in range(len(plan.tensors)):
        old, new = sizes.old_holders(t), sizes.new_holders(t)
        kinds.setdefault((id(old[0]), id(new[0])), []).append(t)
    n = plan.world_size
    columns = []  # per kind of tensor: (old bytes, new bytes) of one tensor, over the processes
    for ts in kinds.values():
        old, new = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        (oh, ob), (nh, nb) = sizes.old_holders(ts[0]), sizes.new_holders(ts[0])
        old[oh], new[nh] = ob, nb
        columns.append((old, new))
    # Processes alike in every kind of tensor are one row of the account.
    table = np.stack([c for pair in columns for c in pair], axis=1) if columns else np.zeros((n, 0), np.int64)
    rows, weight = np.unique(table, axis=0, return_counts=True)
    old_k, new_k = rows[:, 0::2].T, rows[:, 1::2].T  # [kind of tensor, kind of process]
    counts = np.array([len(ts) for ts in kinds.values()])
    allowance = np.maximum(counts @ new_k - counts @ old_k, 0)
    heads = [0] * len(kinds)
    queues = list(kinds.values())
    level = np.zeros(len(rows), dtype=np.int64)
    order: list[int] = []
    while len(order) < len(plan.tensors):
        waiting = [k for k in range(len(queues)) if heads[k] < len(queues[k])]
        worst = (level + new_k[waiting] - allowance).max(axis=1)
        pick = min(range(len(waiting)), key=lambda i: (int(worst[i]), queues[waiting[i]][heads[waiting[i]]]))
        k = waiting[pick]
        order.append(queues[k][heads[k]])
        heads[k] += 1
        level += new_k[k] - old_k[k]
    return order
