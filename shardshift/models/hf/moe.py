"""Hugging Face mixtures of experts (``--model hf:DIR`` of a ``Qwen3MoeForCausalLM`` or a
``MixtralForCausalLM``), built by ShardShift's own mixture of experts (`models.moe`), not by
transformers' modules.

`moe_config` reads config.json into a `MoEConfig` (pure, as `config.HFConfig` reads the dense
architectures) and refuses, in one line naming the key and the fix, what that model does not
compute: a tied head, dense layers among the sparse ones, a sliding window shorter than the
sequence, RoPE other than the default, biases, dropout, router jitter, another activation. Qwen3-MoE
has per-head norms (``qk_norm``) and renormalises the top-k weights if ``norm_topk_prob`` says so;
Mixtral has no head norms and always renormalises. `HFMoESpec` is the `MoESpec` of such a
directory: it starts from the saved weights under any layout (each rank reads only the tensors of
the parameters it holds a piece of, in either form `moe.hf` names), records the whole config.json in
checkpoints, and gives it back as its `hf_config` for ``shardshift export``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
from pathlib import Path
from typing import Any

from shardshift.models.hf.config import (
    CONFIG,
    INSTALL,
    MAX_SEQ_LEN,
    check_byte_vocab,
    config_head_dim,
    config_size,
    safetensors_header,
    weight_files,
)
from shardshift.models.moe.config import MoEConfig
from shardshift.models.moe.hf import is_stacked_expert, module_name, saved_names
from shardshift.models.moe.spec import MoESpec

PREFIX = "hf:"
# What transformers 5.25 takes for a key config.json leaves out or sets to null (tests/unit/test_moe_hf.py
# checks them against its configuration classes).
DEFAULTS = {
    "qwen3_moe": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "norm_topk_prob": False, "router_aux_loss_coef": 0.001,
                  "initializer_range": 0.02},
    "mixtral": {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "norm_topk_prob": True, "router_aux_loss_coef": 0.001,
                "initializer_range": 0.02},
}


def moe_config(fields: dict[str, Any], where: str) -> MoEConfig:
    """The `MoEConfig` of a Qwen3-MoE or Mixtral config.json's `fields`; ValueError naming `where`,
    the key and the fix for what ShardShift's mixture of experts does not compute."""
    model_type = fields["model_type"]
    defaults = DEFAULTS[model_type]

    def size(key: str, default: int | None = None) -> int:
        return config_size(fields, key, where, default)

    def value(key: str) -> Any:
        return defaults[key] if fields.get(key) is None else fields[key]

    hidden, heads, layers, vocab = (size(key) for key in ("hidden_size", "num_attention_heads",
                                                          "num_hidden_layers", "vocab_size"))
    kv = size("num_key_value_heads", heads)
    experts = size("num_experts" if fields.get("num_experts") is not None else "num_local_experts")
    top_k = size("num_experts_per_tok")
    width = size("moe_intermediate_size" if model_type == "qwen3_moe" else "intermediate_size")
    seq_len = min(size("max_position_embeddings", MAX_SEQ_LEN), MAX_SEQ_LEN)
    head_dim = config_head_dim(fields, hidden, heads, where)
    check_byte_vocab(vocab, where)
    if heads % kv:
        raise ValueError(f"{where}: num_key_value_heads={kv} does not divide num_attention_heads={heads}")
    if head_dim % 2:
        raise ValueError(f"{where}: head_dim={head_dim} is odd; rotary embeddings rotate pairs of dims: give an even "
                         f"head_dim")
    if top_k > experts:
        raise ValueError(f"{where}: num_experts_per_tok={top_k} is more than the {experts} experts; give at most "
                         f"{experts}")
    _refuse_what_it_does_not_compute(fields, model_type, layers, seq_len, where)
    rope = _mapping(fields.get("rope_parameters"))
    # transformers' MixtralTopKRouter renormalises whatever config.json says.
    norm_topk_prob = model_type == "mixtral" or bool(value("norm_topk_prob"))
    try:
        return MoEConfig(n_layers=layers, n_heads=heads, n_kv_heads=kv, hidden_size=hidden, num_experts=experts,
                         top_k=top_k, moe_intermediate_size=width, seq_len=seq_len, norm_topk_prob=norm_topk_prob,
                         router_aux_loss_coef=float(value("router_aux_loss_coef")),
                         qk_norm=model_type == "qwen3_moe", vocab_size=vocab,
                         rms_norm_eps=float(value("rms_norm_eps")),
                         rope_theta=float(rope.get("rope_theta") or value("rope_theta")), head_dim=head_dim)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def _refuse_what_it_does_not_compute(fields: dict[str, Any], model_type: str, layers: int, seq_len: int,
                                     where: str) -> None:
    """ValueError naming the first key of `fields` that asks for arithmetic the model lacks."""
    model = "ShardShift's mixture of experts"
    if fields.get("tie_word_embeddings"):
        raise ValueError(f"{where}: tie_word_embeddings is true, but {model} has a head of its own; give a model "
                         f"with tie_word_embeddings false (and its lm_head.weight saved)")
    if model_type == "qwen3_moe":
        step = config_size(fields, "decoder_sparse_step", where, 1)
        only = fields.get("mlp_only_layers") or []
        dense = [i for i in range(layers) if i in only or (i + 1) % step]
        if dense:
            raise ValueError(f"{where}: decoder_sparse_step={step} and mlp_only_layers={only} make layers {dense} "
                             f"dense MLPs, but {model} has experts in every layer; give decoder_sparse_step 1 and "
                             f"mlp_only_layers []")
    window = fields.get("sliding_window")
    if model_type == "qwen3_moe" and not fields.get("use_sliding_window"):
        window = None
    if window is not None and window < seq_len:
        raise ValueError(f"{where}: sliding_window={window} is shorter than the sequence ({seq_len} positions), but "
                         f"{model} attends to every earlier position; give a model without a sliding window")
    rope, scaling = _mapping(fields.get("rope_parameters")), _mapping(fields.get("rope_scaling"))
    rope_type = rope.get("rope_type") or rope.get("type") or scaling.get("rope_type") or scaling.get("type")
    if rope_type not in (None, "default"):
        raise ValueError(f"{where}: rope_parameters rope_type is {rope_type!r}, but {model} rotates by rope_theta "
                         f"alone; give a model with the default RoPE")
    unsupported = {"hidden_act": ("silu", fields.get("hidden_act", "silu")),
                   "attention_bias": (False, bool(fields.get("attention_bias", False))),
                   "attention_dropout": (0, fields.get("attention_dropout") or 0),
                   "router_jitter_noise": (0, fields.get("router_jitter_noise") or 0)}
    for key, (expected, got) in unsupported.items():
        if got != expected:
            raise ValueError(f"{where}: {key} is {json.dumps(got)}, which {model} does not compute; give a model "
                             f"with {key} {json.dumps(expected)}")


