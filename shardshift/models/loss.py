"""The loss of the built-in language models: mean next-token cross entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of logits (b, t, vocab) against targets (b, t).

    bfloat16 logits are upcast to float32 for the softmax; other dtypes are kept exact.
    """
    if logits.dtype == torch.bfloat16:
        logits = logits.float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
