"""Run a switch `SwitchSchedule` on this process: pack, send, receive, copy, free.

The executor knows the state only through two small interfaces, so it serves any state space:

- a `Source` hands out this process's old local piece of a tensor (``shape == old box sizes``), or
  the copy it keeps of a lost process's piece (`plan.Segment.copy_of`), and releases its own piece
  when the schedule no longer needs it;
- a `Sink` allocates the new local piece (``shape == new box sizes``) when the schedule first
  writes it.

Every process walks the same rounds (see `schedule.py` for why this cannot deadlock), posting each
round's messages through the `Transport` of whatever group it is given (`shardshift.comm`: the
job's world, a group spanning an old and a new world, or the tests' in-process group), every wait
bounded by one deadline. A transfer that fails or times out raises `TransferError` naming the
round and the peer.

**Coalesced rounds.** The work of a round does not grow in calls with its pieces. Large segments
are sent from, and received into, the state tensors themselves wherever their slice is contiguous:
no copy, a message each. Every other byte is *staged*: it passes through a buffer in the `Arena`,
and all the copies into one message's buffer are one ``foreach_copy`` (``torch._foreach_copy_``) over the views of its
pieces, as are all the copies out of it and all the round's local copies: a round makes a few calls
per message (a message carries every small segment between its two processes), not one per piece.
A round, as one process runs it: allocate the new pieces it starts; post every receive; pack and
post the sends one by one (the first travel while the next are packed); make the local copies
while the messages are in flight; take the receives in order, unpacking each as soon as it is in
(while the later ones still travel); wait for the sends; free the old pieces it ends. The seconds of each phase (`PHASES`) come back in
`ExecStats.phases`, and the calls that do work (`ExecStats.host_calls`: copies, staging
allocations, posts and waits, hand-overs) are counted; `host_calls` predicts them from the
compiled program, and `calls_per_rank` from a schedule of any size.

**The arena.** Staging buffers are cut from one block of memory per device (`arena`), allocated
once at the start of a switch to its largest round's staging, reused from round to round, and
handed back at the switch's end: between switches the memory is training's. No round allocates
its buffers. The account below books each round's staged bytes as the round's buffers; the
block's bytes beyond the current round's use are held but not booked (`ExecStats.arena_bytes`).

**CUDA.** The copies run on a side stream of the device: the transport's batch (one
``batch_isend_irecv`` per round, `comm.p2p`) is posted after the stream that packed has been
waited for, and unpacking waits for the batch; the round ends with the device's stream waiting for
the side stream, before any old piece is freed.

Where a process keeps a whole piece unchanged (its new box of a tensor is its old box), the old
piece's memory becomes the new piece's: the two storages swap their bytes (`_hand_over`), no byte
is copied and no fresh page is touched. The new piece's storage has been given bytes of its own
when it was opened, never written; the swap leaves them to the old piece, which frees them when it
is released. Later reads of the old piece (sends in later rounds) read the new one: the same bytes.
Pieces that do not own their storage alike (a padded FSDP shard) are copied instead, and so is
every piece of a source that keeps its state whole (``keep``: a change of world that can still go
back to the old state).

`compile_program` turns the schedule into what one process does, round by round, with every slice
and offset worked out and every message's staging decided; it is pure and runs when the switch is
prepared, so that the switch itself only copies and communicates. `run_program` runs it, keeping
an account of the bytes of state and buffers the process holds as it goes, and reports its peak:
the figure that the budget bounds (on CUDA the caching allocator's own peak is reported alongside).
"""

from __future__ import annotations

import contextlib
import dataclasses
import resource
import threading
import time
from collections.abc import Iterator
from typing import Protocol

import numpy as np
import torch

from shardshift.comm.p2p import Deadline, PeerOp, Transport
from shardshift.compat import can_swap_storages, foreach_copy, swap_storages
from shardshift.reshard.plan import Segment, TransitionPlan
from shardshift.reshard.schedule import Message, SwitchSchedule, align


