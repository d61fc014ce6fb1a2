"""Reduction operators the tree executor can apply exactly, and how each combines two chunks.

A REDUCE transfer combines the received chunk into the receiver's chunk; the schedule's trees
decide the order, so a float sum is associated differently than gloo's ring (same terms, other
rounding) while integer sums, products, minima and maxima are exact. AVG is a SUM followed by one
division by the group size where the result lands (floating dtypes only, as in gloo and NCCL).

`torch.distributed.ReduceOp` values that are not here (PREMUL_SUM, BAND, BOR, BXOR) raise
`UnsupportedReduction`, so the backend can hand the call to its inner group instead.
"""

from __future__ import annotations

from enum import Enum

import torch
import torch.distributed as dist


class UnsupportedReduction(ValueError):
    """The tree executor cannot apply this reduction exactly (the caller may delegate it)."""


class Reduction(Enum):
    SUM = "sum"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    AVG = "avg"

    @classmethod
    def parse(cls, op: Reduction | str | dist.ReduceOp | dist.ReduceOp.RedOpType) -> Reduction:
        """A Reduction from itself, its name, or a torch ReduceOp; UnsupportedReduction otherwise."""
        if isinstance(op, Reduction):
            return op
        if isinstance(op, str):
            try:
                return cls(op.lower())
            except ValueError:
                pass
        else:
            for torch_op, ours in _FROM_TORCH:
                if op == torch_op:
                    return ours
        choices = ", ".join(r.value for r in cls)
        raise UnsupportedReduction(f"reduction {op!r} is not run on trees; use one of {choices} "
                                   "(other ops go to the inner process group)")  # fmt: skip

    def check_dtype(self, dtype: torch.dtype) -> None:
        """AVG needs a floating dtype: an integer average would round differently per algorithm."""
        if self is Reduction.AVG and not (dtype.is_floating_point or dtype.is_complex):
            raise UnsupportedReduction(f"AVG of {dtype} is not run on trees; use SUM and divide, "
                                       "or a floating dtype")  # fmt: skip
        if dtype == torch.bool and self in (Reduction.SUM, Reduction.PRODUCT):
            raise UnsupportedReduction(f"{self.value} of torch.bool is not run on trees; use MIN or MAX")

    def combine(self, into: torch.Tensor, other: torch.Tensor) -> None:
        """into ← into ⊕ other, in place (AVG combines as SUM)."""
        if self is Reduction.SUM or self is Reduction.AVG:
            into.add_(other)
        elif self is Reduction.PRODUCT:
            into.mul_(other)
        elif self is Reduction.MIN:
            torch.minimum(into, other, out=into)
        else:
            torch.maximum(into, other, out=into)

    def finish(self, result: torch.Tensor, num_ranks: int) -> None:
        """Applied once to the reduced values where they land (AVG: divide by the group size)."""
        if self is Reduction.AVG:
            result.div_(num_ranks)


_FROM_TORCH = (
    (dist.ReduceOp.SUM, Reduction.SUM),
    (dist.ReduceOp.PRODUCT, Reduction.PRODUCT),
    (dist.ReduceOp.MIN, Reduction.MIN),
    (dist.ReduceOp.MAX, Reduction.MAX),
    (dist.ReduceOp.AVG, Reduction.AVG),
)
