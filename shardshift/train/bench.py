"""Throughput of ShardShift layouts beside plain PyTorch DDP, measured in the same processes.

Every variant trains the same model on the same batches with the same optimizer. The variants take
turns: after a warm-up, each round runs `steps` steps of every variant in order, so slow drifts of a
noisy machine hit them all alike. Tokens/s are computed from the summed time of each variant.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from shardshift.layout import Layout
from shardshift.train.config import TrainConfig
from shardshift.train.data import BatchStream, load_tokens
from shardshift.train.model import GPT, init_value, loss_fn
from shardshift.train.optim import build_optimizer
from shardshift.train.trainer import Trainer


class PlainDDP:
    """The baseline: the whole model on every rank, wrapped in `DistributedDataParallel`."""

    def __init__(self, cfg: TrainConfig, rank: int, device: torch.device, stream: BatchStream):
        self.cfg, self.rank, self.stream = cfg, rank, stream
        self.world = dist.get_world_size()
        model = GPT(cfg.model).to(cfg.param_dtype)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(init_value(cfg.model, name, param.shape, param.dtype, cfg.seed))
        self.model = DistributedDataParallel(model.to(device))
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.device = device
        self.position = 0

    def train_step(self) -> None:
        inputs, targets = self.stream.batch(self.position, self.rank, self.world)
        with self.cfg.autocast(self.device.type):
            loss = loss_fn(self.model(inputs.to(self.device)), targets.to(self.device))
            loss.backward()
        if self.cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(loss.detach())  # the global loss, as ShardShift's step reports it
        self.position += self.cfg.global_batch


@dataclasses.dataclass(frozen=True)
class Throughput:
    name: str  # "ddp" or a layout
    steps: int
    seconds: float
    tokens_per_s: float


def run_bench(base: TrainConfig, layouts: list[Layout], rank: int, device_type: str, steps: int, rounds: int, warmup: int) -> list[Throughput]:
    tokens = load_tokens(base.data)
    variants: dict[str, object] = {}
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    stream = BatchStream(tokens, base.model.seq_len, base.global_batch, base.seed)
    variants["ddp"] = PlainDDP(base, rank, device, stream)
    for layout in layouts:
        cfg = dataclasses.replace(base, layout=layout, micro_batches=0)
        variants[str(layout)] = Trainer(cfg, rank, device_type, tokens=tokens)
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
            dist.barrier()
            seconds[name] += time.perf_counter() - start
    total = steps * rounds
    return [
        Throughput(name, total, seconds[name], total * base.tokens_per_step / seconds[name])
        for name in variants
    ]
