"""Training runs to compare: the test model's configuration, and a rank's state gathered or dumped
so that runs under different layouts can be compared element for element."""

from __future__ import annotations

import json

import torch
from torch.distributed.tensor import DTensor

from shardshift.train.state import local

# Elements that are near zero (biases start at 0) cannot be compared relatively; they are sums of
# O(1) terms, so 1e-12 absolute is still about 1e4 ulps of those terms.
ATOL = 1e-12


def materialised(spec, dtype=torch.float64, seed: int = 0) -> torch.nn.Module:
    """`spec`'s whole model on the CPU, filled as a trainer fills it (`init_value`, `init_buffers`),
    in eval mode."""
    model = spec.build().to(dtype)
    with torch.no_grad():
        for fqn, param in model.named_parameters():
            param.copy_(spec.init_value(fqn, param.shape, param.dtype, seed))
    spec.init_buffers(model)
    return model.eval()


def full_parameters(trainer) -> dict[str, torch.Tensor]:
    """Every parameter this rank's stage holds, gathered whole (a collective over the stage)."""
    out = {}
    for name, param in trainer.model.named_parameters():
        out[name] = (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()
    return out


def local_state(trainer) -> dict[str, torch.Tensor]:
    """Every logical tensor this rank holds, by key, as plain local tensors (copies)."""
    return {key: local(t).detach().clone() for key, t in trainer.state.tensors().items()}


def differences(a: dict, b: dict) -> list[str]:
    """Keys whose tensors are not bit-identical (dtype, shape and every bit), or not in both."""
    bad = sorted(set(a) ^ set(b))
    for key in sorted(set(a) & set(b)):
        x, y = a[key], b[key]
        same = x.dtype == y.dtype and x.shape == y.shape
        if not same or not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            bad.append(key)
    return bad


def metrics(path) -> list[dict]:
    """The records of a `--metrics` file."""
    return [json.loads(line) for line in open(path)]


def step_losses(path) -> dict[int, float]:
    """The loss of every step of a `--metrics` file (the last record of a step that was run again
    after a resume)."""
    return {r["step"]: r["loss"] for r in metrics(path) if "loss" in r}
