"""A worker's place in the job's worlds: the process groups of an epoch, and the heartbeat that
says it is alive.

Each epoch (`protocol.Epoch`) is one world. Its process groups live under a prefix of their own of
the job's store (``epoch{e}/world`` for the training world, ``epoch{e}/move`` for the group of old
and new members that moves the state), so nothing of an earlier world can be mistaken for the next.
"""

from __future__ import annotations

import datetime
import threading
import time

import torch
import torch.distributed as dist

from shardshift.compat import reset_group_count
from shardshift.elastic.protocol import Epoch, JobStore

COORDINATOR_ENV = "SHARDSHIFT_COORDINATOR"  # HOST:PORT of the store, in every worker's environment
MEMBER_ENV = "SHARDSHIFT_MEMBER"  # a first-world worker's id (its rank there)
JOB_DIR_ENV = "SHARDSHIFT_JOB_DIR"  # the coordinator's temporary directory (the default logs), if any


def init_world(store: dist.Store, epoch: Epoch, rank: int, timeout_s: float, backend: str) -> None:
    """Join epoch `epoch`'s world as `rank`: the default process group, on its own prefix."""
    dist.init_process_group(backend, store=dist.PrefixStore(f"epoch{epoch.number}/world", store), rank=rank,
                            world_size=epoch.world_size, timeout=datetime.timedelta(seconds=timeout_s))


def forget_group_names() -> None:
    """Number this process's next process groups from 0 again, as destroying the default group does.

    torch names a group without a name by a per-process counter, and that name is part of its
    rendezvous keys: every rank of a world must have counted alike. A default group whose
    rendezvous failed (a peer died) was counted but never made, so there is nothing to destroy;
    the counter (private in PyTorch 2.13: `compat.reset_group_count`) is set back by hand."""
    reset_group_count()


def move_group(store: dist.Store, epoch: Epoch, process: int, processes: int, timeout_s: float):
    """The group of the old world's and the new world's workers that moves the state into `epoch`
    (a gloo group built by hand: it needs no default group, so a joiner can be in it)."""
    return dist.ProcessGroupGloo(dist.PrefixStore(f"epoch{epoch.number}/move", store), process, processes,
                                 datetime.timedelta(seconds=timeout_s))


def start_heartbeat(address: str, member: int, interval_s: float, timeout_s: float) -> None:
    """Beat for worker `member` every `interval_s`, from a thread and a store client of its own,
    for as long as this process lives: a worker frozen or cut off stops beating, and the
    coordinator notices within its heartbeat timeout."""
    store = JobStore.connect(address, timeout_s)

    def beat() -> None:
        while True:
            try:
                store.beat(member)
            except (RuntimeError, OSError):  # the coordinator is gone: so is the job
                return
            time.sleep(interval_s)

    threading.Thread(target=beat, name=f"shardshift-heartbeat-{member}", daemon=True).start()


def worst(group, values: list[float]) -> list[float]:
    """The largest of each value over `group` (a collective; any group with torch's methods)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MAX
    group.allreduce([tensor], options).wait()
    return tensor.tolist()
