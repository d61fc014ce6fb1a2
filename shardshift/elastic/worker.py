"""One worker of an elastic run: train in the current world, and at each step boundary agree with
the others whether the world changes; if it does, move the state into the next world in the
running processes (`train.switch.switch_world`) and go on.

After every step the world's ranks exchange one small all-reduce (`_Control`): the signal the
coordinator passed on (the job stops), the joiners rank 0 found ready in the store, and which
ranks got a signal of their own (a leave on notice: SIGTERM, SIGINT or SIGHUP to one worker).
Every rank then computes the same next world (`plan_change`): the workers that stay, in the
order of the old world, then the joiners; its layout (`--layout-for`, or the policy of
`config.layout_for`); and the plan that places it (`reshard.plan`, keeping the most bytes where
they are), which the worker has usually worked out while the step ran (`lookout`, `ahead`). The
move itself:

1. the old world's workers and the joiners build the move group (``epoch{e}/move``);
2. the old world's workers leave its process groups; the new world's workers form the next one
   (``epoch{e}/world``) and build its meshes;
3. the state moves over the move group, straight from the workers that hold each piece to those
   that need it; a leaving worker sends its pieces and exits 0.

A world smaller than ``--min-nproc`` is not built: the job stops as for a signal (it saves with
``--save``).

A crash (a worker gone without notice, at any moment) is survived so:

- **Nobody keeps a half-applied update.** Before the optimizer steps, every worker votes in the
  store (`_commit`: one counter per step). A step is applied only once all of the world voted;
  a worker that finds a loss reported before that aborts the step (`StepAborted`), and since the
  count is final once the dead worker is gone, every survivor decides alike. All of a step's
  collectives come before the vote, so a survivor whose collective broke has not applied it either.
- **Everyone plans from the same loss.** The coordinator writes the crashed workers of the
  current world to ``crash/{epoch}`` once (`coordinator._Crashes`); a survivor whose collective
  broke, or whose vote stalls, waits for that record (up to the timeout; otherwise the error
  stands).
- **Each piece comes from a copy.** The survivors form the next world and move the state as for a
  leave, every piece the lost worker held taken from a replica (``reshard.plan``'s ``lost``). A
  piece with no surviving copy sends the survivors to the newest checkpoint of ``--save``
  instead: they form their world, load it, and report the steps lost. Fewer survivors than
  ``--min-nproc``, or no copy and no checkpoint, stop the job with that message (`WorldLost`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardshift.console import say
from shardshift.elastic import membership
from shardshift.elastic.ahead import Ahead
from shardshift.elastic.config import ElasticConfig, Observed, layout_for
from shardshift.elastic.lookout import Lookout, World
from shardshift.elastic.membership import Epoch
from shardshift.elastic.redundancy import Copies, Duty, copy_duties, plan_copies
from shardshift.layout import Layout
from shardshift.models.space import state_space
from shardshift.models.spec import ModelSpec
from shardshift.reshard.execute import SwitchProgram, compile_program
from shardshift.reshard.plan import Assignment, TransitionPlan, plan_transition
from shardshift.reshard.schedule import build_schedule
from shardshift.runtime import process_from_env
from shardshift.train import checkpoint
from shardshift.train.catalog import checkpoints
from shardshift.train.config import TrainConfig
from shardshift.train.data import load_tokens
from shardshift.train.parallelize import build_parallel, forget_old_meshes
from shardshift.train.run import (
    Metrics,
    RunFailed,
    Signals,
    Stopped,
    Summary,
    exit_status,
    report_step,
    resume_point,
)
from shardshift.train.state import LostState
from shardshift.train.switch import switch_world, warm_up
from shardshift.train.trainer import Diverged, StepAborted, Trainer


class WorldLost(RunFailed):
    """Workers were lost and the job cannot go on in the running processes."""

    def __init__(self, what: str, save: str | None) -> None:
        where = f"resume with --resume {save}" if save else "start again (give --save to have checkpoints)"
        super().__init__(f"{what}: the job stops; {where}")


@dataclasses.dataclass(frozen=True)
class _Control:
    """What the ranks agreed after a step."""

    stop: int  # the signal the coordinator passed on (0: none)
    joins: int  # joiners to admit now
    step_seconds: float  # the step just taken, on the slowest rank
    leaving: tuple[int, ...]  # ranks that leave on notice
    noticed_at: float  # on this rank: when its own signal arrived (0: none)


@dataclasses.dataclass(frozen=True)
class _Placement:
    """Everything the plan of a change depends on: the key of the work done for it `Ahead`."""

    model: ModelSpec
    dtype: torch.dtype  # the parameters'
    layout: Layout  # the new world's
    old_members: tuple[int, ...]
    old_layout: Layout
    old_ranks: tuple[int, ...]
    leaving: frozenset[int]
    joiners: tuple[int, ...]  # sorted
    lost: frozenset[int]
    copies: tuple[Duty, ...]

    @property
    def union(self) -> tuple[int, ...]:
        """The plan's processes: the workers that stay (old rank order), the joiners, then the lost,
        so that the move group's ranks are the plan's first processes."""
        return (tuple(m for m in self.old_members if m not in self.lost) + self.joiners
                + tuple(m for m in self.old_members if m in self.lost))

    def plan(self) -> TransitionPlan:
        union = self.union
        where = {m: u for u, m in enumerate(union)}
        members = [u for u, m in enumerate(union) if m not in self.leaving and m not in self.lost]
        space = state_space(self.model, self.dtype)
        old = Assignment(self.old_layout, tuple(where[self.old_members[r]] for r in self.old_ranks), len(union))
        copies = plan_copies(space, self.copies, lambda rank: where[self.old_members[rank]])
        return plan_transition(space, old, self.layout, members=members, lost=[where[m] for m in self.lost],
                               copies=copies)

    def program(self, plan: TransitionPlan, process: int, budget: int) -> SwitchProgram:
        """Process `process`'s part of the plan's schedule."""
        return compile_program(build_schedule(plan, budget), process)


@dataclasses.dataclass(frozen=True)
class _Change:
    """A change of world, as every worker of the old and the new world computes it."""

    epoch: Epoch  # the new world
    placement: _Placement
    plan: TransitionPlan  # over the union's processes (indices into `union`)
    cfg: TrainConfig  # the run's configuration under the new layout

    @property
    def union(self) -> tuple[int, ...]:
        """Worker ids: the old world's that live in rank order, the joiners, the lost."""
        return self.placement.union

    @property
    def old_layout(self) -> Layout:
        return self.placement.old_layout

    @property
    def movers(self) -> int:
        """The processes of the move group: the union but the crashed (the last of it, in no group)."""
        return len(self.union) - len(self.placement.lost)


