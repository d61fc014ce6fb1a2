"""A change of world, planned: who the next world's workers are, its layout, and the plan that
moves the state into it (pure).

A change is the old world (its `Epoch`) and one `Request`: the workers that leave on notice, the
joiners admitted, the workers lost, and the copies the old world kept of their pieces. Every
worker of the old and the new world computes the same `Change` from the same inputs
(`plan_change`): the new world's workers are those that stay, in the old world's rank order, then
the joiners; its layout is `--layout-for`'s or the policy's (`config.layout_for`, calibrated on
the job's measured steps); the plan places it on the processes so that the most bytes stay
where they are (`reshard.plan`), and takes each lost piece from a replica or a kept copy
(ValueError when a piece has none). The plan can be worked out ahead, while training goes on
(`ahead.Ahead`), keyed by its `Placement`.
"""

from __future__ import annotations

import dataclasses

import torch

from shardshift.elastic.config import ElasticConfig, Observed, layout_for
from shardshift.elastic.protocol import Epoch
from shardshift.elastic.redundancy import Duty, plan_copies
from shardshift.layout import Layout
from shardshift.models.space import state_space
from shardshift.models.spec import ModelSpec
from shardshift.reshard.execute import SwitchProgram, compile_program
from shardshift.reshard.plan import Assignment, TransitionPlan, plan_transition
from shardshift.reshard.schedule import build_schedule
from shardshift.train.config import TrainConfig

KINDS = ("join", "leave", "crash")


@dataclasses.dataclass(frozen=True)
class Request:
    """What changes at a step boundary (worker ids throughout)."""

    kind: str  # KINDS: what the new epoch records ("leave" when workers leave and others join at once)
    step: int  # optimizer steps taken: the new world starts from there
    admitted: int  # joiners admitted since the job started, these included
    leaving: frozenset[int] = frozenset()  # go on notice, sending their pieces first
    joiners: tuple[int, ...] = ()  # come, with no state
    lost: frozenset[int] = frozenset()  # crashed: their pieces come from replicas or `copies`
    copies: tuple[Duty, ...] = ()  # the copies the old world kept (--redundancy), by old rank
    observed: Observed = ()  # the job's measured steps, which the layout policy is calibrated on

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind
        object.__setattr__(self, "joiners", tuple(sorted(self.joiners)))

    @classmethod
    def of_epoch(cls, old: Epoch, new: Epoch) -> Request:
        """The request that made `new` from `old` (what a joiner reads: it saw neither world)."""
        return cls(new.kind, new.step, new.admitted, leaving=frozenset(set(old.members) - set(new.members)),
                   joiners=tuple(m for m in new.members if m not in old.members), observed=new.observed)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Everything the plan of a change depends on: the key of the work done for it ahead."""

    model: ModelSpec
    dtype: torch.dtype  # the parameters'
    layout: Layout  # the new world's
    old_members: tuple[int, ...]  # worker ids in the old world's rank order (rank r at coordinate r)
    old_layout: Layout
    leaving: frozenset[int]
    joiners: tuple[int, ...]  # sorted
    lost: frozenset[int]
    copies: tuple[Duty, ...]

    @classmethod
    def of(cls, cfg: TrainConfig, ecfg: ElasticConfig, old: Epoch, request: Request) -> Placement:
        """The placement of `request` on `old`, with the new world's layout chosen."""
        staying = [m for m in old.members if m not in request.leaving and m not in request.lost]
        layout = layout_for(len(staying) + len(request.joiners), ecfg, cfg, request.observed)
        return cls(cfg.model, cfg.param_dtype, layout, old.members, old.layout, request.leaving, request.joiners,
                   request.lost, request.copies)

    @property
    def union(self) -> tuple[int, ...]:
        """The plan's processes: the workers that stay (old rank order), the joiners, then the lost,
        so that the move group's ranks are the plan's first processes."""
        return (tuple(m for m in self.old_members if m not in self.lost) + self.joiners
                + tuple(m for m in self.old_members if m in self.lost))

    def plan(self) -> TransitionPlan:
        union = self.union
        where = {m: u for u, m in enumerate(union)}
        members = [u for u, m in enumerate(union) if m not in self.leaving and m not in self.lost]
        space = state_space(self.model, self.dtype)
        old = Assignment(self.old_layout, tuple(where[m] for m in self.old_members), len(union))
        copies = plan_copies(space, self.copies, lambda rank: where[self.old_members[rank]])
        return plan_transition(space, old, self.layout, members=members, lost=[where[m] for m in self.lost],
                               copies=copies)

    def program(self, plan: TransitionPlan, process: int, budget: int) -> SwitchProgram:
        """Process `process`'s part of the plan's schedule."""
        return compile_program(build_schedule(plan, budget), process)


@dataclasses.dataclass(frozen=True)
class Change:
    """A change of world, as every worker of the old and the new world computes it."""

    old: Epoch
    epoch: Epoch  # the new world
    placement: Placement
    plan: TransitionPlan  # over the union's processes (indices into `union`)
    cfg: TrainConfig  # the run's configuration under the new layout

    @property
    def union(self) -> tuple[int, ...]:
        """Worker ids: the old world's that live in rank order, the joiners, the lost."""
        return self.placement.union

    @property
    def movers(self) -> int:
        """The processes of the move group: the union but the crashed (the last of it, in no group)."""
        return len(self.union) - len(self.placement.lost)

    def keeps_old(self, budget: int) -> bool:
        """Whether the old world's workers keep their whole state until the move is done (rather than
        free each piece once sent), so that a move that fails goes back to the old world's state:
        when holding the old and the new state at once takes, on every process, at most half of
        the switch's memory budget beyond the larger of the two (the other half is the schedule's)."""
        plan = self.plan
        return all(min(plan.held_bytes(plan.old_boxes, p), plan.held_bytes(plan.new_boxes, p)) <= budget // 2
                   for p in range(plan.world_size))


def plan_change(cfg: TrainConfig, ecfg: ElasticConfig, old: Epoch, request: Request, ahead=None,
                number: int | None = None) -> Change:
    """The next world after `old` and the plan that moves the state into it (module docstring).
    Pure, and the same on every worker of the old and the new world. The plan is taken from
    `ahead` (an `ahead.Ahead`) when it was worked out there. `number`: the new epoch's, when it is
    not ``old.number + 1`` (a change tried again after one that failed: `moving`)."""
    placement = Placement.of(cfg, ecfg, old, request)
    plan = ahead.get(placement, placement.plan) if ahead is not None else placement.plan()
    epoch = Epoch(old.number + 1 if number is None else number, tuple(placement.union[u] for u in plan.new.ranks), placement.layout, request.step,
                  request.kind, request.admitted, observed=request.observed)
    return Change(old, epoch, placement, plan, cfg.with_layout(placement.layout))
