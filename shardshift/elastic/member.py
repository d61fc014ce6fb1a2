"""An elastic job's worker across worlds: the state it keeps from one world to the next (its
store, its trainer in the world it is in, the copies it keeps, the job's measured steps), and
entering and leaving a world. What it does at the boundaries is in `worker` (the hooks of its
loop), `moving`, `admission` and `recovery`."""

from __future__ import annotations

import dataclasses
import statistics
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from shardshift.console import say
from shardshift.data.corpus import open_corpus
from shardshift.elastic import membership
from shardshift.elastic.ahead import Ahead
from shardshift.elastic.change import Placement, Request
from shardshift.elastic.config import ElasticConfig, Observed
from shardshift.elastic.faults import Faults
from shardshift.elastic.lookout import Lookout, World
from shardshift.elastic.protocol import Epoch, JobStore
from shardshift.elastic.redundancy import Copies, copy_duties
from shardshift.elastic.watch import BrokenWorldWatch
from shardshift.layout import Layout
from shardshift.models.space import state_space
from shardshift.runtime import process_from_env
from shardshift.train import checkpoint
from shardshift.train.config import TrainConfig
from shardshift.train.loop import Hook, Loop
from shardshift.train.parallelize import forget_old_meshes, tree_options
from shardshift.train.report import Metrics, Signals, Summary
from shardshift.train.run import resume_point
from shardshift.train.state import TrainingState
from shardshift.train.switch import warm_up
from shardshift.train.trainer import Trainer

SAVE_MARKER = ".shardshift-job"  # in --save: the running job's token (`ElasticWorker._mark_save_dir`)


@dataclasses.dataclass
class Carried:
    """What a worker takes with it out of a world: its state there and the copies it kept of others'
    pieces (`--redundancy`; None without)."""

    state: TrainingState
    copies: Copies | None


