"""The coordinator's death: the job's store is gone, and with it every vote, record and admission.

The workers of the world that trains go on talking to each other (their process groups do not
need the store) and end the job consistently, losing nothing they had:

- a worker whose commit vote cannot be read (the store stopped answering during it) leaves the
  step pending, its gradients kept (`Trainer.train_step`), and goes on to the step boundary;
- at the boundary every worker says, in the loop's one all-reduce, whether it found the store gone
  (in its vote, at the boundary, or from its watch thread) and whether it applied the step. If any
  found it gone, the job stops: a pending step is applied where any worker applied it (the vote
  had decided to apply, and every worker holds the same gradients), dropped where none did, so
  every worker holds the same step;
- the state is saved when ``--save`` is given, and rank 0 says how to resume (the same command
  with ``--resume auto``).

A joiner still waiting to be admitted exits saying the job's coordinator is gone.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

from shardshift.console import say
from shardshift.train.loop import Hook, Loop
from shardshift.train.trainer import StepResult

if TYPE_CHECKING:
    from shardshift.elastic.member import ElasticWorker


class CoordinatorLoss(Hook):
    """Ends the job alike on every worker once its coordinator is gone (module docstring)."""

    def __init__(self, worker: ElasticWorker) -> None:
        self.worker = worker
        self.lost = False  # agreed at a boundary

    def vote(self, loop: Loop, result: StepResult) -> list[int]:
        return [int(self.worker.store_gone), int(result.applied)]

    def agreed(self, loop: Loop, values: list[int], result: StepResult) -> int:
        gone, anyone_applied = values
        if not gone:
            assert result.applied, "a step left pending with the store answering"
            return 0
        self.lost = True
        self.worker.lost_store()  # on every worker alike, whoever found it: nothing more is asked of the store
        if not result.applied:
            if anyone_applied:
                loop.apply_pending(result)
            else:
                loop.trainer.drop_pending()
        return signal.SIGTERM

    def stopping(self, loop: Loop, signum: int) -> None:
        if not self.lost or loop.rank != 0:
            return
        cfg = self.worker.cfg
        resume = (f"resume with the same command and --resume auto (it saved into --save {cfg.save})" if cfg.save
                  else "nothing was saved (give --save to have checkpoints)")
        say(f"shardshift: the job's coordinator at {self.worker.store.address} is gone (its store stopped answering); "
            f"the workers stopped after step {loop.trainer.progress.step}; {resume}", "stderr")
