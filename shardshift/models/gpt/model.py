"""A GPT with a byte-level vocabulary, written with no parallelism inside it.

Parallelism is applied from outside (`shardshift.train.parallelize`, through the spec in `spec.py`).
Two conventions make that possible without the model knowing of it:

- blocks live in a `ModuleDict` keyed by their global index, so a pipeline stage that keeps blocks
  3..5 still names them ``blocks.3`` .. ``blocks.5`` and parameter names (FQNs) are the same in every
  layout, which is what checkpoints and the virtual parameter space key on;
- the embeddings, the final norm and the head may be removed (set to ``None``) on stages that do not
  own them; `forward` then passes hidden states through.

Attention infers its number of heads from the width of its projections, so a tensor-parallel rank
that holds ``n_head / tp`` heads' worth of columns computes exactly those heads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shardshift.models.gpt.config import GPTConfig
from shardshift.models.init import seeded_normal


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # (b, t, heads * head_dim) -> (b, heads, t, head_dim); heads = local heads under TP
        q, k, v = (proj(x).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb: nn.Embedding | None = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.ln_f: nn.LayerNorm | None = nn.LayerNorm(cfg.d_model)
        self.head: nn.Linear | None = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """tokens (b, t) int64 -> logits (b, t, vocab); on a middle pipeline stage (b, t, d) -> (b, t, d)."""
        if self.tok_emb is not None:
            t = x.shape[1]
            pos = torch.arange(t, device=x.device)
            x = self.tok_emb(x) + self.pos_emb(pos)  # (b, t, d)
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            x = self.head(self.ln_f(x))  # (b, t, vocab)
        return x


def init_value(cfg: GPTConfig, fqn: str, shape: torch.Size, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """The initial value of parameter `fqn`, as a full tensor.

    It depends only on (seed, fqn), never on the layout or on the order parameters are visited, so
    every layout starts from the same weights. GPT-2 style: normal(0, 0.02) weights, residual output
    projections scaled by 1/sqrt(2 n_layer), zero biases, unit norm gains.
    """
    module, leaf = fqn.split(".")[-2:]
    if module.startswith("ln"):  # LayerNorm gain and shift
        return torch.ones(shape, dtype=dtype) if leaf == "weight" else torch.zeros(shape, dtype=dtype)
    if leaf == "bias":
        return torch.zeros(shape, dtype=dtype)
    std = 0.02
    if fqn.endswith(("attn.out.weight", "mlp.proj.weight")):
        std = 0.02 / math.sqrt(2 * cfg.n_layer)
    return seeded_normal(fqn, shape, dtype, seed, std)

