"""Scripted faults (`--inject STEP:EVENT`), injected for real: tests and demonstrations strike a
running job with the signals a real one gets.

- ``kill=R``: a SIGKILL to the workers of those ranks inside step STEP, after their gradients and
  before their commit vote (the worst moment: every other worker waits in the vote);
- ``leave=R``: a SIGTERM to those workers inside step STEP: a notice, handled as any notice (they
  leave at the boundary after the step);
- ``term=R``: a SIGTERM to those workers of the old world while the first change of world after
  STEP moves the state (they leave at the boundary after it);
- ``movekill=P``: a SIGKILL to those processes of the first change of world after STEP as the state
  starts to move (the old world's workers that live, in rank order, then the joiners);
- ``wedge=R``: inside step STEP, before the votes, a SIGKILL to the world's last rank, and rank R
  waits to receive from the rank after it, which never sends (it sees the crash in its vote and
  leaves the world to recover): a survivor blocked in a transfer on another survivor, which gloo
  cannot cancel. Only leaving the broken world at once (`watch`) gets rank R out before
  ``--timeout``.

``join=N`` is not a fault: the coordinator starts N joiners, admitted at that boundary
(`admission`). Each event fires once, in the first epoch that reaches it: a step run again after a
crash does not repeat it (`protocol.JobStore.claim_event`).
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from shardshift.elastic.change import Change
from shardshift.elastic.config import ElasticConfig, Inject
from shardshift.elastic.protocol import JobStore

NOTICE_WAIT_S = 5.0  # how long a worker that sent itself a notice waits for its own handler to run


class Faults:
    """The scripted faults of a job."""

    def __init__(self, ecfg: ElasticConfig, store: JobStore) -> None:
        self.ecfg, self.store = ecfg, store

    def due(self, step: int, kind: str, epoch: int) -> Inject | None:
        """Step `step`'s scripted event of `kind`, if it fires in `epoch` (module docstring)."""
        inject = self.ecfg.inject_at(step)
        if inject is None or inject.kind != kind or not self.store.claim_event(str(inject), epoch):
            return None
        return inject

    def strike_in_step(self, step: int, epoch: int, rank: int, noticed) -> None:
        """Inside step `step`, before the vote: ``kill``, ``leave`` and ``wedge`` of this rank.
        `noticed()` says whether this process's handler has recorded its notice yet."""
        inject = self.due(step, "kill", epoch)
        if inject is not None and rank in inject.ranks:
            os.kill(os.getpid(), signal.SIGKILL)
        inject = self.due(step, "leave", epoch)
        if inject is not None and rank in inject.ranks:
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + NOTICE_WAIT_S
            while not noticed() and time.monotonic() < deadline:
                time.sleep(0.001)
        inject = self.due(step, "wedge", epoch)
        if inject is not None:
            world = dist.get_world_size()
            if rank == world - 1:
                os.kill(os.getpid(), signal.SIGKILL)
            elif rank == inject.values[0]:
                dist.recv(torch.empty(1), (rank + 1) % world)  # never sent: only a broken world ends it

    def strike_while_moving(self, change: Change, member: int) -> None:
        """As `change` starts to move the state: ``term`` and ``movekill`` of worker `member`."""
        process = change.union.index(member)
        rank = change.old.members.index(member) if member in change.old.members else None
        for inject in self.ecfg.injects:
            if inject.step > change.epoch.step:
                continue
            if inject.kind == "term" and rank in inject.ranks:
                who, sig = f"rank{rank}", signal.SIGTERM
            elif inject.kind == "movekill" and process in inject.ranks:
                who, sig = f"process{process}", signal.SIGKILL
            else:
                continue
            if self.store.fire_once(str(inject), who):  # the first change after its step only
                os.kill(os.getpid(), sig)
