"""A Qwen3-MoE-style decoder, written with no parallelism inside it, under Hugging Face's names.

Embeddings, norms, the rotary embedding and the head are the Llama family's (`models.llama.model`);
attention is the Llama's with heads of ``head_dim`` (Qwen3's and Mixtral's may differ from hidden /
heads) and Qwen3's optional RMSNorm over each query and key head (``q_norm``, ``k_norm``, before
the rotation). The MLP of every layer is a sparse mixture of experts,
``model.layers.{i}.mlp`` (`SparseMoEBlock`):

- a router ``mlp.gate`` (a bias-free linear, hidden -> E); a softmax over the E experts, in float32
  or the model's dtype where that is wider; each token's ``top_k`` most probable experts (ties go
  to the lower index: a stable sort), their probabilities renormalised to sum 1 if
  ``norm_topk_prob``;
- the routed experts held stacked, not as linear modules (``mlp.experts``, `MoEExperts`):
  ``gate_proj`` and ``up_proj`` (E, I, hidden), ``down_proj`` (E, hidden, I); expert e computes
  ``down[e](silu(gate[e] x) * up[e] x)``;
- optionally a shared expert every token passes (``mlp.shared_expert.{gate,up,down}_proj``, the
  Llama's MLP) scaled by ``sigmoid(mlp.shared_expert_gate x)``, as Qwen2-MoE has it.

Dispatch is dropless: every token reaches its ``top_k`` experts, with no capacity. The routing and
the experts' computation are separate steps, so that expert parallelism can move token slots
between them (`SparseMoEBlock.forward`):

1. ``routing = self._route(tokens)``: tokens (n, hidden), n = batch x seq -> `Routing`: the router
   probabilities (n, E), each token's experts (n, top_k) by global index, and their weights
   (n, top_k);
2. the n x top_k token slots sorted by expert (stable: token order within an expert): rows
   (n·top_k, hidden), ``counts`` (E,) int64, ``counts[e]`` rows for expert e, experts in order;
3. ``self.experts(rows, counts)`` when ``self.dispatch`` is None (every expert is held here); else
   ``self.dispatch(rows, counts, self.experts)``, which must return what the former would: each
   row's output of its expert (rows, hidden), in the order of `rows`. It moves each row to the rank
   holding its expert, calls ``experts(held_rows, held_counts)`` there, and moves the results
   back. `MoEExperts.forward` indexes the experts it holds from 0: dim 0 of its parameters may be
   any contiguous run of the E experts, ``held_counts`` giving the rows of each, in order;
4. each slot's output back in token order, weighted, and summed over a token's choices in the
   order of its ranking (a fixed order: the same result on every run, and no atomic adds on a GPU).

Each block also returns per-sequence routing statistics (batch, 2E): for each expert, the token
slots routed to it and the sum of its router probability over the sequence's tokens. The decoder
sums them over its layers and returns ``(logits, stats)`` on the last pipeline stage, ``(hidden,
stats)`` between stages; a later stage takes ``(hidden, stats)``. From them `balance_terms` gives
each sequence's load-balancing term (docs/models.md, Mixture of experts).

Parallelism is applied from outside (`models.moe.spec`): the layers live in a `ModuleDict` keyed
by their global index; the embedding, the final norm and the head may be None on the stages that
do not own them; attention counts its heads from its projections. Under tensor parallelism the
router and the routed experts stay whole: the hidden states are whole after the row-parallel
``o_proj``, so every tp rank routes the same tokens alike and computes the same block output.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from shardshift.models.init import seeded_normal
from shardshift.models.llama.model import LlamaMLP, RMSNorm, RotaryEmbedding, apply_rotary
from shardshift.models.moe.config import MoEConfig


class MoEAttention(nn.Module):
    """The Llama's grouped-query attention with heads of ``head_dim`` (which may differ from
    hidden_size / n_heads) and, with ``qk_norm``, Qwen3's RMSNorm over each query and key head
    (``q_norm``, ``k_norm``: one gain per dim of a head), applied before the rotation."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        h, q, kv = cfg.hidden_size, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(h, q, bias=False)
        self.k_proj = nn.Linear(h, kv, bias=False)
        self.v_proj = nn.Linear(h, kv, bias=False)
        self.o_proj = nn.Linear(q, h, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # (b, t, heads * head_dim) -> (b, t, heads, head_dim), normed per head -> (b, heads, t, head_dim)
        q = self.q_proj(x).view(b, t, -1, self.head_dim)
        k = self.k_proj(x).view(b, t, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos.to(q.dtype), sin.to(q.dtype)), apply_rotary(k, cos.to(k.dtype), sin.to(k.dtype))
        group = q.shape[1] // k.shape[1]  # key-value head j serves query heads j * group .. (j + 1) * group - 1
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.head_dim**-0.5)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class Routing(NamedTuple):
    """Where a block's router sends n tokens."""

    probs: torch.Tensor  # (n, E) the softmax over the experts, float32 or wider
    experts: torch.Tensor  # (n, top_k) int64: each token's experts by global index, most probable first
    weights: torch.Tensor  # (n, top_k) their weights in the token's output, in the router logits' dtype


