"""In-memory copies of the training state (`--redundancy K`): every piece of the state is kept by
at least K + 1 workers of the world, so that any K of them may crash at once and every piece
still has a copy among the survivors.

**Who keeps what** (`copy_duties`, pure). A layout's replicas count: under ``dp=2`` every piece
already has a second holder. A parameter piece with fewer than K + 1 holders gets copies on the
workers that follow its first holder in rank order (cyclically) and do not hold it, until K + 1
hold it (or every worker does). When the workers' hosts are known, workers on a host that holds
none of the piece yet come first: a lost host then takes no piece with all its holders. A copy is
of a whole parameter piece: the piece, its two AdamW moments and its step count.

**Keeping the copies current costs the gradients, not the state** (`Copies`):

- when a world opens, each piece's first holder sends its copy holders the piece, its moments and
  its step (`Copies.fill`);
- in every step, once the gradients are reduced and clipped and before the commit vote, each first
  holder sends its copy holders its gradient pieces (`Copies.send_gradients`): the bytes of the
  parameter pieces, a third of the state's;
- once the step is committed, a copy holder applies AdamW to its copies (`Copies.step`), with the
  owner's hyperparameters and learning rate: the same operations on the same numbers, so a copy
  stays bitwise equal to the piece it copies.

A crash before the vote aborts the step everywhere, and every copy is still the last committed
step's, as every survivor's own state is. Once every worker has voted, every copy holder has its
gradients: nothing after the vote communicates, so whoever survives applies the step to its state
and its copies alike. A lost worker's pieces then come from the copies (`reshard.plan`'s
``copies``), and nothing is lost.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch

from shardshift.comm.p2p import Deadline, PeerOp, Transport
from shardshift.reshard.plan import Assignment, PieceCopies, holdings_of
from shardshift.reshard.space import StateSpace
from shardshift.reshard.training import MOMENTS
from shardshift.train.state import TrainingState, local

KINDS = ("param", *MOMENTS, "step")  # the logical tensors a copy of a parameter piece holds


@dataclasses.dataclass(frozen=True, order=True)
class Duty:
    """Process `holder` keeps a copy of process `of`'s piece of parameter `fqn`."""

    of: int
    holder: int
    fqn: str


def copy_duties(space: StateSpace, assignment: Assignment, k: int,
                hosts: Sequence[str] | None = None) -> tuple[Duty, ...]:
    """The copies a world keeps so that every parameter piece has K + 1 holders (module
    docstring), in the order both ends of every copy walk them. `hosts[p]`: process p's host, when
    known."""
    if k <= 0:
        return ()
    boxes = holdings_of(space, assignment)
    world = assignment.world
    host = (lambda p: hosts[p]) if hosts else (lambda p: p)  # unknown: every process its own host
    duties = []
    for index, tensor in enumerate(space.tensors):
        if not tensor.key.startswith("param:"):
            continue
        fqn = tensor.key.removeprefix("param:")
        classes: dict = {}
        for process in range(world):
            box = boxes[process][index]
            if box is not None and not box.empty:
                classes.setdefault(box, []).append(process)
        for holders in classes.values():
            first, wanted = holders[0], min(k + 1, world) - len(holders)
            taken = {host(p) for p in holders}
            others = [(first + step) % world for step in range(1, world)]
            for _ in range(max(wanted, 0)):
                candidates = [p for p in others if p not in holders]
                if not candidates:
                    break
                chosen = next((p for p in candidates if host(p) not in taken), candidates[0])
                duties.append(Duty(first, chosen, fqn))
                holders = [*holders, chosen]
                taken.add(host(chosen))
    return tuple(sorted(duties))


def plan_copies(space: StateSpace, duties: tuple[Duty, ...], process_of) -> PieceCopies:
    """`duties` as a transition plan takes them (`plan_transition(copies=...)`): (holder, of,
    tensor index) per logical tensor of each copy, with `process_of(rank)` the plan's process
    number of a world rank."""
    index = {t.key: i for i, t in enumerate(space.tensors)}
    return tuple((process_of(d.holder), process_of(d.of), index[f"{kind}:{d.fqn}"]) for d in duties for kind in KINDS)


