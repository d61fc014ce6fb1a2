"""One rank's whole run: join the group, build the trainer, resume, train, save, report."""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from shardshift.runtime import run_in_group
from shardshift.train import checkpoint
from shardshift.train.config import TrainConfig
from shardshift.train.trainer import StepResult, Trainer
from shardshift.units import format_size


def _report(cfg: TrainConfig, result: StepResult, metrics) -> None:
    if cfg.log_every and (result.step % cfg.log_every == 0 or result.step == cfg.stop_at):
        print(
            f"step {result.step:5d} | loss {result.loss:.6f} | lr {result.lr:.2e} | "
            f"grad norm {result.grad_norm:.3f} | {result.tokens_per_s:,.0f} tokens/s",
            flush=True,
        )
    if metrics is not None:
        record = {
            "step": result.step,
            "loss": result.loss,
            "layout": str(cfg.layout),
            "step_time_s": result.step_time_s,
            "tokens_per_s": result.tokens_per_s,
            "grad_norm": result.grad_norm,
            "lr": result.lr,
        }
        metrics.write(json.dumps(record) + "\n")
        metrics.flush()


def _report_switch(report, metrics) -> None:
    print(
        f"switched {report.old} -> {report.new} before step {report.step} in {report.seconds:.2f} s "
        f"(prepared in {report.prepare_seconds:.2f} s{' ahead' if report.prepared_ahead else ''}): "
        f"moved {format_size(report.bytes_moved)} (lower bound {format_size(report.bytes_lower_bound)}), kept "
        f"{format_size(report.bytes_kept)} in place, {report.rounds} round(s), peak {format_size(report.peak_mem_bytes)} "
        f"per rank, {format_size(report.extra_mem_bytes)} over max(old, new) (budget {format_size(report.budget)})",
        flush=True,
    )
    if metrics is not None:
        metrics.write(json.dumps(report.event()) + "\n")
        metrics.flush()


def run_training(cfg: TrainConfig, timeout_s: float) -> int:
    run_in_group(timeout_s, lambda proc: _train(cfg, proc, timeout_s))
    return 0


def _train(cfg: TrainConfig, proc, timeout_s: float) -> None:
    cfg.layout.check_world(proc.world_size)
    trainer = Trainer(cfg, proc.rank, proc.device_type, timeout_s=timeout_s)
    if cfg.resume:
        path = checkpoint.resolve(cfg.resume)
        checkpoint.load(trainer, path)
        if proc.rank == 0:
            print(f"resumed from {path} at step {trainer.progress.step} under {cfg.layout}", flush=True)
    metrics = open(cfg.metrics, "a") if (cfg.metrics and proc.rank == 0) else None
    if proc.rank == 0:
        print(
            f"training {cfg.model_name} ({cfg.model.num_params():,} parameters) under "
            f"{cfg.layout} on {proc.world_size} {proc.device_type} ranks, {cfg.dtype}",
            flush=True,
        )
    pending = [(step, layout) for step, layout in cfg.switches if step > trainer.progress.step]
    # The next switch is prepared (planned, its meshes and storage-less model built) ahead of
    # time, so that at its step only the state moves.
    prepared = trainer.prepare_switch(pending[0][1], cfg.switch_budget) if pending else None
    try:
        while trainer.progress.step < cfg.stop_at:
            if pending and pending[0][0] == trainer.progress.step + 1:
                report = trainer.switch(prepared)
                if proc.rank == 0:
                    _report_switch(report, metrics)
                pending.pop(0)
                prepared = trainer.prepare_switch(pending[0][1], cfg.switch_budget) if pending else None
            result = trainer.train_step()
            if proc.rank == 0:
                _report(trainer.cfg, result, metrics)
            step = trainer.progress.step
            if cfg.save and ((cfg.save_every and step % cfg.save_every == 0) or step == cfg.stop_at):
                path = checkpoint.save(trainer, cfg.save)
                if proc.rank == 0:
                    print(f"saved {path}", flush=True)
    finally:
        if metrics is not None:
            metrics.close()
    dist.barrier()


def worker_main(cfg: TrainConfig, timeout_s: float) -> int:
    """Run one rank; a user error prints one line, anything else its traceback; both exit non-zero."""
    try:
        return run_training(cfg, timeout_s)
    except ValueError as err:
        print(f"shardshift: error: {err}", file=sys.stderr, flush=True)
        return 2