class ElasticWorker:
    """A worker of an elastic run, in a world (`trainer` set) or about to join one."""

    def __init__(self, cfg: TrainConfig, ecfg: ElasticConfig, store: JobStore, member: int, timeout_s: float):
        self.cfg, self.ecfg, self.store, self.member, self.timeout_s = cfg, ecfg, store, member, timeout_s
        self.corpus = open_corpus(cfg.data)
        # The state moves between worlds over gloo groups built by hand (`membership.move_group`),
        # which take CPU tensors: an elastic job runs on the CPU, its worlds on gloo (the command
        # line refuses --device cuda).
        self.device_type = "cpu"
        self.epoch: Epoch | None = None
        self.signals = Signals()
        self.faults = Faults(ecfg, store)
        self.ahead = Ahead()  # changes worked out before they happen
        self.lookout: Lookout | None = None  # while it trains: what it sees coming goes to `ahead`
        self.watch = BrokenWorldWatch(store.address, timeout_s)  # severs a broken world's connections
        self._store_failed = False  # a call of this thread's to the store failed (`orphaned`)
        self.copies: Copies | None = None  # --redundancy: the copies this worker keeps and feeds
        # Between leaving a world and the next world being sure (`moving`): the state and the copies
        # this worker took with it, which a change that fails goes back to.
        self.carried: Carried | None = None
        # The job's measured step times (the slowest rank's), by layout, the same on every worker of
        # the world: the layout policy's calibration (`observed`). A world's first step is left
        # out (it pays for warming up); a new world starts from what its epoch was chosen by.
        self.step_times: dict[Layout, list[float]] = {}
        self.steps_in_world = 0
        summary = Summary(cfg, change="change of world")  # from this worker's first step
        self.loop = Loop(cfg, None, Metrics(None, 0), summary, ())  # its hooks come with `run`

    @property
    def trainer(self) -> Trainer | None:
        """The trainer of this worker's world (the loop's), None while it is in none."""
        return self.loop.trainer

    @property
    def metrics(self) -> Metrics:
        return self.loop.metrics

    @property
    def store_gone(self) -> bool:
        """Whether the job's store stopped answering (the coordinator is gone: `orphaned`)."""
        return self._store_failed or self.watch.store_gone.is_set()

    def lost_store(self) -> None:
        """A call to the store failed: the coordinator is gone."""
        self._store_failed = True

    # ---- worlds ----------------------------------------------------------------------------------

    def start_first_world(self) -> None:
        """Join the first world as the launcher numbered this worker; resume if asked."""
        proc = process_from_env()
        cfg = self.cfg
        cfg.layout.check_world(proc.world_size)
        epoch = Epoch(0, tuple(range(proc.world_size)), cfg.layout, 0)
        self.store.publish_host(self.member)
        membership.init_world(self.store.store, epoch, proc.rank, self.timeout_s, "gloo")
        resume = resume_point(cfg, self.corpus, proc.rank) if (cfg.resume or cfg.save) else None
        trainer = Trainer(cfg, proc.rank, self.device_type, corpus=self.corpus, timeout_s=self.timeout_s,
                          trees=self.trees(epoch))
        self.loop.metrics = Metrics.of(cfg, proc.rank)
        if resume is not None:
            checkpoint.load(trainer, resume)
            self.metrics.write({"event": "resume", "step": trainer.progress.step, "checkpoint": str(resume),
                                "layout": str(cfg.layout)})
        self.enter_world(dataclasses.replace(epoch, step=trainer.progress.step), trainer)
        self.watch.arm(self.epoch.number)
        warm_up(cfg, trainer.par)  # a change's first model build, done now and not in its pause
        self.store.register_process(self.member)  # the coordinator names a crashed worker by it
        if proc.rank == 0:
            self.store.publish_identity({**self.identity(), "save_marker": self._mark_save_dir()})
            self.store.publish_epoch(self.epoch)
            self.store.set_current(0)
            say(f"training {cfg.model.name} ({cfg.model.num_params():,} parameters) elastically under {cfg.layout} "
                f"on {proc.world_size} {self.device_type} workers ({self.ecfg.min_nproc}..{self.ecfg.max_nproc}), "
                f"{cfg.dtype}")

    def identity(self) -> dict:
        """What a worker must share with the job to join it: the versions of shardshift and torch,
        the model and the data (its digest: the same --data path may hold other bytes on another
        host)."""
        import torch

        import shardshift

        return {"shardshift": shardshift.__version__, "torch": torch.__version__, "model": self.cfg.model.name,
                "model_config": self.cfg.model.config_dict(), "data": self.corpus.digest}

    def _mark_save_dir(self) -> str | None:
        """With --save, a token of this job written into the directory (`SAVE_MARKER`): a joiner on
        another host checks that its --save holds it, that is, that every host saves into the same
        directory (a checkpoint needs every worker's files in one place)."""
        if not self.cfg.save:
            return None
        token = uuid.uuid4().hex
        Path(self.cfg.save).mkdir(parents=True, exist_ok=True)
        (Path(self.cfg.save) / SAVE_MARKER).write_text(token)
        return token

    def enter_world(self, epoch: Epoch, trainer: Trainer | None) -> None:
        """Be in `epoch`'s world with `trainer` (None: this worker is not in it), its copies filled
        (a collective of the world). Every worker of a new world starts from the same measurements:
        those its epoch records. The caller arms the watch once the world is sure."""
        self.epoch = epoch
        self.step_times = {layout: [seconds] for layout, seconds in epoch.observed}
        self.steps_in_world = 0
        self.loop.trainer = trainer
        if trainer is not None:
            self._keep_copies(trainer.rank)

    def leave_world(self) -> Carried:
        """Leave this world's process groups; the state and the copies this worker held in it. (Its
        watch is the caller's: disarmed, or armed for the change it makes.)"""
        trainer, copies = self.trainer, self.copies
        trainer.release_runtime()
        self.loop.trainer = None
        self.copies = None
        self.metrics.close()
        self.loop.metrics = Metrics(None, 0)
        dist.destroy_process_group()
        forget_old_meshes()
        return Carried(trainer.state, copies)

    def abandon_world(self) -> None:
        """Drop whatever this worker built of a world that is not going to train (a change that
        failed): its trainer and copies, its default process group, its meshes."""
        self.loop.trainer = None
        self.copies = None
        if dist.is_initialized():
            dist.destroy_process_group()
        else:  # it may have failed halfway, having counted a group all the same
            membership.forget_group_names()
        forget_old_meshes()

    def opened(self, event: dict) -> None:
        """A new world is ready to train: its rank 0 records the change and says it in one line."""
        rank = self.trainer.rank
        self.loop.summary.changed(event["pause_seconds"])
        self.loop.metrics = Metrics.of(self.cfg, rank)
        if rank != 0:
            return
        self.store.set_current(self.epoch.number)
        event = {"event": "membership", "step": self.epoch.step, **event}
        self.metrics.write(event)
        lost = f"{event['steps_lost']} step(s) lost, from {event['checkpoint']}" if event["steps_lost"] else "no step lost"
        say(f"{event['kind']}: {event['from_world']} -> {event['to_world']} workers after step {event['step']}, "
            f"{event['from']} -> {event['to']}: paused {event['pause_seconds']:.2f} s, moved "
            f"{event['bytes_moved']:,} bytes, {lost}")

    def _keep_copies(self, rank: int) -> None:
        """With --redundancy: decide the copies of this world and fill them (a collective)."""
        if not self.ecfg.redundancy:
            return
        trainer = self.trainer
        space = state_space(trainer.cfg.model, trainer.cfg.param_dtype)
        duties = copy_duties(space, trainer.assignment, self.ecfg.redundancy, self.hosts(self.epoch))
        self.copies = Copies(trainer.state, space, trainer.assignment, duties, rank, dist.group.WORLD, self.timeout_s)
        self.copies.fill()

    def trees(self, epoch: Epoch):
        """With ``--collectives trees``: the ShardShiftOptions of `epoch`'s world, packed on the part
        of ``--topology`` its workers' hosts see (`collectives.topology.spec.hosts_topology`); else
        None."""
        if self.cfg.collectives != "trees":
            return None
        from shardshift.collectives.topology.spec import hosts_topology

        topology = hosts_topology(self.cfg.topology, self.hosts(epoch), "--topology")
        return tree_options(self.cfg, self.timeout_s, topology)

    def hosts(self, epoch: Epoch) -> list[str]:
        """The host of each rank of `epoch`'s world (every worker publishes its own before it enters
        a world, and never changes it: every worker reads the same)."""
        return [self.store.host(m) for m in epoch.members]

    # ---- the layout policy's calibration -----------------------------------------------------------

    def observe(self, seconds: float) -> None:
        if self.steps_in_world:
            self.step_times.setdefault(self.trainer.cfg.layout, []).append(seconds)
        self.steps_in_world += 1

    def observed(self) -> Observed:
        """Per layout the job ran under, the median of its measured steps (sorted by layout)."""
        return tuple(sorted(((layout, statistics.median(times)) for layout, times in self.step_times.items() if times),
                            key=lambda item: str(item[0])))

    # ---- training --------------------------------------------------------------------------------

    def run(self, hooks: Sequence[Hook]) -> int:
        """Train to the end with `hooks`, changing worlds on the way; the exit status (0: done, or
        left)."""
        self.loop.hooks = tuple(hooks)
        self.lookout = Lookout(JobStore.connect(self.store.address, self.timeout_s), self.member, self.ecfg,
                               lambda: bool(self.signals.received), self._foresee)
        self.lookout.start()
        self.watch.keep_store_clients()  # the lookout's among them
        try:
            self.loop.run()
            return 0
        finally:
            # The signal handlers stay to the end of the process (`_finish`): a stop signal that
            # comes late must not cut the clean-up short.
            self.lookout.close()
            self.watch.close()
            self.metrics.close()

    def _foresee(self, world: World, leaving: frozenset[int], joiners: tuple[int, ...]) -> None:
        """The lookout saw a change coming: plan it in the background."""
        request = Request("leave" if leaving else "join", world.step - 1, world.epoch.admitted, leaving=leaving,
                          joiners=joiners, observed=world.observed)
        self.prepare(world.epoch, request)

    def prepare(self, old: Epoch, request: Request) -> None:
        """Start working out the plan of `request` on `old` and this worker's program of it, in the
        background (`ahead.Ahead`): the same work, keyed alike, as the boundary's."""
        placement = Placement.of(self.cfg, self.ecfg, old, request)
        budget, process = self.cfg.switch_budget, placement.union.index(self.member)
        self.ahead.start(placement, placement.plan)
        self.ahead.start((placement, process, budget),
                         lambda: placement.program(self.ahead.get(placement, placement.plan), process, budget))
