"""Names shared by the planning modules: which collective, which way data flows along a tree.

Enums rather than strings, so a misspelt operation fails where it is written, not deep in a solver.
The `.value` strings are the names used on the command line and in JSON.
"""

from __future__ import annotations

from enum import Enum


class Collective(Enum):
    """A collective operation, in the nccl-tests / `torch.distributed` sense."""

    BROADCAST = "broadcast"
    REDUCE = "reduce"
    ALLREDUCE = "allreduce"
    ALLGATHER = "allgather"
    REDUCESCATTER = "reducescatter"

    @classmethod
    def parse(cls, name: str | Collective) -> Collective:
        """`Collective.parse("all_reduce")` → ALLREDUCE; underscores and dashes are ignored."""
        if isinstance(name, Collective):
            return name
        key = str(name).lower().replace("_", "").replace("-", "")
        for op in cls:
            if op.value == key:
                return op
        choices = ", ".join(op.value for op in cls)
        raise ValueError(f"unknown collective {name!r}; choose one of {choices}")

    @property
    def rooted(self) -> bool:
        """True for the ops that take a root rank (broadcast, reduce)."""
        return self in (Collective.BROADCAST, Collective.REDUCE)

    @property
    def sharded(self) -> bool:
        """True for the ops whose buffer is cut into one shard per rank (all-gather, reduce-scatter)."""
        return self in (Collective.ALLGATHER, Collective.REDUCESCATTER)

    def busbw_factor(self, num_ranks: int) -> float:
        """busbw / algbw in the nccl-tests convention: 2(n-1)/n, (n-1)/n, or 1 (broadcast, reduce)."""
        if self is Collective.ALLREDUCE:
            return 2 * (num_ranks - 1) / num_ranks
        return (num_ranks - 1) / num_ranks if self.sharded else 1.0


class Direction(Enum):
    """Which way data moves along a tree's edges."""

    OUT = "out"  # from the root towards the leaves: copies (broadcast, all-gather)
    IN = "in"  # from the leaves towards the root: partial sums (reduce, reduce-scatter)


class TransferKind(Enum):
    """What the receiver of a transfer does with the bytes."""

    COPY = "copy"  # overwrite the receiver's chunk with the sender's
    REDUCE = "reduce"  # add the sender's chunk into the receiver's