class Source(Protocol):
    """The old state (module docstring). A source with a true attribute ``keep`` gives nothing away:
    its pieces are copied, never handed over, and `release` leaves them whole."""

    def local(self, tensor: int, copy_of: int | None = None) -> torch.Tensor: ...

    def release(self, tensor: int) -> None: ...


class Sink(Protocol):
    def open(self, tensor: int) -> torch.Tensor: ...


Slices = tuple[slice, ...]


@dataclasses.dataclass(frozen=True)
class Part:
    """One segment's bytes in a message: where they are in the local piece and in the buffer."""

    tensor: int
    where: Slices  # in this process's old piece (sending) or new piece (receiving)
    copy_of: int | None  # sending from the copy of that lost process's piece
    offset: int  # bytes into a packed message
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class MessageEnd:
    """A message as one end of it sees it."""

    peer: int
    nbytes: int
    direct: bool  # one segment, sent from / received into the state tensor where it is contiguous
    parts: tuple[Part, ...]
    staged: bool = True  # passes through an arena buffer: packed, or a direct slice not contiguous here


@dataclasses.dataclass(frozen=True)
class Copy:
    tensor: int
    new: Slices
    old: Slices
    copy_of: int | None = None  # from the copy this process keeps of that lost process's piece
    whole: bool = False  # the whole old piece is the whole new piece: handed over where it can be
    nbytes: int = 0  # of the segment


@dataclasses.dataclass(frozen=True)
class RoundWork:
    """One round, as one process runs it."""

    opens: tuple[tuple[int, int, tuple[int, ...]], ...]  # (tensor, bytes, shape): new pieces, first
    sends: tuple[MessageEnd, ...]
    recvs: tuple[MessageEnd, ...]
    copies: tuple[Copy, ...]
    closes: tuple[tuple[int, int], ...]  # (tensor, bytes): old pieces freed last

    @property
    def staging(self) -> int:
        """Arena bytes the round's staged messages take (`Message.nbytes`: aligned)."""
        return sum(m.nbytes for m in (*self.sends, *self.recvs) if m.staged)

    @property
    def host_calls(self) -> int:
        """The calls that do work (`calls_per_rank`), where every piece is contiguous, owns its
        storage and is handed over where whole."""
        messages = (*self.sends, *self.recvs)
        return (2 * len(messages) + sum(m.staged for m in messages) + sum(c.whole for c in self.copies)
                + any(not c.whole for c in self.copies))


@dataclasses.dataclass(frozen=True)
class SwitchProgram:
    """Everything one process does in a switch (`compile_program`)."""

    rank: int
    rounds: tuple[RoundWork, ...]
    idle_opens: tuple[int, ...]  # new pieces no segment writes (empty shards): allocated at the end
    idle_closes: tuple[int, ...]  # old pieces no segment reads: freed at the end
    old_bytes: int
    new_bytes: int

    @property
    def pieces(self) -> int:
        """Segment ends this process handles: parts it packs or unpacks or sends or receives alone,
        and local copies."""
        return sum(len(m.parts) for step in self.rounds for m in (*step.sends, *step.recvs)) + sum(
            len(step.copies) for step in self.rounds)

    @property
    def host_calls(self) -> int:
        return sum(step.host_calls for step in self.rounds)

    @property
    def copied_bytes(self) -> int:
        """Bytes this process copies, where every piece is contiguous and owns its storage: its local
        copies of pieces not kept whole, and its staged messages (packed, or unpacked)."""
        return sum(c.nbytes for step in self.rounds for c in step.copies if not c.whole) + sum(
            m.nbytes for step in self.rounds for m in (*step.sends, *step.recvs) if m.staged)


