"""The one training loop: steps, and what happens at their boundaries, for fixed runs and elastic
workers alike.

A run is a `Loop` over a `Trainer` with a list of `Hook`s. What varies between runs is in the hooks
(a fixed run: `ScheduledSwitches`, `StopOnSignal`; an elastic worker adds its membership, its
commit vote and crash recovery: `shardshift.elastic.worker`); the loop itself is the same. Each
step, in order:

1. every hook's `before_step` (a scheduled layout switch happens here, before the step it names);
2. the step (`Trainer.train_step`): forward and backward, then every hook's `commit` vote (any False
   aborts the step before anything of the state changes; None leaves it pending, its gradients
   kept, for a hook to apply or drop once the boundary is agreed), the optimizer, every hook's
   `applied`;
3. rank 0 reports the step (the progress line and ``--metrics``);
4. the ranks agree on the boundary in one all-reduce (maximum) of what every hook `vote`s, and each
   hook reads the agreed values (`agreed`), which may ask to stop with a signal; unless stopping,
   the held-out loss when ``--eval-every`` has it due (every K steps and at `stop_at`);
5. a checkpoint when ``--save`` is given and the run stops, every ``--save-every`` steps, and at
   the last step;
6. when stopping: every hook's `stopping`, rank 0's one line saying how to resume, and `Stopped`;
7. every hook's `after_boundary` (a change of world happens here: it may replace the trainer, or
   set it to None when this process leaves).

A step or agreement that fails with a `RuntimeError` (a collective broke: a peer died) or a failed
vote (`StepAborted`) is offered to the hooks' `recover`; one that recovers (a new world of the
survivors) lets the loop go on from the same step. Divergence and a lost state are never
recovered. At `stop_at`, rank 0 says the run's summary, and every hook's `finished` runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist

from shardshift.console import say
from shardshift.train import checkpoint
from shardshift.train.config import TrainConfig
from shardshift.train.report import Metrics, Signals, Stopped, Summary, report_eval, report_step, report_switch
from shardshift.train.state import LostState
from shardshift.train.trainer import Diverged, StepAborted, StepResult, Trainer


class Hook:
    """Something a run does at its step boundaries (module docstring). Every method's default does
    nothing; `vote` must return as many values on every rank."""

    def before_step(self, loop: Loop) -> None:
        """Before the step `loop.trainer.progress.step + 1` runs."""

    def commit(self, loop: Loop, step: int) -> bool | None:
        """Whether `step`, its gradients and loss known, may be applied (every rank asks alike); None
        when that cannot be known yet: the step stays pending, and a hook applies or drops it at the
        boundary (`Loop.apply_pending`, `Trainer.drop_pending`)."""
        return True

    def applied(self, loop: Loop) -> None:
        """Once the optimizer has stepped, within the step's time."""

    def vote(self, loop: Loop, result: StepResult) -> list[int]:
        """This rank's values for the boundary's all-reduce (the maximum over ranks is agreed)."""
        return []

    def agreed(self, loop: Loop, values: list[int], result: StepResult) -> int:
        """The agreed values of this hook's `vote`; returns a signal to stop with (0: go on)."""
        return 0

    def stopping(self, loop: Loop, signum: int) -> None:
        """The run stops for `signum`, after the save."""

    def after_boundary(self, loop: Loop) -> None:
        """The boundary is agreed and nothing stops: act on it."""

    def recover(self, loop: Loop, err: Exception) -> bool:
        """A step or agreement failed with `err`: True once the run can go on (`loop.trainer`
        replaced), False to let the error stand."""
        return False

    def finished(self, loop: Loop) -> None:
        """The run reached `stop_at` (after rank 0's summary)."""


