"""One rank's whole run: join the group, resume, train, switch, save, report, and stop cleanly.

How a run ends, and its exit status (the same on every rank):

- 0: it reached `stop_at` (a checkpoint saved there when `--save` is given);
- 128 + the signal: SIGTERM (preemption, the launcher passing on Ctrl-C), SIGINT or SIGHUP (the
  terminal closed) arrived. The handler only records it; after each step the ranks agree (the
  loop's one all-reduce at the boundary: `loop.StopOnSignal`) whether any got one, finish that
  step, save a checkpoint when `--save` is given, and exit together;
- 3: a step diverged (a non-finite loss or gradient norm, `trainer.Diverged`): the step is not
  applied and nothing of it is saved;
- 1: a switch failed while moving the state (a peer died, a transfer timed out): the state is
  lost, the message names the rank and round and the checkpoint to resume from;
- 2: bad input (one line, no traceback).

Rank 0 prints best effort: with its terminal or reader gone, a run still saves and stops as above.

With `--metrics`, rank 0 appends one JSON object per step, one per switch, one ``resume``
event when the run starts from a checkpoint (so that steps a crash made it redo are never
mistaken for new ones), and one ``summary`` when it reaches `stop_at` (`Summary`; also printed).
With `--tensorboard DIR`, the same records go to an event file in DIR (`train.tensorboard`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from shardshift.comm import TransferError
from shardshift.console import say
from shardshift.data.corpus import Corpus, open_corpus
from shardshift.runtime import run_in_group, say_device_note
from shardshift.train import checkpoint
from shardshift.train.catalog import REPLACED_PREFIX, RunIdentity, check_save_dir, checkpoints, choose
from shardshift.train.config import TrainConfig
from shardshift.train.loop import Hook, Loop, ProfileSteps, ScheduledSwitches, StopOnSignal
from shardshift.train.report import Metrics, Signals, Stopped, Summary
from shardshift.train.state import LostState
from shardshift.train.trainer import Diverged, Trainer

DIVERGED_EXIT = 3


def run_training(cfg: TrainConfig, timeout_s: float, profile: ProfileSteps | None = None) -> int:
    run_in_group(timeout_s, lambda proc: _train(cfg, proc, timeout_s, profile))
    return 0


def resume_point(cfg: TrainConfig, corpus: Corpus, rank: int) -> Path | None:
    """The checkpoint to resume from (None: start fresh), as rank 0 chose it, after checking that
    the run may save into `--save`: every rank gets the same answer, or the same ValueError."""
    answer: list = [None]
    if rank == 0:
        try:
            if cfg.save:
                check_save_dir(cfg.save, cfg.resume_from)
            if cfg.resume:
                answer = [_choose(cfg, corpus)]
        except ValueError as err:
            answer = [err]
    dist.broadcast_object_list(answer, src=0)
    if isinstance(answer[0], ValueError):
        raise answer[0]
    return None if answer[0] is None else Path(answer[0])


def _choose(cfg: TrainConfig, corpus: Corpus) -> str | None:
    """Rank 0's part of `resume_point`: the choice, said; a checkpoint a crash left set aside
    while its step was saved again is renamed back first."""
    choice = choose(cfg.resume_from, RunIdentity.of(cfg, corpus.digest), missing_ok=cfg.resume == "auto")
    if choice.skipped or choice.path is not None:
        say(choice.describe())
    elif cfg.resume == "auto":
        say(f"no checkpoint in {cfg.save} yet: starting from step 0")
    if choice.path is not None and choice.path.name.startswith(REPLACED_PREFIX):
        restored = choice.path.with_name(choice.path.name[len(REPLACED_PREFIX):])
        choice.path.rename(restored)
        return str(restored)
    return None if choice.path is None else str(choice.path)


def _train(cfg: TrainConfig, proc, timeout_s: float, profile: ProfileSteps | None) -> None:
    cfg.layout.check_world(proc.world_size)
    if cfg.collectives == "trees" and proc.device_type != "cpu":
        raise ValueError("--collectives trees runs on CPU tensors (gloo) only in this build: on GPUs leave it out "
                         "(NCCL), or pass --device cpu")
    corpus = open_corpus(cfg.data)
    resume = resume_point(cfg, corpus, proc.rank) if (cfg.resume or cfg.save) else None
    trainer = Trainer(cfg, proc.rank, proc.device_type, corpus=corpus, timeout_s=timeout_s)
    metrics = Metrics.of(cfg, proc.rank)
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
    # The profiler's first: a switch before a step it traces is in the trace.
    hooks: list[Hook] = [] if profile is None else [profile]
    loop = Loop(cfg, trainer, metrics, Summary(cfg), [*hooks, ScheduledSwitches(cfg, trainer), StopOnSignal(signals)])
    try:
        loop.run()
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


class RunFailed(RuntimeError):
    """The run cannot go on, and its message says why and where to resume from (exit status 1)."""


class SwitchFailed(RunFailed):
    """A switch failed while moving the state; says where to resume from."""

    def __init__(self, err: Exception, save: str | None) -> None:
        newest = checkpoints(Path(save)) if save else []
        where = (f"resume with --resume {save}, which takes its newest intact checkpoint (the newest there is "
                 f"{newest[0].name})" if newest else "no checkpoint was saved: start again (give --save to have one)")
        super().__init__(f"{err}; the training state is lost: {where}")


def worker_main(cfg: TrainConfig, timeout_s: float, profile: ProfileSteps | None = None) -> int:
    """Run one rank (`exit_status`), traced by `profile` (``--profile``) when given."""
    return exit_status(lambda: run_training(cfg, timeout_s, profile))


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