def plan_change(cfg: TrainConfig, ecfg: ElasticConfig, old_members: tuple[int, ...], old_layout: Layout,
                old_ranks: tuple[int, ...], leaving: set[int], joiners: list[int], number: int, kind: str, step: int,
                admitted: int, lost: frozenset[int] = frozenset(), copies: tuple[Duty, ...] = (),
                observed: Observed = (), ahead: Ahead | None = None) -> _Change:
    """The next world and the plan that moves the state into it. Pure, and the same on every
    worker of the old and the new world: its inputs are in the epoch's record (`Epoch`).

    `old_members`: worker ids in the old world's rank order; `old_ranks`: the old world's rank at
    each coordinate of `old_layout`; `leaving`: worker ids that go on notice; `joiners`: ids that
    come; `lost`: ids that crashed (their pieces come from replicas, or from the `copies` the old
    world kept (`--redundancy`, by old rank); ValueError if one has none); `observed`: the job's
    measured steps, which the layout policy is calibrated on (`config.layout_for`). The plan is
    taken from `ahead` when it was worked out there."""
    placement = _placement(cfg, ecfg, old_members, old_layout, old_ranks, leaving, joiners, lost, copies, observed)
    plan = ahead.get(placement, placement.plan) if ahead is not None else placement.plan()
    epoch = Epoch(number, tuple(placement.union[u] for u in plan.new.ranks), placement.layout, step, kind, admitted,
                  previous=tuple(old_members), previous_layout=old_layout, previous_ranks=tuple(old_ranks),
                  observed=observed)
    return _Change(epoch, placement, plan, cfg.with_layout(placement.layout))


def _placement(cfg: TrainConfig, ecfg: ElasticConfig, old_members, old_layout: Layout, old_ranks, leaving, joiners,
               lost=frozenset(), copies=(), observed: Observed = ()) -> _Placement:
    """A change's inputs (as `plan_change` takes them), with the new world's layout chosen."""
    staying = [m for m in old_members if m not in leaving and m not in lost]
    layout = layout_for(len(staying) + len(joiners), ecfg, cfg, observed)
    return _Placement(cfg.model, cfg.param_dtype, layout, tuple(old_members), old_layout, tuple(old_ranks),
                      frozenset(leaving), tuple(sorted(joiners)), frozenset(lost), tuple(copies))


