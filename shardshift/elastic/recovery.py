"""Surviving a crash: a worker gone without notice, at any moment.

- **Nobody keeps a half-applied update** (`CommitVote`). Before the optimizer steps, every worker
  votes in the store (one counter per step). A step is applied only once all of the world voted;
  a worker that finds a loss reported before that aborts the step (`StepAborted`). The decision is
  written once (a compare-and-set), so every worker reads the same one, even if a worker taken for
  lost is still alive and votes late; such a worker finds itself in the record and exits (it is
  fenced off). All of a step's collectives come before the vote, so a survivor whose collective
  broke has not applied it either.
- **Everyone plans from the same loss** (`CrashRecovery`). The coordinator writes the crashed
  workers of the current world once (`protocol.CrashRecord`); a survivor whose collective broke,
  or whose vote stalls, waits for that record (up to the timeout; otherwise the error stands).
- **Nobody waits out a timeout** (`BrokenWorldWatch`). A survivor can be blocked in a collective
  or a transfer on another survivor, which has seen the crash and left the world to recover: gloo
  cannot cancel that wait, and it would last until ``--timeout``. So every worker watches for the
  crash record of the world it trains in, from a thread of its own: once the record is there and
  the worker has not begun to recover, the thread severs this process's connections of the world
  (`watch`, `comm.sever`), and whatever the worker waits for fails at once; it then recovers as
  above.
- **Each piece comes from a copy.** The survivors form the next world and move the state as for a
  leave, every piece the lost worker held taken from a replica or a kept copy (``--redundancy``).
  A worker lost while that happens (a second crash) makes the move fail, and it is tried again
  without it (`moving`). A piece with no surviving copy sends the survivors to the newest
  checkpoint of ``--save`` instead (`restart`). Fewer survivors than ``--min-nproc``, or no copy
  and no checkpoint, stop the job with that message (`restart.WorldLost`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch.distributed as dist

from shardshift.elastic.change import Request, plan_change
from shardshift.elastic.moving import move
from shardshift.elastic.restart import check_enough, restart_from_checkpoint
from shardshift.train.loop import Hook, Loop
from shardshift.train.run import RunFailed

if TYPE_CHECKING:
    from shardshift.elastic.member import ElasticWorker

VOTE_POLL_S = 0.002
RECORD_POLL_S = 0.01


class CommitVote(Hook):
    """The vote before the optimizer steps (module docstring). Scripted kills and leaves strike
    here, inside the step (`faults`), and the gradients of the kept copies are sent before it."""

    def __init__(self, worker: ElasticWorker) -> None:
        self.worker = worker

    def commit(self, loop: Loop, step: int) -> bool | None:
        """True once every worker of this world has its gradients for `step`; False when the
        coordinator reports a worker of this world lost before all had voted. The decision is one
        compare-and-set in the store, made by the first worker that can make it (the last to vote,
        or the first to read the crash record): every worker reads the same, and a vote that comes
        after it (a worker taken for lost that wakes up) changes nothing. A worker that finds itself
        reported lost does not vote: it was fenced off, and exits. None when the store stops
        answering: the step stays pending (`orphaned`)."""
        worker = self.worker
        worker.faults.strike_in_step(step, worker.epoch.number, loop.rank, lambda: bool(worker.signals.received))
        if worker.copies is not None:
            worker.copies.send_gradients()  # a worker lost meanwhile breaks it: the step is not voted
        try:
            return self._vote(step)
        except dist.DistError:
            worker.lost_store()
            return None

    def _vote(self, step: int) -> bool:
        worker = self.worker
        epoch, store = worker.epoch, worker.store
        self._check_not_lost(store.crash(epoch.number), step)
        if store.vote(epoch.number, step) == epoch.world_size:
            return store.decide(epoch.number, step, apply=True)
        while (decided := store.decision(epoch.number, step)) is None:
            if (record := store.crash(epoch.number)) is not None:
                self._check_not_lost(record, step)
                return store.decide(epoch.number, step, apply=store.votes(epoch.number, step) == epoch.world_size)
            time.sleep(VOTE_POLL_S)
        return decided

    def _check_not_lost(self, record, step: int) -> None:
        if record is not None and self.worker.member in record.lost:
            raise RunFailed(f"this worker (id {self.worker.member}) was taken for lost during step {step}, and the "
                            "others went on without it; it applies nothing and exits")

    def applied(self, loop: Loop) -> None:
        if self.worker.copies is not None:
            self.worker.copies.step()


class CrashRecovery(Hook):
    """A worker of this world crashed: agree on who is lost, and go on in a world of the survivors."""

    def __init__(self, worker: ElasticWorker) -> None:
        self.worker = worker

    def recover(self, loop: Loop, err: Exception) -> bool:
        """The survivors agree on who is lost (the coordinator's record; `err` is raised again if
        none comes within the timeout: it was not about a loss), and move the state into a world of
        the survivors, each piece from a surviving copy; without one, from the newest checkpoint."""
        worker = self.worker
        if worker.store_gone:  # nobody can say who is lost: the error stands
            return False
        noticed = time.monotonic()
        worker.watch.disarm()
        worker.lookout.world = None
        epoch, trainer = worker.epoch, worker.trainer
        while (record := worker.store.crash(epoch.number)) is None:
            if time.monotonic() - noticed > worker.timeout_s:
                raise err
            time.sleep(RECORD_POLL_S)
        lost = frozenset(record.lost)
        if worker.member in lost:  # silent too long (frozen, cut off): the others went on without it
            raise RunFailed(f"this worker (id {worker.member}) was taken for lost after step "
                            f"{trainer.progress.step}, and the others went on without it; it exits")
        detect = max(0.0, time.time() - record.seen)
        trainer.optimizer.zero_grad(set_to_none=True)
        step = trainer.progress.step
        survivors = [m for m in epoch.members if m not in lost]
        check_enough(worker, lost, len(survivors), step)
        duties = worker.copies.duties if worker.copies is not None else ()
        request = Request("crash", step, epoch.admitted, lost=lost, copies=duties, observed=worker.observed())
        try:
            change = plan_change(worker.cfg, worker.ecfg, epoch, request, ahead=worker.ahead)
        except ValueError as no_copy:
            worker.leave_world()
            restart_from_checkpoint(worker, epoch, survivors, epoch.number + 1, lost, str(no_copy), step, noticed,
                                    detect)
            return True
        if dist.get_rank() == min(epoch.members.index(m) for m in survivors):
            worker.store.admit(change.epoch, ())
        used_copies = any(seg.copy_of is not None for seg in change.plan.segments)
        move(worker, change, noticed, detect_s=detect, recovered_from="redundancy" if used_copies else "replica")
        return True