class MoEExperts(nn.Module):
    """Experts held stacked along dim 0: ``gate_proj``, ``up_proj`` (experts, I, hidden) and
    ``down_proj`` (experts, hidden, I); expert i computes ``down[i](silu(gate[i] x) * up[i] x)``."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        # Filled by the spec's init_value (or a checkpoint), as every parameter of a built model.
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows (m, hidden) grouped by the experts held here, ``counts[i]`` of them for the i-th
        (counts: (experts held,), summing to m) -> each row's output of its expert (m, hidden).

        Every expert runs, on no rows if it has none, so that every parameter has a gradient. Split
        over expert parallelism, the parameters are DTensors whose local part is the experts held."""
        gate, up, down = (_held(p) for p in (self.gate_proj, self.up_proj, self.down_proj))
        assert counts.shape == (gate.shape[0],), (counts.shape, gate.shape)
        out = [F.linear(F.silu(F.linear(x, gate[i])) * F.linear(x, up[i]), down[i])
               for i, x in enumerate(rows.split(counts.tolist()))]
        return torch.cat(out)


def _held(param: torch.Tensor) -> torch.Tensor:
    """The experts this rank holds of a stacked parameter: a DTensor's local part, or all of it."""
    return param.to_local() if isinstance(param, DTensor) else param


