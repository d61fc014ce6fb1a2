"""The mixture-of-experts family's sizes: `MoEConfig` and the named `PRESETS` (pure data).

The fields are those of Hugging Face's ``Qwen3MoeConfig`` (and, for the shared expert,
``Qwen2MoeConfig``) that change the model's shape or its arithmetic, under the Llama family's
shorter names where the two share a meaning (`models.llama.config`); ``max_position_embeddings``
is the sequence length the model trains on.
"""

from __future__ import annotations

import dataclasses
import math

from shardshift.models.llama.config import VOCAB_SIZE, LlamaConfig


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    n_layers: int  # num_hidden_layers: every layer's MLP is a sparse MoE block
    n_heads: int  # num_attention_heads (query heads)
    n_kv_heads: int  # num_key_value_heads
    hidden_size: int
    num_experts: int  # E: routed experts per layer
    top_k: int  # num_experts_per_tok: the experts each token is sent to
    moe_intermediate_size: int  # the SwiGLU width of one routed expert
    seq_len: int  # max_position_embeddings
    shared_expert_intermediate_size: int = 0  # the SwiGLU width of the shared expert every token passes (0: none)
    norm_topk_prob: bool = True  # the top-k routing weights renormalised to sum 1
    router_aux_loss_coef: float = 0.001  # the weight of the load-balancing term in the loss
    qk_norm: bool = True  # RMSNorm over each query and key head before the rotation (Qwen3's q_norm, k_norm)
    vocab_size: int = VOCAB_SIZE
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    head_dim: int | None = None  # the width of one attention head; None: hidden_size / n_heads

    def __post_init__(self) -> None:
        if self.head_dim is None and self.n_heads >= 1 and self.hidden_size % self.n_heads == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.n_heads)  # frozen: set once, while built
        for name in ("n_layers", "n_heads", "n_kv_heads", "hidden_size", "seq_len", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {name}={getattr(self, name)} must be >= 1")
        if self.head_dim is None:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by n_heads={self.n_heads}; give "
                             f"head_dim, or a hidden_size that is a multiple of n_heads")
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} is not an even number >= 2; rotary embeddings rotate pairs "
                             f"of dims: choose an even head_dim")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads}: each key-value "
                             f"head serves a whole group of query heads; choose n_kv_heads dividing n_heads")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps} and rope_theta={self.rope_theta} must be > 0")
        if self.num_experts < 1:
            raise ValueError(f"model num_experts={self.num_experts} must be >= 1")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"model top_k={self.top_k} must be between 1 and num_experts={self.num_experts}: each "
                             f"token goes to top_k different experts")
        if self.moe_intermediate_size < 1 or self.shared_expert_intermediate_size < 0:
            raise ValueError(f"model moe_intermediate_size={self.moe_intermediate_size} must be >= 1 and "
                             f"shared_expert_intermediate_size={self.shared_expert_intermediate_size} >= 0 (0: none)")
        if not self.router_aux_loss_coef >= 0:
            raise ValueError(f"model router_aux_loss_coef={self.router_aux_loss_coef} must be >= 0")
        if self.shared_expert_intermediate_size:
            self.llama(self.shared_expert_intermediate_size)  # the shared expert is the Llama's MLP: its checks

    def llama(self, intermediate_size: int) -> LlamaConfig:
        """The Llama of these sizes whose MLP, of width `intermediate_size`, is the shared expert."""
        return LlamaConfig(n_layers=self.n_layers, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                           hidden_size=self.hidden_size, intermediate_size=intermediate_size, seq_len=self.seq_len,
                           vocab_size=self.vocab_size, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter of the model (`model.MoE`), by name, with its shape, in the model's order."""
        h, i, e, d = self.hidden_size, self.moe_intermediate_size, self.num_experts, self.head_dim
        q, kv, shared = self.n_heads * d, self.n_kv_heads * d, self.shared_expert_intermediate_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for layer in range(self.n_layers):
            p = f"model.layers.{layer}."
            shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                           p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q)})
            if self.qk_norm:
                shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
            shapes.update({p + "mlp.gate.weight": (e, h), p + "mlp.experts.gate_proj": (e, i, h),
                           p + "mlp.experts.up_proj": (e, i, h), p + "mlp.experts.down_proj": (e, h, i)})
            if shared:
                shapes.update({p + "mlp.shared_expert.gate_proj.weight": (shared, h),
                               p + "mlp.shared_expert.up_proj.weight": (shared, h),
                               p + "mlp.shared_expert.down_proj.weight": (h, shared),
                               p + "mlp.shared_expert_gate.weight": (1, h)})
            shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        shapes.update({"model.norm.weight": (h,), "lm_head.weight": (self.vocab_size, h)})
        return shapes

    def num_params(self) -> int:
        return sum(math.prod(shape) for shape in self.param_shapes().values())


# Named sizes. `moe-test` is the tests' model: its shards split unevenly (13 positions, 5 layers, a
# vocabulary of 259 whose rows split 65, 65, 65, 64 over 4 ranks) and it takes every layout of 4
# ranks (8 query heads over 4 key-value heads, a shared expert of width 16: tp in {1, 2, 4}).
# `moe-tiny` and `moe-small` have the layers, hidden size, heads and sequence length of `llama-tiny`
# and `llama-small`, 8 experts of which each token reads 2, and about their parameters (the
# experts' widths 48 and 96: 8 experts hold about as many as the Llama's one MLP); no shared
# expert, as Qwen3-MoE. Routed experts are whole on every tp rank, so tp is bounded by the heads
# alone: every layout of up to 8 ranks.
PRESETS: dict[str, MoEConfig] = {
    "moe-test": MoEConfig(n_layers=5, n_heads=8, n_kv_heads=4, hidden_size=32, num_experts=4, top_k=2,
                          moe_intermediate_size=24, shared_expert_intermediate_size=16, seq_len=13, vocab_size=259),
    "moe-tiny": MoEConfig(n_layers=8, n_heads=16, n_kv_heads=8, hidden_size=128, num_experts=8, top_k=2,
                          moe_intermediate_size=48, seq_len=128),
    "moe-small": MoEConfig(n_layers=8, n_heads=16, n_kv_heads=8, hidden_size=256, num_experts=8, top_k=2,
                           moe_intermediate_size=96, seq_len=256),
}
