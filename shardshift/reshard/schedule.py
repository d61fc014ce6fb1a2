"""A transition plan cut into rounds that respect a memory budget and cannot deadlock.

**Budget.** At no point does a process hold more than max(its old state, its new state) + `budget`
bytes of state and message buffers (unless one piece alone is bigger than the budget). Rounds are
closed by keeping the executor's own account of each process's memory (`build_schedule`), and
segments larger than a quarter of the budget are first cut along their outermost dims.

**Order.** Tensors are taken one after another, and rounds are filled greedily in that order, so a
tensor's segments occupy a run of consecutive rounds. The executor allocates a tensor's new piece
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

import numpy as np

from shardshift.reshard.plan import Segment, TransitionPlan

DEFAULT_BUDGET = 256 << 20
MIN_BUDGET = 4 << 10
ALIGN = 16  # bytes: every segment starts aligned in a packed message, so any dtype can view it
DIRECT_BYTES = 64 << 10  # segments this big get a message of their own (see `Message`)


@dataclasses.dataclass(frozen=True)
class Round:
    segments: tuple[Segment, ...]


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


@dataclasses.dataclass(frozen=True)
class SwitchSchedule:
    plan: TransitionPlan
    budget: int
    rounds: tuple[Round, ...]

    def __post_init__(self) -> None:
        self.validate()

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
        """What the first segment of round `index` costs `rank`: the pieces it opens, its buffers."""
        seg = self.rounds[index].segments[0]
        opened = self.tensor_rounds[seg.tensor][0] < index
        cost = 0 if opened else self.plan.piece_bytes(self.plan.new_boxes, rank, seg.tensor)
        if not seg.local and rank in (seg.src, seg.dst):
            cost += align(self.plan.segment_bytes(seg))
        return cost

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
        """For every tensor with segments: (first round, last round) of its run."""
        spans: dict[int, tuple[int, int]] = {}
        for index, rnd in enumerate(self.rounds):
            for seg in rnd.segments:
                first, _ = spans.get(seg.tensor, (index, index))
                spans[seg.tensor] = (first, index)
        return spans

    def validate(self) -> None:
        flat = [seg for rnd in self.rounds for seg in rnd.segments]
        covered = sum(seg.box.numel for seg in flat)
        assert covered == sum(seg.box.numel for seg in self.plan.segments), "rounds lose or add elements"
        # The budget rule: a round stays within each process's limit, except that its first segment
        # is taken even when it alone goes over (a piece bigger than what is left of the budget);
        # then nothing more for that process joins the round.
        allowances = _allowances(_pieces(self.plan, self.plan.old_boxes), _pieces(self.plan, self.plan.new_boxes))
        for rank in range(self.plan.world_size):
            limit = int(allowances[rank]) + self.budget
            for index, (start, peak) in enumerate(self._memory(rank)):
                first = self._first_cost(index, rank)
                assert peak <= max(limit, start + first), f"round {index} takes rank {rank} to {peak} > {limit}"
        seen, previous = set(), None
        for seg in flat:
            if seg.tensor != previous:
                assert seg.tensor not in seen, f"tensor {seg.tensor}'s segments are not one run"
                seen.add(seg.tensor)
                previous = seg.tensor


def build_schedule(plan: TransitionPlan, budget: int = DEFAULT_BUDGET) -> SwitchSchedule:
    """Cut `plan` into rounds; every process stays within max(old, new) + `budget` bytes.

    The builder keeps, for every process, the account the executor will keep: new pieces are
    allocated at the first round of their tensor, buffers live for one round, old pieces are freed
    at the end of their tensor's last round. A round closes when one more segment would take some
    process above its limit; a segment that alone exceeds it (a piece bigger than the budget) gets a
    round of its own.
    """
    if budget < MIN_BUDGET:
        raise ValueError(f"--switch-budget {budget} bytes is too small; give at least {MIN_BUDGET} (4K)")
    n = plan.world_size
    cap = max(1, budget // 4)
    old_piece, new_piece = _pieces(plan, plan.old_boxes), _pieces(plan, plan.new_boxes)
    limit = (_allowances(old_piece, new_piece) + budget).tolist()
    # Only the processes holding a piece of a tensor are touched by it: (process, bytes) lists.
    olds, news = _holders(old_piece), _holders(new_piece)
    by_tensor: dict[int, list[Segment]] = {}
    for seg in plan.segments:
        by_tensor.setdefault(seg.tensor, []).append(seg)

    rounds: list[Round] = []
    current: list[Segment] = []
    level = [0] * n  # bytes above the old state held at the start of the current round
    opened, buffers, freeing = [0] * n, [0] * n, [0] * n  # within the current round
    started: set[int] = set()

    def close() -> None:
        rounds.append(Round(tuple(current)))
        current.clear()
        for r in range(n):
            level[r] += opened[r] - freeing[r]
            opened[r] = buffers[r] = freeing[r] = 0

    for t in memory_order(plan, old_piece, new_piece):
        itemsize = plan.tensors[t].itemsize
        for seg in by_tensor.get(t, ()):
            for box in seg.box.split(itemsize, cap):
                nbytes = align(box.numel * itemsize)  # as packed in a message
                cost = {} if t in started else dict(news[t])
                if not seg.local:
                    cost[seg.src] = cost.get(seg.src, 0) + nbytes
                    cost[seg.dst] = cost.get(seg.dst, 0) + nbytes
                if current and any(level[r] + opened[r] + buffers[r] + c > limit[r] for r, c in cost.items()):
                    close()
                if t not in started:
                    started.add(t)
                    for r, nbytes_new in news[t]:
                        opened[r] += nbytes_new
                if not seg.local:
                    buffers[seg.src] += nbytes
                    buffers[seg.dst] += nbytes
                current.append(dataclasses.replace(seg, box=box))
        for r, nbytes_old in olds[t]:  # the tensor is done: its old pieces go at the end of this round
            freeing[r] += nbytes_old
    if current:
        close()
    return SwitchSchedule(plan, budget, tuple(rounds))


def _pieces(plan: TransitionPlan, boxes) -> np.ndarray:
    """int64[tensor, process]: bytes of the piece each process holds (0 for none)."""
    itemsize = np.array([t.itemsize for t in plan.tensors], dtype=np.int64)
    numel = np.array([[0 if box is None else box.numel for box in row] for row in boxes], dtype=np.int64)
    return numel.T * itemsize[:, None] if numel.size else np.zeros((len(plan.tensors), plan.world_size), np.int64)


def _holders(pieces: np.ndarray) -> list[list[tuple[int, int]]]:
    """[tensor]: (process, bytes) of every process holding a non-empty piece of it."""
    return [[(int(r), int(row[r])) for r in np.flatnonzero(row)] for row in pieces]


def _allowances(old_piece: np.ndarray, new_piece: np.ndarray) -> np.ndarray:
    """How far above its old state each process may go without exceeding max(old, new)."""
    return np.maximum(new_piece.sum(axis=0) - old_piece.sum(axis=0), 0)


def memory_order(plan: TransitionPlan, old_piece: np.ndarray | None = None,
                 new_piece: np.ndarray | None = None) -> list[int]:
    """An order of the tensors that keeps each process's state near max(old, new) throughout.

    Process r starts at its old state and, after tensor T, holds ``new[T, r] - old[T, r]`` more;
    while T is being moved it holds both pieces. Greedily, the next tensor is the one whose move
    leaves the worst process least above its allowance ``max(old, new) - old``. Tensors with the same
    pattern of pieces across processes keep their relative order, and only the first waiting tensor
    of each pattern is a candidate, so this is fast for any model.
    """
    old_piece = _pieces(plan, plan.old_boxes) if old_piece is None else old_piece
    new_piece = _pieces(plan, plan.new_boxes) if new_piece is None else new_piece
    allowance = _allowances(old_piece, new_piece)
    queues: dict[bytes, list[int]] = {}
    patterns = np.stack([old_piece > 0, new_piece > 0, new_piece > old_piece], axis=-1)
    for t in range(len(plan.tensors)):
        queues.setdefault(patterns[t].tobytes(), []).append(t)
    heads = {pattern: 0 for pattern in queues}
    level = np.zeros(plan.world_size, dtype=np.int64)  # bytes above the old state, per process
    order = []
    while len(order) < len(plan.tensors):
        waiting = [(queues[p][i], p) for p, i in heads.items() if i < len(queues[p])]
        t, pattern = min(waiting, key=lambda item: (int((level + new_piece[item[0]] - allowance).max()), item[0]))
        heads[pattern] += 1
        order.append(t)
        level += new_piece[t] - old_piece[t]
    return order
