"""One worker of an elastic run: the one training loop (`train.loop`) with the hooks of a world
whose members change.

At each step boundary the world's ranks agree, in the loop's one all-reduce (`Membership`), on
the signal the coordinator passed on (the job stops), the joiners rank 0 found ready in the store
(`admission`), the slowest rank's step time (the layout policy's calibration), and which ranks got
a signal of their own (a leave on notice: SIGTERM, SIGINT or SIGHUP to one worker). Every rank then
computes the same next world (`change.plan_change`), which it has usually worked out while the step
ran (its `lookout` saw the notice or the joiner coming; `ahead`), and moves its state there
(`moving.move`). A world smaller than ``--min-nproc`` is not built: the job stops as for a signal
(it saves with ``--save``).

A crash is survived by the commit vote and the recovery of `recovery` (`CommitVote`,
`CrashRecovery`); scripted faults (`--inject`) are in `faults`; how a worker joins, in
`admission`. The job's store is read and written only through `protocol.JobStore`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import time

import torch.distributed as dist

from shardshift.console import say
from shardshift.elastic import admission, membership
from shardshift.elastic.change import Request, plan_change
from shardshift.elastic.config import ElasticConfig
from shardshift.elastic.lookout import World
from shardshift.elastic.member import ElasticWorker
from shardshift.elastic.moving import move
from shardshift.elastic.orphaned import CoordinatorLoss
from shardshift.elastic.protocol import JobStore
from shardshift.elastic.recovery import CommitVote, CrashRecovery
from shardshift.elastic.restart import WorldLost
from shardshift.train.config import TrainConfig
from shardshift.train.loop import Hook, Loop
from shardshift.train.run import RunFailed, exit_status
from shardshift.train.trainer import StepResult


@dataclasses.dataclass(frozen=True)
class Control:
    """What the ranks agreed at a step boundary."""

    stop: int  # the signal the coordinator passed on (0: none)
    joins: int  # joiners to admit now
    step_seconds: float  # the step just taken, on the slowest rank
    leaving: tuple[int, ...]  # ranks that leave on notice
    noticed_at: float  # on this rank: when its own signal arrived (0: none)


class Membership(Hook):
    """The changes of world at the step boundaries (module docstring)."""

    def __init__(self, worker: ElasticWorker) -> None:
        self.worker = worker
        self.control: Control | None = None

    def before_step(self, loop: Loop) -> None:
        worker = self.worker
        worker.lookout.world = World(worker.epoch, worker.observed(), loop.trainer.progress.step + 1)

    def vote(self, loop: Loop, result: StepResult) -> list[int]:
        worker, step = self.worker, result.step
        values = [0, 0, round(result.step_time_s * 1e6)] + [0] * worker.epoch.world_size
        if loop.rank == 0 and not worker.store_gone:
            try:
                values[0] = worker.store.stop_requested()
                values[1] = admission.joins_now(worker, worker.faults.due(step, "join", worker.epoch.number), step)
            except dist.DistError:  # the coordinator is gone: `orphaned.CoordinatorLoss` stops the job
                worker.lost_store()
                values[:2] = [0, 0]
        if worker.signals.received:
            values[3 + loop.rank] = 1
        return values

    def agreed(self, loop: Loop, values: list[int], result: StepResult) -> int:
        worker = self.worker
        leaving = tuple(r for r in range(worker.epoch.world_size) if values[3 + r])
        self.control = control = Control(values[0], values[1], values[2] / 1e6, leaving, worker.signals.received_at)
        worker.observe(control.step_seconds)
        if worker.store_gone:  # whatever the notices say (the kernel signals a dead coordinator's workers)
            return 0
        return control.stop or (signal.SIGTERM if self._too_few() else 0)

    def _too_few(self) -> bool:
        return self._staying() < self.worker.ecfg.min_nproc

    def _staying(self) -> int:
        return self.worker.epoch.world_size - len(self.control.leaving) + self.control.joins

    def stopping(self, loop: Loop, signum: int) -> None:
        if loop.rank != 0 or self.worker.store_gone:
            return
        self.worker.store.mark_stopped(signum)  # the coordinator: exits now are not crashes
        if self._too_few():
            say(f"shardshift: {len(self.control.leaving)} worker(s) leaving would leave {self._staying()}, "
                f"fewer than --min-nproc {self.worker.ecfg.min_nproc}: stopping the job", "stderr")

    def after_boundary(self, loop: Loop) -> None:
        control = self.control
        if control.leaving or control.joins:
            self._change(loop, control)

    def _change(self, loop: Loop, control: Control) -> None:
        worker = self.worker
        decided_at = time.monotonic()
        worker.watch.disarm()  # the world's watch ends here: the move watches the change (`moving`)
        worker.lookout.world = None
        old, store, step = worker.epoch, worker.store, loop.trainer.progress.step
        places = store.admissions(old.number, step) if control.joins else []
        leaving = frozenset(old.members[r] for r in control.leaving)
        request = Request("leave" if leaving else "join", step, max(places) + 1 if places else old.admitted,
                          leaving=leaving, joiners=tuple(store.joiner_id(i) for i in places),
                          observed=worker.observed())
        change = plan_change(worker.cfg, worker.ecfg, old, request, ahead=worker.ahead)
        if loop.rank == 0:
            store.admit(change.epoch, places)
        detect = decided_at - control.noticed_at if control.noticed_at else 0.0
        move(worker, change, decided_at, detect_s=detect)

    def finished(self, loop: Loop) -> None:
        if loop.rank == 0 and not self.worker.store_gone:
            self.worker.store.mark_done()


def hooks(worker: ElasticWorker) -> list[Hook]:
    """The hooks of an elastic worker's loop."""
    return [Membership(worker), CoordinatorLoss(worker), CommitVote(worker), CrashRecovery(worker)]


