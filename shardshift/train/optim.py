"""AdamW over a rank's local shards, and gradient clipping by the norm of the whole model.

The global gradient norm is the norm of the logical gradient, not of what one rank holds. Each rank
adds up the squares of its local gradient pieces, weighting every piece by one over the number of
ranks that hold an identical copy of it, and one all-reduce over all ranks sums those contributions.
A copy is held by every rank of the stage that shares the piece's shard coordinates: for a DTensor,
the stage's ranks divided by the number of distinct shards (the product of the mesh sizes along its
sharded axes); for a plain tensor, every rank of the stage. Pipeline stages hold disjoint
parameters, so the world-wide sum counts every logical element exactly once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardshift.train.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig,
                    state: Mapping[str, dict[str, torch.Tensor]] | None = None) -> torch.optim.AdamW:
    """AdamW over `model`'s parameters, with its state present for every parameter from the start:
    ``state[fqn]`` (``exp_avg``, ``exp_avg_sq``, ``step``) where given, as a switch moves it, else
    what AdamW's first step would create (zero moments, step 0), so that the state can be listed,
    saved and moved before any step."""
    decay, no_decay = [], []
    for param in model.parameters():
        (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # foreach=False: parameters live on different meshes (tp-only, fsdp, plain), which the fused
    # multi-tensor kernels do not group across; the per-parameter loop is exact and cheap here.
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=False)
    for fqn, param in model.named_parameters():
        if state is not None:
            optimizer.state[param] = {kind: state[fqn][kind] for kind in ("step", "exp_avg", "exp_avg_sq")}
        else:  # as AdamW initialises a parameter's state (a 0-d float32 step on the CPU)
            optimizer.state[param] = {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
            }
    return optimizer


def _copies(param: torch.Tensor, ranks_per_stage: int) -> int:
    if not isinstance(param, DTensor):
        return ranks_per_stage
    assert not any(p.is_partial() for p in param.placements), param.placements
    # Every non-Replicate placement splits the tensor: Shard and FSDP's _StridedShard (which is not
    # a Shard subclass) alike.
    shards = math.prod(
        param.device_mesh.size(axis)
        for axis, placement in enumerate(param.placements)
        if not placement.is_replicate()
    )
    assert ranks_per_stage % shards == 0, (ranks_per_stage, shards, param.placements)
    return ranks_per_stage // shards


@torch.no_grad()
def clip_grad_norm(model: nn.Module, max_norm: float, ranks_per_stage: int, group=None) -> float:
    """Scale gradients so their global norm is at most `max_norm`; returns the norm before clipping.

    `ranks_per_stage` is dp * fsdp * tp; `group` spans all ranks (None: the default group).
    A `max_norm` of 0 only measures.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for grad in grads:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        total += local.double().square().sum() / _copies(grad, ranks_per_stage)
    dist.all_reduce(total, group=group)
    norm = float(total.sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for grad in grads:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            local.mul_(scale)
    return norm