class ElasticWorker:
    """A worker of an elastic run, in a world (`trainer` set) or about to join one."""

    def __init__(self, cfg: TrainConfig, ecfg: ElasticConfig, store: dist.Store, member: int, timeout_s: float):
        self.cfg, self.ecfg, self.store, self.member, self.timeout_s = cfg, ecfg, store, member, timeout_s
        self.tokens = load_tokens(cfg.data)
        # The state moves between worlds over gloo groups built by hand (`membership.move_group`),
        # which take CPU tensors: an elastic job runs on the CPU, its worlds on gloo (the command
        # line refuses --device cuda).
        self.device_type = "cpu"
        self.trainer: Trainer | None = None
        self.epoch: Epoch | None = None
        self.metrics: Metrics | None = None
        self.signals = Signals()
        self.summary = Summary(cfg, change="change of world")  # from this worker's first step
        self.ahead = Ahead()  # changes worked out before they happen
        self.lookout: Lookout | None = None  # while it trains: what it sees coming goes to `ahead`
        self.copies: Copies | None = None  # --redundancy: the copies this worker keeps and feeds
        # The job's measured step times (the slowest rank's), by layout, the same on every worker of
        # the world: the layout policy's calibration (`_observed`). A world's first step is left
        # out (it pays for warming up); a new world starts from what its epoch was chosen by.
        self.step_times: dict[Layout, list[float]] = {}
        self.steps_in_world = 0

    # ---- starting ------------------------------------------------------------------------------

    def start_first_world(self) -> None:
        """Join the first world as the launcher numbered this worker; resume if asked."""
        proc = process_from_env()
        cfg = self.cfg
        cfg.layout.check_world(proc.world_size)
        epoch = Epoch(0, tuple(range(proc.world_size)), cfg.layout, 0)
        membership.init_world(self.store, epoch, proc.rank, self.timeout_s, "gloo")
        resume = resume_point(cfg, self.tokens, proc.rank) if (cfg.resume or cfg.save) else None
        self.trainer = Trainer(cfg, proc.rank, self.device_type, tokens=self.tokens, timeout_s=self.timeout_s)
        self.metrics = Metrics(cfg.metrics, proc.rank)
        if resume is not None:
            checkpoint.load(self.trainer, resume)
            self.metrics.write({"event": "resume", "step": self.trainer.progress.step, "checkpoint": str(resume),
                                "layout": str(cfg.layout)})
        self.epoch = dataclasses.replace(epoch, step=self.trainer.progress.step)
        self._keep_copies(proc.rank)
        warm_up(cfg, self.trainer.par)  # a change's first model build, done now and not in its pause
        self.store.set(f"pid/{os.getpid()}", str(self.member))  # the coordinator names a crashed worker by it
        if proc.rank == 0:
            self.store.set("epoch/0", self.epoch.to_json())
            self.store.set("epoch/current", "0")
            say(f"training {cfg.model.name} ({cfg.model.num_params():,} parameters) elastically under {cfg.layout} "
                f"on {proc.world_size} {self.device_type} workers ({self.ecfg.min_nproc}..{self.ecfg.max_nproc}), "
                f"{cfg.dtype}")

    def join(self, registered=lambda member: None) -> bool:
        """Say this worker is ready, wait to be admitted, then move into that world; False if the
        job stopped or ended first. Its id follows the first world's: its place in the queue;
        `registered(id)` is called once it has one."""
        warm_up(self.cfg, None, self.device_type)  # before it says it is ready: not in anyone's pause
        index = membership.register_joiner(self.store)
        self.member = int(self.store.get("config/nproc")) + index
        self.store.set(f"pid/{os.getpid()}", str(self.member))
        registered(self.member)
        ready_at = time.monotonic()
        foreseen = []  # the world this worker last worked out its admission into
        epoch = membership.wait_for_admission(self.store, index, lambda: self._foresee_admission(index, foreseen))
        if epoch is None:
            return False
        waited = time.monotonic() - ready_at
        change = plan_change(self.cfg, self.ecfg, epoch.previous, epoch.previous_layout, epoch.previous_ranks,
                             set(epoch.previous) - set(epoch.members),
                             [m for m in epoch.members if m not in epoch.previous], epoch.number, epoch.kind,
                             epoch.step, epoch.admitted, observed=epoch.observed, ahead=self.ahead)
        assert change.epoch == epoch, (change.epoch, epoch)
        self._move(change, time.monotonic(), detect_s=waited)
        return True

    def _foresee_admission(self, index: int, foreseen: list[int]) -> None:
        """While joiner `index` waits: plan ahead its admission into the world that runs now, with
        the joiners the next boundary will admit (counted as the boundary counts them: a scripted
        join's number of them, otherwise as many as fit); again whenever that world or the queue
        of ready joiners changes."""
        if not self.store.check(["epoch/current"]):
            return
        current, ready = int(self.store.get("epoch/current")), membership.ready_joiners(self.store)
        if foreseen == [current, ready]:
            return
        foreseen[:] = [current, ready]
        epoch = Epoch.from_json(self.store.get(f"epoch/{current}"))
        coming = min((i for i in self.ecfg.injects if i.kind == "join" and i.step > epoch.step),
                     key=lambda i: i.step, default=None)  # the next scripted join, if any
        places = membership.live_joiners(self.store, epoch.admitted)[:self.ecfg.admits(epoch.world_size, coming)]
        if index in places:
            first = int(self.store.get("config/nproc"))
            self._prepare(_placement(self.cfg, self.ecfg, epoch.members, epoch.layout,
                                     tuple(range(epoch.world_size)), set(), [first + i for i in places],
                                     observed=epoch.observed))

    def _foresee(self, world: World, leaving: frozenset[int], joiners: tuple[int, ...]) -> None:
        """The lookout saw a change coming: plan it (`_prepare`)."""
        self._prepare(_placement(self.cfg, self.ecfg, world.epoch.members, world.layout, world.ranks, leaving,
                                 list(joiners), observed=world.observed))

    def _prepare(self, placement: _Placement) -> None:
        """Start working out `placement`'s plan and this worker's program of it (`ahead`)."""
        budget, process = self.cfg.switch_budget, placement.union.index(self.member)
        self.ahead.start(placement, placement.plan)
        self.ahead.start((placement, process, budget),
                         lambda: placement.program(self.ahead.get(placement, placement.plan), process, budget))

    # ---- training --------------------------------------------------------------------------------

    def run(self) -> int:
        """Train to the end, changing worlds on the way; the exit status (0: done, or left)."""
        address = f"{self.store.host}:{self.store.port}"
        self.lookout = Lookout(membership.connect(address, self.timeout_s), self.member, self.ecfg,
                               lambda: bool(self.signals.received), self._foresee)
        self.lookout.start()
        try:
            while self.trainer is not None and self.trainer.progress.step < self.cfg.stop_at:
                trainer = self.trainer
                rank = dist.get_rank()
                self.lookout.world = World(self.epoch, trainer.cfg.layout, tuple(trainer.par.ranks),
                                           self._observed(), trainer.progress.step + 1)
                try:
                    result = trainer.train_step(commit=self._commit,
                                                applied=self.copies.step if self.copies is not None else None)
                    self.summary.stepped(result)
                    if rank == 0:
                        report_step(trainer.cfg, result, self.metrics)
                    control = self._control(trainer.progress.step, rank, result.step_time_s)
                    self._observe(control.step_seconds)
                except (RuntimeError, StepAborted) as err:  # a collective broke, or the vote failed
                    if isinstance(err, (Diverged, LostState)):
                        raise
                    self._recover(err)
                    continue
                cfg = self.cfg
                staying = self.epoch.world_size - len(control.leaving)
                joins = control.joins
                too_few = staying + joins < self.ecfg.min_nproc
                stop = control.stop or (signal.SIGTERM if too_few else 0)
                step = trainer.progress.step
                if cfg.save and (stop or (cfg.save_every and step % cfg.save_every == 0) or step == cfg.stop_at):
                    path = checkpoint.save(trainer, cfg.save, keep=cfg.keep_checkpoints)
                    if rank == 0:
                        say(f"saved {path}")
                if stop:
                    if rank == 0:
                        self.store.set("stopped", str(stop))  # the coordinator: exits now are not crashes
                    if too_few and rank == 0:
                        say(f"shardshift: {len(control.leaving)} worker(s) leaving would leave {staying + joins}, "
                            f"fewer than --min-nproc {self.ecfg.min_nproc}: stopping the job", "stderr")
                    if rank == 0:
                        saved = f"; resume with --resume {cfg.save}" if cfg.save else " (no --save: nothing was saved)"
                        say(f"shardshift: stopped by signal {stop} after step {step}{saved}", "stderr")
                    raise Stopped(stop)
                if control.leaving or joins:
                    self._change(control, step, joins)
            if self.trainer is not None and dist.get_rank() == 0:
                self.summary.report(self.trainer, self.metrics)
                self.store.set("done", "1")
            return 0
        finally:
            # The signal handlers stay to the end of the process (`_finish`): a stop signal that
            # comes late must not cut the clean-up short.
            self.lookout.close()
            if self.metrics is not None:
                self.metrics.close()

    def _commit(self, step: int) -> bool:
        """The vote before the optimizer steps: True once every worker of this world has its
        gradients for `step`; False when the coordinator reports a worker of this world lost
        before all had voted. Every survivor decides alike: the count a lost worker left behind
        is final once its loss is reported. Scripted kills and leaves strike here, inside the step
        (a leave is a real SIGTERM, handled as any notice: the worker leaves at this step's end)."""
        inject = self._inject(step, "kill")
        if inject is not None and dist.get_rank() in inject.ranks:
            os.kill(os.getpid(), signal.SIGKILL)
        inject = self._inject(step, "leave")
        if inject is not None and dist.get_rank() in inject.ranks:
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 5.0
            while not self.signals.received and time.monotonic() < deadline:
                time.sleep(0.001)
        if self.copies is not None:
            self.copies.send_gradients()  # a worker lost meanwhile breaks it: the step is not voted
        epoch, key = self.epoch, f"commit/{self.epoch.number}/{step}"
        if self.store.add(key, 1) == epoch.world_size:
            self.store.set(f"{key}/all", "1")
            return True
        crash = f"crash/{epoch.number}"
        while not self.store.check([f"{key}/all"]):
            if self.store.check([crash]):
                return self.store.add(key, 0) == epoch.world_size
            time.sleep(0.002)
        return True

    def _inject(self, step: int, kind: str):
        """This step's scripted event of `kind`, if it has not happened yet: a step that runs again
        after a crash does not repeat it (the store counts each event once per rank acting on it)."""
        inject = self.ecfg.inject_at(step)
        if inject is None or inject.kind != kind:
            return None
        done = f"inject/{inject}/epoch"
        first = self.store.compare_set(done, "", str(self.epoch.number)).decode()
        return inject if first == str(self.epoch.number) else None

    def _recover(self, err: Exception) -> None:
        """A worker of this world crashed (or `err` is not about that: it is raised again once the
        coordinator has not reported a loss within the timeout). The survivors agree on who is
        lost (the coordinator's record), and move the state into a world of the survivors, each
        piece from a surviving copy; without one, from the newest checkpoint."""
        noticed = time.monotonic()
        self.lookout.world = None
        epoch, key = self.epoch, f"crash/{self.epoch.number}"
        while not self.store.check([key]):
            if time.monotonic() - noticed > self.timeout_s:
                raise err
            time.sleep(0.01)
        record = json.loads(self.store.get(key))
        lost = frozenset(record["lost"])
        if self.member in lost:  # silent too long (frozen, cut off): the others went on without it
            raise RunFailed(f"this worker (id {self.member}) was taken for lost after step "
                            f"{self.trainer.progress.step}, and the others went on without it; it exits")
        detect = max(0.0, time.time() - record["seen"])
        trainer = self.trainer
        trainer.optimizer.zero_grad(set_to_none=True)
        survivors = [m for m in epoch.members if m not in lost]
        if len(survivors) < self.ecfg.min_nproc:
            raise WorldLost(f"workers {sorted(lost)} were lost after step {trainer.progress.step}, leaving "
                            f"{len(survivors)}, fewer than --min-nproc {self.ecfg.min_nproc}", self.cfg.save)
        duties = self.copies.duties if self.copies is not None else ()
        try:
            change = plan_change(self.cfg, self.ecfg, epoch.members, trainer.cfg.layout, trainer.par.ranks, set(), [],
                                 epoch.number + 1, "crash", trainer.progress.step, epoch.admitted, lost, duties,
                                 self._observed(), ahead=self.ahead)
        except ValueError as no_copy:
            self._restart_from_checkpoint(survivors, lost, no_copy, noticed, detect)
            return
        if dist.get_rank() == min(epoch.members.index(m) for m in survivors):
            membership.announce(self.store, change.epoch, range(0))
        used_copies = any(seg.copy_of is not None for seg in change.plan.segments)
        self._move(change, noticed, detect_s=detect, recovered_from="redundancy" if used_copies else "replica")

    def _restart_from_checkpoint(self, survivors: list[int], lost: frozenset[int], why: ValueError, noticed: float,
                                 detect: float) -> None:
        """No surviving copy of some piece: the survivors form their world and load the newest
        checkpoint of `--save` (the steps since it are lost, and run again)."""
        trainer, epoch, cfg = self.trainer, self.epoch, self.cfg
        newest = checkpoints(Path(cfg.save)) if cfg.save else []
        if not newest:
            beyond = (f" (more workers failed at once than --redundancy {self.ecfg.redundancy} covers)"
                      if self.ecfg.redundancy else "")
            raise WorldLost(f"workers {sorted(lost)} were lost after step {trainer.progress.step} and {why}{beyond}; "
                            "there is no checkpoint either (give --save)", None)
        layout = layout_for(len(survivors), self.ecfg, cfg, self._observed())
        new_cfg = cfg.with_layout(layout)
        step_before = trainer.progress.step
        next_epoch = Epoch(epoch.number + 1, tuple(survivors), layout, step_before, "crash", epoch.admitted,
                           previous=epoch.members, previous_layout=trainer.cfg.layout,
                           previous_ranks=tuple(trainer.par.ranks), observed=self._observed())
        trainer.release_runtime()
        self.trainer = trainer = self.copies = None
        if self.metrics is not None:
            self.metrics.close()
        dist.destroy_process_group()
        forget_old_meshes()
        rank = survivors.index(self.member)
        if rank == 0:
            membership.announce(self.store, next_epoch, range(0))
        membership.init_world(self.store, next_epoch, rank, self.timeout_s, "gloo")
        self.cfg = new_cfg
        self.trainer = Trainer(new_cfg, rank, self.device_type, tokens=self.tokens, timeout_s=self.timeout_s)
        checkpoint.load(self.trainer, newest[0])
        self._new_world(dataclasses.replace(next_epoch, step=self.trainer.progress.step))
        self._keep_copies(rank)
        pause = _worst(dist.group.WORLD, [time.monotonic() - noticed, detect])
        self._opened(rank, {"kind": "crash", "from_world": epoch.world_size, "to_world": len(survivors),
                            "from": str(next_epoch.previous_layout), "to": str(layout), "detect_seconds": pause[1],
                            "pause_seconds": pause[0], "bytes_moved": 0,
                            "steps_lost": step_before - self.trainer.progress.step,
                            "recovered_from": "checkpoint", "checkpoint": str(newest[0])})

    def _control(self, step: int, rank: int, step_seconds: float) -> _Control:
        """The after-step exchange (module docstring)."""
        n = self.epoch.world_size
        vector = torch.zeros(3 + n, dtype=torch.int64)
        if rank == 0:
            vector[0] = membership.read_int(self.store, "stop")
            vector[1] = self._joins_now(self._inject(step, "join"), step)
        vector[2] = round(step_seconds * 1e6)
        if self.signals.received:
            vector[3 + rank] = 1
        device = self.trainer.par.device
        vector = vector.to(device)
        dist.all_reduce(vector, op=dist.ReduceOp.MAX)
        values = vector.tolist()
        leaving = tuple(r for r in range(n) if values[3 + r])
        return _Control(values[0], values[1], values[2] / 1e6, leaving, self.signals.received_at)

    def _joins_now(self, inject, step: int) -> int:
        """Rank 0: how many joiners to admit at this boundary, their queue places written to
        ``admit/{epoch}/{step}`` for the others (as many as `config.ElasticConfig.admits`). A
        scripted join first waits while a joiner the coordinator started is still getting ready, up
        to half of --timeout, since the others wait in a collective; then those that are ready go
        in. A joiner that died before it was admitted is passed over."""
        if inject is not None:  # a scripted join
            # The others wait in the after-step all-reduce meanwhile, up to --timeout: give up well before.
            wait_s = self.timeout_s / 2
            deadline = time.monotonic() + wait_s
            while len(live := self._live_joiners()) < inject.count and self._joiners_preparing():
                if time.monotonic() > deadline:  # a joiner stuck getting ready does not stop the job
                    say(f"shardshift: {len(live)} of the {inject.count} worker(s) to join after step {inject.step} "
                        f"were ready within {wait_s:g} s (half of --timeout); the job goes on with them", "stderr")
                    break
                time.sleep(0.01)
        chosen = self._live_joiners()[:self.ecfg.admits(self.epoch.world_size, inject)]
        if chosen:
            self.store.set(f"admit/{self.epoch.number}/{step}", json.dumps(chosen))
        return len(chosen)

    def _live_joiners(self) -> list[int]:
        return membership.live_joiners(self.store, self.epoch.admitted)

    def _joiners_preparing(self) -> bool:
        """Whether a joiner the coordinator started is neither ready nor dead yet."""
        started = membership.read_int(self.store, "spawn/started")
        gone_before_ready = membership.read_int(self.store, "join/dead-before-ready")
        return membership.ready_joiners(self.store) + gone_before_ready < started

    # ---- changing worlds -------------------------------------------------------------------------

    def _change(self, control: _Control, step: int, joins: int) -> None:
        decided_at = time.monotonic()
        self.lookout.world = None
        old, trainer = self.epoch, self.trainer
        places = json.loads(self.store.get(f"admit/{old.number}/{step}")) if joins else []
        first = int(self.store.get("config/nproc"))
        leaving = {old.members[r] for r in control.leaving}
        admitted = max(places) + 1 if places else old.admitted
        change = plan_change(self.cfg, self.ecfg, old.members, trainer.cfg.layout, trainer.par.ranks, leaving,
                             [first + i for i in places], old.number + 1, "leave" if leaving else "join",
                             trainer.progress.step, admitted, observed=self._observed(), ahead=self.ahead)
        if dist.get_rank() == 0:
            membership.announce(self.store, change.epoch, places)
        detect = decided_at - control.noticed_at if control.noticed_at else 0.0
        self._move(change, decided_at, detect_s=detect)

    def _move(self, change: _Change, started_at: float, detect_s: float, recovered_from: str = "none") -> None:
        """Move this worker's state (if any) into the new world (if it is in it). The event's
        ``phases`` break the pause down (seconds, the slowest worker's each: `PHASES`)."""
        clock = _Phases(started_at)
        process = change.union.index(self.member)
        group = membership.move_group(self.store, change.epoch, process, change.movers, self.timeout_s)
        clock.lap("move_group")
        self._act_while_moving(change)
        old_state, copies = None, None
        if self.copies is not None:
            kept, previous = self.copies, change.epoch.previous
            copies = lambda of, key: kept.piece(previous.index(change.union[of]), key)  # noqa: E731
        if self.trainer is not None:
            old_state = self.trainer.state
            self.trainer.release_runtime()
            self.trainer = None
            if self.metrics is not None:
                self.metrics.close()
                self.metrics = None
            dist.destroy_process_group()
            forget_old_meshes()
        clock.lap("leave_old_world")
        new_par, rank = None, None
        if process in change.plan.new.ranks:
            rank = change.plan.new.ranks.index(process)
            membership.init_world(self.store, change.epoch, rank, self.timeout_s, "gloo")
            clock.lap("new_world")
            new_par = build_parallel(change.epoch.layout, rank, self.device_type)
            clock.lap("meshes")
        budget = self.cfg.switch_budget
        key = (change.placement, process, budget)
        ahead = key in self.ahead
        program = self.ahead.get(key, lambda: change.placement.program(change.plan, process, budget))
        self.ahead.forget()
        clock.lap("program")
        state, stats = switch_world(old_state, change.plan, program, change.cfg, new_par, group, self.timeout_s,
                                    copies)
        clock.lap("model_and_transfer")
        clock.times["transfer"] = stats.seconds
        clock.times["model_and_transfer"] -= stats.seconds
        del old_state, copies
        self.copies = None
        self._new_world(change.epoch)
        if state is not None:
            self.cfg = change.cfg
            self.trainer = Trainer(change.cfg, rank, self.device_type, tokens=self.tokens, timeout_s=self.timeout_s,
                                   state=state)
            clock.lap("trainer")
            self._keep_copies(rank)
            clock.lap("copies")
        # The slowest worker's figures; also, nobody leaves before every worker has arrived here.
        worst = _worst(group, [time.monotonic() - started_at, detect_s, 0.0 if ahead else 1.0, *clock.values()])
        del group
        if state is None:
            say(f"shardshift: worker {self.member} left after step {change.epoch.step}, its state moved to the "
                f"{change.epoch.world_size} remaining", "stderr")
            return
        self._opened(rank, {"kind": change.epoch.kind, "from_world": len(change.epoch.previous),
                            "to_world": change.epoch.world_size, "from": str(change.old_layout),
                            "to": str(change.epoch.layout), "detect_seconds": worst[1], "pause_seconds": worst[0],
                            "bytes_moved": change.plan.bytes_moved, "steps_lost": 0, "recovered_from": recovered_from,
                            "planned_ahead": worst[2] == 0.0, "phases": dict(zip(PHASES, worst[3:]))})

    def _act_while_moving(self, change: _Change) -> None:
        """Scripted events while the state moves, each once: ``term``, a real SIGTERM to those ranks
        of the old world (the handler only notes it: the move completes, and the worker leaves at
        the next step boundary); ``movekill``, a real SIGKILL to those processes of the move (the
        old world's workers that live in rank order, then the joiners: `_Change.union`)."""
        epoch, process = change.epoch, change.union.index(self.member)
        rank = epoch.previous.index(self.member) if self.member in epoch.previous else None
        for inject in self.ecfg.injects:
            if inject.step > epoch.step:
                continue
            if inject.kind == "term" and rank in inject.ranks:
                who, sig = f"rank{rank}", signal.SIGTERM
            elif inject.kind == "movekill" and process in inject.ranks:
                who, sig = f"process{process}", signal.SIGKILL
            else:
                continue
            if self.store.add(f"inject/{inject}/fired/{who}", 1) == 1:  # the first change after its step only
                os.kill(os.getpid(), sig)

    def _observe(self, seconds: float) -> None:
        if self.steps_in_world:
            self.step_times.setdefault(self.trainer.cfg.layout, []).append(seconds)
        self.steps_in_world += 1

    def _observed(self) -> Observed:
        """Per layout the job ran under, the median of its measured steps (sorted by layout)."""
        return tuple(sorted(((layout, statistics.median(times)) for layout, times in self.step_times.items() if times),
                            key=lambda item: str(item[0])))

    def _new_world(self, epoch: Epoch) -> None:
        """Every worker of a new world starts from the same measurements: those its epoch records."""
        self.epoch = epoch
        self.step_times = {layout: [seconds] for layout, seconds in epoch.observed}
        self.steps_in_world = 0

    def _keep_copies(self, rank: int) -> None:
        """With --redundancy: decide the copies of this world and fill them (a collective)."""
        if not self.ecfg.redundancy:
            return
        trainer = self.trainer
        space = state_space(trainer.cfg.model, trainer.cfg.param_dtype)
        duties = copy_duties(space, trainer.assignment, self.ecfg.redundancy)
        self.copies = Copies(trainer.state, space, trainer.assignment, duties, rank, dist.group.WORLD, self.timeout_s)
        self.copies.fill()

    def _opened(self, rank: int, event: dict) -> None:
        """A new world is ready to train: its rank 0 records the change and says it in one line."""
        self.summary.changed(event["pause_seconds"])
        self.metrics = Metrics(self.cfg.metrics, rank)
        if rank != 0:
            return
        self.store.set("epoch/current", str(self.epoch.number))
        event = {"event": "membership", "step": self.epoch.step, **event}
        self.metrics.write(event)
        lost = f"{event['steps_lost']} step(s) lost, from {event['checkpoint']}" if event["steps_lost"] else "no step lost"
        say(f"{event['kind']}: {event['from_world']} -> {event['to_world']} workers after step {event['step']}, "
            f"{event['from']} -> {event['to']}: paused {event['pause_seconds']:.2f} s, moved "
            f"{event['bytes_moved']:,} bytes, {lost}")