def member_main(cfg: TrainConfig, ecfg: ElasticConfig, timeout_s: float) -> int:
    """A worker the coordinator started in the first world."""
    parent = os.getppid()
    address = os.environ[membership.COORDINATOR_ENV]
    worker = ElasticWorker(cfg, ecfg, JobStore.connect(address, timeout_s), int(os.environ[membership.MEMBER_ENV]),
                           timeout_s)
    membership.start_heartbeat(address, worker.member, ecfg.heartbeat_interval_s, timeout_s)
    worker.start_first_world()
    return _finish(worker, parent)


def joiner_main(cfg: TrainConfig, ecfg: ElasticConfig, address: str, timeout_s: float) -> int:
    """A worker that joins the running job whose coordinator is at `address` (`shardshift join`)."""
    parent = os.getppid()
    worker = ElasticWorker(cfg, ecfg, JobStore.connect(address, timeout_s), -1, timeout_s)  # its id: its queue place
    try:
        admitted = admission.join(worker, lambda member: membership.start_heartbeat(
            address, member, ecfg.heartbeat_interval_s, timeout_s))
        why = "the job stopped or ended"
    except dist.DistError:
        admitted, why = False, f"the job's coordinator at {address} went away"
    except ValueError as err:  # it differs from the job (`admission.check_identity`)
        worker.ahead.close()
        worker.watch.close()
        say(f"shardshift: error: {err}", "stderr")
        return 2
    except RunFailed as err:  # the change it was admitted to failed, and the job cannot go on
        _job_failed(worker, err)
        worker.ahead.close()
        worker.watch.close()
        say(f"shardshift: error: {err}", "stderr")
        return 1
    if not admitted:
        worker.ahead.close()
        worker.watch.close()
        _remove_job_dir_if_orphaned(parent)
        say(f"shardshift: {why} before this worker was admitted", "stderr")
        return 0
    return _finish(worker, parent)


def _finish(worker: ElasticWorker, parent: int) -> int:
    """Run `worker` to its end; its exit status, as a worker of a fixed job would have it
    (`train.run.exit_status`). A worker whose coordinator (`parent`) died removes the
    coordinator's temporary directory, which nobody else would.

    The worker's handlers of the stop signals (`ElasticWorker.signals`) are never taken back, so
    a SIGTERM that arrives during this clean-up is only recorded. One does arrive late when the
    coordinator is killed: Linux closes a dying process's sockets before it signals its children,
    so a worker can find the store gone, end its run and only then get the SIGTERM; with the
    default handler back, that signal would kill it before it removed the directory."""
    def body() -> int:
        try:
            return worker.run(hooks(worker))
        except RunFailed as err:
            _job_failed(worker, err)
            raise

    try:
        return exit_status(body)
    finally:
        worker.ahead.close()
        worker.watch.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        _remove_job_dir_if_orphaned(parent)


def _job_failed(worker: ElasticWorker, err: RunFailed) -> None:
    """Tell the coordinator that the job cannot go on (`restart.WorldLost`): the exits that follow
    are not crashes to survive."""
    if isinstance(err, WorldLost):
        with contextlib.suppress(dist.DistError):
            worker.store.mark_failed()


def _remove_job_dir_if_orphaned(parent: int) -> None:
    """Remove the directory of the coordinator that started this worker, if it has died (a
    worker started by `shardshift join` from a shell has none)."""
    job_dir = os.environ.get(membership.JOB_DIR_ENV)
    if job_dir and os.getppid() != parent:
        shutil.rmtree(job_dir, ignore_errors=True)