def compile_program(schedule: SwitchSchedule, rank: int) -> SwitchProgram:
    """What `rank` does in each round of `schedule`, every slice and offset computed."""
    plan = schedule.plan
    opens, closes = schedule.lifetimes(rank)  # the same account the schedule was built to
    rounds = []
    for index in range(len(schedule.rounds)):
        sends, recvs, local = schedule.messages(index, rank)
        rounds.append(RoundWork(
            opens=tuple((t, plan.piece_bytes(plan.new_boxes, rank, t), plan.new_boxes[rank][t].sizes)
                        for t in opens.get(index, ())),
            sends=tuple(_transfer(plan, m, m.dst, plan.source_box, sending=True) for m in sends),
            recvs=tuple(_transfer(plan, m, m.src, lambda seg: plan.new_boxes[rank][seg.tensor]) for m in recvs),
            copies=tuple(_copy(plan, seg, plan.new_boxes[rank][seg.tensor]) for seg in local),
            closes=tuple((t, plan.piece_bytes(plan.old_boxes, rank, t)) for t in closes.get(index, ())),
        ))
    spans = schedule.tensor_rounds
    idle = [t for t in range(len(plan.tensors)) if t not in spans]
    return SwitchProgram(
        rank=rank,
        rounds=tuple(rounds),
        idle_opens=tuple(t for t in idle if plan.new_boxes[rank][t] is not None),
        idle_closes=tuple(t for t in idle if plan.old_boxes[rank][t] is not None),
        old_bytes=plan.held_bytes(plan.old_boxes, rank),
        new_bytes=plan.held_bytes(plan.new_boxes, rank),
    )


def _copy(plan: TransitionPlan, seg: Segment, new_box) -> Copy:
    """A local segment as this process copies it into its new piece (of box `new_box`)."""
    old_box = plan.source_box(seg)
    return Copy(seg.tensor, seg.box.relative_to(new_box), seg.box.relative_to(old_box), seg.copy_of,
                whole=seg.copy_of is None and seg.box == new_box == old_box, nbytes=plan.segment_bytes(seg))


def _transfer(plan: TransitionPlan, message: Message, peer: int, box_of, sending: bool = False) -> MessageEnd:
    """`message` as the end at `peer`'s partner sees it; `box_of(segment)`: the local piece's box."""
    parts = []
    for seg, offset in zip(message.segments, message.offsets):
        tensor = plan.tensors[seg.tensor]
        parts.append(Part(seg.tensor, seg.box.relative_to(box_of(seg)), seg.copy_of if sending else None, offset,
                          plan.segment_bytes(seg), tensor.dtype, seg.box.sizes))
    staged = not message.direct or not message.segments[0].box.contiguous_in(box_of(message.segments[0]))
    return MessageEnd(peer, message.nbytes, message.direct, tuple(parts), staged)


@dataclasses.dataclass(frozen=True)
class CallCounts:
    """Per process of a schedule (int64[process]): segment ends it handles, and the calls that do
    work in a switch (copies, staging allocations, posts and waits, hand-overs) for an executor
    that copies piece by piece (`before`) and for this one (`after`). Neither counts the views of
    pieces (metadata), nor allocating and freeing the pieces themselves (one call per tensor)."""

    pieces: np.ndarray
    before: np.ndarray
    after: np.ndarray