class Loop:
    """The training loop of one process (module docstring).

    `trainer` is the state it trains, replaced by a hook when the world changes and None once this
    process has left; `metrics` is rank 0's record of the run, which a hook may replace with the
    world's."""

    def __init__(self, cfg: TrainConfig, trainer: Trainer, metrics: Metrics, summary: Summary,
                 hooks: Sequence[Hook]) -> None:
        self.cfg = cfg  # the run's: its length, saving and stopping (the layout is the trainer's)
        self.trainer: Trainer | None = trainer
        self.metrics = metrics
        self.summary = summary
        self.hooks = tuple(hooks)

    @property
    def rank(self) -> int:
        return self.trainer.rank

    def run(self) -> None:
        """Train to `stop_at` (or until this process leaves); `Stopped` when the ranks agree to stop."""
        while self.trainer is not None and self.trainer.progress.step < self.cfg.stop_at:
            for hook in self.hooks:
                hook.before_step(self)
            try:
                result = self.trainer.train_step(commit=self._commit, applied=self._applied)
                self._report(result)
                stop = self._agree(result)
                if not stop:
                    self._evaluate_if_due()
            except (RuntimeError, StepAborted) as err:  # a collective broke, or the vote failed
                if isinstance(err, (Diverged, LostState)) or not any(h.recover(self, err) for h in self.hooks):
                    raise
                continue
            self._save_if_due(stop)
            if stop:
                for hook in self.hooks:
                    hook.stopping(self, stop)
                if self.rank == 0:
                    saved = f"; resume with --resume {self.cfg.save}" if self.cfg.save else " (no --save: nothing was saved)"
                    say(f"shardshift: stopped by signal {stop} after step {self.trainer.progress.step}{saved}",
                        "stderr")
                raise Stopped(stop)
            for hook in self.hooks:
                hook.after_boundary(self)
        if self.trainer is not None:
            if self.rank == 0:
                self.summary.report(self.trainer, self.metrics)
            for hook in self.hooks:
                hook.finished(self)

    def _report(self, result: StepResult) -> None:
        """A step applied, said by rank 0 (a pending one once a hook applies it: `apply_pending`)."""
        if not result.applied:
            return
        self.summary.stepped(result)
        if self.rank == 0:
            report_step(self.trainer.cfg, result, self.metrics)

    def apply_pending(self, result: StepResult) -> None:
        """Apply the step `result` left pending (its vote's outcome came late), and report it."""
        self.trainer.apply_pending()
        self._report(dataclasses.replace(result, applied=True))

    def _commit(self, step: int) -> bool | None:
        """Every hook's vote (each is asked, even after a False): False if any is, else None (the
        outcome unknown: the step stays pending) if any is, else True."""
        votes = [hook.commit(self, step) for hook in self.hooks]
        return False if False in votes else None if None in votes else True

    def _applied(self) -> None:
        for hook in self.hooks:
            hook.applied(self)

    def _agree(self, result: StepResult) -> int:
        """The boundary's one all-reduce: the hooks' votes, maxed over ranks; the signal to stop with."""
        votes = [hook.vote(self, result) for hook in self.hooks]
        flat = [value for vote in votes for value in vote]
        if flat:
            values = torch.tensor(flat, dtype=torch.int64, device=self.trainer.par.device)
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
            flat = values.tolist()
        stop, start = 0, 0
        for hook, vote in zip(self.hooks, votes):
            stop = max(stop, hook.agreed(self, flat[start:start + len(vote)], result))
            start += len(vote)
        return stop

    def _evaluate_if_due(self) -> None:
        every, step = self.cfg.eval_every, self.trainer.progress.step
        if every and (step % every == 0 or step == self.cfg.stop_at):
            loss = self.trainer.evaluate()
            self.summary.evaluated(loss)
            if self.rank == 0:
                report_eval(self.cfg, step, loss, self.metrics)

    def _save_if_due(self, stop: int) -> None:
        cfg, step = self.cfg, self.trainer.progress.step
        if cfg.save and (stop or (cfg.save_every and step % cfg.save_every == 0) or step == cfg.stop_at):
            path = checkpoint.save(self.trainer, cfg.save, keep=cfg.keep_checkpoints)
            if self.rank == 0:
                say(f"saved {path}")


class ScheduledSwitches(Hook):
    """``--switch STEP:LAYOUT``: switch the layout online before STEP. The next switch is prepared
    (planned, its meshes and storage-less model built) ahead of time, so that at its step only the
    state moves."""

    def __init__(self, cfg: TrainConfig, trainer: Trainer) -> None:
        self.pending = [(step, layout) for step, layout in cfg.switches if step > trainer.progress.step]
        self.budget = cfg.switch_budget
        self.prepared = self._prepare(trainer)

    def _prepare(self, trainer: Trainer):
        return trainer.prepare_switch(self.pending[0][1], self.budget) if self.pending else None

    def before_step(self, loop: Loop) -> None:
        if not self.pending or self.pending[0][0] != loop.trainer.progress.step + 1:
            return
        loop.summary.switching(loop.trainer)
        report = loop.trainer.switch(self.prepared)
        loop.summary.changed(report.seconds)
        if loop.rank == 0:
            report_switch(report, loop.metrics)
        self.pending.pop(0)
        self.prepared = self._prepare(loop.trainer)


class StopOnSignal(Hook):
    """A stop signal (SIGTERM, SIGINT, SIGHUP) to any rank stops the run at the next boundary, on
    every rank alike: the handler only records it; the boundary agrees on it."""

    def __init__(self, signals: Signals) -> None:
        self.signals = signals

    def vote(self, loop: Loop, result: StepResult) -> list[int]:
        return [self.signals.received]

    def agreed(self, loop: Loop, values: list[int], result: StepResult) -> int:
        return values[0]



class ProfileSteps(Hook):
    """``--profile A:B``: a torch profiler trace (CPU activities, and CUDA's on a GPU) of steps A to B,
    1-based and inclusive (what the boundaries between them do included), written by every rank as
    a Chrome trace, ``directory/profile-rank-N.json``, once step B is done, or when the run stops
    or reaches `stop_at` sooner. A resumed run past A traces from its first step."""

    def __init__(self, first: int, last: int, directory: str) -> None:
        self.first, self.last, self.directory = first, last, directory
        self.profiler: torch.profiler.profile | None = None
        self.done = False

    def before_step(self, loop: Loop) -> None:
        if self.done or self.profiler is not None or not self.first <= loop.trainer.progress.step + 1 <= self.last:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if loop.trainer.par.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.start()

    def after_boundary(self, loop: Loop) -> None:
        if loop.trainer is not None and loop.trainer.progress.step >= self.last:
            self._write(loop)

    def stopping(self, loop: Loop, signum: int) -> None:
        self._write(loop)

    def finished(self, loop: Loop) -> None:
        self._write(loop)

    def _write(self, loop: Loop) -> None:
        if self.profiler is None:
            return
        self.profiler.stop()
        path = f"{self.directory}/profile-rank-{loop.rank}.json"
        self.profiler.export_chrome_trace(path)
        self.profiler, self.done = None, True
        if loop.rank == 0:
            say(f"wrote the profile of steps {self.first}..{self.last} as {self.directory}/profile-rank-N.json")
