"""Expert parallelism's token exchange: each token slot goes to the rank holding its expert and its
output comes back, by all-to-all within the ``ep`` group (gloo's ``all_to_all_single`` on the CPU,
NCCL's on CUDA).

Under ``ep = P`` the E experts of a layer are split into P contiguous runs of E / P: rank p of the
group holds experts ``p·E/P .. (p+1)·E/P - 1``. A block gives the dispatcher its token slots sorted
by expert (``rows``, ``counts[e]`` of them for expert e, `models.moe.model`); the dispatcher

1. sends each rank the rows of its experts: rank q's rows for rank p are the ``p``-th run of its
   ``counts`` (the counts themselves go first, one all-to-all of P x E/P numbers);
2. groups what arrived by expert, each expert's rows in the order of the ranks they came from, and
   runs the held experts on them (``experts(held_rows, held_counts)``);
3. sends each output back to the rank its row came from, in the order it was sent.

No slot is dropped (no capacity), so every layout computes every token's experts. The exchanges
are autograd functions: the backward sends the outputs' gradients the same way back, and each
expert's gradient sums the gradients of the rows of every rank of the group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardshift.compat import all_to_all_autograd


class AllToAllDispatch:
    """The dispatch of a block whose experts are split over the ``ep`` ranks of `group` (a plain
    object, not a module: it holds no state a checkpoint or a switch would see)."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int) -> None:
        self.group, self.size = group, dist.get_world_size(group)
        assert num_experts % self.size == 0, (num_experts, self.size)
        self.held = num_experts // self.size

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        """rows (m, hidden) sorted by global expert, counts (E,) -> each row's expert output (m, hidden)."""
        size, held = self.size, self.held
        sent = counts.view(size, held)  # [p, i]: rows for rank p's i-th expert
        got = torch.empty_like(sent)
        dist.all_to_all_single(got, sent.contiguous(), group=self.group)  # [q, i]: rows from rank q for my i-th
        sent_splits, got_splits = sent.sum(dim=1).tolist(), got.sum(dim=1).tolist()
        arrived = _exchange(rows, got_splits, sent_splits, self.group)  # grouped by source rank, then expert
        order = _by_expert(got)  # arrived rows grouped by my expert, each expert's by source rank
        out = experts(arrived[order], got.sum(dim=0))
        back = torch.empty_like(order)
        back[order] = torch.arange(len(order), device=order.device)
        return _exchange(out[back], sent_splits, got_splits, self.group)


def _exchange(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """All-to-all of `rows` (split by `in_splits` among the ranks) into rows split by `out_splits`,
    differentiable (PyTorch's functional collective: ``torch.distributed.nn``'s is deprecated)."""
    return all_to_all_autograd(rows.contiguous(), out_splits, in_splits, group)


def _by_expert(got: torch.Tensor) -> torch.Tensor:
    """The permutation that takes rows arrived grouped by source rank q, then by held expert i
    (``got[q, i]`` rows each), to rows grouped by i, then by q."""
    size, held = got.shape
    starts = torch.cumsum(got.reshape(-1), 0) - got.reshape(-1)  # where block (q, i) starts, q-major
    starts = starts.view(size, held)
    pieces = [torch.arange(int(starts[q, i]), int(starts[q, i] + got[q, i]), device=got.device)
              for i in range(held) for q in range(size)]
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64, device=got.device)
