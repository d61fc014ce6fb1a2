"""Run a switch `Schedule` on this process: pack, send, receive, copy, free.

The executor knows the state only through two small interfaces, so it serves any state space:

- a `Source` hands out this process's old local piece of a tensor (``shape == old box sizes``) and
  releases it when the schedule no longer needs it;
- a `Sink` allocates the new local piece (``shape == new box sizes``) when the schedule first
  writes it.

Every process walks the same rounds (see `schedule.py` for why this cannot deadlock). Within a
round, local copies run while messages are in flight. Large segments are sent from, and received
into, the state tensors themselves wherever their slice is contiguous: no packing copy. The executor keeps an account of the bytes of
state and buffers this process holds as it goes, and reports its peak: the figure that the budget
bounds (on CUDA the caching allocator's own peak is reported alongside).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol

import torch
import torch.distributed as dist

from shardshift.reshard.plan import Segment
from shardshift.reshard.schedule import Message, Schedule


class Source(Protocol):
    def local(self, tensor: int) -> torch.Tensor: ...

    def release(self, tensor: int) -> None: ...


class Sink(Protocol):
    def open(self, tensor: int) -> torch.Tensor: ...


@dataclasses.dataclass(frozen=True)
class ExecStats:
    seconds: float
    rounds: int
    bytes_sent: int
    bytes_received: int
    bytes_copied: int  # local copies
    old_bytes: int  # state this process held before
    new_bytes: int  # state it holds after
    peak_bytes: int  # most state + buffers held at once during the switch (the executor's account)


class _Account:
    def __init__(self, start: int):
        self.live = self.peak = start

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def sub(self, nbytes: int) -> None:
        self.live -= nbytes


@torch.no_grad()
def execute(schedule: Schedule, rank: int, source: Source, sink: Sink, device: torch.device) -> ExecStats:
    """Move this process's part of `schedule` (a collective: every process of the plan calls it)."""
    plan = schedule.plan
    start = time.perf_counter()
    old_bytes = plan.held_bytes(plan.old_boxes, rank)
    account = _Account(old_bytes)
    spans = schedule.tensor_rounds
    opens, closes = schedule.lifetimes(rank)  # the same account the schedule was built to
    new_local: dict[int, torch.Tensor] = {}
    sent = received = copied = 0
    for index in range(len(schedule.rounds)):
        for tensor in opens.get(index, ()):
            new_local[tensor] = sink.open(tensor)
            assert tuple(new_local[tensor].shape) == plan.new_boxes[rank][tensor].sizes, plan.tensors[tensor]
            account.add(plan.piece_bytes(plan.new_boxes, rank, tensor))
        sends, recvs, local = schedule.messages(index, rank)
        outbox = [_outgoing(plan, m, source, device) for m in sends]
        inbox = [_incoming(plan, m, new_local, rank, device) for m in recvs]
        in_flight = sum(t.numel() * t.element_size() for t, fresh in outbox + inbox if fresh)
        account.add(in_flight)
        works = _post(sends, [t for t, _ in outbox], recvs, [t for t, _ in inbox], tag=index, device=device)
        for seg in local:  # overlaps the messages in flight
            box = plan.old_boxes[rank][seg.tensor]
            target = plan.new_boxes[rank][seg.tensor]
            new_local[seg.tensor][seg.box.relative_to(target)].copy_(source.local(seg.tensor)[seg.box.relative_to(box)])
            copied += plan.segment_bytes(seg)
        for work in works:
            work.wait()
        for message, (buf, fresh) in zip(recvs, inbox):
            if fresh:
                _unpack(plan, message, buf, new_local, rank)
        sent += sum(m.nbytes for m in sends)
        received += sum(m.nbytes for m in recvs)
        account.sub(in_flight)
        del outbox, inbox
        for tensor in closes.get(index, ()):
            source.release(tensor)
            account.sub(plan.piece_bytes(plan.old_boxes, rank, tensor))
    # Pieces no segment touched: empty new pieces, and old pieces nobody needed from this process.
    for tensor in range(len(plan.tensors)):
        if tensor not in spans:
            if plan.new_boxes[rank][tensor] is not None:
                sink.open(tensor)
            if plan.old_boxes[rank][tensor] is not None:
                source.release(tensor)
    return ExecStats(
        seconds=time.perf_counter() - start,
        rounds=len(schedule.rounds),
        bytes_sent=sent,
        bytes_received=received,
        bytes_copied=copied,
        old_bytes=old_bytes,
        new_bytes=plan.held_bytes(plan.new_boxes, rank),
        peak_bytes=account.peak,
    )


def _segment_view(buf: torch.Tensor, offset: int, nbytes: int, seg: Segment, dtype: torch.dtype) -> torch.Tensor:
    return buf[offset : offset + nbytes].view(dtype).view(seg.box.sizes)


def _outgoing(plan, message: Message, source: Source, device: torch.device) -> tuple[torch.Tensor, bool]:
    """What to send for `message`, and whether it is a new buffer (else a view of the old piece)."""
    if message.direct:
        seg = message.segments[0]
        view = source.local(seg.tensor)[seg.box.relative_to(plan.old_boxes[message.src][seg.tensor])]
        if view.is_contiguous() and view.device == device:
            return view, False
        return view.to(device, copy=True, memory_format=torch.contiguous_format), True
    buf = torch.empty(message.nbytes, dtype=torch.uint8, device=device)
    for seg, offset in zip(message.segments, message.offsets):
        tensor = plan.tensors[seg.tensor]
        box = plan.old_boxes[message.src][seg.tensor]
        view = _segment_view(buf, offset, plan.segment_bytes(seg), seg, tensor.dtype)
        view.copy_(source.local(seg.tensor)[seg.box.relative_to(box)])
    return buf, True


def _incoming(plan, message: Message, new_local: dict[int, torch.Tensor], rank: int, device: torch.device) -> tuple[torch.Tensor, bool]:
    """Where to receive `message`, and whether it is a new buffer (else the new piece itself)."""
    if message.direct:
        seg = message.segments[0]
        target = new_local[seg.tensor][seg.box.relative_to(plan.new_boxes[rank][seg.tensor])]
        if target.is_contiguous() and target.device == device:
            return target, False
        return torch.empty(target.shape, dtype=target.dtype, device=device), True
    return torch.empty(message.nbytes, dtype=torch.uint8, device=device), True


def _unpack(plan, message: Message, buf: torch.Tensor, new_local: dict[int, torch.Tensor], rank: int) -> None:
    for seg, offset in zip(message.segments, message.offsets):
        target = new_local[seg.tensor][seg.box.relative_to(plan.new_boxes[rank][seg.tensor])]
        if message.direct:
            target.copy_(buf)
        else:
            tensor = plan.tensors[seg.tensor]
            target.copy_(_segment_view(buf, offset, plan.segment_bytes(seg), seg, tensor.dtype))


def _post(sends, send_bufs, recvs, recv_bufs, tag: int, device: torch.device) -> list:
    """Post every receive and send of a round before waiting on any (see `schedule.py`)."""
    if device.type == "cuda":
        ops = [dist.P2POp(dist.irecv, buf, m.src) for m, buf in zip(recvs, recv_bufs)]
        ops += [dist.P2POp(dist.isend, buf, m.dst) for m, buf in zip(sends, send_bufs)]
        return dist.batch_isend_irecv(ops) if ops else []
    works = [dist.irecv(buf, src=m.src, tag=tag) for m, buf in zip(recvs, recv_bufs)]
    works += [dist.isend(buf, dst=m.dst, tag=tag) for m, buf in zip(sends, send_bufs)]
    return works
