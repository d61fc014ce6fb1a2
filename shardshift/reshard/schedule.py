"""A transition plan cut into rounds that respect a memory budget and cannot deadlock.

**Budget.** In one round a process sends, receives and copies locally at most `budget` bytes in
all: its send and receive buffers are at most that, and so is the new storage it fills that round.
Segments larger than a quarter of the budget are first cut along their outermost dims.

**Order.** Segments keep the plan's tensor order and rounds are filled greedily in that order, so a
tensor's segments occupy a run of consecutive rounds. The executor allocates a tensor's new piece
at the first round of its run and frees the old piece after the last: at any moment only the tensors
of the current round hold both an old and a new piece, which bounds the extra memory of a switch by
the budget plus the one tensor a round boundary can cut.

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

from shardshift.reshard.plan import Segment, TransitionPlan

DEFAULT_BUDGET = 256 << 20
MIN_BUDGET = 4 << 10
ALIGN = 16  # bytes: every segment starts aligned in a packed message, so any dtype can view it


@dataclasses.dataclass(frozen=True)
class Round:
    segments: tuple[Segment, ...]


@dataclasses.dataclass(frozen=True)
class Message:
    """One packed message of a round: segments from `src` to `dst` at byte offsets."""

    src: int
    dst: int
    segments: tuple[Segment, ...]
    offsets: tuple[int, ...]
    nbytes: int


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclasses.dataclass(frozen=True)
class Schedule:
    plan: TransitionPlan
    budget: int
    rounds: tuple[Round, ...]

    def __post_init__(self) -> None:
        self.validate()

    def round_load(self, index: int, rank: int) -> int:
        """Bytes `rank` sends, receives and copies locally in round `index`."""
        load = 0
        for seg in self.rounds[index].segments:
            nbytes = self.plan.segment_bytes(seg)
            load += nbytes * ((seg.src == rank) + (seg.dst == rank and not seg.local))
        return load

    def messages(self, index: int, rank: int) -> tuple[list[Message], list[Message], list[Segment]]:
        """(messages `rank` sends, messages it receives, its local copies) in round `index`."""
        by_pair: dict[tuple[int, int], list[Segment]] = {}
        local = []
        for seg in self.rounds[index].segments:
            if seg.local:
                if seg.dst == rank:
                    local.append(seg)
            elif rank in (seg.src, seg.dst):
                by_pair.setdefault((seg.src, seg.dst), []).append(seg)
        sends, recvs = [], []
        for (src, dst), segs in sorted(by_pair.items()):
            offsets, end = [], 0
            for seg in segs:
                offsets.append(end)
                end = align(end + self.plan.segment_bytes(seg))
            message = Message(src, dst, tuple(segs), tuple(offsets), end)
            (sends if src == rank else recvs).append(message)
        return sends, recvs, local

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
        for index in range(len(self.rounds)):
            for rank in range(self.plan.world_size):
                load = self.round_load(index, rank)
                single = len(self.rounds[index].segments) == 1
                assert load <= self.budget or single, f"round {index} loads rank {rank} with {load} bytes"
        order = [seg.tensor for seg in flat]
        assert order == sorted(order), "rounds must keep the plan's tensor order"


def build_schedule(plan: TransitionPlan, budget: int = DEFAULT_BUDGET) -> Schedule:
    if budget < MIN_BUDGET:
        raise ValueError(f"--switch-budget {budget} bytes is too small; give at least {MIN_BUDGET} (4K)")
    cap = max(1, budget // 4)
    rounds: list[Round] = []
    current: list[Segment] = []
    load = [0] * plan.world_size
    for seg in plan.segments:
        itemsize = plan.tensors[seg.tensor].itemsize
        for box in seg.box.split(itemsize, cap):
            piece = Segment(seg.tensor, seg.src, seg.dst, box)
            nbytes = box.numel * itemsize
            ranks = (seg.dst,) if seg.local else (seg.src, seg.dst)
            if current and any(load[r] + nbytes > budget for r in ranks):
                rounds.append(Round(tuple(current)))
                current, load = [], [0] * plan.world_size
            current.append(piece)
            for r in ranks:
                load[r] += nbytes
    if current:
        rounds.append(Round(tuple(current)))
    return Schedule(plan, budget, tuple(rounds))


def parse_size(text: str) -> int:
    """``"64M"``, ``"1G"``, ``"512K"`` or a number of bytes."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    body = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = body[-1:] if body[-1:] in "KMG" else ""
    try:
        value = float(body[: len(body) - len(unit)])
    except ValueError:
        raise ValueError(f"size {text!r} is not a number of bytes; write e.g. 64M, 1G or 1048576") from None
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return int(value * units[unit])
