"""Initial values that depend on (seed, parameter name) only, never on the layout or on the order
parameters are visited: every layout, and every rank of it, starts from the same weights."""

from __future__ import annotations

import zlib

import torch


def seeded_normal(fqn: str, shape: torch.Size, dtype: torch.dtype, seed: int, std: float) -> torch.Tensor:
    """normal(0, std) values of parameter `fqn`, whole, drawn from a generator seeded by (seed, fqn).

    They are drawn in float64 and cast, so every dtype starts from the same values, rounded.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(fqn.encode()))
    return torch.randn(shape, generator=generator, dtype=torch.float64).mul_(std).to(dtype)
