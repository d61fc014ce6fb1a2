"""The training loop of one rank: its `TrainingState`, the data stream, one step at a time.

A `Trainer` holds the state (`state.py`) and what runs steps on it: the module that runs forward
and backward (the model, or a DDP wrapper around it) and, under pp, the 1F1B pipeline. A switch
(`switch.py`) builds the next layout's state from the current one; the trainer then drops its
runtime and builds a new one around the new state. A switch that fails half-way leaves the state
lost and the trainer refusing to go on, saying why (resume from a checkpoint).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from shardshift.data.corpus import Corpus, open_corpus
from shardshift.data.stream import BatchStream, data_slice, loss_weight
from shardshift.layout import Layout
from shardshift.reshard.plan import Assignment
from shardshift.reshard.schedule import DEFAULT_BUDGET
from shardshift.train.checkpointing import wrap_layers
from shardshift.train.compiling import compiled_graphs
from shardshift.train.config import TrainConfig
from shardshift.train.memory import device_peak_flops, peak_bytes, reset_peak
from shardshift.train.optim import clip_grad_norm
from shardshift.train.parallelize import (
    Parallel,
    average_over_ep,
    build_parallel,
    reshard_after_break,
    sum_partial_gradients,
    tree_options,
    wrap_for_training,
)
from shardshift.train.state import Progress, TrainingState
from shardshift.train.switch import PreparedSwitch, SwitchReport, prepare_switch, switch_report, switch_state

if TYPE_CHECKING:
    from torch.distributed.pipelining import Schedule1F1B

DEFAULT_TIMEOUT_S = 300.0  # a switch's transfers, as the job's collectives (`--timeout`)


class Diverged(RuntimeError):
    """Training produced non-finite values: a step's loss or gradient norm (the step is then not
    applied: every rank sees the same global values, and stops alike), or the state itself (then
    it is not saved)."""

    def __init__(self, step: int, what: str) -> None:
        super().__init__(f"step {step} diverged: {what}; nothing of it was saved. Lower --lr (or raise --warmup)")
        self.step = step


class StepAborted(RuntimeError):
    """A step's commit vote failed (a worker died): nothing of the step was applied."""

    def __init__(self, step: int) -> None:
        super().__init__(f"step {step} was not committed: a worker was lost; nothing of it was applied")
        self.step = step


@dataclasses.dataclass(frozen=True)
class StepResult:
    step: int  # optimizer steps taken after this one (1 after the first step)
    loss: float  # mean loss over the global batch, the same on every rank
    grad_norm: float  # global gradient norm before clipping
    lr: float
    step_time_s: float
    tokens_per_s: float
    applied: bool = True  # False: the step is pending (`Trainer.apply_pending`), nothing of the state changed
    peak_memory: int = 0  # bytes: the largest of the ranks' peaks in the step (`train.memory`); 0: unknown
    flops_per_s: float = 0.0  # model FLOPs per second of the step, all ranks together (`train.memory`)
    mfu: float | None = None  # flops_per_s over the devices' peak, where known
    compiled: int = 0  # graphs --compile compiled in the step (`train.compiling`): its time includes theirs


