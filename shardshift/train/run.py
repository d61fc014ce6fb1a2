"""One rank's whole run: join the group, resume, train, switch, save, report, and stop cleanly.

How a run ends, and its exit status (the same on every rank):

- 0: it reached `stop_at` (a checkpoint saved there when `--save` is given);
- 128 + the signal: SIGTERM (preemption, the launcher passing on Ctrl-C), SIGINT or SIGHUP (the
  terminal closed) arrived. The handler only records it; after each step the ranks agree (one tiny all-reduce) whether any got
  one, finish that step, save a checkpoint when `--save` is given, and exit together;
- 3: a step diverged (a non-finite loss or gradient norm, `trainer.Diverged`): the step is not
  applied and nothing of it is saved;
- 1: a switch failed while moving the state (a peer died, a transfer timed out): the state is
  lost, the message names the rank and round and the checkpoint to resume from;
- 2: bad input (one line, no traceback).

Rank 0 prints best effort: with its terminal or reader gone, a run still saves and stops as above.

With `--metrics`, rank 0 appends one JSON object per step, one per switch, one ``resume``
event when the run starts from a checkpoint (so that steps a crash made it redo are never
mistaken for new ones), and one ``summary`` when it reaches `stop_at` (`Summary`; also printed).
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from shardshift.comm import TransferError
from shardshift.console import say
from shardshift.runtime import run_in_group, say_device_note
from shardshift.train import checkpoint
from shardshift.train.catalog import REPLACED_PREFIX, RunIdentity, check_save_dir, checkpoints, choose
from shardshift.train.config import TrainConfig
from shardshift.train.data import digest, load_tokens
from shardshift.train.parallelize import TREE_AXES
from shardshift.train.state import LostState
from shardshift.train.trainer import Diverged, StepResult, Trainer
from shardshift.units import format_size

DIVERGED_EXIT = 3


class Stopped(Exception):
    """The ranks agreed to stop for a signal; `signum` is the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Signals:
    """`STOP_SIGNALS`, recorded while a run trains (the handler does nothing else)."""

    def __init__(self) -> None:
        self.received = 0
        self.received_at = 0.0  # time.monotonic() when the first arrived
        self.previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        for sig in self.previous:
            signal.signal(sig, self._record)

    def _record(self, signum: int, _frame) -> None:
        if not self.received:
            self.received, self.received_at = signum, time.monotonic()

    def agreed(self, device: torch.device) -> int:
        """The signal any rank received (0: none): a collective, so that all stop at one step."""
        flag = torch.tensor([self.received], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class Metrics:
    """Rank 0's JSONL file of steps and events (a no-op elsewhere or without `--metrics`)."""

    def __init__(self, path: str | None, rank: int) -> None:
        self.file = open(path, "a") if (path and rank == 0) else None

    def write(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def report_step(cfg: TrainConfig, result: StepResult, metrics: Metrics) -> None:
    if cfg.log_every and (result.step % cfg.log_every == 0 or result.step == cfg.stop_at):
        say(f"step {result.step:5d} | loss {result.loss:.6f} | lr {result.lr:.2e} | "
             f"grad norm {result.grad_norm:.3f} | {result.tokens_per_s:,.0f} tokens/s")
    metrics.write({
        "step": result.step,
        "loss": result.loss,
        "layout": str(cfg.layout),
        "step_time_s": result.step_time_s,
        "tokens_per_s": result.tokens_per_s,
        "grad_norm": result.grad_norm,
        "lr": result.lr,
    })


def _report_switch(report, metrics: Metrics) -> None:
    say(
        f"switched {report.old} -> {report.new} before step {report.step} in {report.seconds:.2f} s "
        f"(prepared in {report.prepare_seconds:.2f} s{' ahead' if report.prepared_ahead else ''}): "
        f"moved {format_size(report.bytes_moved)} (lower bound {format_size(report.bytes_lower_bound)}), kept "
        f"{format_size(report.bytes_kept)} in place, {report.rounds} round(s), peak {format_size(report.peak_mem_bytes)} "
        f"per rank, {format_size(report.extra_mem_bytes)} over max(old, new) (budget {format_size(report.budget)})"
    )
    metrics.write(report.event())


class Summary:
    """What a run did, said at its end (rank 0): steps, tokens, wall time, the loss from its first
    to its last step, the changes it made (`change`: online switches, or an elastic job's changes
    of world) and the time they took, and the calls its data groups ran on trees."""

    def __init__(self, cfg: TrainConfig, change: str = "switch") -> None:
        self.cfg, self.change, self.start = cfg, change, time.monotonic()
        self.steps = self.changes = 0
        self.first_loss = self.last_loss = None
        self.change_seconds = 0.0
        self.tree_calls: dict[str, int] = {}  # of the layouts switched from

    def stepped(self, result: StepResult) -> None:
        self.steps += 1
        self.first_loss = result.loss if self.first_loss is None else self.first_loss
        self.last_loss = result.loss

    def switching(self, trainer: Trainer) -> None:
        """Before a switch: the calls of the groups it leaves behind."""
        self.tree_calls = _added(self.tree_calls, tree_calls(trainer))

    def changed(self, seconds: float) -> None:
        self.changes += 1
        self.change_seconds += seconds

    def report(self, trainer: Trainer, metrics: Metrics) -> None:
        """Say the run's end in one line, and record it in the metrics (rank 0)."""
        event = self.event(trainer)
        say(Summary.line(event))
        metrics.write(event)

    def event(self, trainer: Trainer) -> dict:
        return {"event": "summary", "step": trainer.progress.step, "steps": self.steps,
                "tokens": self.steps * self.cfg.tokens_per_step, "seconds": time.monotonic() - self.start,
                "first_loss": self.first_loss, "last_loss": self.last_loss, "change": self.change,
                "changes": self.changes, "change_seconds": self.change_seconds,
                "tree_calls": _added(self.tree_calls, tree_calls(trainer))}

    @staticmethod
    def line(event: dict) -> str:
        seconds = event["seconds"]
        text = (f"done: {event['steps']} steps, {event['tokens']:,} tokens in {seconds:.1f} s "
                f"({event['tokens'] / seconds:,.0f} tokens/s)")
        if event["first_loss"] is not None:
            text += f"; loss {event['first_loss']:.4f} -> {event['last_loss']:.4f}"
        if event["changes"]:
            name = event["change"]
            if event["changes"] > 1:  # "switch" -> "switches", "change of world" -> "changes of world"
                head, space, tail = name.partition(" ")
                name = head + ("es" if head.endswith(("s", "sh", "ch")) else "s") + space + tail
            text += (f"; {event['changes']} {name} took {event['change_seconds']:.2f} s "
                     f"({event['change_seconds'] / seconds:.1%} of the run)")
        if event["tree_calls"]:
            calls = ", ".join(f"{op} {count}" for op, count in sorted(event["tree_calls"].items()))
            text += f"; on trees: {calls}"
        return text


def tree_calls(trainer: Trainer) -> dict[str, int]:
    """The calls this rank's data-axis groups ran on trees, by op (none unless --collectives trees)."""
    calls: dict[str, int] = {}
    for axis in TREE_AXES:
        calls = _added(calls, getattr(trainer.par.mesh[axis].get_group(), "tree_calls", {}))
    return calls


def _added(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {op: a.get(op, 0) + b.get(op, 0) for op in sorted({*a, *b})}


def run_training(cfg: TrainConfig, timeout_s: float) -> int:
    run_in_group(timeout_s, lambda proc: _train(cfg, proc, timeout_s))
    return 0


def resume_point(cfg: TrainConfig, tokens, rank: int) -> Path | None:
    """The checkpoint to resume from (None: start fresh), as rank 0 chose it, after checking that
    the run may save into `--save`: every rank gets the same answer, or the same ValueError."""
    answer: list = [None]
    if rank == 0:
        try:
            if cfg.save:
                check_save_dir(cfg.save, cfg.resume_from)
            if cfg.resume:
                answer = [_choose(cfg, tokens)]
        except ValueError as err:
            answer = [err]
    dist.broadcast_object_list(answer, src=0)
    if isinstance(answer[0], ValueError):
        raise answer[0]
    return None if answer[0] is None else Path(answer[0])


def _choose(cfg: TrainConfig, tokens) -> str | None:
    """Rank 0's part of `resume_point`: the choice, said; a checkpoint a crash left set aside
    while its step was saved again is renamed back first."""
    choice = choose(cfg.resume_from, RunIdentity.of(cfg, digest(tokens)), missing_ok=cfg.resume == "auto")
    if choice.skipped or choice.path is not None:
        say(choice.describe())
    elif cfg.resume == "auto":
        say(f"no checkpoint in {cfg.save} yet: starting from step 0")
    if choice.path is not None and choice.path.name.startswith(REPLACED_PREFIX):
        restored = choice.path.with_name(choice.path.name[len(REPLACED_PREFIX):])
        choice.path.rename(restored)
        return str(restored)
    return None if choice.path is None else str(choice.path)


def _train(cfg: TrainConfig, proc, timeout_s: float) -> None:
    cfg.layout.check_world(proc.world_size)
    if cfg.collectives == "trees" and proc.device_type != "cpu":
        raise ValueError("--collectives trees runs on CPU tensors (gloo) only in this build: on GPUs leave it out "
                         "(NCCL), or pass --device cpu")
    tokens = load_tokens(cfg.data)
    resume = resume_point(cfg, tokens, proc.rank) if (cfg.resume or cfg.save) else None
    trainer = Trainer(cfg, proc.rank, proc.device_type, tokens=tokens, timeout_s=timeout_s)
    metrics = Metrics(cfg.metrics, proc.rank)
    if resume is not None:
        checkpoint.load(trainer, resume)
        metrics.write({"event": "resume", "step": trainer.progress.step, "checkpoint": str(resume),
                       "layout": str(cfg.layout)})
    if proc.rank == 0:
        say_device_note(proc)
        say(
            f"training {cfg.model.name} ({cfg.model.num_params():,} parameters) under "
            f"{cfg.layout} on {proc.world_size} {proc.device_type} ranks, {cfg.dtype}"
        )
    signals = Signals()
    summary = Summary(cfg)
    try:
        _loop(cfg, trainer, proc.rank, metrics, signals, summary)
        if proc.rank == 0:
            summary.report(trainer, metrics)
    except Stopped as stop:
        if proc.rank == 0:
            saved = f"; resume with --resume {cfg.save}" if cfg.save else " (no --save: nothing was saved)"
            say(f"shardshift: stopped by signal {stop.signum} after step {trainer.progress.step}{saved}", "stderr")
        raise
    except (TransferError, LostState) as err:
        raise SwitchFailed(err, cfg.save) from err
    finally:
        signals.restore()
        metrics.close()
    if proc.rank == 0 and cfg.plot:
        from shardshift.plots.runs import draw_runs

        draw_runs([Path(cfg.metrics)], Path(cfg.picture))
        say(f"drew the run in {cfg.picture}")
    dist.barrier()


def _loop(cfg: TrainConfig, trainer: Trainer, rank: int, metrics: Metrics, signals: Signals,
          summary: Summary) -> None:
    pending = [(step, layout) for step, layout in cfg.switches if step > trainer.progress.step]
    # The next switch is prepared (planned, its meshes and storage-less model built) ahead of
    # time, so that at its step only the state moves.
    prepared = trainer.prepare_switch(pending[0][1], cfg.switch_budget) if pending else None
    while trainer.progress.step < cfg.stop_at:
        if pending and pending[0][0] == trainer.progress.step + 1:
            summary.switching(trainer)
            report = trainer.switch(prepared)
            summary.changed(report.seconds)
            if rank == 0:
                _report_switch(report, metrics)
            pending.pop(0)
            prepared = trainer.prepare_switch(pending[0][1], cfg.switch_budget) if pending else None
        result = trainer.train_step()
        summary.stepped(result)
        if rank == 0:
            report_step(trainer.cfg, result, metrics)
        step = trainer.progress.step
        stop = signals.agreed(trainer.par.device)
        if cfg.save and (stop or (cfg.save_every and step % cfg.save_every == 0) or step == cfg.stop_at):
            path = checkpoint.save(trainer, cfg.save, keep=cfg.keep_checkpoints)
            if rank == 0:
                say(f"saved {path}")
        if stop:
            raise Stopped(stop)


class RunFailed(RuntimeError):
    """The run cannot go on, and its message says why and where to resume from (exit status 1)."""


class SwitchFailed(RunFailed):
    """A switch failed while moving the state; says where to resume from."""

    def __init__(self, err: Exception, save: str | None) -> None:
        newest = checkpoints(Path(save)) if save else []
        where = (f"resume with --resume {save}, which takes its newest intact checkpoint (the newest there is "
                 f"{newest[0].name})" if newest else "no checkpoint was saved: start again (give --save to have one)")
        super().__init__(f"{err}; the training state is lost: {where}")


def worker_main(cfg: TrainConfig, timeout_s: float) -> int:
    """Run one rank (`exit_status`)."""
    return exit_status(lambda: run_training(cfg, timeout_s))


def exit_status(body: Callable[[], int]) -> int:
    """Run a rank's `body`; every way a run ends is one line and an exit status (module docstring);
    a bug is a traceback."""
    try:
        return body()
    except ValueError as err:
        say(f"shardshift: error: {err}", "stderr")
        return 2
    except Stopped as stop:
        return 128 + stop.signum
    except Diverged as err:
        say(f"shardshift: error: {err}", "stderr")
        return DIVERGED_EXIT
    except RunFailed as err:
        say(f"shardshift: error: {err}", "stderr")
        return 1
