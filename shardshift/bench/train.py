"""`shardshift bench train`: throughput of ShardShift layouts beside plain PyTorch DDP, measured in
the same processes.

    shardshift bench train --nproc 4 --layout dp=4 --also 'fsdp=4;tp=4'
    shardshift bench train --nproc 4 --layout dp=4 --also fsdp=4 --topology hetero4x.yaml --emulate
    shardshift bench train --nproc 2 --layout fsdp=2 --also 'fsdp=2 --activation-checkpointing full;fsdp=2 --compile'

Every variant trains the same model on the same batches with the same optimizer. A variant is a
layout, and may set the trainer's own knobs beside it (`Variant`: activation checkpointing,
compile, mixed precision, micro-batch size), as `shardshift train`'s flags. The variants take
turns: after a warm-up, each round runs `steps` steps of every variant in order, so slow drifts of a
noisy machine hit them all alike. Tokens/s are computed from the summed time of each variant. After
the rounds, one more step of each gives its working memory (`train.memory.working_bytes`: what the
step takes beyond the state, on the rank that takes most).

With `topology`, every layout is trained twice, its data-parallel collectives on gloo and on packed
trees (`--collectives trees`), and `emulate` runs the ranks on that network, emulated
(`shardshift.netemu`: every ordered pair of ranks shaped to its rate × `emulate_scale`), so that
gloo's ring and the trees meet the links they would meet there.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from shardshift.console import say
from shardshift.data.corpus import open_corpus
from shardshift.data.stream import BatchStream
from shardshift.layout import Layout
from shardshift.plots.canvas import check_drawable
from shardshift.runtime import run_in_group
from shardshift.train.config import TrainConfig
from shardshift.train.memory import working_bytes
from shardshift.train.optim import build_optimizer
from shardshift.train.trainer import Trainer
from shardshift.units import format_size

# The `shardshift train` flags a variant may give after its layout, and the `TrainConfig` field each sets.
VARIANT_FLAGS = {"--activation-checkpointing": "activation_checkpointing", "--compile": "compile",
                 "--mixed-precision": "mixed_precision", "--micro-batch-size": "micro_batch_size"}


@dataclasses.dataclass(frozen=True)
class Variant:
    """A row of the bench: a layout, and the trainer's settings beside it (``fsdp=2 --compile``)."""

    layout: Layout
    settings: tuple[tuple[str, object], ...] = ()  # (TrainConfig field, value), in the order given

    @classmethod
    def parse(cls, text: str) -> Variant:
        """``LAYOUT [FLAG VALUE]...`` with a flag of `VARIANT_FLAGS` (``--compile`` alone: inductor);
        ValueError naming what to write otherwise."""
        words = text.split()
        layout, rest, settings = Layout.parse(words[0]), words[1:], []
        while rest:
            flag = rest.pop(0)
            if flag not in VARIANT_FLAGS:
                raise ValueError(f"--also {text.strip()!r}: {flag!r} is not a flag a row takes; after its layout "
                                 f"give any of {', '.join(VARIANT_FLAGS)} with its value")
            if flag == "--compile" and (not rest or rest[0].startswith("--")):
                value: object = "inductor"
            elif not rest:
                raise ValueError(f"--also {text.strip()!r}: {flag} needs a value")
            else:
                value = rest.pop(0)
            if flag == "--micro-batch-size":
                if not str(value).isdigit():
                    raise ValueError(f"--also {text.strip()!r}: --micro-batch-size {value} is not a whole number")
                value = int(value)
            settings.append((VARIANT_FLAGS[flag], value))
        return cls(layout, tuple(settings))

    def __str__(self) -> str:
        flags = {field: flag for flag, field in VARIANT_FLAGS.items()}
        return " ".join([str(self.layout), *(f"{flags[field]} {value}" for field, value in self.settings)])


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainBenchOptions:
    """What `shardshift bench train` runs; validated when built (ValueError says what to change)."""

    base: TrainConfig  # model, dtype, batch, seed; its layout is the one compared with DDP
    also: tuple[Variant, ...] = ()  # more variants reported beside it
    nproc: int = 4
    steps: int = 3  # timed steps per variant per round
    rounds: int = 3
    warmup: int = 2  # untimed steps per variant first
    timeout_s: float = 600.0
    json: bool = False
    topology: str | None = None  # a YAML file: train each layout on gloo and on trees packed on it
    emulate: bool = False  # run the ranks on `topology`'s links, emulated
    emulate_scale: float = 1.0  # emulated rate / topology rate
    plot: Path | None = None  # rank 0 draws the report here (a PNG) once it exists

    def __post_init__(self) -> None:
        for name in ("steps", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} {getattr(self, name)} must be >= 1")
        if self.warmup < 0:
            raise ValueError(f"--warmup {self.warmup} must be >= 0")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout {self.timeout_s} must be > 0 seconds")
        if self.base.steps < self.warmup + self.steps * self.rounds:
            raise ValueError(f"the run's --steps {self.base.steps} is shorter than the bench's "
                             f"{self.warmup + self.steps * self.rounds} steps per variant")
        if self.emulate and self.topology is None:
            raise ValueError("--emulate needs --topology FILE: the network to emulate")
        for variant in self.variants:
            variant.layout.check_world(self.nproc)
            for collectives in self.collectives:
                self.config(variant, collectives)  # refuses what the model, batch or topology cannot take
        if self.plot is not None:
            check_drawable(self.plot, "--plot")

    @property
    def collectives(self) -> tuple[str, ...]:
        return ("gloo", "trees") if self.topology is not None else ("gloo",)

    def config(self, variant: Variant, collectives: str) -> TrainConfig:
        trees = collectives == "trees"
        return dataclasses.replace(self.base.with_layout(variant.layout), collectives=collectives,
                                   topology=self.topology if trees else None, **dict(variant.settings))

    @property
    def variants(self) -> tuple[Variant, ...]:
        return (Variant(self.base.layout), *self.also)