def calls_per_rank(schedule: SwitchSchedule) -> CallCounts:
    """`CallCounts` of every process of `schedule`, from its flow pieces (no segment is spelt out,
    so it runs for thousands of processes): every message end is a post and a wait; piece by
    piece, every staged message end is an allocation and every staged part or local copy a call;
    coalesced, every staged message end one call, a round's local copies one call, and every whole
    piece kept one hand-over. As `SwitchProgram.host_calls`, it takes every piece as contiguous,
    owning its storage."""
    plan, n = schedule.plan, schedule.plan.world_size
    pieces, before, after = (np.zeros(n, dtype=np.int64) for _ in range(3))

    def ends(pairs: np.ndarray, weight: int) -> None:
        """Book `weight` calls at both ends of each (src * n + dst) pair."""
        for counts in (before, after):
            np.add.at(counts, pairs // n, weight)
            np.add.at(counts, pairs % n, weight)

    for round_pieces in schedule.pieces:
        packed, copying = [], []
        for piece in round_pieces:
            flow, itemsize = piece.flow, plan.tensors[piece.tensor].itemsize
            old_box = plan.old_classes[piece.tensor].boxes[flow.a]
            new_box = plan.new_classes[piece.tensor].boxes[flow.b]
            local = flow.src == flow.dst
            whole = piece.box == old_box == new_box
            kept = flow.dst[local & (flow.copy_of < 0)] if whole else flow.dst[:0]
            np.add.at(pieces, flow.dst[local], 1)
            np.add.at(before, flow.dst[local], 1)
            np.add.at(after, kept, 1)  # hand-overs
            copying.append(np.setdiff1d(flow.dst[local], kept))
            src, dst = flow.src[~local], flow.dst[~local]
            np.add.at(pieces, src, 1)
            np.add.at(pieces, dst, 1)
            pairs = src * n + dst
            if piece.box.numel * itemsize < schedule.direct_bytes:
                packed.append(pairs)
                np.add.at(before, src, 1)  # the part's copy, each end
                np.add.at(before, dst, 1)
                continue
            ends(pairs, 2)  # a message of its own: posted and waited for
            for end, contiguous in ((src, piece.box.contiguous_in(old_box)), (dst, piece.box.contiguous_in(new_box))):
                if not contiguous:
                    np.add.at(before, end, 2)  # a buffer and a copy into or out of it
                    np.add.at(after, end, 1)  # a copy into or out of the arena
        packed_pairs = np.unique(np.concatenate(packed)) if packed else np.zeros(0, dtype=np.int64)
        ends(packed_pairs, 3)  # posted, waited for, packed in one call (before: its buffer; its parts apart)
        if copying:
            np.add.at(after, np.unique(np.concatenate(copying)), 1)
    return CallCounts(pieces, before, after)


@dataclasses.dataclass(frozen=True)
class ExecStats:
    seconds: float
    rounds: int
    bytes_sent: int
    bytes_received: int
    bytes_copied: int  # local copies
    bytes_handed_over: int  # kept whole pieces whose memory became the new piece's (no copy; not in bytes_copied)
    old_bytes: int  # state this process held before
    new_bytes: int  # state it holds after
    peak_bytes: int  # most state + buffers held at once during the switch (the executor's account)
    phases: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds in each of `PHASES`
    cpu_seconds: float = 0.0  # processor time of this process while it ran, its threads' (gloo's transfers) included
    page_faults: int = 0  # pages the kernel had to map for this process while it ran (fresh memory, first touched)
    pieces: int = 0  # segment ends handled (`SwitchProgram.pieces`)
    host_calls: int = 0  # calls that did work: copies, staging allocations, posts and waits, hand-overs
    arena_bytes: int = 0  # the arena's block during the switch (its largest round's staging)


class _Account:
    def __init__(self, start: int):
        self.live = self.peak = start

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def sub(self, nbytes: int) -> None:
        self.live -= nbytes


class Arena:
    """One block of device memory that staging buffers are cut from (module docstring): `take`
    hands out aligned slices in turn, `reset` (at a round's end) takes them all back. A round that
    needs more than the block gets buffers of its own beyond it, and the block grows to that
    round's need when it is reset."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.block = torch.empty(0, dtype=torch.uint8, device=device)
        self.used = 0
        self.spilled = 0  # bytes of buffers given beyond the block this round
        self.allocations = 0  # blocks and buffers allocated, ever

    @property
    def nbytes(self) -> int:
        return self.block.numel()

    def reserve(self, nbytes: int) -> None:
        """Grow the block to at least `nbytes` (nothing may be taken from it)."""
        assert not self.used and not self.spilled, "the arena is resized only between rounds"
        if nbytes > self.nbytes:
            self.block = torch.empty(0, dtype=torch.uint8, device=self.device)  # the old block goes first
            self.block = torch.empty(align(nbytes), dtype=torch.uint8, device=self.device)
            self.allocations += 1

    def take(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of memory (uint8), valid until `reset`."""
        end = self.used + nbytes
        if self.spilled or end > self.nbytes:
            self.spilled += align(nbytes)
            self.allocations += 1
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.used = align(end)
        return self.block[end - nbytes : end]

    def reset(self) -> None:
        """Take every buffer back; where the round spilled, grow the block to what it needed."""
        need = self.used + self.spilled
        self.used = self.spilled = 0
        self.reserve(need)

    def release(self) -> None:
        """Hand the block back (to the allocator), whatever was taken from it: a transfer that
        failed may still hold its buffers (they live as long as it does)."""
        self.used = self.spilled = 0
        self.block = torch.empty(0, dtype=torch.uint8, device=self.device)


_ARENAS = threading.local()  # .by_device: {device: Arena}; a thread of its own runs each rank of the tests


def arena(device: torch.device) -> Arena:
    """This thread's arena on `device` (a process runs its switches in one thread: the process's)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if not hasattr(_ARENAS, "by_device"):
        _ARENAS.by_device = {}
    return _ARENAS.by_device.setdefault(device, Arena(device))


class _Streams:
    """Where the executor's copies run: on CUDA a side stream, ordered against the device's
    current stream (which the transport's batch and the allocator follow); on the CPU inline."""

    def __init__(self, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.main = torch.cuda.current_stream(device) if cuda else None
        self.side = torch.cuda.Stream(device) if cuda else None

    def copies(self):
        """Run the copies issued in this context on the side stream."""
        return contextlib.nullcontext() if self.side is None else torch.cuda.stream(self.side)

    def side_waits(self) -> None:
        """Copies issued from now on see everything the current stream did (new pieces, receives)."""
        if self.side is not None:
            self.side.wait_stream(self.main)

    def main_waits(self) -> None:
        """Sends posted and pieces freed from now on come after the copies issued so far."""
        if self.side is not None:
            self.main.wait_stream(self.side)


@torch.no_grad()
def run_program(program: SwitchProgram, source: Source, sink: Sink, transport: Transport, deadline: Deadline,
                device: torch.device) -> ExecStats:
    """Run this process's part of a switch (a collective: every process of the plan runs its own,
    on the same group), every transfer done by `deadline`."""
    start, start_cpu, start_faults = time.perf_counter(), time.process_time(), _page_faults()
    buffers = arena(device)
    buffers.reserve(max((step.staging for step in program.rounds), default=0))
    allocations = buffers.allocations  # the block, once for the switch; what a round allocates beyond it counts
    try:
        stats = _run(program, source, sink, transport, deadline, buffers)
    finally:
        buffers.release()  # between switches the memory is training's
    return dataclasses.replace(stats, seconds=time.perf_counter() - start, cpu_seconds=time.process_time() - start_cpu,
                               page_faults=_page_faults() - start_faults,
                               host_calls=stats.host_calls + buffers.allocations - allocations)


def _run(program: SwitchProgram, source: Source, sink: Sink, transport: Transport, deadline: Deadline,
         buffers: Arena) -> ExecStats:
    account = _Account(program.old_bytes)
    new_local: dict[int, torch.Tensor] = {}
    old = _OldPieces(source)
    streams = _Streams(buffers.device)
    sent = received = copied = handed = 0
    clock, calls = _Phases(), _Calls()
    for index, step in enumerate(program.rounds):
        clock.lap()
        for tensor, nbytes, shape in step.opens:
            new_local[tensor] = sink.open(tensor)
            assert tuple(new_local[tensor].shape) == shape, (tensor, tuple(new_local[tensor].shape), shape)
            account.add(nbytes)
        streams.side_waits()
        clock.lap("open")
        inbox = [_incoming(m, new_local, buffers) for m in step.recvs]  # (wire tensor, staged views or None)
        outbox: list[torch.Tensor] = []  # the staged sends, held until the round is done
        in_flight = sum(buf.numel() * buf.element_size() for buf, views in inbox if views is not None)
        account.add(in_flight)
        posted = transport.post_round(
            _sends(step, index, old, buffers, streams, outbox, clock, calls),
            [PeerOp(m.peer, buf, index) for m, (buf, _) in zip(step.recvs, inbox)],
            f"switch round {index + 1} of {len(program.rounds)}",
        )
        packed = sum(buf.numel() * buf.element_size() for buf in outbox)
        account.add(packed)  # nothing is freed before the round's end: adding them now gives the same peak
        in_flight += packed
        calls.n += 2 * (len(step.sends) + len(step.recvs))  # each posted and waited for
        clock.lap("send")
        targets, origins = [], []  # overlaps the messages in flight
        for c in step.copies:
            target = new_local[c.tensor][c.new]
            nbytes = target.numel() * target.element_size()
            if c.whole and old.hand_over(c.tensor, target):
                handed += nbytes
                calls.n += 1
                continue
            targets.append(target)
            origins.append(old.local(c.tensor, c.copy_of)[c.old])
            copied += nbytes
        if targets:
            with streams.copies():
                foreach_copy(targets, origins)
            calls.n += 1
        del targets, origins
        clock.lap("copy")
        _unpack_as_received(step, inbox, posted.received(deadline), new_local, streams, clock, calls)
        posted.wait(deadline)
        streams.main_waits()
        clock.lap("wait")
        sent += sum(m.nbytes for m in step.sends)
        received += sum(m.nbytes for m in step.recvs)
        account.sub(in_flight)
        del outbox, inbox, posted
        buffers.reset()
        for tensor, nbytes in step.closes:
            source.release(tensor)
            account.sub(nbytes)
        clock.lap("close")
    for tensor in program.idle_opens:
        sink.open(tensor)
    for tensor in program.idle_closes:
        source.release(tensor)
    return ExecStats(
        seconds=0.0,
        rounds=len(program.rounds),
        bytes_sent=sent,
        bytes_received=received,
        bytes_copied=copied,
        bytes_handed_over=handed,
        old_bytes=program.old_bytes,
        new_bytes=program.new_bytes,
        peak_bytes=account.peak,
        phases=clock.seconds,
        pieces=program.pieces,
        host_calls=calls.n,
        arena_bytes=buffers.nbytes,
    )


def _page_faults() -> int:
    """Page faults of this process so far (minor and major): on CPU, a fault is a page of fresh
    memory the kernel maps and zeroes when it is first written."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt


# Where a switch's rounds spend their time (`ExecStats.phases`), in the order a round runs them:
# allocating new pieces; packing the staged sends; posting the sends (on gloo, writing what the
# socket takes at once); local copies (while messages are in flight); waiting for the receives (the
# wire); unpacking the staged receives (while the later ones travel); waiting for the sends still
# in flight; freeing old pieces.
PHASES = ("open", "pack", "send", "copy", "receive", "unpack", "wait", "close")


class _Phases:
    """Seconds spent in each of `PHASES` (`lap(name)` books the time since the last lap)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._last = time.perf_counter()

    def lap(self, name: str | None = None) -> None:
        now = time.perf_counter()
        if name is not None:
            self.seconds[name] += now - self._last
        self._last = now


class _OldPieces:
    """The source's old pieces, as the executor reads them: a piece handed over to the new state
    (`_hand_over`) is read from there afterwards."""

    def __init__(self, source: Source):
        self.source = source
        self.handed: dict[int, torch.Tensor] = {}
        self.keep = getattr(source, "keep", False)  # never hand a piece over (`Source`)

    def local(self, tensor: int, copy_of: int | None = None) -> torch.Tensor:
        if copy_of is None and tensor in self.handed:
            return self.handed[tensor]
        return self.source.local(tensor, copy_of)

    def hand_over(self, tensor: int, new: torch.Tensor) -> bool:
        """Give `new` (the whole new piece, never written) the old piece's bytes; False where the
        two cannot swap storages, or the source keeps its pieces, and the caller must copy."""
        if self.keep or not _hand_over(self.source.local(tensor), new):
            return False
        self.handed[tensor] = new
        return True


def _hand_over(old: torch.Tensor, new: torch.Tensor) -> bool:
    """Swap the bytes of `old`'s and `new`'s storages, where each tensor is the whole of its
    storage, laid out alike; return whether it was done."""
    if not can_swap_storages() or old.dtype != new.dtype or old.shape != new.shape or old.device != new.device:
        return False
    nbytes = new.numel() * new.element_size()
    pair = (old, new)
    if not all(t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == nbytes
               and t.untyped_storage().resizable() for t in pair):
        return False
    swap_storages(new.untyped_storage(), old.untyped_storage())
    return True


class _Calls:
    """The calls that did work, counted as the executor makes them (`ExecStats.host_calls`)."""

    n: int = 0


def _packed_view(buf: torch.Tensor, part: Part) -> torch.Tensor:
    return buf[part.offset : part.offset + part.nbytes].view(part.dtype).view(part.shape)


def _staged(message: MessageEnd, buffers: Arena) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """An arena buffer for `message`: the tensor that travels (a direct one's typed as its
    segment, as the other end's) and the views its parts occupy."""
    if message.direct:
        part = message.parts[0]
        buf = buffers.take(part.nbytes).view(part.dtype).view(part.shape)
        return buf, [buf]
    buf = buffers.take(message.nbytes)
    return buf, [_packed_view(buf, part) for part in message.parts]


def _direct(view: torch.Tensor, device: torch.device) -> bool:
    """Whether a direct message can travel from or into `view` itself."""
    return view.is_contiguous() and view.device == device


def _sends(step: RoundWork, index: int, source: _OldPieces, buffers: Arena, streams: _Streams,
           outbox: list[torch.Tensor], clock: _Phases, calls: _Calls) -> Iterator[PeerOp]:
    """The round's sends, each staged one packed in one call when the transport asks for it (it
    posts the first while the next is packed); their buffers are kept in `outbox`."""
    for m in step.sends:
        clock.lap("send")
        views = [source.local(part.tensor, part.copy_of)[part.where] for part in m.parts]
        if m.direct and not m.staged and _direct(views[0], buffers.device):
            yield PeerOp(m.peer, views[0], index)
            continue
        buf, packed = _staged(m, buffers)
        outbox.append(buf)
        with streams.copies():
            foreach_copy(packed, views)
        streams.main_waits()
        calls.n += 1
        clock.lap("pack")
        yield PeerOp(m.peer, buf, index)


def _incoming(message: MessageEnd, new_local: dict[int, torch.Tensor],
              buffers: Arena) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """Where to receive `message`, and the views of its staged buffer (None: it is received into
    the new piece itself)."""
    if message.direct and not message.staged:
        part = message.parts[0]
        target = new_local[part.tensor][part.where]
        if _direct(target, buffers.device):
            return target, None
    return _staged(message, buffers)


def _unpack_as_received(step: RoundWork, inbox: list[tuple[torch.Tensor, list[torch.Tensor] | None]],
                        arrivals: Iterator[int], new_local: dict[int, torch.Tensor], streams: _Streams,
                        clock: _Phases, calls: _Calls) -> None:
    """Take the receives as they arrive, copying each staged one into the new pieces in one call
    (while the later ones still travel)."""
    clock.lap("receive")
    for i in arrivals:
        clock.lap("receive")
        m, (_, views) = step.recvs[i], inbox[i]
        if views is None:
            continue
        streams.side_waits()
        with streams.copies():
            foreach_copy([new_local[part.tensor][part.where] for part in m.parts], views)
        calls.n += 1
        clock.lap("unpack")
