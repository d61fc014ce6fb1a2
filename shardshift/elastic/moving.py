"""Moving a worker's state into the next world, in the running processes, and what happens when a
worker of the change dies on the way.

Every worker of a change (the old world's that live, and the joiners) runs `move`:

1. the move group (``epoch{e}/move``) of all of them, built by hand so that a joiner with no
   world can be in it;
2. the old world's workers leave its process groups (taking their state and copies with them:
   `member.Carried`); the new world's form the next one and build its meshes;
3. the state moves over the move group, straight from the workers that hold each piece to those
   that need it (`train.switch.switch_world`, on this process's program of the plan: worked out
   ahead while training went on, usually); a leaving worker sends its pieces;
4. the new world's workers build their trainer around the moved state, and fill their copies
   (``--redundancy``);
5. every worker votes in the store that the move is complete; the change is done once all have
   voted (a compare-and-set, as the commit vote: `protocol.JobStore.decide_moved`). Only then does
   a leaving worker exit and the new world train.

**A change that fails.** A worker of the change can die at any point of it (a joiner just
admitted, a worker of the old world, a survivor recovering from a first crash). The coordinator
records it (`protocol.CrashRecord`, under the change's epoch, or under the old one's if that has
no record yet); every worker of the change watches those records (`watch`), so whatever it waits
for (a rendezvous, a transfer, a collective) fails at once. The change is then decided failed, and
every worker that lives drops what it built of the new world and tries again, from the old world,
without the lost workers, as a new epoch:

- the old world's state is still whole when the change kept it (`change.Change.keeps_old`: when
  the old and the new state fit together in the switch's memory budget, no piece is freed or handed
  over before the change is done). The next try plans from it, each lost piece taken from a
  replica or a copy, and the joiners that live come along: no step is lost;
- otherwise, or when a lost piece has neither replica nor copy, the workers left load the newest
  checkpoint (`restart`), reporting the steps lost.

A change that fails again is tried again the same way, each time without the workers lost so far.

The pause is broken down into `PHASES`, each the slowest worker's; the new world's rank 0 records
the change as a ``membership`` event.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from shardshift.console import say
from shardshift.elastic import membership
from shardshift.elastic.change import Change, Request, plan_change
from shardshift.elastic.protocol import connect
from shardshift.elastic.redundancy import copy_duties
from shardshift.elastic.restart import check_enough, restart_from_checkpoint
from shardshift.models.space import state_space
from shardshift.reshard.plan import Assignment
from shardshift.train.parallelize import build_parallel
from shardshift.train.run import RunFailed
from shardshift.train.switch import switch_world
from shardshift.train.trainer import Trainer

if TYPE_CHECKING:
    from shardshift.elastic.member import ElasticWorker

PHASES = ("leave_old_world", "move_group", "new_world", "meshes", "program", "model_and_transfer", "transfer",
          "trainer", "copies")
"""The parts of a change's pause: leaving the old world's groups; building the move group; joining
the new world's default group; its meshes; this worker's program of the transfers (next to nothing
when it was worked out ahead); the new model's structure and optimizer (without the transfer); the
transfer itself; the trainer around the new state; filling the copies (`--redundancy`). A phase a
worker has no part in counts 0 for it."""

POLL_S = 0.005


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


def move(worker: ElasticWorker, change: Change, started_at: float, detect_s: float,
         recovered_from: str = "none") -> None:
    """Move `worker`'s state (if any) into the new world of `change` (if it is in it), trying again
    after a worker of the change is lost (module docstring). The event's ``phases`` break the
    pause down."""
    watched = _watched(worker, change)
    while True:
        worker.watch.arm(*watched)
        try:
            figures, state = _move_once(worker, change, started_at, detect_s)
            failure = None
        except RuntimeError as err:  # a peer died, or this worker's connections were severed for it
            figures = state = None
            failure = err
        if _decide(worker, change, watched, failure):
            if state is not None:
                worker.cfg = change.cfg
            break
        worker.abandon_world()
        lost = _lost(worker, change)
        keep = change.keeps_old(worker.cfg.switch_budget)
        if worker.member in lost:
            raise RunFailed(f"this worker (id {worker.member}) was taken for lost while the state moved into epoch "
                            f"{change.epoch.number}, and the others went on without it; it exits")
        retry = _retry(worker, change, lost) if keep else None
        if retry is None:
            _fall_back(worker, change, lost, started_at, detect_s)
            return
        if worker.member == retry.union[0]:
            worker.store.admit(retry.epoch, ())
            say(f"shardshift: workers {sorted(lost)} were lost while the state moved into epoch "
                f"{change.epoch.number}; trying again from the state after step {change.epoch.step} as epoch "
                f"{retry.epoch.number}", "stderr")
        change, watched, recovered_from = retry, (retry.epoch.number,), "rollback"
    worker.carried = None  # the old state, kept whole while the change could fail, is dropped here
    worker.watch.arm(change.epoch.number)
    if state is None:
        say(f"shardshift: worker {worker.member} left after step {change.epoch.step}, its state moved to the "
            f"{change.epoch.world_size} remaining", "stderr")
        return
    worker.opened({"kind": change.epoch.kind, "from_world": change.old.world_size,
                   "to_world": change.epoch.world_size, "from": str(change.old.layout),
                   "to": str(change.epoch.layout), "detect_seconds": figures[1], "pause_seconds": figures[0],
                   "bytes_moved": change.plan.bytes_moved, "steps_lost": 0, "recovered_from": recovered_from,
                   "planned_ahead": figures[2] == 0.0, "phases": dict(zip(PHASES, figures[3:]))})


def _watched(worker: ElasticWorker, change: Change) -> tuple[int, ...]:
    """The crash records that break `change`: its epoch's, and the old world's when that has none
    yet (a worker that dies before the new epoch is published is recorded there)."""
    old = change.old.number
    return (change.epoch.number,) if worker.store.has_crash(old) else (old, change.epoch.number)


def _move_once(worker: ElasticWorker, change: Change, started_at: float, detect_s: float):
    """One try at `change` (module docstring, 1-4): the slowest worker's figures, and whether this
    worker is in the new world (its trainer then set, not yet training)."""
    clock = Phases(started_at)
    if worker.trainer is not None:  # the first try: leave the old world, taking the state along
        worker.carried = worker.leave_world()
    clock.lap("leave_old_world")
    process = change.union.index(worker.member)
    # A store client of its own for this change's rendezvous: severed with the rest if the change
    # breaks (`watch`), so that nobody waits for a worker that died.
    rendezvous = connect(worker.store.address, worker.timeout_s)
    group = membership.move_group(rendezvous, change.epoch, process, change.movers, worker.timeout_s)
    clock.lap("move_group")
    worker.faults.strike_while_moving(change, worker.member)
    carried = worker.carried
    copies = None
    if carried is not None and carried.copies is not None:
        kept, old_members = carried.copies, change.old.members
        copies = lambda of, key: kept.piece(old_members.index(change.union[of]), key)  # noqa: E731
    new_par, rank = None, None
    if process in change.plan.new.ranks:
        rank = change.plan.new.ranks.index(process)
        membership.init_world(rendezvous, change.epoch, rank, worker.timeout_s, "gloo")
        clock.lap("new_world")
        new_par = build_parallel(change.epoch.layout, rank, worker.device_type, trees=worker.trees(change.epoch))
        clock.lap("meshes")
    budget = worker.cfg.switch_budget
    key = (change.placement, process, budget)
    ahead = key in worker.ahead
    program = worker.ahead.get(key, lambda: change.placement.program(change.plan, process, budget))
    worker.ahead.forget()
    clock.lap("program")
    state, stats = switch_world(carried.state if carried is not None else None, change.plan, program, change.cfg,
                                new_par, group, worker.timeout_s, copies, keep_old=change.keeps_old(budget))
    clock.lap("model_and_transfer")
    clock.times["transfer"] = stats.seconds
    clock.times["model_and_transfer"] -= stats.seconds
    trainer = None
    if state is not None:
        trainer = Trainer(change.cfg, rank, worker.device_type, corpus=worker.corpus, timeout_s=worker.timeout_s,
                          state=state)
        clock.lap("trainer")
    worker.enter_world(change.epoch, trainer)
    if trainer is not None:
        clock.lap("copies")
    # The slowest worker's figures; also, nobody votes before every worker has arrived here.
    figures = membership.worst(group, [time.monotonic() - started_at, detect_s, 0.0 if ahead else 1.0,
                                       *clock.values()])
    return figures, state


def _decide(worker: ElasticWorker, change: Change, watched: tuple[int, ...], failure: RuntimeError | None) -> bool:
    """Whether `change` is done (module docstring, 5). A worker that got through votes; one that
    failed waits for the record of a loss (up to the timeout: otherwise `failure` stands). The first
    worker to know decides: done when every mover voted, failed once a loss is recorded before."""
    store, number = worker.store, change.epoch.number
    deadline = time.monotonic() + worker.timeout_s
    if failure is None and store.vote_moved(number) == change.movers:
        return store.decide_moved(number, True)
    while (decided := store.moved_decision(number)) is None:
        if any(store.has_crash(n) for n in watched):
            return store.decide_moved(number, store.moved_votes(number) == change.movers)
        if time.monotonic() > deadline:
            if failure is not None:
                raise failure
            raise RunFailed(f"the change into epoch {number} was not complete on every worker within --timeout "
                            f"{worker.timeout_s:g} s, and no worker of it was reported lost")
        time.sleep(POLL_S)
    if decided and failure is not None:  # cannot be: the change needs this worker's vote
        raise AssertionError(f"the change into epoch {number} was decided done without this worker") from failure
    return decided


def _lost(worker: ElasticWorker, change: Change) -> frozenset[int]:
    """Every worker recorded lost since the old world of `change` trained (its record included)."""
    lost: set[int] = set()
    for number in range(change.old.number, change.epoch.number + 1):
        record = worker.store.crash(number)
        if record is not None:
            lost.update(record.lost)
    return frozenset(lost & set(change.union))


def _retry(worker: ElasticWorker, change: Change, lost: frozenset[int]) -> Change | None:
    """`change` again from its old world, without the `lost` workers, as the next epoch; None when a
    piece of the state has no holder left that lives (then: the newest checkpoint)."""
    placement = change.placement
    staying = [m for m in change.old.members if m not in lost and m not in placement.leaving]
    joiners = tuple(m for m in placement.joiners if m not in lost)
    check_enough(worker, lost, len(staying) + len(joiners), change.epoch.step)
    old = change.old
    # The copies the old world kept (`--redundancy`): the lost workers' pieces come from them.
    space = state_space(worker.cfg.model, worker.cfg.param_dtype)
    duties = copy_duties(space, Assignment(old.layout, tuple(range(old.world_size))), worker.ecfg.redundancy,
                         worker.hosts(old))
    request = Request("crash", change.epoch.step, change.epoch.admitted, leaving=placement.leaving - lost,
                      joiners=joiners, lost=lost & set(old.members), copies=duties, observed=change.epoch.observed)
    try:
        return plan_change(worker.cfg, worker.ecfg, old, request, number=change.epoch.number + 1)
    except ValueError:
        return None


def _fall_back(worker: ElasticWorker, change: Change, lost: frozenset[int], started_at: float, detect_s: float) -> None:
    """No whole state to go back to, or a lost piece with no holder left: the workers of the change
    that live and stay form a world from the newest checkpoint; the others (leaving) are done."""
    worker.carried = None
    members = [m for m in change.union if m not in lost and m not in change.placement.leaving]
    check_enough(worker, lost, len(members), change.epoch.step)
    if worker.member not in members:
        say(f"shardshift: worker {worker.member} left after step {change.epoch.step}", "stderr")
        return
    why = ("the state was being moved, its old pieces freed as they went"
           if not change.keeps_old(worker.cfg.switch_budget) else "some piece of the state has no copy left")
    restart_from_checkpoint(worker, change.old, members, change.epoch.number + 1, lost, why, change.epoch.step,
                            started_at, detect_s)
    worker.watch.arm(worker.epoch.number)
