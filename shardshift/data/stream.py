"""Global batches whose samples do not depend on the layout or the world size.

A split's token stream is cut into non-overlapping windows of ``seq_len + 1`` tokens (window ``w``
starts at token ``w * seq_len``: each window's last token is the next one's first, so every token
but the first is a target once). Epoch ``e`` visits the windows in the order of a permutation drawn
from ``(seed, e)`` (`order.permute`: computed per index, so no array of the windows exists); the
stream of samples is the concatenation of epochs. The global batch at position ``p`` (samples
consumed so far) is samples ``p .. p + B - 1``, and data rank ``r`` of ``D`` reads a contiguous
slice of it (`data_slice`: ``B / D`` each when ``D`` divides ``B``, else the first ``B mod D`` ranks
read one more). So the global batch at step ``k`` is the same samples under every layout and every
world size, and the position ``p`` is the whole of the data state (saved in checkpoints and carried
across switches and changes of world).

Where the slices differ in length, each rank's mean loss is weighted by its share of the batch
(`loss_weight`), so the gradient is still that of the global mean loss.

The held-out split is read in order, with no shuffling: evaluation batch ``j`` is windows
``j * B .. j * B + B - 1`` (modulo the split's windows), split among the data ranks alike.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from shardshift.data.corpus import Tokens
from shardshift.data.order import permute

if TYPE_CHECKING:
    import torch


def data_slice(global_batch: int, data_parallel: int, data_rank: int) -> tuple[int, int]:
    """(start, count) of data rank `data_rank`'s slice of a global batch split among `data_parallel`:
    contiguous, as even as can be, the longer slices first."""
    base, extra = divmod(global_batch, data_parallel)
    return data_rank * base + min(data_rank, extra), base + (data_rank < extra)


def loss_weight(global_batch: int, data_parallel: int, data_rank: int) -> float:
    """What a data rank's mean loss is multiplied by before its backward, so that averaging the
    gradients over the data ranks (as DDP and FSDP do) gives the gradient of the mean over the
    global batch: the rank's share of the batch times the number of data ranks (1 on an even split)."""
    _, count = data_slice(global_batch, data_parallel, data_rank)
    return 1.0 if global_batch % data_parallel == 0 else count * data_parallel / global_batch


def window_count(tokens: int, seq_len: int) -> int:
    """Windows of ``seq_len + 1`` tokens a stream of `tokens` holds."""
    return max(0, (tokens - 1) // seq_len)


@dataclasses.dataclass(frozen=True, eq=False)
class BatchStream:
    """Global batches of ``global_batch`` windows of `tokens` (the module docstring gives the order)."""

    tokens: Tokens
    seq_len: int
    global_batch: int
    seed: int
    what: str = "the text"  # the stream, for messages
    unit: str = "tokens"  # what its ids are, for messages

    def __post_init__(self) -> None:
        if self.num_windows < self.global_batch:
            raise ValueError(
                f"{self.what} has {len(self.tokens)} {self.unit}: {self.num_windows} windows of "
                f"seq_len+1={self.seq_len + 1} {self.unit}, fewer than one global batch of "
                f"{self.global_batch}; use more data, a shorter sequence or a smaller batch"
            )

    @property
    def num_windows(self) -> int:
        return window_count(len(self.tokens), self.seq_len)

    def window_ids(self, position: int, count: int) -> np.ndarray:
        """Samples ``position .. position + count - 1`` of the shuffled stream, as window indices."""
        epochs, within = np.divmod(np.arange(position, position + count, dtype=np.int64), self.num_windows)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            out[chosen] = permute(within[chosen], self.num_windows, self.seed, int(epoch))
        return out

    def batch(self, position: int, data_rank: int, data_parallel: int) -> tuple["torch.Tensor", "torch.Tensor"]:
        """Inputs and targets (local_batch, seq_len) int64 of one data rank at stream `position`."""
        start, count = data_slice(self.global_batch, data_parallel, data_rank)
        assert count > 0, (self.global_batch, data_parallel, data_rank)
        return self._rows(self.window_ids(position + start, count))

    def held_out(self, index: int, data_rank: int, data_parallel: int) -> tuple["torch.Tensor", "torch.Tensor"]:
        """Inputs and targets of one data rank in evaluation batch `index`: windows in order."""
        start, count = data_slice(self.global_batch, data_parallel, data_rank)
        first = index * self.global_batch + start
        return self._rows(np.arange(first, first + count, dtype=np.int64) % self.num_windows)

    def _rows(self, ids: np.ndarray) -> tuple["torch.Tensor", "torch.Tensor"]:
        import torch  # here: a launcher reads the data to check it, and never batches it

        rows = np.stack([self.tokens.read(int(w) * self.seq_len, self.seq_len + 1) for w in ids])
        rows_t = torch.from_numpy(rows)
        return rows_t[:, :-1].contiguous(), rows_t[:, 1:].contiguous()
