"""The Llama family as a `ModelSpec`: its tensor-parallel plan, its pipeline split, the layouts it
refuses, and its Hugging Face ``config.json`` (`LlamaSpec.hf_config`), over its sizes
(`config.py`). Pure data: no torch until the model is built."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from shardshift.layout import Layout
from shardshift.models.llama.config import PRESETS, LlamaConfig
from shardshift.models.spec import PipelineSplit, SizedSpec, check_divides, check_stages

# Module -> its tensor-parallel style, as Hugging Face's LlamaConfig.base_model_tp_plan has it (whose
# names are relative to `model.`): each rank holds n_heads / tp query heads, n_kv_heads / tp
# key-value heads (the ones its query heads read) and intermediate_size / tp hidden units of the
# MLP; the attention output and the MLP's down projection are row-parallel (one all-reduce each,
# forward and backward). The embedding, the norms and the head stay whole.
TP_PLAN = {
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}


@dataclasses.dataclass(frozen=True)
class LlamaSpec(SizedSpec):
    """A Llama (`model.Llama`): RMSNorm, rotary position embeddings, grouped-query attention, a
    SwiGLU MLP, no biases; Hugging Face's ``LlamaForCausalLM``, parameter for parameter."""

    name: str
    config: LlamaConfig

    @classmethod
    def preset(cls, name: str) -> LlamaSpec:
        return cls(name, PRESETS[name])

    @property
    def pipeline(self) -> PipelineSplit:
        last = ("model.norm",) if self.config.tie_word_embeddings else ("model.norm", "lm_head")
        return PipelineSplit("model.layers", self.config.n_layers, first=("model.embed_tokens",), last=last)

    @property
    def tp_plan(self) -> Mapping[str, str]:
        return TP_PLAN

    def check_layout(self, layout: Layout) -> None:
        cfg = self.config
        if layout.ep > 1:
            raise ValueError(f"ep={layout.ep}: {self.name} has no experts to split; ep is for planning "
                             f"mixture-of-experts models with `shardshift simulate` (train with ep=1)")
        check_divides("tp", layout.tp, [(f"n_heads={cfg.n_heads}", cfg.n_heads),
                                        (f"n_kv_heads={cfg.n_kv_heads}", cfg.n_kv_heads),
                                        (f"intermediate_size={cfg.intermediate_size}", cfg.intermediate_size)])
        check_stages(layout.pp, cfg.n_layers, f"n_layers={cfg.n_layers}")
        if layout.pp > 1 and cfg.tie_word_embeddings:
            raise ValueError(f"pp={layout.pp}: {self.name} ties its head to its embedding, which live on the first "
                             f"and the last pipeline stage; choose pp=1, or a model with tie_word_embeddings false")

    def hf_config(self) -> dict[str, Any]:
        """The ``config.json`` of the equal ``transformers.LlamaConfig``: with it, Hugging Face's
        ``LlamaForCausalLM`` takes this model's parameters under their own names and computes the
        same logits. ``torch_dtype`` says float32; a writer of tensors of another dtype says theirs."""
        cfg = self.config
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads,
            "num_hidden_layers": cfg.n_layers,
            "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.seq_len,
            "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta,  # as transformers 4 reads it; 5 reads rope_parameters
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "tie_word_embeddings": cfg.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "initializer_range": 0.02,
            "torch_dtype": "float32",
        }

    def build(self):
        from shardshift.models.llama.model import Llama

        return Llama(self.config)

    def init_value(self, fqn, shape, dtype, seed):
        from shardshift.models.llama.model import llama_init_value

        return llama_init_value(self.config, fqn, shape, dtype, seed)

    def init_buffers(self, module):
        from shardshift.models.llama.model import reset_rotary

        reset_rotary(module)

    def loss(self, logits, targets):
        from shardshift.models.loss import next_token_loss

        return next_token_loss(logits, targets)