def _mapping(value: Any) -> dict[str, Any]:
    """A config.json entry that holds an object (RoPE's parameters), or {} when it holds none."""
    return value if isinstance(value, dict) else {}


def check_moe_weights(model_type: str, cfg: MoEConfig, files: dict[str, str], where: str) -> None:
    """ValueError naming the first parameter that the weights (tensor name -> safetensors file)
    lack, or hold with another shape, in the checkpoint form or transformers' fused one (`moe.hf`)."""
    headers = {file: safetensors_header(Path(file)) for file in sorted(set(files.values()))}

    def saved_shape(name: str) -> tuple[int, ...]:
        return tuple(headers[files[name]].get(name, {}).get("shape", ()))

    for fqn, shape in cfg.param_shapes().items():
        names = saved_names(model_type, fqn, cfg.num_experts)
        if all(name in files for name in names):
            wanted = {name: shape[1:] if is_stacked_expert(fqn) else shape for name in names}
        else:
            name, half = module_name(fqn)
            if name not in files:
                missing = next(name for name in names if name not in files)
                raise ValueError(f"{where}: its weights lack {missing}; save the whole model with save_pretrained, "
                                 f"or remove the weights to start from the seed")
            wanted = {name: shape if half is None else (shape[0], 2 * shape[1], shape[2])}
        for name, expected in wanted.items():
            if saved_shape(name) != expected:
                raise ValueError(f"{where}: its weights hold {name} with shape {list(saved_shape(name))}, but "
                                 f"config.json makes it {list(expected)}; save the weights and the configuration "
                                 f"together")


@dataclasses.dataclass(frozen=True)
class HFMoESpec(MoESpec):
    """The `MoESpec` of a Hugging Face mixture of experts (module docstring): its name is ``hf:``
    and the directory's absolute path."""

    text: str  # the whole config.json, as canonical JSON (sorted keys): recorded and written back as is
    weights: tuple[tuple[str, str], ...] = ()  # (saved tensor, safetensors file) to start from; (): from the seed

    @classmethod
    def from_directory(cls, name: str, directory: str, fields: dict[str, Any]) -> HFMoESpec:
        """The model of ``hf:DIR`` (`name`) whose config.json `fields` were read from `directory`
        (an absolute path), its weights checked against them."""
        where = f"--model {name}: {CONFIG}"
        config = moe_config(fields, where)
        files = weight_files(directory)
        if files:
            if importlib.util.find_spec("safetensors") is None:
                raise ValueError(f"--model {name} needs safetensors to read its weights, not installed here: {INSTALL}")
            check_moe_weights(fields["model_type"], config, files, f"--model {name}")
        return cls(PREFIX + directory, config, json.dumps(fields, sort_keys=True), tuple(sorted(files.items())))

    @classmethod
    def from_recorded(cls, name: str, fields: dict[str, Any]) -> HFMoESpec:
        """The model a checkpoint recorded (its name and config.json), with no directory needed."""
        config = moe_config(fields, f"{name}: the recorded {CONFIG}")
        return cls(name, config, json.dumps(fields, sort_keys=True))

    @functools.cached_property
    def fields(self) -> dict[str, Any]:
        """The whole config.json (a fresh copy for each caller is `json.loads(text)`)."""
        return json.loads(self.text)

    def config_dict(self) -> dict[str, Any]:
        return json.loads(self.text)

    def with_config(self, config) -> HFMoESpec:
        recorded = HFMoESpec.from_recorded(self.name, dict(config))
        return dataclasses.replace(recorded, weights=self.weights) if recorded.text == self.text else recorded

    def hf_config(self) -> dict[str, Any]:
        """The directory's own config.json, which describes this model."""
        return json.loads(self.text)

    def init_value(self, fqn, shape, dtype, seed):
        """The saved tensors (`moe.hf.read_saved`), else transformers' initialisation drawn from
        (seed, fqn): normal(0, initializer_range) matrices, ones for norms."""
        if self.weights:
            from shardshift.models.moe.hf import read_saved

            return read_saved(self.fields["model_type"], fqn, tuple(shape), dict(self.weights)).to(dtype)
        from shardshift.models.hf.model import seeded_value

        std = float(self.fields.get("initializer_range") or DEFAULTS[self.fields["model_type"]]["initializer_range"])
        pad = self.fields.get("pad_token_id")
        return seeded_value(fqn, shape, dtype, seed, std, pad if isinstance(pad, int) and 0 <= pad < self.vocab_size
                            else None)

