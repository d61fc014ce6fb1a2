"""Point-to-point transfers on an explicitly given group, every wait bounded by a deadline.

The one send/receive layer of ShardShift: the layout switch's executor (`shardshift.reshard`)
posts whole rounds through it, the tree collectives' executor posts single messages from several
threads. Neither knows which group it talks over: `Transport(group)` takes anything with torch's
point-to-point methods ``send([tensor], peer, tag)`` / ``recv([tensor], peer, tag)`` returning a
work with ``wait(timeout)`` (a `ProcessGroup` such as ``dist.group.WORLD``, a backend such as
``ProcessGroupGloo`` built on a store of its own, or the tests' in-process group), and `peer` is a
rank of that group. So a transfer can run on the job's world, on a private group, or on a group
that spans an old and a new world.

A failure or a timeout raises `TransferError`, which names this rank, the peer, and what was being
done (e.g. ``switch round 3 of 7: receiving 4.0 MiB from rank 2``), with the group's own error as
its cause. After one, the group's message streams are out of step: the caller must not reuse it
for transfers of the same kind.

Rounds (`post_round`): every receive of the round is posted, then every send, before anything is
waited on; two ranks that post matching rounds in the same order therefore never wait on each
other in a cycle. On CUDA tensors the round is one batch (`torch.distributed.batch_isend_irecv`,
which NCCL needs so that a send and a receive between the same two ranks do not block each
other); on gloo they are separate calls, since gloo's batched form is known to hang
(docs/background.md). There a round's sends may be produced lazily (a generator: each is posted
as soon as it is produced, so packing the next overlaps the transfer of the last), and its
receives can be taken one by one as they complete (`PostedRound.received`).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from typing import NamedTuple

import torch

from shardshift.units import format_size

Describe = str | Callable[[], str]  # what a transfer is doing; a callable is only called on failure


class TransferError(RuntimeError):
    """A point-to-point transfer failed or ran out of time (see the module docstring)."""

    def __init__(self, message: str, *, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


@dataclasses.dataclass(frozen=True)
class Deadline:
    """A point in time (``time.monotonic()``) that every wait of one operation is bounded by."""

    at: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        if not seconds > 0:
            raise ValueError(f"a deadline {seconds} s from now has passed; give seconds > 0")
        return cls(time.monotonic() + seconds)

    def left(self) -> float:
        """Seconds until the deadline (<= 0 once it has passed)."""
        return self.at - time.monotonic()


class PeerOp(NamedTuple):
    """One message of a round: `tensor` to or from `peer`, matched first in, first out per tag."""

    peer: int
    tensor: torch.Tensor
    tag: int = 0


class PostedRound:
    """A round's sends and receives, posted; `wait` for all of them, or take the receives as they
    complete (`received`)."""

    def __init__(self, transport: Transport, works: list, ops: list[tuple[bool, PeerOp]], what: Describe,
                 batched: bool = False) -> None:
        self._transport, self._works, self._ops, self._what = transport, works, ops, what
        self._batched = batched  # one work stands for the whole round (a CUDA batch)
        self._done = [False] * len(ops)

    def _wait(self, index: int, deadline: Deadline) -> None:
        if self._done[index]:
            return
        is_send, op = self._ops[index]
        if self._batched:
            for work in self._works:
                self._transport.wait(work, deadline, op.peer, lambda: _describe_op(self._what, is_send, op))
            self._done = [True] * len(self._ops)
            return
        self._transport.wait(self._works[index], deadline, op.peer, lambda: _describe_op(self._what, is_send, op))
        self._done[index] = True

    def received(self, deadline: Deadline) -> Iterator[int]:
        """Wait for each receive in the order posted, yielding its index among the receives once
        its bytes have arrived (on a batch, after the whole batch)."""
        index = 0
        for position, (is_send, _) in enumerate(self._ops):
            if not is_send:
                self._wait(position, deadline)
                yield index
                index += 1

    def wait(self, deadline: Deadline) -> None:
        for position in range(len(self._ops)):
            self._wait(position, deadline)


class Transport:
    """Sends and receives on `group` (see the module docstring)."""

    def __init__(self, group) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()

    def send(self, tensor: torch.Tensor, peer: int, tag: int = 0):
        """Post a send of `tensor` to `peer`; returns the work to `wait` for."""
        return self.group.send([tensor], peer, tag)

    def recv(self, tensor: torch.Tensor, peer: int, tag: int = 0):
        """Post a receive into `tensor` from `peer`; returns the work to `wait` for."""
        return self.group.recv([tensor], peer, tag)

    def wait(self, work, deadline: Deadline, peer: int | None, what: Describe) -> None:
        """Wait for one posted transfer (or any work of the group: `peer` None) until `deadline`;
        TransferError names `peer` and `what`."""
        seconds = deadline.left()
        if seconds <= 0:
            raise self.error(peer, what, "timed out")
        try:
            work.wait(timedelta(seconds=seconds))
        except Exception as err:  # gloo reports timeouts and closed peers as RuntimeError
            raise self.error(peer, what, f"failed: {err}") from err

    def error(self, peer: int | None, what: Describe, how: str) -> TransferError:
        """The error for `what` (done with `peer`) that failed `how`."""
        return TransferError(f"rank {self.rank}: {_text(what)} {how}", peer=peer)

    def post_round(self, sends: Iterable[PeerOp], recvs: Sequence[PeerOp], what: Describe) -> PostedRound:
        """Post a round: every receive, then every send, none waited on (see the module docstring).
        Messages to the same peer with the same tag are matched in the order given. `sends` may be
        a generator: on gloo each send is posted as soon as it is produced, so the first ones travel
        while the next are still being packed."""
        sends = iter(sends)
        head = list(itertools.islice(sends, 0 if recvs else 1))  # a tensor to tell the device by
        sends = itertools.chain(head, sends)
        probe = recvs or head
        ops = [(False, op) for op in recvs]
        if probe and probe[0].tensor.is_cuda:  # NCCL: one batch, so the whole round first
            import torch.distributed as dist

            ops += [(True, op) for op in sends]
            batch = [dist.P2POp(dist.isend if is_send else dist.irecv, op.tensor, group=self.group,
                                tag=op.tag, group_peer=op.peer) for is_send, op in ops]  # fmt: skip
            return PostedRound(self, dist.batch_isend_irecv(batch), ops, what, batched=True)
        works = [self._post(False, op, what) for _, op in ops]
        for op in sends:
            works.append(self._post(True, op, what))
            ops.append((True, op))
        return PostedRound(self, works, ops, what)

    def _post(self, is_send: bool, op: PeerOp, what: Describe):
        """Post one send or receive of a round; gloo refuses to post to a peer whose connection
        has closed (it died): TransferError naming it, as a failed wait would."""
        try:
            return (self.send if is_send else self.recv)(op.tensor, op.peer, op.tag)
        except RuntimeError as err:
            raise self.error(op.peer, lambda: _describe_op(what, is_send, op), f"failed: {err}") from err


def _text(what: Describe) -> str:
    return what() if callable(what) else what


def _describe_op(what: Describe, is_send: bool, op: PeerOp) -> str:
    size = format_size(op.tensor.numel() * op.tensor.element_size())
    verb = f"sending {size} to" if is_send else f"receiving {size} from"
    return f"{_text(what)}: {verb} rank {op.peer} (tag {op.tag})"