PHASES = ("move_group", "leave_old_world", "new_world", "meshes", "program", "model_and_transfer", "transfer",
          "trainer", "copies")
"""The parts of a change's pause: building the move group; leaving the old world's groups; joining
the new world's default group; its meshes; this worker's program of the transfers (next to nothing
when it was worked out ahead); the new model's structure and optimizer (without the transfer); the
transfer itself; the trainer around the new state; filling the copies (`--redundancy`). A phase a
worker has no part in counts 0 for it."""


class _Phases:
    def __init__(self, start: float):
        self.last, self.times = start, {}

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.times[name] = now - self.last
        self.last = now

    def values(self) -> list[float]:
        return [self.times.get(name, 0.0) for name in PHASES]


def _worst(group, values: list[float]) -> list[float]:
    """The largest of each value over `group` (a collective; any group with torch's methods)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MAX
    group.allreduce([tensor], options).wait()
    return tensor.tolist()


def member_main(cfg: TrainConfig, ecfg: ElasticConfig, timeout_s: float) -> int:
    """A worker the coordinator started in the first world."""
    parent = os.getppid()
    address = os.environ[membership.COORDINATOR_ENV]
    store = membership.connect(address, timeout_s)
    worker = ElasticWorker(cfg, ecfg, store, int(os.environ[membership.MEMBER_ENV]), timeout_s)
    membership.start_heartbeat(address, worker.member, ecfg.heartbeat_interval_s, timeout_s)
    worker.start_first_world()
    return _finish(worker, parent)


def joiner_main(cfg: TrainConfig, ecfg: ElasticConfig, address: str, timeout_s: float) -> int:
    """A worker that joins the running job whose coordinator is at `address` (`shardshift join`)."""
    parent = os.getppid()
    store = membership.connect(address, timeout_s)
    worker = ElasticWorker(cfg, ecfg, store, -1, timeout_s)  # its id comes with its place in the queue
    if not worker.join(lambda member: membership.start_heartbeat(address, member, ecfg.heartbeat_interval_s,
                                                                 timeout_s)):
        worker.ahead.close()
        _remove_job_dir_if_orphaned(parent)
        say("shardshift: the job stopped or ended before this worker was admitted", "stderr")
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
    try:
        return exit_status(worker.run)
    finally:
        worker.ahead.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        _remove_job_dir_if_orphaned(parent)


def _remove_job_dir_if_orphaned(parent: int) -> None:
    """Remove the directory of the coordinator that started this worker, if it has died (a
    worker started by `shardshift join` from a shell has none)."""
    job_dir = os.environ.get(membership.JOB_DIR_ENV)
    if job_dir and os.getppid() != parent:
        shutil.rmtree(job_dir, ignore_errors=True)
