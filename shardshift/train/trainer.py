"""The training loop of one rank: model stage, optimizer, data stream, one step at a time."""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from shardshift.layout import Layout
from shardshift.reshard.plan import Assignment
from shardshift.reshard.schedule import DEFAULT_BUDGET
from shardshift.train.config import TrainConfig
from shardshift.train.data import BatchStream, load_tokens
from shardshift.train.model import loss_fn
from shardshift.train.optim import build_optimizer, clip_grad_norm
from shardshift.train.parallelize import build_parallel, build_stage_model, wrap_for_training
from shardshift.train.switch import PreparedSwitch, SwitchReport, prepare_switch, switch_trainer


@dataclasses.dataclass(frozen=True)
class StepResult:
    step: int  # optimizer steps taken after this one (1 after the first step)
    loss: float  # mean loss over the global batch, the same on every rank
    grad_norm: float  # global gradient norm before clipping
    lr: float
    step_time_s: float
    tokens_per_s: float


@dataclasses.dataclass
class Progress:
    """Training position; with the model and optimizer it is the whole training state."""

    step: int = 0  # optimizer steps taken
    position: int = 0  # samples of the data stream consumed


class Trainer:
    """Trains this rank's part of the model under `cfg.layout`.

    Every rank of the job constructs one and calls `train_step` in lockstep.
    """

    def __init__(self, cfg: TrainConfig, rank: int, device_type: str, tokens=None, ranks=None):
        """`ranks`: the process at each coordinate of the layout (default: process i at the i-th)."""
        self.cfg = cfg
        self.rank = rank
        torch.manual_seed(cfg.seed)
        self.par = build_parallel(cfg.layout, rank, device_type, ranks)
        self.model = build_stage_model(cfg.model, self.par, cfg.param_dtype, cfg.seed)
        self.module = wrap_for_training(self.model, self.par)  # what runs forward and backward
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.stream = BatchStream(
            load_tokens(cfg.data) if tokens is None else tokens,
            cfg.model.seq_len,
            cfg.global_batch,
            cfg.seed,
        )
        self.progress = Progress()
        self.schedule = self._build_schedule() if cfg.layout.pp > 1 else None

    @property
    def assignment(self) -> Assignment:
        """The layout and the process at each of its coordinates."""
        return Assignment(self.cfg.layout, self.par.ranks)

    def switch(self, target: Layout | PreparedSwitch, budget: int = DEFAULT_BUDGET) -> SwitchReport:
        """Continue training under a layout, moving the state in place (see `switch.py`).

        A collective between steps: every rank calls it with the same arguments. `target` is the
        layout or what `prepare_switch` made for it. A layout the model, the batch or the world
        cannot take raises ValueError before anything changes.
        """
        return switch_trainer(self, target, budget)

    def prepare_switch(self, layout: Layout, budget: int = DEFAULT_BUDGET) -> PreparedSwitch:
        """Plan a switch and build the new layout's meshes and storage-less model, ahead of time."""
        return prepare_switch(self, layout, budget)

    def drop_runtime(self) -> None:
        """Drop what only runs steps (DDP wrapper, pipeline schedule): a switch is about to start."""
        self.module = self.schedule = None

    def install(self, cfg: TrainConfig, par, assignment: Assignment, model, optimizer, step: int, position: int) -> None:
        """Take the state a switch built for `cfg.layout`."""
        assert par.ranks == assignment.ranks and cfg.layout == assignment.layout
        self.cfg, self.par, self.model, self.optimizer = cfg, par, model, optimizer
        self.progress = Progress(step=step, position=position)
        self.module = wrap_for_training(model, par, sync=False)  # the switch made replicas identical
        self.schedule = self._build_schedule() if cfg.layout.pp > 1 else None

    def _build_schedule(self) -> Schedule1F1B:
        stage = PipelineStage(
            self.module,
            stage_index=self.par.coord.pp,
            num_stages=self.cfg.layout.pp,
            device=self.par.device,
            group=self.par.mesh["pp"].get_group(),
        )
        # scale_grads: each micro-batch's loss is a mean over the micro-batch; dividing the summed
        # gradients by the number of micro-batches makes them the gradient of the local-batch mean.
        return Schedule1F1B(stage, n_microbatches=self.cfg.micro_batches, loss_fn=loss_fn, scale_grads=True)

    def _forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Local mean loss on the last stage (None elsewhere); gradients left in `.grad`."""
        if self.schedule is None:
            loss = loss_fn(self.module(inputs), targets)
            loss.backward()
            return loss.detach()
        if self.par.is_first_stage:
            self.schedule.step(inputs)
            return None
        if self.par.is_last_stage:
            losses: list[torch.Tensor] = []
            self.schedule.step(target=targets, losses=losses)
            return torch.stack([loss.detach() for loss in losses]).mean()
        self.schedule.step()
        return None

    def _global_loss(self, local_loss: torch.Tensor | None) -> float:
        """Mean of the data ranks' losses, counted once per data rank (tp rank 0 of the last stage)."""
        layout = self.cfg.layout
        total = torch.zeros((), dtype=torch.float64, device=self.par.device)
        if local_loss is not None and self.par.coord.tp == 0:
            total += local_loss.double() / layout.data_parallel
        dist.all_reduce(total)
        return float(total)

    def train_step(self) -> StepResult:
        cfg, layout = self.cfg, self.cfg.layout
        start = time.perf_counter()
        inputs, targets = self.stream.batch(
            self.progress.position, layout.data_rank(self.par.coord), layout.data_parallel
        )
        inputs, targets = inputs.to(self.par.device), targets.to(self.par.device)
        lr = cfg.optim.lr_at(self.progress.step, cfg.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

        with cfg.autocast(self.par.device.type):
            local_loss = self._forward_backward(inputs, targets)
        ranks_per_stage = layout.dp * layout.fsdp * layout.tp
        grad_norm = clip_grad_norm(self.model, cfg.optim.grad_clip, ranks_per_stage)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._global_loss(local_loss)

        self.progress.step += 1
        self.progress.position += cfg.global_batch
        elapsed = time.perf_counter() - start
        return StepResult(
            step=self.progress.step,
            loss=loss,
            grad_norm=grad_norm,
            lr=lr,
            step_time_s=elapsed,
            tokens_per_s=cfg.tokens_per_step / elapsed,
        )
