"""Typed configuration of a training run, validated before any process starts."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from shardshift.data.stream import data_slice
from shardshift.layout import Layout
from shardshift.reshard.schedule import DEFAULT_BUDGET, MIN_BUDGET

if TYPE_CHECKING:
    import torch

    from shardshift.models.spec import ModelSpec

DTYPES = ("float32", "float64", "bfloat16")  # the --dtype names, each a torch dtype's (`torch_dtype`)


def torch_dtype(name: str) -> "torch.dtype":
    """The torch dtype `name` of `DTYPES` stands for (torch is imported here, not by the module: a
    launcher checks a configuration without it)."""
    import torch

    return getattr(torch, name)
COLLECTIVES = ("gloo", "trees")  # `TrainConfig.collectives`
# torch.compile's backends that --compile takes (`train.compiling`): inductor generates kernels (what
# training wants); aot_eager traces each layer's forward and backward into graphs that eager kernels
# run (the capture, checked at a fraction of inductor's cost: what the tests use); eager runs what
# dynamo captures, with autograd as usual.
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at the last step
    warmup_steps: int = 10
    weight_decay: float = 0.1  # applied to matrices (2-D and up) only
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"--lr {self.lr} must be > 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio} must lie in [0, 1]")
        if self.warmup_steps < 0:
            raise ValueError(f"--warmup {self.warmup_steps} must be >= 0")
        if self.grad_clip < 0:
            raise ValueError(f"--grad-clip {self.grad_clip} must be >= 0 (0 disables clipping)")

    def lr_at(self, step: int, total_steps: int) -> float:
        """Learning rate of optimizer step `step` (0-based): linear warmup, then cosine decay."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        low = self.lr * self.min_lr_ratio
        return low + (self.lr - low) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    layout: Layout
    model: ModelSpec  # what is trained (`shardshift.models`); its name is --model's
    steps: int  # length of the run in optimizer steps: the LR schedule's horizon
    stop_at: int = 0  # stop after this global step (0: at `steps`); a resumed run goes on from its step
    seed: int = 0
    dtype: str = "float32"
    global_batch: int = 16  # sequences per optimizer step, summed over data-parallel ranks
    micro_batches: int = 0  # per data rank, under pp; 0 means 2 * pp (for every layout switched to)
    # At most this many sequences in one forward (0: a rank's whole share of the batch): a rank runs
    # its share in as many micro-batches as it needs and sums their gradients (under pp, they are
    # the pipeline's micro-batches). The global batch and the loss do not change.
    micro_batch_size: int = 0
    eval_every: int = 0  # held-out loss every K steps (and at the last); 0: never
    activation_checkpointing: str = "none"  # none, full or selective, per layer (`train.checkpointing`)
    # "bf16": FSDP2 computes and gathers bfloat16 copies of the float32 parameters and reduces in float32
    # (`parallelize.build_stage_skeleton`); bfloat16 autocast around what FSDP2 does not hold.
    mixed_precision: str = "none"
    # "none", or the torch.compile backend that compiles each layer's forward (`train.compiling`)
    compile: str = "none"
    eval_batches: int = 4  # global batches of the held-out split each evaluation reads
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    data: str | None = None  # text file; None means the shipped corpus
    save: str | None = None  # checkpoint directory
    save_every: int = 0  # save every K steps (and at the end) when `save` is set; 0: only at the end
    keep_checkpoints: int = 0  # keep the newest K checkpoints in `save` (0: all)
    resume: str | None = None  # checkpoint directory (or one checkpoint in it); "auto": `save`'s, if any
    metrics: str | None = None  # JSONL file that rank 0 appends one object per step to
    tensorboard: str | None = None  # directory of rank 0's TensorBoard event files (`train.tensorboard`)
    log_every: int = 1
    # Online layout switches: (step, layout) switches before that step (1-based) runs.
    switches: tuple[tuple[int, Layout], ...] = ()
    switch_budget: int = DEFAULT_BUDGET  # bytes a switch may hold beyond max(old state, new state)
    # Where the data-parallel collectives run (DDP's gradient all-reduce, FSDP2's all-gathers and
    # reduce-scatters): "gloo" (or NCCL), or "trees", packed trees on `topology` (the
    # `shardshift` backend: a YAML file or a spec of `collectives.topology.spec`; None: "full").
    collectives: str = "gloo"
    topology: str | None = None
    # An elastic job's: the topology file's ranks name hosts, and each world packs on the part its
    # workers' hosts see (`collectives.topology.spec.hosts_topology`), whatever its size.
    topology_by_host: bool = False
    plot: bool = False  # at the end, rank 0 draws the run beside its metrics (METRICS with .png)
    auto_micro_batches: bool = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
        if self.steps < 1:
            raise ValueError(f"--steps {self.steps} must be >= 1")
        if self.global_batch < 1:
            raise ValueError(f"--global-batch {self.global_batch} must be >= 1")
        if self.log_every < 0:
            raise ValueError(f"--log-every {self.log_every} must be >= 0 (0: print no steps)")
        if self.stop_at == 0:
            object.__setattr__(self, "stop_at", self.steps)
        if not 1 <= self.stop_at <= self.steps:
            raise ValueError(f"--stop-at {self.stop_at} must lie in [1, --steps {self.steps}]")
        if self.save_every < 0:
            raise ValueError(f"--save-every {self.save_every} must be >= 0")
        if self.save_every and not self.save:
            raise ValueError("--save-every needs --save DIR")
        if self.keep_checkpoints < 0:
            raise ValueError(f"--keep-checkpoints {self.keep_checkpoints} must be >= 0 (0 keeps all)")
        if self.keep_checkpoints and not self.save:
            raise ValueError("--keep-checkpoints needs --save DIR")
        if self.resume == "auto" and not self.save:
            raise ValueError("--resume auto resumes from --save's directory: give --save DIR too")
        if self.micro_batches < 0:
            raise ValueError(f"--micro-batches {self.micro_batches} must be >= 1")
        if self.micro_batch_size < 0:
            raise ValueError(f"--micro-batch-size {self.micro_batch_size} must be >= 1 (0: a rank's whole share)")
        if self.micro_batch_size and self.micro_batches:
            raise ValueError("--micro-batches and --micro-batch-size both set the pipeline's micro-batches; give one")
        if self.eval_every < 0:
            raise ValueError(f"--eval-every {self.eval_every} must be >= 0 (0: no held-out loss)")
        if self.eval_batches < 1:
            raise ValueError(f"--eval-batches {self.eval_batches} must be >= 1")
        if self.mixed_precision not in ("none", "bf16"):
            raise ValueError(f"--mixed-precision {self.mixed_precision!r}: choose none or bf16")
        if self.mixed_precision == "bf16" and self.dtype != "float32":
            raise ValueError(f"--mixed-precision bf16 keeps float32 parameters and computes in bfloat16: give --dtype "
                             f"float32 (the default), not {self.dtype}")
        if self.compile not in ("none", *COMPILE_BACKENDS):
            raise ValueError(f"--compile {self.compile!r}: choose a backend of {', '.join(COMPILE_BACKENDS)} (or none)")
        if self.activation_checkpointing not in ("none", "full", "selective"):
            raise ValueError(f"--activation-checkpointing {self.activation_checkpointing!r}: choose none, full or "
                             "selective")
        if self.tensorboard is not None and not self.tensorboard.strip():
            raise ValueError("--tensorboard '' names no directory; give one, e.g. --tensorboard runs/tb")
        if self.tensorboard is not None and importlib.util.find_spec("tensorboard") is None:
            raise ValueError("--tensorboard needs the tensorboard package: pip install 'shardshift[tensorboard]'")
        object.__setattr__(self, "auto_micro_batches", self.micro_batches == 0)
        if self.micro_batches == 0:
            object.__setattr__(self, "micro_batches", self._pipeline_micro_batches())
        self.model.check_layout(self.layout)
        self.check_batch(self.layout)
        self._check_collectives()
        self._check_switches()
        if self.plot and not self.metrics:
            raise ValueError("--plot draws the run from its metrics: give --metrics FILE (or --run-dir DIR) too")

    def _check_collectives(self) -> None:
        if self.collectives not in COLLECTIVES:
            raise ValueError(f"--collectives {self.collectives!r}: choose one of {', '.join(COLLECTIVES)}")
        if self.topology is None:
            return
        if self.collectives != "trees":
            raise ValueError("--topology describes the network the trees are packed on: give --collectives trees too")
        from shardshift.collectives.topology.io import load_topology
        from shardshift.collectives.topology.spec import is_probe, topology_from_spec
        from shardshift.textfile import FileError

        if self.topology_by_host and is_probe(self.topology):
            raise ValueError("--topology probe measures a fixed group; under --elastic give a YAML file whose ranks "
                             "name the hosts, or full[:RATE]")
        if self.topology_by_host and os.path.exists(self.topology.strip()):
            load_topology(self.topology.strip(), "--topology")  # hosts: checked as workers arrive
        elif not is_probe(self.topology):
            try:
                topology_from_spec(self.topology, self.layout.world_size, flag="--topology")
            except FileError:
                raise  # it names --topology and the file already
            except ValueError as err:
                raise ValueError(f"--topology: {err}") from None

    def _check_switches(self) -> None:
        previous = 0
        for step, layout in self.switches:
            if not previous < step <= self.steps:
                raise ValueError(
                    f"--switch {step}:{layout}: switch steps must increase and lie in [1, --steps {self.steps}]"
                )
            if layout.world_size != self.layout.world_size:
                raise ValueError(
                    f"--switch {step}:{layout} has {layout.world_size} ranks but the job has "
                    f"{self.layout.world_size}; choose degrees whose product is {self.layout.world_size}"
                )
            try:
                self.with_layout(layout)  # checks the model and the batch under `layout`
            except ValueError as err:
                raise ValueError(f"--switch {step}:{layout}: {err}") from None
            previous = step
        if self.switch_budget < MIN_BUDGET:
            raise ValueError(f"--switch-budget {self.switch_budget} bytes is too small; give at least 4K")

    @property
    def picture(self) -> str | None:
        """Where `plot` draws the run: beside the metrics, as .png."""
        return str(Path(self.metrics).with_suffix(".png")) if self.plot else None

    @property
    def resume_from(self) -> str | None:
        """The directory (or checkpoint) a resume looks in: `resume`, or `save` for "auto"."""
        return self.save if self.resume == "auto" else self.resume

    def _pipeline_micro_batches(self) -> int:
        """Micro-batches per data rank under pp when --micro-batches is not given: as many as
        --micro-batch-size asks for (of the largest local batch), else 2 * pp; 1 without pp."""
        layout = self.layout
        if layout.pp == 1:
            return 1
        if self.micro_batch_size:
            return -(-data_slice(self.global_batch, layout.data_parallel, 0)[1] // self.micro_batch_size)
        return 2 * layout.pp

    def micro_slices(self, count: int) -> list[int]:
        """How a local batch of `count` sequences is run outside pp: the sizes of its micro-batches,
        at most --micro-batch-size each, the longer first. Every data rank runs as many as the
        largest local batch needs (FSDP2 gathers and reduces once per micro-batch on each of
        them), so where the batch splits unevenly a shorter one may end in an empty micro-batch."""
        if not self.micro_batch_size:
            return [count]
        largest = data_slice(self.global_batch, self.layout.data_parallel, 0)[1]
        n = -(-largest // self.micro_batch_size)
        return [data_slice(count, n, i)[1] for i in range(n)]

    def with_layout(self, layout: Layout) -> "TrainConfig":
        """This configuration under another layout; ValueError if the model or batch cannot take it."""
        micro = 0 if self.auto_micro_batches else self.micro_batches
        return dataclasses.replace(self, layout=layout, micro_batches=micro, switches=())

    def check_batch(self, layout: Layout) -> None:
        """Every data rank gets a sequence of the batch (split as evenly as can be: `data_slice`)
        and, under pp, a local batch that splits into micro-batches."""
        d = layout.data_parallel
        if self.global_batch < d:
            raise ValueError(
                f"--global-batch {self.global_batch} leaves some of the dp*fsdp={d} data ranks without "
                f"a sequence; use a global batch of at least {d}"
            )
        if layout.pp > 1:
            counts = sorted({data_slice(self.global_batch, d, r)[1] for r in range(d)})
            if self.micro_batch_size and any(count % self.micro_batches for count in counts):
                raise ValueError(
                    f"under pp={layout.pp} the local batches of {' and '.join(map(str, counts))} sequences (global "
                    f"batch {self.global_batch} among {d} data rank{'s' if d > 1 else ''}) do not split into equal "
                    f"micro-batches of at most --micro-batch-size {self.micro_batch_size}; choose a micro-batch "
                    f"size dividing them"
                )
            if any(count % self.micro_batches for count in counts):
                raise ValueError(
                    f"the local batches of {' and '.join(map(str, counts))} sequences (global batch "
                    f"{self.global_batch} among {d} data rank{'s' if d > 1 else ''}) do not split into --micro-batches "
                    f"{self.micro_batches}; choose micro-batches dividing them, or a global batch that "
                    f"is a multiple of {d * self.micro_batches}"
                )
            if self.micro_batches < layout.pp and self.micro_batch_size:
                raise ValueError(
                    f"--micro-batch-size {self.micro_batch_size} cuts the local batch of {counts[-1]} sequences into "
                    f"{self.micro_batches} micro-batches, fewer than pp={layout.pp} stages (1F1B needs one per "
                    f"stage); choose a micro-batch size of at most {counts[-1] // layout.pp}"
                )
            if self.micro_batches < layout.pp:
                raise ValueError(
                    f"--micro-batches {self.micro_batches} is fewer than pp={layout.pp} stages; "
                    f"1F1B needs at least one micro-batch per stage"
                )
            if self.micro_batches == layout.pp and layout.dp > 1 and layout.fsdp == layout.tp == 1:
                # The first stage then runs every forward before any backward, and DDP's reducer (which
                # replicates the stages) records its parameters twice and fails the step after.
                raise ValueError(
                    f"{layout}: 1F1B with as many micro-batches as stages ({self.micro_batches}) breaks DDP's "
                    f"replication of the stages in PyTorch 2.13; choose more micro-batches (e.g. --micro-batches "
                    f"{2 * layout.pp}" + (", or a smaller --micro-batch-size)" if self.micro_batch_size else ")")
                )

    @property
    def param_dtype(self) -> "torch.dtype":
        """Dtype of parameters and optimizer state. Under ``bfloat16`` they stay float32 (master
        weights) and the forward and backward compute in bfloat16 under autocast."""
        return torch_dtype("float32" if self.dtype == "bfloat16" else self.dtype)

    def autocast(self, device_type: str):
        """The context the forward runs in: bfloat16 autocast (``--dtype bfloat16``, or around what
        FSDP2 does not hold under ``--mixed-precision bf16``), or nothing."""
        if self.dtype == "bfloat16" or self.mixed_precision == "bf16":
            import torch

            return torch.autocast(device_type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.model.seq_len