class Copies:
    """The copies this rank keeps of other ranks' pieces, and the pieces it sends to be copied
    (`copy_duties` over its world). Collectives over `group` (every rank of the world calls
    `fill` and `send_gradients` together)."""

    def __init__(self, state: TrainingState, space: StateSpace, assignment: Assignment, duties: tuple[Duty, ...],
                 rank: int, group, timeout_s: float):
        self.state, self.duties, self.rank, self.group, self.timeout_s = state, duties, rank, group, timeout_s
        params = dict(state.model.named_parameters())
        self.params = {d.fqn: params[d.fqn] for d in duties if d.of == rank}  # pieces others copy
        self.kept: dict[tuple[int, str], dict[str, torch.Tensor]] = {}  # (of, fqn) -> kind -> tensor
        self.grads: dict[tuple[int, str], torch.Tensor] = {}
        self._optimizer = None
        boxes = holdings_of(space, assignment)
        index = {t.key: i for i, t in enumerate(space.tensors)}
        device = state.par.device
        for d in duties:
            if d.holder != rank:
                continue
            tensor = index[f"param:{d.fqn}"]
            shape, dtype = boxes[d.of][tensor].sizes, space.tensors[tensor].dtype
            self.kept[(d.of, d.fqn)] = {
                "param": torch.empty(shape, dtype=dtype, device=device),
                **{kind: torch.empty(shape, dtype=dtype, device=device) for kind in MOMENTS},
                "step": torch.zeros((), dtype=torch.float32),
            }
            self.grads[(d.of, d.fqn)] = torch.empty(shape, dtype=dtype, device=device)

    def piece(self, of: int, key: str) -> torch.Tensor:
        """The copy this rank keeps of rank `of`'s piece of logical tensor `key` (``kind:fqn``)."""
        kind, _, fqn = key.partition(":")
        return self.kept[(of, fqn)][kind]

    # ---- keeping the copies current --------------------------------------------------------------

    def fill(self) -> float:
        """Copy every piece to its holders (when a world opens); the seconds it took."""
        start = time.perf_counter()
        optim, device = self.state.optimizer, self.state.par.device
        steps = {key: torch.empty(1, dtype=torch.float32, device=device) for key in self.kept}  # AdamW's step is on the CPU

        def outgoing(d: Duty) -> list[torch.Tensor]:
            param = self.params[d.fqn]
            state = optim.state[param]
            pieces = [local(param.detach()), *(local(state[k]) for k in MOMENTS)]
            return [*(_contiguous(t) for t in pieces), state["step"].reshape(1).to(device)]

        def incoming(d: Duty) -> list[torch.Tensor]:
            kept = self.kept[(d.of, d.fqn)]
            return [kept["param"], *(kept[k] for k in MOMENTS), steps[(d.of, d.fqn)]]

        self._exchange(outgoing, incoming, "copying the state")
        for key, buf in steps.items():
            self.kept[key]["step"].copy_(buf[0])
        self._optimizer = None  # built again over the new copies at the next step
        return time.perf_counter() - start

    def send_gradients(self) -> None:
        """Exchange this step's gradient pieces (reduced and clipped) with the copy holders: before
        the commit vote, so that every holder has them once the step is committed."""
        def outgoing(d: Duty) -> list[torch.Tensor]:
            grad = self.params[d.fqn].grad
            if grad is None:
                raise RuntimeError(f"{d.fqn} has no gradient to send to its copy on rank {d.holder}")
            return [_contiguous(local(grad))]

        self._exchange(outgoing, lambda d: [self.grads[(d.of, d.fqn)]], "sending gradients to the copies")

    def step(self) -> None:
        """Apply the committed step to the copies, as the owners applied it to their pieces."""
        if not self.kept:
            return
        optimizer = self._optimizer or self._build_optimizer()
        lr = self.state.optimizer.param_groups[0]["lr"]
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()

    def _build_optimizer(self) -> torch.optim.AdamW:
        """AdamW over the copies, its state the copies' moments and steps, its hyperparameters the
        owner's (`train.optim.build_optimizer`: weight decay on pieces of two or more dims)."""
        source = self.state.optimizer
        decay, no_decay = [], []
        for key, kept in self.kept.items():
            kept["param"].grad = self.grads[key]
            (decay if kept["param"].dim() >= 2 else no_decay).append(kept["param"])
        groups = []
        for params, template in ((decay, source.param_groups[0]), (no_decay, source.param_groups[1])):
            groups.append({"params": params, **{k: v for k, v in template.items() if k != "params"}})
        optimizer = torch.optim.AdamW(groups, foreach=False)
        for kept in self.kept.values():
            optimizer.state[kept["param"]] = {kind: kept[kind] for kind in ("step", *MOMENTS)}
        self._optimizer = optimizer
        return optimizer

    def _exchange(self, outgoing, incoming, what: str) -> None:
        sends, recvs = [], []
        for d in self.duties:  # the same order at both ends of every copy
            if d.of == self.rank:
                sends += [PeerOp(d.holder, t, 0) for t in outgoing(d)]
            elif d.holder == self.rank:
                recvs += [PeerOp(d.of, t, 0) for t in incoming(d)]
        if sends or recvs:
            Transport(self.group).post_round(sends, recvs, what).wait(Deadline.after(self.timeout_s))


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.is_contiguous() else tensor.contiguous()
