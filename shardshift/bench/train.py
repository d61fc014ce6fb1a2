"""`shardshift bench train`: throughput of ShardShift layouts beside plain PyTorch DDP, measured in
the same processes.

    shardshift bench train --nproc 4 --layout dp=4 --also 'fsdp=4;tp=4'
    shardshift bench train --nproc 4 --layout dp=4 --also fsdp=4 --topology hetero4x.yaml --emulate

Every variant trains the same model on the same batches with the same optimizer. The variants take
turns: after a warm-up, each round runs `steps` steps of every variant in order, so slow drifts of a
noisy machine hit them all alike. Tokens/s are computed from the summed time of each variant.

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
from shardshift.train.optim import build_optimizer
from shardshift.train.trainer import Trainer


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainBenchOptions:
    """What `shardshift bench train` runs; validated when built (ValueError says what to change)."""

    base: TrainConfig  # model, dtype, batch, seed; its layout is the one compared with DDP
    also: tuple[Layout, ...] = ()  # more layouts reported beside it
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
        for layout in self.layouts:
            layout.check_world(self.nproc)
            for collectives in self.collectives:
                self.config(layout, collectives)  # refuses a layout the model, batch or topology cannot take
        if self.plot is not None:
            check_drawable(self.plot, "--plot")

    @property
    def collectives(self) -> tuple[str, ...]:
        return ("gloo", "trees") if self.topology is not None else ("gloo",)

    def config(self, layout: Layout, collectives: str) -> TrainConfig:
        trees = collectives == "trees"
        return dataclasses.replace(self.base.with_layout(layout), collectives=collectives,
                                   topology=self.topology if trees else None)

    @property
    def layouts(self) -> tuple[Layout, ...]:
        return (self.base.layout, *self.also)


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

    name: tuple[str, str]  # ("ddp" or a layout, "gloo" or "trees")
    steps: int
    seconds: float
    tokens_per_s: float


@dataclasses.dataclass(frozen=True)
class ThroughputRow:
    """One variant in the report, beside DDP and beside the same layout on gloo (a row of ``rows``)."""

    impl: str  # "ddp" or a layout
    layout: str  # the same, under the name the report's table gives it
    collectives: str  # "gloo" (the process group's own: NCCL's on CUDA) or "trees"
    tokens_per_s: float
    seconds: float
    steps: int
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
    for layout in opts.layouts:
        for collectives in opts.collectives:
            variants[str(layout), collectives] = Trainer(opts.config(layout, collectives), rank, device_type,
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
    total = steps * rounds
    return [
        Throughput(name, total, seconds[name], total * base.tokens_per_step / seconds[name])
        for name in variants
    ]


def report(opts: TrainBenchOptions, results: list[Throughput], device_type: str) -> dict:
    """Print the throughputs: one JSON object, or the table. Returns that object (what ``--json`` prints)."""
    ddp = results[0]
    gloo = {r.name[0]: r.tokens_per_s for r in results if r.name[1] == "gloo"}
    rows = tuple(
        ThroughputRow(impl=r.name[0], layout=r.name[0], collectives=r.name[1], tokens_per_s=r.tokens_per_s,
                      seconds=r.seconds, steps=r.steps, ratio_vs_ddp=r.tokens_per_s / ddp.tokens_per_s,
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
    print(f"{'layout':<16}{'collectives':<13}{'tokens/s':>12}{'vs DDP':>9}{'vs ' + own:>9}")
    for row in rows:
        shown = own if row.collectives == "gloo" else row.collectives
        print(f"{row.layout:<16}{shown:<13}{row.tokens_per_s:>12,.0f}{row.ratio_vs_ddp:>9.3f}{row.ratio_vs_gloo:>9.3f}")
    return result
