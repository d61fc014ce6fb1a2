"""A Llama, written with no parallelism inside it, with Hugging Face's parameter names and arithmetic.

Every parameter has the name it has in ``transformers.LlamaForCausalLM`` (``model.embed_tokens``,
``model.layers.{i}.self_attn.{q,k,v,o}_proj``, ``model.layers.{i}.mlp.{gate,up,down}_proj``,
``model.layers.{i}.{input,post_attention}_layernorm``, ``model.norm``, ``lm_head``), the same
shape, and plays the same part: RMSNorm (``rms_norm_eps`` under the square root), rotary position
embeddings in the rotate-half convention (``rope_theta``), grouped-query attention scaled by
``head_dim ** -0.5``, a SwiGLU MLP, no biases. So a state dict moves to and from Hugging Face's
model unchanged. Where Hugging Face computes the norm and the rotary angles in float32 whatever
the model's dtype, this model computes them in float32 or in the model's dtype if that is wider
(float64): the same arithmetic for float32 and bfloat16, full precision for float64.

With tied embeddings (``tie_word_embeddings``) there is no ``lm_head`` module: the head multiplies
by ``model.embed_tokens.weight``, the one copy of the matrix (as Hugging Face's checkpoints of tied
models hold it once).

Parallelism is applied from outside (`shardshift.train.parallelize`, through `spec.py`), by the
same conventions as the GPT's (`models.gpt.model`):

- the layers live in a `ModuleDict` keyed by their global index (``model.layers.3``), so parameter
  names are the same on every pipeline stage and in every layout;
- the embedding (first stage), the final norm and the head (last stage) may be set to ``None`` on
  the stages that do not own them; `forward` then passes hidden states through;
- attention infers its numbers of query and key-value heads from the width of its projections,
  so a tensor-parallel rank that holds ``1/tp`` of each computes exactly its heads.

The rotary module's ``inv_freq`` is a buffer no checkpoint holds (as in Hugging Face's model);
`reset_rotary` (the spec's ``init_buffers``) fills it again once a model built on the meta device
is materialised.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shardshift.models.init import seeded_normal
from shardshift.models.llama.config import LlamaConfig


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or `dtype` if it is wider (float64)."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) times a gain per feature, over the last dim."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(_compute_dtype(dtype))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """``1 / theta ** (2i / head_dim)`` for i < head_dim / 2, in float64: the rotation speed of each
    pair of dims (i, i + head_dim / 2)."""
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


class RotaryEmbedding(nn.Module):
    """The cosines and sines of the rotary angles ``position * inv_freq`` of every position."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim, self.theta = cfg.head_dim, cfg.rope_theta
        self.register_buffer("inv_freq", inverse_frequencies(self.head_dim, self.theta).float(), persistent=False)

    @torch.no_grad()
    def reset(self) -> None:
        """Fill ``inv_freq`` (in its own dtype and device): after the meta device, or a change of dtype."""
        self.inv_freq.copy_(inverse_frequencies(self.head_dim, self.theta))

    def forward(self, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (seq_len, head_dim) of positions 0 .. seq_len - 1, in `dtype`."""
        inv_freq = self.inv_freq.to(_compute_dtype(self.inv_freq.dtype))
        positions = torch.arange(seq_len, device=inv_freq.device, dtype=inv_freq.dtype)
        angles = torch.outer(positions, inv_freq)  # (t, head_dim / 2)
        angles = torch.cat((angles, angles), dim=-1)  # (t, head_dim): dims i and i + head_dim / 2 share an angle
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dim's two halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair of dims (i, i + head_dim / 2) of x (b, heads, t, head_dim) by its angle."""
    return x * cos + rotate_half(x) * sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        h, kv = cfg.hidden_size, cfg.n_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, kv, bias=False)
        self.v_proj = nn.Linear(h, kv, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # (b, t, heads * head_dim) -> (b, heads, t, head_dim); heads = local heads under TP
        q, k, v = (proj(x).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = apply_rotary(q, cos.to(q.dtype), sin.to(q.dtype)), apply_rotary(k, cos.to(k.dtype), sin.to(k.dtype))
        # Key-value head j serves query heads j * group .. (j + 1) * group - 1 (Hugging Face's repeat_kv).
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (b, heads, t, head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.head_dim**-0.5)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """The decoder: Hugging Face's ``LlamaModel`` (``model.`` in parameter names)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): LlamaDecoderLayer(cfg) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """tokens (b, t) -> hidden states (b, t, h); on a stage without the embedding (b, t, h) ->
        (b, t, h); normalised on a stage with the final norm."""
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)  # (b, t, h)
        cos, sin = self.rotary_emb(x.shape[1], x.dtype)  # (t, head_dim) each
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        if self.norm is not None:
            x = self.norm(x)
        return x


class Llama(nn.Module):
    """The causal language model: Hugging Face's ``LlamaForCausalLM`` (`model` and `lm_head`)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        self.lm_head: nn.Linear | None = (
            None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """tokens (b, t) int64 -> logits (b, t, vocab); on a stage without the final norm (a middle
        or first pipeline stage) the hidden states (b, t, h)."""
        x = self.model(x)
        if self.model.norm is None:
            return x
        if self.lm_head is None:  # tied: the embedding's weight (vocab, h) is the head's
            return F.linear(x, self.model.embed_tokens.weight)
        return self.lm_head(x)  # (b, t, vocab)


def llama_init_value(cfg: LlamaConfig, fqn: str, shape: torch.Size, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """The initial value of parameter `fqn`, as a full tensor, a function of (seed, fqn) only.

    Norm gains are ones; every other weight is normal(0, 0.02) (Hugging Face's
    ``initializer_range``), the projections that write into the residual stream (``o_proj``,
    ``down_proj``) scaled by 1/sqrt(2 n_layers) as GPT-2 does.
    """
    if fqn.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    std = 0.02
    if fqn.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
        std = 0.02 / math.sqrt(2 * cfg.n_layers)
    return seeded_normal(fqn, shape, dtype, seed, std)


def reset_rotary(module: nn.Module) -> None:
    """Fill the rotary angles of every `RotaryEmbedding` in `module` (whatever stage it is)."""
    for sub in module.modules():
        if isinstance(sub, RotaryEmbedding):
            sub.reset()
