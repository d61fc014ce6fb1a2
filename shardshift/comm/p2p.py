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
(docs/background.md).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
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
    """A round's sends and receives, posted; `wait` for all of them."""

    def __init__(self, transport: Transport, works: list, ops: list[tuple[bool, PeerOp]], what: Describe) -> None:
        self._transport, self._works, self._ops, self._what = transport, works, ops, what

    def wait(self, deadline: Deadline) -> None:
        for work, (is_send, op) in zip(self._works, self._ops):
            self._transport.wait(work, deadline, op.peer, lambda: _describe_op(self._what, is_send, op))


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

    def post_round(self, sends: Sequence[PeerOp], recvs: Sequence[PeerOp], what: Describe) -> PostedRound:
        """Post a round: every receive, then every send, none waited on (see the module docstring).
        Messages to the same peer with the same tag are matched in the order given."""
        ops = [(False, op) for op in recvs] + [(True, op) for op in sends]
        if ops and ops[0][1].tensor.is_cuda:
            import torch.distributed as dist

            batch = [dist.P2POp(dist.isend if is_send else dist.irecv, op.tensor, group=self.group,
                                tag=op.tag, group_peer=op.peer) for is_send, op in ops]  # fmt: skip
            works = dist.batch_isend_irecv(batch)
        else:
            works = [(self.send if is_send else self.recv)(op.tensor, op.peer, op.tag) for is_send, op in ops]
        return PostedRound(self, works, ops, what)


def _text(what: Describe) -> str:
    return what() if callable(what) else what


def _describe_op(what: Describe, is_send: bool, op: PeerOp) -> str:
    size = format_size(op.tensor.numel() * op.tensor.element_size())
    verb = f"sending {size} to" if is_send else f"receiving {size} from"
    return f"{_text(what)}: {verb} rank {op.peer} (tag {op.tag})"
