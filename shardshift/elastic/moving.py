"""Moving a worker's state into the next world, in the running processes.

Every worker of a change (the old world's that live, and the joiners) runs `move`:

1. the move group (``epoch{e}/move``) of all of them, built by hand so that a joiner with no
   world can be in it;
2. the old world's workers leave its process groups; the new world's form the next one and build
   its meshes;
3. the state moves over the move group, straight from the workers that hold each piece to those
   that need it (`train.switch.switch_world`, on this process's program of the plan: worked out
   ahead while training went on, usually); a leaving worker sends its pieces and is done;
4. the new world's workers build their trainer around the moved state, and fill their copies
   (``--redundancy``).

The pause is broken down into `PHASES`, each the slowest worker's; the new world's rank 0 records
the change as a ``membership`` event.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from shardshift.console import say
from shardshift.elastic import membership
from shardshift.elastic.change import Change
from shardshift.train.parallelize import build_parallel
from shardshift.train.switch import switch_world
from shardshift.train.trainer import Trainer

if TYPE_CHECKING:
    from shardshift.elastic.member import ElasticWorker

PHASES = ("move_group", "leave_old_world", "new_world", "meshes", "program", "model_and_transfer", "transfer",
          "trainer", "copies")
"""The parts of a change's pause: building the move group; leaving the old world's groups; joining
the new world's default group; its meshes; this worker's program of the transfers (next to nothing
when it was worked out ahead); the new model's structure and optimizer (without the transfer); the
transfer itself; the trainer around the new state; filling the copies (`--redundancy`). A phase a
worker has no part in counts 0 for it."""


class Phases:
    """The time of each phase, lap by lap."""

    def __init__(self, start: float):
        self.last, self.times = start, {}

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.times[name] = now - self.last
        self.last = now

    def values(self) -> list[float]:
        return [self.times.get(name, 0.0) for name in PHASES]


def worst(group, values: list[float]) -> list[float]:
    """The largest of each value over `group` (a collective; any group with torch's methods)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MAX
    group.allreduce([tensor], options).wait()
    return tensor.tolist()


def move(worker: ElasticWorker, change: Change, started_at: float, detect_s: float,
         recovered_from: str = "none") -> None:
    """Move `worker`'s state (if any) into the new world of `change` (if it is in it), as the
    module docstring says. The event's ``phases`` break the pause down."""
    clock = Phases(started_at)
    process = change.union.index(worker.member)
    group = membership.move_group(worker.store.store, change.epoch, process, change.movers, worker.timeout_s)
    clock.lap("move_group")
    worker.faults.strike_while_moving(change, worker.member)
    copies = None
    if worker.copies is not None:
        kept, old_members = worker.copies, change.old.members
        copies = lambda of, key: kept.piece(old_members.index(change.union[of]), key)  # noqa: E731
    old_state = worker.leave_world() if worker.trainer is not None else None
    clock.lap("leave_old_world")
    new_par, rank = None, None
    if process in change.plan.new.ranks:
        rank = change.plan.new.ranks.index(process)
        membership.init_world(worker.store.store, change.epoch, rank, worker.timeout_s, "gloo")
        clock.lap("new_world")
        new_par = build_parallel(change.epoch.layout, rank, worker.device_type)
        clock.lap("meshes")
    budget = worker.cfg.switch_budget
    key = (change.placement, process, budget)
    ahead = key in worker.ahead
    program = worker.ahead.get(key, lambda: change.placement.program(change.plan, process, budget))
    worker.ahead.forget()
    clock.lap("program")
    state, stats = switch_world(old_state, change.plan, program, change.cfg, new_par, group, worker.timeout_s,
                                copies)
    clock.lap("model_and_transfer")
    clock.times["transfer"] = stats.seconds
    clock.times["model_and_transfer"] -= stats.seconds
    del old_state, copies
    worker.copies = None
    if state is not None:
        worker.cfg = change.cfg
        trainer = Trainer(change.cfg, rank, worker.device_type, tokens=worker.tokens, timeout_s=worker.timeout_s,
                          state=state)
        clock.lap("trainer")
        worker.enter_world(change.epoch, trainer)
        clock.lap("copies")
    else:
        worker.enter_world(change.epoch, None)
    # The slowest worker's figures; also, nobody leaves before every worker has arrived here.
    figures = worst(group, [time.monotonic() - started_at, detect_s, 0.0 if ahead else 1.0, *clock.values()])
    del group
    if state is None:
        say(f"shardshift: worker {worker.member} left after step {change.epoch.step}, its state moved to the "
            f"{change.epoch.world_size} remaining", "stderr")
        return
    worker.opened({"kind": change.epoch.kind, "from_world": change.old.world_size,
                   "to_world": change.epoch.world_size, "from": str(change.old.layout),
                   "to": str(change.epoch.layout), "detect_seconds": figures[1], "pause_seconds": figures[0],
                   "bytes_moved": change.plan.bytes_moved, "steps_lost": 0, "recovered_from": recovered_from,
                   "planned_ahead": figures[2] == 0.0, "phases": dict(zip(PHASES, figures[3:]))})