class PlainDDP:
    """The baseline: the whole model on every rank, wrapped in `DistributedDataParallel`."""

    def __init__(self, cfg: TrainConfig, rank: int, device: torch.device, stream: BatchStream):
        self.cfg, self.rank, self.stream = cfg, rank, stream
        self.world = dist.get_world_size()
        model = cfg.model.build().to(cfg.param_dtype)
        cfg.model.init_buffers(model)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(cfg.model.init_value(name, param.shape, param.dtype, cfg.seed))
        self.model = DistributedDataParallel(model.to(device))
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.device = device
        self.position = 0

    def train_step(self) -> None:
        inputs, targets = self.stream.batch(self.position, self.rank, self.world)
        with self.cfg.autocast(self.device.type):
            loss = self.cfg.model.loss(self.model(inputs.to(self.device)), targets.to(self.device))
            loss.backward()
        if self.cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(loss.detach())  # the global loss, as ShardShift's step reports it
        self.position += self.cfg.global_batch


@dataclasses.dataclass(frozen=True)
class Throughput:
    """One variant's timed steps, summed over the rounds (what `run_bench` measures)."""

    name: tuple[str, str]  # ("ddp" or a variant, "gloo" or "trees")
    steps: int
    seconds: float
    tokens_per_s: float
    working_bytes: int = 0  # what one step takes beyond the state, on the rank that takes most


@dataclasses.dataclass(frozen=True)
class ThroughputRow:
    """One variant in the report, beside DDP and beside the same layout on gloo (a row of ``rows``)."""

    impl: str  # "ddp" or a variant (`Variant`: a layout and the trainer's settings beside it)
    layout: str  # the same, under the name the report's table gives it
    collectives: str  # "gloo" (the process group's own: NCCL's on CUDA) or "trees"
    tokens_per_s: float
    seconds: float
    steps: int
    working_bytes: int  # what one step takes beyond the state (`train.memory.working_bytes`)
    ratio_vs_ddp: float  # tokens/s ÷ DDP's
    ratio_vs_gloo: float  # tokens/s ÷ the same layout's on gloo


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainBenchResult:
    """What ``--json`` prints."""

    model: str
    nproc: int
    device: str  # "cpu" or "cuda"
    backend: str  # what "gloo" stands for on `device`: "gloo", or "nccl" on CUDA
    topology: str | None  # the YAML file the trees are packed on
    emulate_scale: float | None  # emulated rate / topology rate, where the network was emulated
    rows: tuple[ThroughputRow, ...]

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "rows": [dataclasses.asdict(row) for row in self.rows]}


def start(opts: TrainBenchOptions, argv: list[str]) -> int:
    """Start the ranks, each running ``shardshift <argv>`` (`run_rank`), on loopback or inside the
    emulated network; the job's exit status."""
    from shardshift.launch import launch

    if not opts.emulate:
        return launch(opts.nproc, argv, preload=(__name__,), timeout_s=opts.timeout_s)
    from shardshift.collectives.topology.io import load_topology
    from shardshift.netemu import EmulatedNetwork, emulation_rates, netns_unavailable_reason

    reason = netns_unavailable_reason()
    if reason is not None:
        raise ValueError(f"--emulate: {reason}")
    with EmulatedNetwork(emulation_rates(load_topology(opts.topology), opts.emulate_scale), opts.nproc) as net:
        return launch(opts.nproc, argv, spawn=net.spawn, timeout_s=opts.timeout_s)