class SparseMoEBlock(nn.Module):
    """The MLP of a layer: a router, routed experts and an optional shared expert (module
    docstring). ``dispatch``: None while every expert is held here (module docstring, step 3)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = cfg.num_experts, cfg.top_k, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = MoEExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        shared = cfg.shared_expert_intermediate_size
        self.shared_expert = LlamaMLP(cfg.llama(shared)) if shared else None
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if shared else None
        self.dispatch = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (b, t, hidden) -> the block's output (b, t, hidden) and each sequence's routing
        statistics (b, 2E): slots routed to each expert, then each expert's summed probability."""
        b, t, h = x.shape
        tokens = x.reshape(b * t, h)
        routing = self._route(tokens)
        out = self._routed(tokens, routing)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(tokens)) * self.shared_expert(tokens)
        return out.view(b, t, h), _statistics(routing, b)

    def _route(self, tokens: torch.Tensor) -> Routing:
        """tokens (n, hidden) -> their `Routing`."""
        logits = self.gate(tokens)  # (n, E)
        probs = F.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
        # A stable sort rather than topk: among equal probabilities the lower expert wins, always.
        top, experts = probs.sort(dim=-1, descending=True, stable=True)
        top, experts = top[:, :self.top_k], experts[:, :self.top_k]
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return Routing(probs, experts, top.to(logits.dtype))

    def _routed(self, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The routed experts' weighted sum for each token (n, hidden)."""
        n, k = routing.experts.shape
        slots = routing.experts.reshape(-1)  # (n k,): token i's j-th choice at i k + j
        order = slots.argsort(stable=True)  # the slots grouped by expert, in token order within each
        counts = torch.bincount(slots, minlength=self.num_experts)  # (E,)
        rows = tokens.repeat_interleave(k, dim=0)[order]  # (n k, hidden)
        if self.dispatch is None:
            out = self.experts(rows, counts)
        else:
            out = self.dispatch(rows, counts, self.experts)
        back = torch.empty_like(order)
        back[order] = torch.arange(n * k, device=order.device)  # slot -> its row in `rows`
        out = out[back].view(n, k, -1)  # (n, k, hidden): each token's choices in rank order
        return (out * routing.weights.unsqueeze(-1)).sum(dim=1)


def _statistics(routing: Routing, b: int) -> torch.Tensor:
    """Per sequence of the b, the slots routed to each expert and each expert's summed router
    probability: (b, 2E), in the probabilities' dtype (the counts are exact whole numbers)."""
    probs = routing.probs.view(b, -1, routing.probs.shape[-1])  # (b, t, E)
    choices = routing.experts.reshape(b, -1)  # (b, t k)
    counts = torch.zeros(probs.shape[0], probs.shape[-1], dtype=probs.dtype, device=probs.device)
    counts.scatter_add_(1, choices, torch.ones_like(choices, dtype=probs.dtype))
    return torch.cat((counts, probs.sum(dim=1)), dim=1)


def balance_terms(stats: torch.Tensor, n_layers: int, seq_len: int) -> torch.Tensor:
    """Each sequence's load-balancing term (b,) from its statistics summed over all `n_layers`
    layers (b, 2E): ``E * sum_e f_e * P_e``, f_e the fraction of the sequence's ``n_layers *
    seq_len`` tokens whose choices include e (summed over a token's top_k choices), P_e the mean of
    e's router probability over them. Hugging Face's ``load_balancing_loss_func`` of one sequence."""
    experts = stats.shape[1] // 2
    tokens = n_layers * seq_len
    counts, probs = stats[:, :experts], stats[:, experts:]
    return experts * (counts / tokens * (probs / tokens)).sum(dim=-1)


class MoEDecoderLayer(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.self_attn = MoEAttention(cfg)
        self.mlp = SparseMoEBlock(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        y, stats = self.mlp(self.post_attention_layernorm(x))
        return x + y, stats


class MoEModel(nn.Module):
    """The decoder: Hugging Face's ``Qwen3MoeModel`` (``model.`` in parameter names)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.embed_tokens: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): MoEDecoderLayer(cfg) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)  # it reads head_dim and rope_theta, which MoEConfig has as LlamaConfig

    def forward(self, x: torch.Tensor, stats: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens (b, t) -> hidden states (b, t, h) and the layers' summed statistics (b, 2E); on a
        stage without the embedding, hidden states and the earlier stages' statistics in."""
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)  # (b, t, h)
        cos, sin = self.rotary_emb(x.shape[1], x.dtype)
        for layer in self.layers.values():
            x, layer_stats = layer(x, cos, sin)
            stats = layer_stats if stats is None else stats + layer_stats
        if self.norm is not None:
            x = self.norm(x)
        return x, stats


class MoE(nn.Module):
    """The causal language model: Hugging Face's ``Qwen3MoeForCausalLM`` (`model` and `lm_head`)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.model = MoEModel(cfg)
        self.lm_head: nn.Linear | None = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, stats: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens (b, t) int64 -> logits (b, t, vocab) and routing statistics (b, 2E); on a stage
        without the head, hidden states (b, t, h) in place of the logits; on a stage without the
        embedding, hidden states and statistics in."""
        x, stats = self.model(x, stats)
        if self.lm_head is None:
            return x, stats
        return self.lm_head(x), stats


def moe_init_value(cfg: MoEConfig, fqn: str, shape: torch.Size, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """The initial value of parameter `fqn`, whole, a function of (seed, fqn) only.

    Norm gains are ones; every other weight (the router and every expert included) is normal(0,
    0.02), the projections that write into the residual stream (``o_proj``, the experts' and the
    shared expert's ``down_proj``) scaled by 1/sqrt(2 n_layers), as the Llama family's.
    """
    if fqn.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    std = 0.02
    if fqn.endswith(("self_attn.o_proj.weight", "experts.down_proj", "shared_expert.down_proj.weight")):
        std = 0.02 / math.sqrt(2 * cfg.n_layers)
    return seeded_normal(fqn, shape, dtype, seed, std)
