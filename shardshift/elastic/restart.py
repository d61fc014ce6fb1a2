"""The last way on: a world of the workers left, from the newest checkpoint of ``--save``.

When some piece of the state has no surviving holder (a crash with no replica and no copy, more
crashes at once than ``--redundancy`` covers, a crash while the state moved and the old state was
not kept whole: `moving`), the workers left form their world, load the newest checkpoint under
its layout (DCP reshards it), and report the steps lost, which they run again. With no checkpoint,
or fewer workers than ``--min-nproc``, the job stops with that message (`WorldLost`).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from shardshift.elastic import membership
from shardshift.elastic.config import layout_for
from shardshift.elastic.protocol import Epoch, connect
from shardshift.train import checkpoint
from shardshift.train.catalog import checkpoints
from shardshift.train.run import RunFailed
from shardshift.train.trainer import Trainer

if TYPE_CHECKING:
    from shardshift.elastic.member import ElasticWorker


class WorldLost(RunFailed):
    """Workers were lost and the job cannot go on in the running processes."""

    def __init__(self, what: str, save: str | None) -> None:
        where = f"resume with --resume {save}" if save else "start again (give --save to have checkpoints)"
        super().__init__(f"{what}: the job stops; {where}")


def check_enough(worker: ElasticWorker, lost, left: int, step: int) -> None:
    """Stop the job (`WorldLost`) when `left` workers are fewer than ``--min-nproc``."""
    if left < worker.ecfg.min_nproc:
        raise WorldLost(f"workers {sorted(lost)} were lost after step {step}, leaving {left}, fewer than "
                        f"--min-nproc {worker.ecfg.min_nproc}", worker.cfg.save)


def restart_from_checkpoint(worker: ElasticWorker, old: Epoch, members: list[int], number: int, lost, why: str,
                            step_before: int, noticed: float, detect: float) -> None:
    """Form epoch `number`'s world of `members` (worker ids, in this order) and load the newest
    checkpoint into it (module docstring). `worker` is in no world; `old` is the last world that
    trained, `step_before` the step it had reached, `lost` and `why` say why there is no other way."""
    cfg = worker.cfg
    newest = checkpoints(Path(cfg.save)) if cfg.save else []
    if not newest:
        beyond = (f" (more workers failed at once than --redundancy {worker.ecfg.redundancy} covers)"
                  if worker.ecfg.redundancy else "")
        raise WorldLost(f"workers {sorted(lost)} were lost after step {step_before} and {why}{beyond}; there is no "
                        "checkpoint either (give --save)", None)
    layout = layout_for(len(members), worker.ecfg, cfg, worker.observed())
    epoch = Epoch(number, tuple(members), layout, step_before, "crash", old.admitted, observed=worker.observed())
    rank = members.index(worker.member)
    if rank == 0:
        worker.store.admit(epoch, ())
    worker.watch.arm(number)
    membership.init_world(connect(worker.store.address, worker.timeout_s), epoch, rank, worker.timeout_s, "gloo")
    worker.cfg = cfg.with_layout(layout)
    trainer = Trainer(worker.cfg, rank, worker.device_type, corpus=worker.corpus, timeout_s=worker.timeout_s,
                      trees=worker.trees(epoch))
    checkpoint.load(trainer, newest[0])
    worker.enter_world(dataclasses.replace(epoch, step=trainer.progress.step), trainer)
    pause = membership.worst(dist.group.WORLD, [time.monotonic() - noticed, detect])
    worker.opened({"kind": "crash", "from_world": old.world_size, "to_world": len(members), "from": str(old.layout),
                   "to": str(layout), "detect_seconds": pause[1], "pause_seconds": pause[0], "bytes_moved": 0,
                   "steps_lost": step_before - trainer.progress.step, "recovered_from": "checkpoint",
                   "checkpoint": str(newest[0])})
