"""Hugging Face model directories for tests: small random models of each supported architecture,
written by transformers' own ``save_pretrained`` (config.json and model.safetensors), as a user's
directory would be; and, for the mixtures of experts, transformers' model read back in float64
(`load_moe`) and made to compute in float64 what it computes in float32 (`moe_in_float64`)."""

from __future__ import annotations

from pathlib import Path

# Sizes that every 4-rank layout takes (8 query and 4 key/value heads: grouped-query attention;
# widths divisible by 4; 5 layers, an odd number, over pp=4 as 2, 1, 1, 1), whose shards cut
# unevenly: 259 vocabulary rows over fsdp=4, 13 positions.
QWEN2 = dict(vocab_size=259, hidden_size=32, num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=5,
             intermediate_size=40, max_position_embeddings=13)
# Qwen3: per-head q_norm and k_norm, an explicit head_dim unlike hidden / heads.
QWEN3 = dict(vocab_size=256, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             num_hidden_layers=2, intermediate_size=40, max_position_embeddings=16)
# Mistral: a sliding window (5) shorter than the sequence (16).
MISTRAL = dict(vocab_size=256, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
               intermediate_size=40, max_position_embeddings=16, sliding_window=5)
# Llama: the head tied to the embeddings; attention and MLP biases.
LLAMA_TIED = dict(vocab_size=256, hidden_size=32, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
                  intermediate_size=40, max_position_embeddings=16, tie_word_embeddings=True, attention_bias=True,
                  mlp_bias=True)

# Qwen3-MoE (ShardShift's own mixture of experts builds it): 4 experts of width 24, each token's top
# 2 renormalised, per-head norms, a head_dim (16) unlike hidden / heads (8).
QWEN3_MOE = dict(vocab_size=256, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_hidden_layers=2, intermediate_size=40, moe_intermediate_size=24, num_experts=4,
                 num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=16)
# Mixtral: 3 layers (pp=2 splits them 2, 1), 259 vocabulary rows (fsdp=2 splits them 130, 129), 4
# experts of width 24, top 2 (always renormalised), no head norms, a balancing coefficient of its own.
MIXTRAL = dict(vocab_size=259, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
               intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16,
               router_aux_loss_coef=0.02)

ARCHITECTURES = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM", QWEN2),
                 "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", QWEN3),
                 "mistral": ("MistralConfig", "MistralForCausalLM", MISTRAL),
                 "llama": ("LlamaConfig", "LlamaForCausalLM", LLAMA_TIED),
                 "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", QWEN3_MOE),
                 "mixtral": ("MixtralConfig", "MixtralForCausalLM", MIXTRAL)}
MOE_MODELING = {"qwen3_moe": ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3Moe"),
                "mixtral": ("transformers.models.mixtral.modeling_mixtral", "Mixtral")}


def hf_model(kind: str, seed: int = 0, **overrides):
    """A random transformers model of architecture `kind` (a key of ARCHITECTURES), in float32."""
    import torch
    import transformers

    config_class, model_class, sizes = ARCHITECTURES[kind]
    config = getattr(transformers, config_class)(**{**sizes, **overrides})
    torch.manual_seed(seed)
    return getattr(transformers, model_class)(config)


def load_moe(directory, dtype=None):
    """transformers' ``from_pretrained`` of a mixture of experts, its experts run one by one
    (``eager``: the default ``grouped_mm`` takes no float64 on the CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype or torch.float64, experts_implementation="eager")


def moe_in_float64(patch, kind: str) -> None:
    """With `patch` (a ``pytest.MonkeyPatch``), transformers' mixture of experts of `kind` computes in
    float64 the three things it computes in float32 whatever the dtype: RMSNorm, the rotary angles
    (from inverse frequencies in float64) and the router's softmax, top-k and renormalisation. The
    formulas are transformers' own; only the casts to float32 are dropped."""
    import importlib

    import torch
    import torch.nn.functional as F

    module, prefix = MOE_MODELING[kind]
    modeling = importlib.import_module(module)

    def norm_forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rotary_forward(self, x, position_ids):
        config = self.config
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        inv_freq = 1.0 / config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angles = position_ids[..., None].to(torch.float64) * inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    def router_forward(self, hidden_states):
        logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        top, experts = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        if getattr(self, "norm_topk_prob", True):  # Mixtral's router has no flag: it always renormalises
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), experts

    patch.setattr(getattr(modeling, f"{prefix}RMSNorm"), "forward", norm_forward)
    patch.setattr(getattr(modeling, f"{prefix}RotaryEmbedding"), "forward", rotary_forward)
    patch.setattr(getattr(modeling, f"{prefix}TopKRouter"), "forward", router_forward)


def save_hf_model(kind: str, directory: Path, seed: int = 0, weights: bool = True, **overrides) -> str:
    """``save_pretrained`` of `hf_model(kind, seed)` into `directory` (without its weights unless
    `weights`); returns ``hf:DIRECTORY`` for --model."""
    model = hf_model(kind, seed, **overrides)
    if weights:
        model.save_pretrained(directory)
    else:
        model.config.save_pretrained(directory)
    return f"hf:{directory}"
