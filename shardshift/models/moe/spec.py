"""The mixture-of-experts family as a `ModelSpec`: its tensor-parallel plan, its pipeline split,
the layouts it refuses and its loss (cross entropy plus the load-balancing term), over its sizes
(`config.py`). Pure data: no torch until the model is built or a loss computed."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from shardshift.layout import Layout
from shardshift.models.llama.spec import TP_PLAN as LLAMA_TP_PLAN
from shardshift.models.moe.config import PRESETS, MoEConfig
from shardshift.models.spec import PipelineSplit, SizedSpec, check_divides, check_stages

ATTENTION_TP_PLAN = {name: style for name, style in LLAMA_TP_PLAN.items() if ".self_attn." in name}
# Qwen3's norms over each head: every tp rank norms the heads it holds with the whole gains, whose
# gradients are summed over tp.
QK_NORM_TP_PLAN = {
    "model.layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
    "model.layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
}
# The shared expert as the Llama's MLP: intermediate_size / tp hidden units on each rank, one
# all-reduce after its down projection.
SHARED_EXPERT_TP_PLAN = {
    "model.layers.*.mlp.shared_expert.gate_proj": "colwise",
    "model.layers.*.mlp.shared_expert.up_proj": "colwise",
    "model.layers.*.mlp.shared_expert.down_proj": "rowwise",
}


@dataclasses.dataclass(frozen=True)
class MoESpec(SizedSpec):
    """A Qwen3-MoE-style decoder (`model.MoE`): the Llama's attention with optional per-head
    norms, and in every layer a sparse mixture of experts routed top-k, dropless."""

    name: str
    config: MoEConfig

    @classmethod
    def preset(cls, name: str) -> MoESpec:
        return cls(name, PRESETS[name])

    @property
    def pipeline(self) -> PipelineSplit:
        return PipelineSplit("model.layers", self.config.n_layers, first=("model.embed_tokens",),
                             last=("model.norm", "lm_head"))

    @property
    def tp_plan(self) -> Mapping[str, str]:
        """Attention as the Llama's (q, k, v colwise, o rowwise), the head norms replicated with
        their gradients summed, the shared expert colwise then rowwise. The router and the routed
        experts are not in the plan: whole on every tp rank (`model` module docstring)."""
        plan = dict(ATTENTION_TP_PLAN)
        if self.config.qk_norm:
            plan.update(QK_NORM_TP_PLAN)
        if self.config.shared_expert_intermediate_size:
            plan.update(SHARED_EXPERT_TP_PLAN)
        return plan

    def flops_per_token(self) -> int:
        """PaLM's count over the parameters a token reads: its top-k routed experts of the E."""
        cfg = self.config
        unread = cfg.n_layers * 3 * (cfg.num_experts - cfg.top_k) * cfg.moe_intermediate_size * cfg.hidden_size
        return 6 * (self.num_params() - unread) + 12 * cfg.n_layers * self.hidden_size * self.seq_len

    @property
    def expert_modules(self) -> tuple[str, ...]:
        return ("model.layers.*.mlp.experts",)

    def check_layout(self, layout: Layout) -> None:
        cfg = self.config
        check_divides("ep", layout.ep, [(f"num_experts={cfg.num_experts}", cfg.num_experts)])
        widths = {"n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads}
        if cfg.shared_expert_intermediate_size:
            widths["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
        check_divides("tp", layout.tp, [(f"{name}={size}", size) for name, size in widths.items()])
        check_stages(layout.pp, cfg.n_layers, f"n_layers={cfg.n_layers}")

    def build(self):
        from shardshift.models.moe.model import MoE

        return MoE(self.config)

    def init_value(self, fqn, shape, dtype, seed):
        from shardshift.models.moe.model import moe_init_value

        return moe_init_value(self.config, fqn, shape, dtype, seed)

    def init_buffers(self, module):
        from shardshift.models.llama.model import reset_rotary

        reset_rotary(module)

    def logits(self, output):
        return output[0]

    def loss(self, output, targets):
        """Mean next-token cross entropy plus ``router_aux_loss_coef`` times the mean over the
        batch's sequences of each one's load-balancing term (`model.balance_terms`): both means of
        per-sequence values, so data ranks and micro-batches split them alike."""
        from shardshift.models.loss import next_token_loss
        from shardshift.models.moe.model import balance_terms

        logits, stats = output
        balance = balance_terms(stats, self.config.n_layers, logits.shape[1]).mean()
        return next_token_loss(logits, targets) + self.config.router_aux_loss_coef * balance

    def hf_config(self) -> dict[str, Any] | None:
        """The ``config.json`` of ``Qwen3MoeForCausalLM`` (per-head norms) or ``MixtralForCausalLM``
        (none) with this model's parameters; None with a shared expert (`moe.hf.hf_config_fields`)."""
        from shardshift.models.moe.hf import hf_config_fields

        return hf_config_fields(self.config)

    def hf_state_dict(self, params):
        """`params` (name -> whole tensor) under the names and shapes of `hf_config`'s checkpoint, as
        ``save_pretrained`` writes it: one matrix per expert (`moe.hf.to_saved`)."""
        from shardshift.models.moe.hf import to_saved

        return to_saved(self.hf_config()["model_type"], params)
