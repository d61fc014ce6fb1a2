"""The mixture-of-experts family's Hugging Face forms, in one place both ways: the ``config.json``
of the equal ``Qwen3MoeForCausalLM`` or ``MixtralForCausalLM``, and each parameter's tensors in a
Hugging Face checkpoint.

Every parameter but the stacked experts has the same name and value in both (Mixtral's
checkpoints call the block ``block_sparse_moe`` where its modules, and ours, say ``mlp``). The
experts are held in three forms:

- ours, stacked: ``mlp.experts.gate_proj`` and ``up_proj`` (E, I, hidden), ``down_proj`` (E, hidden, I);
- a checkpoint as ``save_pretrained`` writes it (transformers 5.25 converts back on saving) and the
  Hub holds it: one matrix per expert, ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (Qwen3-MoE)
  or ``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`` (Mixtral: w1 the gate, w3 up, w2 down);
- transformers 5's modules (``state_dict()``), fused: ``mlp.experts.gate_up_proj`` (E, 2I, hidden),
  the gate's rows first, then up's, and ``mlp.experts.down_proj`` (E, hidden, I), as ours.

`to_saved` writes the checkpoint form (what ``shardshift export`` writes); `read_saved` reads
either form, and `saved_names` and `module_name` say where each parameter is in each. Pure: torch
and safetensors are imported by the functions that move tensors, when called.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from shardshift.models.moe.config import MoEConfig

if TYPE_CHECKING:
    import torch

# model_type -> the Hugging Face class built by ShardShift's own mixture of experts (`models.moe`).
MOE_ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
EXPERTS = ".mlp.experts."  # our stacked experts: EXPERTS + one of EXPERT_PARAMS
EXPERT_PARAMS = ("gate_proj", "up_proj", "down_proj")
# Mixtral's checkpoint names of the experts' projections.
MIXTRAL_EXPERTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def is_stacked_expert(fqn: str) -> bool:
    """Whether our parameter `fqn` is a stacked expert parameter (dim 0: the experts)."""
    return EXPERTS in fqn and fqn.rpartition(".")[2] in EXPERT_PARAMS


def saved_names(model_type: str, fqn: str, num_experts: int) -> tuple[str, ...]:
    """The tensors of a checkpoint as ``save_pretrained`` writes it that hold our parameter `fqn`:
    for a stacked expert parameter, one matrix per expert, in order along its dim 0; else one
    tensor of the same value."""
    layer, sep, rest = fqn.partition(".mlp.")
    if not sep:
        return (fqn,)
    block = f"{layer}.block_sparse_moe." if model_type == "mixtral" else f"{layer}.mlp."
    if not is_stacked_expert(fqn):
        return (block + rest,)  # the router, mlp.gate.weight
    proj = rest.removeprefix("experts.")
    leaf = MIXTRAL_EXPERTS[proj] if model_type == "mixtral" else proj
    return tuple(f"{block}experts.{e}.{leaf}.weight" for e in range(num_experts))


def module_name(fqn: str) -> tuple[str, int | None]:
    """transformers 5's module parameter that holds our `fqn`, and for ``gate_proj`` (0) and
    ``up_proj`` (1) which half of dim 1 of the fused ``gate_up_proj`` (None: the whole tensor)."""
    for half, proj in enumerate(("gate_proj", "up_proj")):
        if is_stacked_expert(fqn) and fqn.endswith(proj):
            return fqn.removesuffix(proj) + "gate_up_proj", half
    return fqn, None


def to_saved(model_type: str, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our parameters (name -> whole tensor) as the checkpoint ``save_pretrained`` writes: each
    stacked expert parameter as one matrix per expert (copies: a safetensors file holds no views)."""
    saved = {}
    for fqn, tensor in params.items():
        names = saved_names(model_type, fqn, tensor.shape[0])
        if is_stacked_expert(fqn):
            saved.update({name: tensor[e].clone() for e, name in enumerate(names)})
        else:
            saved[names[0]] = tensor
    return saved


def read_saved(model_type: str, fqn: str, shape: tuple[int, ...], files: Mapping[str, str]) -> torch.Tensor:
    """Our parameter `fqn`, of `shape`, from safetensors files (`files`: tensor name -> file), in
    the checkpoint form if they hold it, else in transformers' fused form; only the tensors (or
    the half of ``gate_up_proj``) it needs are read."""
    import torch
    from safetensors import safe_open

    names = saved_names(model_type, fqn, shape[0])
    if all(name in files for name in names):
        tensors = {}
        for file in dict.fromkeys(files[name] for name in names):  # each file opened once, in order
            with safe_open(file, framework="pt") as f:
                tensors.update({name: f.get_tensor(name) for name in names if files[name] == file})
        return torch.stack([tensors[name] for name in names]) if is_stacked_expert(fqn) else tensors[names[0]]
    name, half = module_name(fqn)
    with safe_open(files[name], framework="pt") as f:
        if half is None:
            return f.get_tensor(name)
        rows = shape[1]
        return f.get_slice(name)[:, half * rows:(half + 1) * rows]


def hf_config_fields(cfg: MoEConfig) -> dict[str, Any] | None:
    """The ``config.json`` of the Hugging Face model whose parameters are this model's (under
    `to_saved`'s names) and which computes its logits: ``Qwen3MoeForCausalLM`` with per-head norms,
    ``MixtralForCausalLM`` without them (its router always renormalises: ``norm_topk_prob``);
    None for a model neither expresses (a shared expert; no norms and no renormalisation)."""
    if cfg.shared_expert_intermediate_size or not (cfg.qk_norm or cfg.norm_topk_prob):
        return None
    fields = {
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.top_k,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "output_router_logits": True,  # transformers adds the balancing term to its loss only then
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
    }
    if cfg.qk_norm:
        # intermediate_size is the width of the dense layers Qwen3-MoE may have; this model has none.
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **fields,
                "moe_intermediate_size": cfg.moe_intermediate_size, "intermediate_size": cfg.moe_intermediate_size,
                "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": 1, "mlp_only_layers": [],
                "attention_bias": False, "use_sliding_window": False, "sliding_window": None}
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **fields,
            "intermediate_size": cfg.moe_intermediate_size, "sliding_window": None, "router_jitter_noise": 0.0}
