"""Joiners: how a worker joins a running job, and how the job admits it.

**The joiner** (`join`): it warms up (imports, a model build of its own, so none of it falls in
anyone's pause), says it is ready in the store (its place in the queue gives its worker id), and
waits to be admitted. While it waits it plans ahead its admission into the world that runs now
(`foresee_admission`), so that at the boundary the plan is ready. Once admitted it reads the new
epoch and the one before it, computes the same change as the others (`change.plan_change`), and
moves into the new world with them (`moving.move`).

**The job** (`joins_now`, rank 0 at each step boundary): as many ready joiners as fit under
``--max-nproc`` (`config.ElasticConfig.admits`; with scripted joins, only at a join's boundary and
at most its number), their places written for the others. A scripted join first waits while a
joiner the coordinator started is still getting ready, up to half of ``--timeout`` (the others
wait in the boundary's all-reduce meanwhile). A joiner that died before it was admitted is passed
over.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from shardshift.console import say
from shardshift.elastic.change import Request, plan_change
from shardshift.elastic.config import Inject
from shardshift.elastic.member import SAVE_MARKER
from shardshift.elastic.moving import move
from shardshift.train.switch import warm_up

if TYPE_CHECKING:
    from shardshift.elastic.member import ElasticWorker

POLL_S = 0.01


def join(worker: ElasticWorker, registered=lambda member: None) -> bool:
    """Say `worker` is ready, wait to be admitted, then move into that world; False if the job
    stopped or ended first. `registered(id)` is called once the worker has its id."""
    check_identity(worker)
    warm_up(worker.cfg, None, worker.device_type)  # before it says it is ready: not in anyone's pause
    index = worker.store.register_joiner()
    worker.member = worker.store.joiner_id(index)
    worker.store.register_process(worker.member)
    worker.store.publish_host(worker.member)
    registered(worker.member)
    ready_at = time.monotonic()
    foreseen: list[int] = []  # the world this worker last worked out its admission into
    epoch = worker.store.wait_for_admission(index, lambda: foresee_admission(worker, index, foreseen))
    if epoch is None:
        return False
    waited = time.monotonic() - ready_at
    old = worker.store.epoch(epoch.number - 1)
    change = plan_change(worker.cfg, worker.ecfg, old, Request.of_epoch(old, epoch), ahead=worker.ahead)
    assert change.epoch == epoch, (change.epoch, epoch)
    move(worker, change, time.monotonic(), detect_s=waited)
    return True


def check_identity(worker: ElasticWorker, poll_s: float = 0.05) -> None:
    """Refuse to join a job whose versions, model or data differ from this worker's, or whose
    --save is not this host's (ValueError naming the first difference), once the job has said what
    they are."""
    store = worker.store
    while (job := store.identity()) is None:  # the first world has not started yet
        if store.stop_requested() or store.done():
            return
        time.sleep(poll_s)
    marker = job.pop("save_marker", None)
    if marker is not None:
        path = Path(worker.cfg.save) / SAVE_MARKER
        if not path.is_file() or path.read_text() != marker:
            raise ValueError(f"--save {worker.cfg.save} on this host is not the directory the job saves into (it "
                             f"lacks the job's {SAVE_MARKER}): every worker must save into one directory; give "
                             "--save a directory on a filesystem every host shares")
    if worker.cfg.collectives == "trees":  # its host must be in the network the trees pack on
        from shardshift.collectives.topology.spec import hosts_topology

        hosts_topology(worker.cfg.topology, [store.this_host()], "--topology")
    mine = worker.identity()
    for key, what in (("shardshift", "shardshift version"), ("torch", "torch version"), ("model", "model"),
                      ("model_config", "model configuration"), ("data", "data (digest of --data)")):
        if mine[key] != job[key]:
            raise ValueError(f"this worker's {what} is {mine[key]}, the job's is {job[key]}: it cannot join; install "
                             "the job's versions, or give this host the job's data at the same path")


def foresee_admission(worker: ElasticWorker, index: int, foreseen: list[int]) -> None:
    """While joiner `index` waits: plan ahead its admission into the world that runs now, with the
    joiners the next boundary will admit (counted as the boundary counts them: a scripted join's
    number of them, otherwise as many as fit); again whenever that world or the queue of ready
    joiners changes."""
    store = worker.store
    current = store.current_number()
    if current is None:
        return
    ready = store.ready_joiners()
    if foreseen == [current, ready]:
        return
    foreseen[:] = [current, ready]
    epoch = store.epoch(current)
    coming = min((i for i in worker.ecfg.injects if i.kind == "join" and i.step > epoch.step),
                 key=lambda i: i.step, default=None)  # the next scripted join, if any
    places = store.live_joiners(epoch.admitted)[:worker.ecfg.admits(epoch.world_size, coming)]
    if index in places:
        joiners = tuple(store.joiner_id(i) for i in places)
        worker.prepare(epoch, Request("join", epoch.step, epoch.admitted, joiners=joiners, observed=epoch.observed))


def joins_now(worker: ElasticWorker, inject: Inject | None, step: int) -> int:
    """Rank 0: how many joiners to admit at the boundary after `step` (module docstring); their
    places are written for the others. `inject`: this boundary's scripted join, if any."""
    store, epoch = worker.store, worker.epoch
    if inject is not None:  # a scripted join
        # The others wait in the boundary's all-reduce meanwhile, up to --timeout: give up well before.
        wait_s = worker.timeout_s / 2
        deadline = time.monotonic() + wait_s
        while len(live := store.live_joiners(epoch.admitted)) < inject.count and _preparing(worker):
            if time.monotonic() > deadline:  # a joiner stuck getting ready does not stop the job
                say(f"shardshift: {len(live)} of the {inject.count} worker(s) to join after step {inject.step} "
                    f"were ready within {wait_s:g} s (half of --timeout); the job goes on with them", "stderr")
                break
            time.sleep(POLL_S)
    chosen = store.live_joiners(epoch.admitted)[:worker.ecfg.admits(epoch.world_size, inject)]
    if chosen:
        store.set_admissions(epoch.number, step, chosen)
    return len(chosen)


def _preparing(worker: ElasticWorker) -> bool:
    """Whether a joiner the coordinator started is neither ready nor dead yet."""
    store = worker.store
    return store.ready_joiners() + store.dead_before_ready() < store.joiners_started()
