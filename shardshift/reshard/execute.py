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
bounded by one deadline. Within a round, local copies run while messages are in flight. Large
segments are sent from, and received into, the state tensors themselves wherever their slice is
contiguous: no packing copy. A transfer that fails or times out raises `TransferError` naming the
round and the peer.

A round, as one process runs it: allocate the new pieces it starts; post every receive; pack and
post the sends one by one (the first travel while the next are packed); make the local copies
while the messages are in flight; take the receives in order, unpacking each as soon as it is in
(while the later ones still travel); wait for the sends; free the old pieces it ends. The seconds
of each phase (`PHASES`) come back in `ExecStats.phases`: the switch's own profile.

Where a process keeps a whole piece unchanged (its new box of a tensor is its old box), the old
piece's memory becomes the new piece's: the two storages swap their bytes (`_hand_over`), no byte
is copied and no fresh page is touched. The new piece's storage has been given bytes of its own
when it was opened, never written; the swap leaves them to the old piece, which frees them when it
is released. Later reads of the old piece (sends in later rounds) read the new one: the same bytes.
Pieces that do not own their storage alike (a padded FSDP shard) are copied instead, and so is
every piece of a source that keeps its state whole (``keep``: a change of world that can still go
back to the old state).

`compile_program` turns the schedule into what one process does, round by round, with every slice
and offset worked out; it is pure and runs when the switch is prepared, so that the switch itself
only copies and communicates. `run_program` runs it, keeping an account of the bytes of state and
buffers the process holds as it goes, and reports its peak: the figure that the budget bounds (on
CUDA the caching allocator's own peak is reported alongside).
"""

from __future__ import annotations

import dataclasses
import resource
import time
from collections.abc import Iterator
from typing import Protocol

import torch

from shardshift.comm.p2p import Deadline, PeerOp, Transport
from shardshift.compat import can_swap_storages, swap_storages
from shardshift.reshard.plan import Segment, TransitionPlan
from shardshift.reshard.schedule import Message, SwitchSchedule


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


@dataclasses.dataclass(frozen=True)
class Copy:
    tensor: int
    new: Slices
    old: Slices
    copy_of: int | None = None  # from the copy this process keeps of that lost process's piece
    whole: bool = False  # the whole old piece is the whole new piece: handed over where it can be


@dataclasses.dataclass(frozen=True)
class RoundWork:
    """One round, as one process runs it."""

    opens: tuple[tuple[int, int, tuple[int, ...]], ...]  # (tensor, bytes, shape): new pieces, first
    sends: tuple[MessageEnd, ...]
    recvs: tuple[MessageEnd, ...]
    copies: tuple[Copy, ...]
    closes: tuple[tuple[int, int], ...]  # (tensor, bytes): old pieces freed last


@dataclasses.dataclass(frozen=True)
class SwitchProgram:
    """Everything one process does in a switch (`compile_program`)."""

    rank: int
    rounds: tuple[RoundWork, ...]
    idle_opens: tuple[int, ...]  # new pieces no segment writes (empty shards): allocated at the end
    idle_closes: tuple[int, ...]  # old pieces no segment reads: freed at the end
    old_bytes: int
    new_bytes: int


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
                whole=seg.copy_of is None and seg.box == new_box == old_box)


def _transfer(plan: TransitionPlan, message: Message, peer: int, box_of, sending: bool = False) -> MessageEnd:
    """`message` as the end at `peer`'s partner sees it; `box_of(segment)`: the local piece's box."""
    parts = []
    for seg, offset in zip(message.segments, message.offsets):
        tensor = plan.tensors[seg.tensor]
        parts.append(Part(seg.tensor, seg.box.relative_to(box_of(seg)), seg.copy_of if sending else None, offset,
                          plan.segment_bytes(seg), tensor.dtype, seg.box.sizes))
    return MessageEnd(peer, message.nbytes, message.direct, tuple(parts))


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


class _Account:
    def __init__(self, start: int):
        self.live = self.peak = start

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def sub(self, nbytes: int) -> None:
        self.live -= nbytes


@torch.no_grad()
def run_program(program: SwitchProgram, source: Source, sink: Sink, transport: Transport, deadline: Deadline,
                device: torch.device) -> ExecStats:
    """Run this process's part of a switch (a collective: every process of the plan runs its own,
    on the same group), every transfer done by `deadline`."""
    start, start_cpu, start_faults = time.perf_counter(), time.process_time(), _page_faults()
    account = _Account(program.old_bytes)
    new_local: dict[int, torch.Tensor] = {}
    old = _OldPieces(source)
    sent = received = copied = handed = 0
    clock = _Phases()
    for index, step in enumerate(program.rounds):
        clock.lap()
        for tensor, nbytes, shape in step.opens:
            new_local[tensor] = sink.open(tensor)
            assert tuple(new_local[tensor].shape) == shape, (tensor, tuple(new_local[tensor].shape), shape)
            account.add(nbytes)
        clock.lap("open")
        inbox = [_incoming(m, new_local, device) for m in step.recvs]
        outbox: list[torch.Tensor] = []  # the packed sends, held until the round is done
        in_flight = sum(buf.numel() * buf.element_size() for buf, fresh in inbox if fresh)
        account.add(in_flight)
        posted = transport.post_round(
            _sends(step, index, old, device, outbox),
            [PeerOp(m.peer, buf, index) for m, (buf, _) in zip(step.recvs, inbox)],
            f"switch round {index + 1} of {len(program.rounds)}",
        )
        packed = sum(buf.numel() * buf.element_size() for buf in outbox)
        account.add(packed)  # nothing is freed before the round's end: adding them now gives the same peak
        in_flight += packed
        clock.lap("send")
        for c in step.copies:  # overlaps the messages in flight
            target = new_local[c.tensor][c.new]
            nbytes = target.numel() * target.element_size()
            if c.whole and old.hand_over(c.tensor, target):
                handed += nbytes
                continue
            target.copy_(old.local(c.tensor, c.copy_of)[c.old])
            copied += nbytes
        clock.lap("copy")
        for i in posted.received(deadline):  # each unpacked while the later ones still travel
            buf, fresh = inbox[i]
            if fresh:
                _unpack(step.recvs[i], buf, new_local)
        clock.lap("receive")
        posted.wait(deadline)
        clock.lap("wait")
        sent += sum(m.nbytes for m in step.sends)
        received += sum(m.nbytes for m in step.recvs)
        account.sub(in_flight)
        del outbox, inbox, posted
        for tensor, nbytes in step.closes:
            source.release(tensor)
            account.sub(nbytes)
        clock.lap("close")
    for tensor in program.idle_opens:
        sink.open(tensor)
    for tensor in program.idle_closes:
        source.release(tensor)
    return ExecStats(
        seconds=time.perf_counter() - start,
        rounds=len(program.rounds),
        bytes_sent=sent,
        bytes_received=received,
        bytes_copied=copied,
        bytes_handed_over=handed,
        old_bytes=program.old_bytes,
        new_bytes=program.new_bytes,
        peak_bytes=account.peak,
        phases=clock.seconds,
        cpu_seconds=time.process_time() - start_cpu,
        page_faults=_page_faults() - start_faults,
    )


def _page_faults() -> int:
    """Page faults of this process so far (minor and major): on CPU, a fault is a page of fresh
    memory the kernel maps and zeroes when it is first written."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt


