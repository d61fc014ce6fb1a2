"""A switch whose peer dies half-way: the survivor fails fast with an error that names the peer and
the round, and its trainer refuses to go on (its state was partly moved), saying why. The fault is
real: the peer's process kills itself with SIGKILL after a few transfers of the switch."""

from __future__ import annotations

import os
import signal

import torch.distributed as dist

from shardshift.comm import TransferError
from shardshift.layout import Layout
from shardshift.models import model_spec
from shardshift.train.config import TrainConfig
from shardshift.train.state import LostState
from shardshift.train.trainer import Trainer
from support.dist import run_distributed


class _DiesMidSwitch:
    """The job's world group as a switch sees it, on a rank whose process is killed (SIGKILL, by
    itself) when it is about to post its `after`-th point-to-point transfer."""

    def __init__(self, group, after: int) -> None:
        self.group, self.left = group, after

    def rank(self) -> int:
        return self.group.rank()

    def size(self) -> int:
        return self.group.size()

    def _tick(self) -> None:
        self.left -= 1
        if self.left <= 0:
            os.kill(os.getpid(), signal.SIGKILL)

    def send(self, tensors, peer, tag):
        self._tick()
        return self.group.send(tensors, peer, tag)

    def recv(self, tensors, peer, tag):
        self._tick()
        return self.group.recv(tensors, peer, tag)

    def allreduce(self, tensors, opts):
        return self.group.allreduce(tensors, opts)


def _switch_with_a_dying_peer(rank: int, world_size: int) -> dict:
    cfg = TrainConfig(layout=Layout(fsdp=2), model=model_spec("test"), steps=4,
                      global_batch=4, seed=1)
    group = _DiesMidSwitch(dist.group.WORLD, after=3) if rank == 1 else dist.group.WORLD
    trainer = Trainer(cfg, rank, "cpu", group=group, timeout_s=60)
    trainer.train_step()
    out = {}
    try:
        trainer.switch(Layout(tp=2), budget=8 << 10)  # many small rounds: the peer dies in one
    except TransferError as err:
        out["switch"], out["peer"] = str(err), err.peer
    for name, attempt in (("step", trainer.train_step), ("again", lambda: trainer.switch(Layout(fsdp=2)))):
        try:
            attempt()
        except LostState as err:
            out[name] = str(err)
    return out


def test_a_peer_lost_mid_switch_fails_the_switch_and_marks_the_state_lost(budget):
    survivor, dead = run_distributed(2, _switch_with_a_dying_peer, timeout_s=budget.left(), dying=frozenset({1}))
    assert dead is None
    assert survivor["peer"] == 1
    assert "rank 0: switch round" in survivor["switch"] and "rank 1" in survivor["switch"], survivor
    for name in ("step", "again"):
        assert "a switch from fsdp=2 to tp=2 failed while moving it" in survivor[name], survivor
        assert "resume from the newest checkpoint" in survivor[name]
