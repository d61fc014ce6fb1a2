"""Model specs: the shapes of a transformer from its published config, and nothing else.

A `DecoderSpec` holds the fields of a Hugging Face-style ``config.json`` under their own key names, so
`load_spec` reads a model's config as published (JSON or YAML; unknown keys are ignored) as well as
the specs shipped in ``specs/`` (``llama3-70b``, ``llama3-405b``, ``qwen3-235b-a22b``). The
architecture is the Llama/Qwen decoder: per layer an RMSNorm, grouped-query attention (optionally
with per-head RMSNorms of queries and keys, ``qk_norm``, as Qwen3 has), an RMSNorm and a gated MLP,
dense or a mixture of experts in every layer; then the final norm and the LM head (or the embedding
again, when tied). `parameters` names them as Hugging Face does (without the ``model.`` prefix),
with the experts of a layer stacked into one tensor per projection as torchtitan keeps them.

Norms are weights only (no biases anywhere), as in these models.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
from pathlib import Path

import yaml

from shardshift.textfile import naming, read_json, read_yaml

# Other names the configs of some models give a field (Mixtral's, DeepSeek's).
ALIASES = {"num_experts": ("num_local_experts", "n_routed_experts")}
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
# Hugging Face's config does not say whether queries and keys are normed; its model type does.
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    """The shapes of a decoder-only transformer, under Hugging Face's config key names."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int  # the dense MLP's width (unused when every layer is a mixture of experts)
    vocab_size: int
    num_key_value_heads: int | None = None  # None: num_attention_heads (no grouping)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    tie_word_embeddings: bool = False
    num_experts: int = 0  # 0: dense
    num_experts_per_tok: int = 0  # top-k of the router
    moe_intermediate_size: int | None = None  # an expert's width; None: intermediate_size (Mixtral's config)
    qk_norm: bool = False  # RMSNorms of head_dim on queries and keys in every layer

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name={self.name!r} must be a non-empty string")
        for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
            _positive(field, getattr(self, field))
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} does not divide "
                             f"hidden_size={self.hidden_size}; give head_dim")
        self._default("num_key_value_heads", self.num_attention_heads)
        self._default("head_dim", self.hidden_size // self.num_attention_heads)
        self._default("moe_intermediate_size", self.intermediate_size)
        for field in ("num_key_value_heads", "head_dim", "moe_intermediate_size"):
            _positive(field, getattr(self, field))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads={self.num_key_value_heads} does not divide "
                             f"num_attention_heads={self.num_attention_heads}: each group of query heads "
                             f"shares one key/value head")
        for field in ("tie_word_embeddings", "qk_norm"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"{field}={getattr(self, field)!r} must be true or false")
        self._check_experts()

    def _default(self, field: str, value: int) -> None:
        if getattr(self, field) is None:
            object.__setattr__(self, field, value)  # frozen: set once, while being built

    def _check_experts(self) -> None:
        if not _is_int(self.num_experts) or self.num_experts < 0:
            raise ValueError(f"num_experts={self.num_experts!r} must be an integer >= 0 (0: a dense model)")
        if self.moe:
            _positive("num_experts_per_tok", self.num_experts_per_tok)
            if self.num_experts_per_tok > self.num_experts:
                raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} is more than "
                                 f"num_experts={self.num_experts}: a token cannot go to more experts than exist")

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    def parameters(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every parameter's name and shape, in the model's order (embedding, layers, norm, head)."""
        h = self.hidden_size
        out = [("embed_tokens.weight", (self.vocab_size, h))]
        for i in range(self.num_hidden_layers):
            out += [(f"layers.{i}.{name}", shape) for name, shape in self._layer()]
        out.append(("norm.weight", (h,)))
        if not self.tie_word_embeddings:
            out.append(("lm_head.weight", (self.vocab_size, h)))
        return out

    def _layer(self) -> list[tuple[str, tuple[int, ...]]]:
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        out = [
            ("input_layernorm.weight", (h,)),
            ("self_attn.q_proj.weight", (q, h)),
            ("self_attn.k_proj.weight", (kv, h)),
            ("self_attn.v_proj.weight", (kv, h)),
            ("self_attn.o_proj.weight", (h, q)),
        ]
        if self.qk_norm:
            out += [("self_attn.q_norm.weight", (self.head_dim,)), ("self_attn.k_norm.weight", (self.head_dim,))]
        out.append(("post_attention_layernorm.weight", (h,)))
        if self.moe:
            e, f = self.num_experts, self.moe_intermediate_size
            out += [("mlp.gate.weight", (e, h)), ("mlp.experts.gate_proj", (e, f, h)),
                    ("mlp.experts.up_proj", (e, f, h)), ("mlp.experts.down_proj", (e, h, f))]
        else:
            f = self.intermediate_size
            out += [("mlp.gate_proj.weight", (f, h)), ("mlp.up_proj.weight", (f, h)), ("mlp.down_proj.weight", (h, f))]
        return out

    def num_params(self) -> int:
        """All parameters (a tied embedding counted once)."""
        return sum(math.prod(shape) for _, shape in self.parameters())

    def active_params(self) -> int:
        """The parameters one token uses: all but the experts it is not routed to (the embedding and
        head counted whole, as the "A22B" of Qwen3-235B-A22B counts them)."""
        if not self.moe:
            return self.num_params()
        experts = sum(math.prod(shape) for name, shape in self.parameters() if is_expert(name))
        return self.num_params() - experts * (self.num_experts - self.num_experts_per_tok) // self.num_experts

    def describe(self) -> str:
        attention = f"{self.num_attention_heads} heads ({self.num_key_value_heads} KV) of {self.head_dim}"
        if self.moe:
            mlp = f"{self.num_experts} experts of {self.moe_intermediate_size}, top-{self.num_experts_per_tok}"
            size = f"{self.num_params() / 1e9:.1f}B parameters, {self.active_params() / 1e9:.1f}B active"
        else:
            mlp, size = f"MLP {self.intermediate_size}", f"{self.num_params() / 1e9:.1f}B parameters"
        tied = ", tied embedding" if self.tie_word_embeddings else ""
        return (f"{self.name}: {self.num_hidden_layers} layers, hidden {self.hidden_size}, {attention}, {mlp}, "
                f"vocab {self.vocab_size}{tied}: {size}")


def is_expert(name: str) -> bool:
    """Whether a parameter is a layer's stacked experts (split over ep, its dim 0)."""
    return ".mlp.experts." in name


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(field: str, value) -> None:
    if not _is_int(value) or value < 1:
        raise ValueError(f"{field}={value!r} must be a positive integer")


# ---- loading ------------------------------------------------------------------------------------


def shipped_specs() -> list[str]:
    """The names of the specs shipped with the package."""
    return sorted(p.name.removesuffix(".yaml") for p in _shipped().iterdir() if p.name.endswith(".yaml"))


def load_spec(name_or_path: str | Path, flag: str | None = "--model") -> DecoderSpec:
    """A shipped spec by name (`shipped_specs`), or a config file (a model's ``config.json``, or YAML);
    ValueError in one line naming `flag` and the file (`shardshift.textfile`), or what in it is wrong."""
    if str(name_or_path) in shipped_specs():
        file = f"{name_or_path}.yaml"
        return spec_from_config(yaml.safe_load((_shipped() / file).read_text()), file)
    path = Path(name_or_path)
    if not path.exists():
        raise ValueError(f"no model spec named {str(name_or_path)!r} and no such file; the shipped specs are "
                         f"{', '.join(shipped_specs())}, or give a model's config.json")
    read = read_json if path.suffix == ".json" else read_yaml
    config = read(path, flag, "a model's config.json or a YAML spec")
    return spec_from_config(config, naming(flag, path),
                            default_name=path.parent.name if path.name == "config.json" else path.stem)


def spec_from_config(config: dict, source: str, default_name: str | None = None) -> DecoderSpec:
    """A `DecoderSpec` from a config's keys (Hugging Face's names; others ignored); `source` names the
    file in errors, `default_name` is the name when the config gives none."""
    if not isinstance(config, dict):
        raise ValueError(f"{source} holds {type(config).__name__}, not a mapping of config keys")
    values = {}
    for field in dataclasses.fields(DecoderSpec):
        key = next((k for k in (field.name, *ALIASES.get(field.name, ())) if config.get(k) is not None), None)
        if key is not None:
            values[field.name] = config[key]
    values.setdefault("name", default_name or Path(source).stem)
    values.setdefault("qk_norm", config.get("model_type") in QK_NORM_MODEL_TYPES)
    required = REQUIRED + (("num_experts_per_tok",) if values.get("num_experts") else ())
    missing = [key for key in required if key not in values]
    if missing:
        raise ValueError(f"{source} lacks {', '.join(map(repr, missing))}, which a model spec needs")
    try:
        return DecoderSpec(**values)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def _shipped():
    return importlib.resources.files(__package__) / "specs"
