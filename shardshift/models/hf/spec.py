"""A Hugging Face architecture as a `ModelSpec`: ``--model hf:DIR``.

The spec is pure data (`config.HFConfig`, read from ``DIR/config.json``, and which file holds each
saved tensor), so a launcher checks a run's layout against it before any process starts. The model
itself is transformers' own (`model.py`), under Hugging Face's parameter names:

- tensor parallelism: the configuration class's ``base_model_tp_plan``, its names prefixed with
  ``model.`` (the causal LM's backbone). ``colwise`` and ``rowwise`` are the projections'; Qwen3's
  per-head ``q_norm`` and ``k_norm`` are ``replicated_with_grad_allreduce`` (whole, their gradient
  summed over the heads every rank holds). The embeddings, the other norms and the head stay whole,
  as the built-in GPT's do;
- pipeline: the decoder layers ``model.layers.N``; the embeddings on the first stage, the final norm
  and the head on the last. Tied embeddings (the head's weight is the embeddings') would be one
  parameter on two stages: such a model trains with pp=1;
- initial values: the saved tensors where ``model.safetensors`` is there, else drawn from the seed
  and each parameter's name (`model.init_value`).

A checkpoint records the whole config.json (`config_dict`); `with_config` and `from_config` build
the spec back from it, with no directory: the weights then come from the checkpoint.

A mixture of experts (``qwen3_moe``, ``mixtral``) is not transformers' model: `from_name` and
`from_config` give ShardShift's own for it (`moe.HFMoESpec`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from shardshift.layout import Layout
from shardshift.models.hf.config import (
    CONFIG,
    HFConfig,
    check_weights,
    num_params,
    read_fields,
    require_transformers,
    weight_files,
)
from shardshift.models.hf.moe import HFMoESpec
from shardshift.models.moe.hf import MOE_ARCHITECTURES
from shardshift.models.spec import TP_STYLES, PipelineSplit, SizedSpec, check_divides, check_stages

PREFIX = "hf:"
BACKBONE = "model"  # the causal LM's attribute holding the backbone, whose names the config's plan uses


@dataclasses.dataclass(frozen=True)
class HFSpec(SizedSpec):
    """A decoder of a supported Hugging Face architecture (`config.ARCHITECTURES`)."""

    name: str  # "hf:" and the directory's absolute path
    config: HFConfig
    weights: tuple[tuple[str, str], ...] = ()  # (parameter, safetensors file) to start from; (): from the seed

    @classmethod
    def from_name(cls, name: str) -> HFSpec | HFMoESpec:
        """The model of ``hf:DIR``, its weights checked against its configuration; ValueError saying
        what is missing or wrong, and what to do. A mixture of experts (`moe.hf.MOE_ARCHITECTURES`)
        is ShardShift's own (`hf.moe.HFMoESpec`)."""
        directory = name[len(PREFIX):]
        if not directory:
            raise ValueError(f"--model {name}: give the directory after hf:, e.g. --model hf:runs/qwen")
        fields = read_fields(directory, name)
        if isinstance(fields, dict) and fields.get("model_type") in MOE_ARCHITECTURES:
            return HFMoESpec.from_directory(name, os.path.abspath(directory), fields)
        config = HFConfig.from_fields(fields, f"--model {name}: {CONFIG}")
        require_transformers(name)
        directory = os.path.abspath(directory)  # the same model, and files, from any working directory
        files = weight_files(directory)
        if files:
            check_weights(config, files, f"--model {name}")
        return cls(PREFIX + directory, config, tuple(sorted(files.items())))

    @classmethod
    def from_config(cls, name: str, config: Mapping[str, Any]) -> HFSpec | HFMoESpec:
        """The model a checkpoint recorded (its name and config.json), with no directory needed."""
        if config.get("model_type") in MOE_ARCHITECTURES:
            return HFMoESpec.from_recorded(name, dict(config))
        require_transformers(name)
        return cls(name, HFConfig.from_fields(dict(config), f"{name}: the recorded {CONFIG}"))

    # ---- what the model is ---------------------------------------------------------------------

    @property
    def pipeline(self) -> PipelineSplit:
        return PipelineSplit(f"{BACKBONE}.layers", self.config.num_layers, first=(f"{BACKBONE}.embed_tokens",),
                             last=(f"{BACKBONE}.norm", "lm_head"))

    @property
    def tp_plan(self) -> Mapping[str, str]:
        """The configuration class's ``base_model_tp_plan`` under the backbone's name (module docstring)."""
        from transformers import CONFIG_MAPPING

        plan = {}
        for pattern, style in CONFIG_MAPPING[self.config.model_type].base_model_tp_plan.items():
            if style not in TP_STYLES:
                raise ValueError(f"{self.name}: its tensor-parallel plan makes {pattern} {style!r}, which ShardShift "
                                 f"does not apply (it applies {', '.join(TP_STYLES)}); train it with tp=1")
            plan[f"{BACKBONE}.{pattern}"] = style
        return plan

    def config_dict(self) -> dict[str, Any]:
        return self.config.fields.copy()

    def with_config(self, config: Mapping[str, Any]) -> HFSpec:
        recorded = HFConfig.from_fields(dict(config), f"{self.name}: the recorded {CONFIG}")
        return HFSpec(self.name, recorded, self.weights if recorded == self.config else ())

    def hf_config(self) -> dict[str, Any]:
        return self.config.fields.copy()

    def num_params(self) -> int:
        return num_params(self.config)

    def check_layout(self, layout: Layout) -> None:
        cfg = self.config
        if layout.ep > 1:
            raise ValueError(f"ep={layout.ep}: {cfg.architecture} has no experts to split; train with ep=1")
        sizes = (("num_key_value_heads", cfg.num_kv_heads), ("num_attention_heads", cfg.num_heads),
                 ("intermediate_size", cfg.intermediate_size))
        check_divides("tp", layout.tp, [(f"{key}={size} of {cfg.architecture}", size) for key, size in sizes])
        check_stages(layout.pp, cfg.num_layers, f"num_hidden_layers={cfg.num_layers}")
        if layout.pp > 1 and cfg.tied:
            raise ValueError(f"pp={layout.pp}: {cfg.architecture} ties its head to its embeddings "
                             f"(tie_word_embeddings), one parameter that the first and the last stage would both "
                             f"need; train it with pp=1")

    # ---- torch ---------------------------------------------------------------------------------

    def build(self):
        from shardshift.models.hf.model import build

        return build(self.config)

    def init_value(self, fqn, shape, dtype, seed):
        from shardshift.models.hf.model import initial_value

        return initial_value(self.config, dict(self.weights).get(fqn), fqn, shape, dtype, seed)

    def init_buffers(self, module) -> None:
        from shardshift.models.hf.model import fill_rope_buffers

        fill_rope_buffers(module)

    def loss(self, logits, targets):
        from shardshift.models.loss import next_token_loss

        return next_token_loss(logits, targets)