class Trainer:
    """Trains this rank's part of the model under `cfg.layout`.

    Every rank of the job constructs one and calls `train_step` (and `switch`) in lockstep.
    `group` carries a switch's transfers (default: the job's world), within `timeout_s`.
    """

    def __init__(self, cfg: TrainConfig, rank: int, device_type: str, corpus: Corpus | None = None, ranks=None,
                 group=None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, state: TrainingState | None = None, trees=None):
        """`ranks`: the process at each coordinate of the layout (default: process i at the i-th).
        `corpus`: the data (default: `open_corpus(cfg.data)`).
        `state`: go on from this state (one a change of world built) instead of the initial one.
        `trees`: the ShardShiftOptions of the data axes' groups (default: from `cfg`, `tree_options`)."""
        self.corpus = open_corpus(cfg.data) if corpus is None else corpus
        self.corpus.check_vocabulary(cfg.model.name, cfg.model.vocab_size)
        self.cfg = cfg
        self.rank = rank
        self.group = dist.group.WORLD if group is None else group
        self.timeout_s = timeout_s
        self.state = state or TrainingState.initial(
            cfg, build_parallel(cfg.layout, rank, device_type, ranks, trees or tree_options(cfg, timeout_s)))
        self.stream = BatchStream(self.corpus.train, cfg.model.seq_len, cfg.global_batch, cfg.seed)
        self.module, self.pipeline = self._runtime(sync=state is None)  # a moved state's replicas are equal
        self._pending: tuple | None = None  # a step left pending by `train_step`: (its `applied`,)

    # ---- the state, read through --------------------------------------------------------------

    @property
    def par(self) -> Parallel:
        return self.state.par

    @property
    def model(self) -> nn.Module:
        return self.state.model

    @property
    def optimizer(self) -> torch.optim.AdamW:
        return self.state.optimizer

    @property
    def progress(self) -> Progress:
        return self.state.progress

    @property
    def assignment(self) -> Assignment:
        """The layout and the process at each of its coordinates."""
        return Assignment(self.cfg.layout, self.par.ranks)

    # ---- switching -----------------------------------------------------------------------------

    def prepare_switch(self, layout: Layout, budget: int = DEFAULT_BUDGET) -> PreparedSwitch:
        """Plan a switch and build the new layout's meshes and storage-less model, ahead of time."""
        self.state.check_usable()
        return prepare_switch(self.cfg, self.state, self.rank, layout, budget)

    def switch(self, target: Layout | PreparedSwitch, budget: int = DEFAULT_BUDGET) -> SwitchReport:
        """Continue training under another layout, the state moved in place (see `switch.py`).

        A collective between steps: every rank calls it with the same arguments. `target` is the
        layout or what `prepare_switch` made for it. A layout the model, the batch or the world
        cannot take raises ValueError before anything changes. A failure while the state moves
        (a lost peer, a timeout) leaves this trainer unusable: its error says why.
        """
        start = time.perf_counter()
        if self.par.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        prepared = target if isinstance(target, PreparedSwitch) else self.prepare_switch(target, budget)
        if prepared.plan.old != self.assignment:
            raise ValueError(f"this switch was prepared from {prepared.plan.old}, but the trainer is under "
                             f"{self.assignment}; prepare it again")
        self.module = self.pipeline = None  # the DDP wrapper's buckets and the pipeline go first
        self.state, stats = switch_state(self.state, prepared, self.group, self.timeout_s)
        self.cfg = prepared.cfg
        self.module, self.pipeline = self._runtime(sync=False)  # the switch made replicas identical
        return switch_report(prepared, stats, time.perf_counter() - start, ahead=prepared is target,
                             step=self.progress.step + 1, group=self.group)

    def release_runtime(self) -> None:
        """Drop what runs steps (the DDP wrapper, the pipeline): before the groups they use go. The
        parameters go back to their sharded form: FSDP2 registers the gathered ones while a layer
        runs, and a step that broke midway (a peer died in a forward) leaves them registered."""
        self.module = self.pipeline = None
        reshard_after_break(self.model)

    # ---- steps ---------------------------------------------------------------------------------

    def _runtime(self, sync: bool) -> tuple[nn.Module, Schedule1F1B | None]:
        """What runs steps on the state: the module (a DDP wrapper under pure replication; `sync`
        broadcasts its parameters from rank 0 first) and, under pp, the pipeline."""
        wrap_layers(self.model, self.cfg.model.pipeline.layers, self.cfg.activation_checkpointing, self.cfg.compile)
        module = wrap_for_training(self.model, self.par, sync=sync)
        if self.cfg.layout.pp == 1:
            return module, None
        # Imported here: it costs a process about 0.5 s of CPU, and most layouts have no pipeline.
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        stage = PipelineStage(
            module,
            stage_index=self.par.coord.pp,
            num_stages=self.cfg.layout.pp,
            device=self.par.device,
            group=self.par.mesh["pp"].get_group(),
        )
        # scale_grads: each micro-batch's loss is a mean over the micro-batch; dividing the summed
        # gradients by the number of micro-batches makes them the gradient of the local-batch mean.
        # Under pp the batch splits evenly (`TrainConfig.check_batch`: slices that differ by one
        # cannot both split into two or more micro-batches), so no rank's loss is weighted.
        return module, Schedule1F1B(stage, n_microbatches=self.cfg.micro_batches, loss_fn=self.cfg.model.loss,
                                    scale_grads=True)

    def _loss_weight(self) -> float:
        """This rank's weight on its mean loss (`data.loss_weight`: 1 unless the batch splits unevenly)."""
        layout = self.cfg.layout
        return loss_weight(self.cfg.global_batch, layout.data_parallel, layout.data_rank(self.par.coord))

    def _forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Local mean loss on the last stage (None elsewhere); gradients, of the loss weighted by
        this rank's share of the batch (`_loss_weight`), left in `.grad`.

        Outside pp the local batch runs in micro-batches of at most --micro-batch-size
        (`TrainConfig.micro_slices`), each one's mean loss weighted by its share of the local batch,
        so that the summed gradients are those of the local mean. DDP reduces once, after the last
        (`no_sync` before it); FSDP2 reduce-scatters each micro-batch's gradients into the sharded
        ones it accumulates (unsharded gradients of the whole model are never held). An empty
        micro-batch (`micro_slices`) runs one sequence whose loss is weighted 0."""
        weight = self._loss_weight()
        if self.pipeline is None:
            count, sizes = len(inputs), self.cfg.micro_slices(len(inputs))
            ddp = isinstance(self.module, nn.parallel.DistributedDataParallel)
            total = None
            for i, (x, y) in enumerate(zip(inputs.split(sizes), targets.split(sizes))):
                share = weight * len(x) / count
                if len(x) == 0:  # run one sequence at weight 0: the others' collectives need this rank
                    x, y = inputs[:1], targets[:1]
                with self.module.no_sync() if ddp and i < len(sizes) - 1 else contextlib.nullcontext():
                    loss = self.cfg.model.loss(self.module(x), y)
                    (loss if share == 1.0 else loss * share).backward()
                if share:
                    part = loss.detach() if len(sizes) == 1 else loss.detach() * (len(x) / count)
                    total = part if total is None else total + part
            return total
        if self.par.is_first_stage:
            self.pipeline.step(inputs)
            return None
        if self.par.is_last_stage:
            losses: list[torch.Tensor] = []
            self.pipeline.step(target=targets, losses=losses)
            return torch.stack([loss.detach() for loss in losses]).mean()
        self.pipeline.step()
        return None

    def evaluate(self) -> float:
        """The mean loss over the first ``cfg.eval_batches`` global batches of the held-out split
        (`BatchStream.held_out`: in order, the same samples under every layout), with no gradient
        and nothing of the state changed. A collective: every rank calls it."""
        self.state.check_usable()
        if self.corpus.val is None:
            raise ValueError("--eval-every needs a held-out split: prepare the data with --val-fraction")
        cfg, layout = self.cfg, self.cfg.layout
        stream = BatchStream(self.corpus.val, cfg.model.seq_len, cfg.global_batch, cfg.seed, "the held-out split")
        total = 0.0
        with torch.no_grad(), cfg.autocast(self.par.device.type):
            for index in range(cfg.eval_batches):
                inputs, targets = stream.held_out(index, layout.data_rank(self.par.coord), layout.data_parallel)
                total += self._global_loss(self._forward(inputs.to(self.par.device), targets.to(self.par.device)))
        reshard_after_break(self.model)  # FSDP2 keeps gathered what a forward with no backward left so
        return total / cfg.eval_batches

    def _forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """`_forward_backward` with no backward (under ``no_grad``): the local mean loss on the
        last stage, None elsewhere. The model runs unwrapped (DDP's hooks are for backward)."""
        if self.pipeline is not None:
            losses: list[torch.Tensor] = []
            if self.par.is_first_stage:
                self.pipeline.eval(inputs)
            elif self.par.is_last_stage:
                self.pipeline.eval(target=targets, losses=losses)
            else:
                self.pipeline.eval()
            return torch.stack(losses).mean() if self.par.is_last_stage else None
        count, total = len(inputs), None
        for x, y in zip(inputs.split(sizes := self.cfg.micro_slices(count)), targets.split(sizes)):
            loss = self.cfg.model.loss(self.model(x if len(x) else inputs[:1]), y if len(y) else targets[:1])
            if len(x):  # an empty micro-batch runs one sequence for the others' collectives, and counts for nothing
                part = loss * (len(x) / count)
                total = part if total is None else total + part
        return total

    def _global_loss(self, local_loss: torch.Tensor | None) -> float:
        """Mean loss over the global batch: the data ranks' means, each weighted by its share of
        the batch and counted once (tp rank 0 of the last stage)."""
        layout, batch = self.cfg.layout, self.cfg.global_batch
        total = torch.zeros((), dtype=torch.float64, device=self.par.device)
        if local_loss is not None and self.par.coord.tp == 0:
            if batch % layout.data_parallel == 0:
                total += local_loss.double() / layout.data_parallel
            else:
                _, count = data_slice(batch, layout.data_parallel, layout.data_rank(self.par.coord))
                total += local_loss.double() * count / batch
        dist.all_reduce(total)
        return float(total)

    def train_step(self, commit=None, applied=None) -> StepResult:
        """One optimizer step. `commit(step)`, when given, is asked once the step's gradients and
        loss are known and before anything of the state changes: False aborts the step
        (`StepAborted`), leaving the state as it was (an elastic run's workers vote so); None leaves
        the step pending, its gradients kept and nothing of the state changed, until
        `apply_pending` or `drop_pending` (an elastic worker that could not learn the vote's
        outcome). `applied()`, when given, runs once the optimizer has stepped, within the step's
        time (an elastic run's copies of other workers' pieces step then)."""
        self.state.check_usable()
        cfg, layout, progress = self.cfg, self.cfg.layout, self.progress
        start, graphs = time.perf_counter(), compiled_graphs()
        reset_peak(self.par.device)
        inputs, targets = self.stream.batch(progress.position, layout.data_rank(self.par.coord), layout.data_parallel)
        inputs, targets = inputs.to(self.par.device), targets.to(self.par.device)
        lr = cfg.optim.lr_at(progress.step, cfg.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

        with cfg.autocast(self.par.device.type):
            local_loss = self._forward_backward(inputs, targets)
        sum_partial_gradients(self.model)
        average_over_ep(self.model, cfg.model, self.par)
        ranks_per_stage = layout.dp * layout.fsdp * layout.ep * layout.tp
        grad_norm = clip_grad_norm(self.model, cfg.optim.grad_clip, ranks_per_stage)
        loss = self._global_loss(local_loss)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            raise Diverged(progress.step + 1, f"loss {loss}, gradient norm {grad_norm}")
        decision = True if commit is None else commit(progress.step + 1)
        if decision is False:
            self.optimizer.zero_grad(set_to_none=True)
            raise StepAborted(progress.step + 1)
        if decision is None:
            self._pending = (applied,)
        else:
            self._apply(applied)
        elapsed = time.perf_counter() - start
        peak = torch.tensor([peak_bytes(self.par.device)], dtype=torch.int64, device=self.par.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # after the step's time: a figure, not part of the step
        tokens_per_s = cfg.tokens_per_step / elapsed
        flops_per_s = cfg.model.flops_per_token() * tokens_per_s
        device_peak = device_peak_flops(self.par.device)
        return StepResult(step=progress.step + (decision is None), loss=loss, grad_norm=grad_norm, lr=lr,
                          step_time_s=elapsed, tokens_per_s=tokens_per_s, applied=decision is not None,
                          peak_memory=int(peak), flops_per_s=flops_per_s,
                          mfu=None if device_peak is None else flops_per_s / (device_peak * layout.world_size),
                          compiled=compiled_graphs() - graphs)

    def apply_pending(self) -> None:
        """Apply the step `train_step` left pending, from the gradients it kept."""
        assert self._pending is not None, "no step is pending"
        self._apply(self._pending[0])

    def drop_pending(self) -> None:
        """Abandon the step `train_step` left pending: the state stays as before it."""
        self.optimizer.zero_grad(set_to_none=True)
        self._pending = None

    def _apply(self, applied) -> None:
        self.optimizer.step()
        if applied is not None:
            applied()
        self.optimizer.zero_grad(set_to_none=True)
        self._pending = None
        self.progress.step += 1
        self.progress.position += self.cfg.global_batch