# Where a switch's rounds spend their time (`ExecStats.phases`), in the order a round runs them:
# allocating new pieces; packing and posting the sends (the first travel while the next are
# packed); local copies (while messages are in flight); waiting for each receive and unpacking it
# (while the later ones travel); waiting for the sends still in flight; freeing old pieces.
PHASES = ("open", "send", "copy", "receive", "wait", "close")


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


def _packed_view(buf: torch.Tensor, part: Part) -> torch.Tensor:
    return buf[part.offset : part.offset + part.nbytes].view(part.dtype).view(part.shape)


def _outgoing(message: MessageEnd, source: _OldPieces, device: torch.device) -> tuple[torch.Tensor, bool]:
    """What to send for `message`, and whether it is a new buffer (else a view of the old piece)."""
    if message.direct:
        part = message.parts[0]
        view = source.local(part.tensor, part.copy_of)[part.where]
        if view.is_contiguous() and view.device == device:
            return view, False
        return view.to(device, copy=True, memory_format=torch.contiguous_format), True
    buf = torch.empty(message.nbytes, dtype=torch.uint8, device=device)
    for part in message.parts:
        _packed_view(buf, part).copy_(source.local(part.tensor, part.copy_of)[part.where])
    return buf, True


def _sends(step: RoundWork, index: int, source: _OldPieces, device: torch.device,
           outbox: list[torch.Tensor]) -> Iterator[PeerOp]:
    """The round's sends, each packed only when the transport asks for it (it posts the first
    while the next is packed); new buffers are kept in `outbox`."""
    for m in step.sends:
        buf, fresh = _outgoing(m, source, device)
        if fresh:
            outbox.append(buf)
        yield PeerOp(m.peer, buf, index)


def _incoming(message: MessageEnd, new_local: dict[int, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, bool]:
    """Where to receive `message`, and whether it is a new buffer (else the new piece itself)."""
    if message.direct:
        part = message.parts[0]
        target = new_local[part.tensor][part.where]
        if target.is_contiguous() and target.device == device:
            return target, False
        return torch.empty(target.shape, dtype=target.dtype, device=device), True
    return torch.empty(message.nbytes, dtype=torch.uint8, device=device), True


def _unpack(message: MessageEnd, buf: torch.Tensor, new_local: dict[int, torch.Tensor]) -> None:
    for part in message.parts:
        target = new_local[part.tensor][part.where]
        target.copy_(buf if message.direct else _packed_view(buf, part))