def run_rank(opts: TrainBenchOptions) -> int:
    """One rank's part of the bench; rank 0 prints the report."""
    proc, results = run_in_group(opts.timeout_s, lambda proc: run_bench(opts, proc.rank, proc.device_type))
    if proc.rank == 0:
        result = report(opts, results, proc.device_type)
        if opts.plot is not None:
            from shardshift.plots.bench import draw_train_bench

            draw_train_bench(result, opts.plot)
            say(f"wrote {opts.plot}", "stderr")
    return 0


def run_bench(opts: TrainBenchOptions, rank: int, device_type: str) -> list[Throughput]:
    """DDP and every layout of `opts`, measured in turns (see the module docstring)."""
    base, steps, rounds, warmup = opts.base, opts.steps, opts.rounds, opts.warmup
    corpus = open_corpus(base.data)
    variants: dict[tuple[str, str], object] = {}
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    stream = BatchStream(corpus.train, base.model.seq_len, base.global_batch, base.seed)
    variants["ddp", "gloo"] = PlainDDP(base, rank, device, stream)
    for variant in opts.variants:
        for collectives in opts.collectives:
            variants[str(variant), collectives] = Trainer(opts.config(variant, collectives), rank, device_type,
                                                          corpus=corpus, timeout_s=opts.timeout_s)
    seconds = dict.fromkeys(variants, 0.0)
    for name, variant in variants.items():
        for _ in range(warmup):
            variant.train_step()
    for _ in range(rounds):
        for name, variant in variants.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                variant.train_step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the steps' kernels done, not only queued
            dist.barrier()
            seconds[name] += time.perf_counter() - start
    working = {}
    for name, variant in variants.items():
        dist.barrier()
        held = torch.tensor([working_bytes(variant.train_step, device)], dtype=torch.int64, device=device)
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
        working[name] = int(held)
    total = steps * rounds
    return [
        Throughput(name, total, seconds[name], total * base.tokens_per_step / seconds[name], working[name])
        for name in variants
    ]


def report(opts: TrainBenchOptions, results: list[Throughput], device_type: str) -> dict:
    """Print the throughputs: one JSON object, or the table. Returns that object (what ``--json`` prints)."""
    ddp = results[0]
    gloo = {r.name[0]: r.tokens_per_s for r in results if r.name[1] == "gloo"}
    rows = tuple(
        ThroughputRow(impl=r.name[0], layout=r.name[0], collectives=r.name[1], tokens_per_s=r.tokens_per_s,
                      seconds=r.seconds, steps=r.steps, working_bytes=r.working_bytes,
                      ratio_vs_ddp=r.tokens_per_s / ddp.tokens_per_s,
                      ratio_vs_gloo=r.tokens_per_s / gloo[r.name[0]])
        for r in results
    )
    base = opts.base
    # "gloo" names the process group's own collectives: NCCL's on CUDA.
    own = "nccl" if device_type == "cuda" else "gloo"
    result = TrainBenchResult(model=base.model.name, nproc=opts.nproc, device=device_type, backend=own,
                              topology=opts.topology, emulate_scale=opts.emulate_scale if opts.emulate else None,
                              rows=rows).as_dict()
    if opts.json:
        print(json.dumps(result))
        return result
    where = f", on {opts.topology}" + (f" emulated at {opts.emulate_scale:.4g} × its rates" if opts.emulate
                                       else " (loopback)") if opts.topology else ""
    print(f"model {base.model.name}, {opts.nproc} {device_type} ranks{where}, global batch {base.global_batch}, "
          f"{ddp.steps} timed steps per variant")
    width = max(16, *(len(row.layout) + 2 for row in rows))
    print(f"{'layout':<{width}}{'collectives':<13}{'tokens/s':>12}{'vs DDP':>9}{'vs ' + own:>9}{'working mem':>13}")
    for row in rows:
        shown = own if row.collectives == "gloo" else row.collectives
        print(f"{row.layout:<{width}}{shown:<13}{row.tokens_per_s:>12,.0f}{row.ratio_vs_ddp:>9.3f}"
              f"{row.ratio_vs_gloo:>9.3f}{format_size(row.working_bytes):>13}")
    return result
