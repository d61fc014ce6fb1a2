"""A Hugging Face model directory read as data: its ``config.json`` and, if there, its weights.

``--model hf:DIR`` names a directory as ``save_pretrained`` writes one: ``config.json`` (the
architecture and its sizes) and, optionally, ``model.safetensors`` (or the shards listed by
``model.safetensors.index.json``). Everything here is pure: JSON, and the JSON header that opens
every safetensors file (8 bytes of length, then the names, dtypes and shapes of its tensors). No
torch and no transformers are imported, so a launcher checks a run against the directory before
any process starts, and refuses what cannot train in one line that says what to change.

`HFConfig` is the configuration the engine reads (sizes, biases, tying), validated; it keeps the
whole file as canonical JSON, which is what a checkpoint records and `shardshift export` writes
back. `param_shapes` names every parameter of the architecture with its shape, as transformers
builds it (a unit test checks the two agree for every supported architecture): it prices the model
for the layout policy, and checks a weights file before anything is built.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
import struct
from pathlib import Path
from typing import Any

from shardshift.models.moe.hf import MOE_ARCHITECTURES
from shardshift.textfile import FileError, read_json

# model_type -> the transformers class that builds it. Each is a decoder of the Llama family
# (embeddings, decoder layers that take RoPE's cos and sin, a final RMSNorm, a head), which is what
# `model.HFCausalLM` runs stage by stage; other architectures need their own forward.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
BYTE_VOCAB = 256  # training reads bytes: token ids 0..255
MAX_SEQ_LEN = 256  # the sequence length trained on: max_position_embeddings, at most this
INSTALL = "pip install 'shardshift[hf]'"


def supported() -> str:
    """The model types ``hf:DIR`` takes, with their classes, for messages."""
    return ", ".join(f"{t} ({c})" for t, c in {**ARCHITECTURES, **MOE_ARCHITECTURES}.items())


def config_size(fields: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    """The whole number >= 1 that config.json `fields` give `key` (`default` where absent or null);
    ValueError naming `where` and the key otherwise."""
    value = fields.get(key)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {key} is {value!r}; it must be a whole number >= 1")
    return value


def config_head_dim(fields: dict[str, Any], hidden: int, heads: int, where: str) -> int:
    """config.json `fields`' head_dim, or hidden_size / num_attention_heads where it gives none;
    ValueError naming `where` when that does not divide."""
    if fields.get("head_dim") is not None:
        return config_size(fields, "head_dim", where)
    if hidden % heads:
        raise ValueError(f"{where}: hidden_size={hidden} is not divisible by num_attention_heads={heads} "
                         f"and there is no head_dim; give head_dim or a divisible width")
    return hidden // heads


def check_byte_vocab(vocab: int, where: str) -> None:
    """ValueError naming `where` unless a vocabulary of `vocab` holds the byte-level token ids."""
    if vocab < BYTE_VOCAB:
        raise ValueError(f"{where}: vocab_size={vocab} is below {BYTE_VOCAB}: training reads bytes (token ids "
                         f"0..255); give a model with vocab_size >= {BYTE_VOCAB}")


def require_transformers(name: str, modules: tuple[str, ...] = ("transformers", "safetensors")) -> None:
    """ValueError naming the extra to install, unless `modules` can be imported. Only looked up (not
    imported): importing transformers' models costs seconds."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"--model {name} needs {' and '.join(missing)}, not installed here: {INSTALL}")


@dataclasses.dataclass(frozen=True)
class HFConfig:
    """The fields of a ``config.json`` the engine reads, checked (`from_fields`), and the whole file."""

    text: str  # the whole config.json, as canonical JSON (sorted keys): recorded and written back as is
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int  # num_hidden_layers
    num_heads: int  # num_attention_heads
    num_kv_heads: int  # num_key_value_heads (num_attention_heads when absent)
    head_dim: int
    intermediate_size: int
    tied: bool  # tie_word_embeddings: the head's weight is the embeddings'
    seq_len: int  # trained on: min(max_position_embeddings, MAX_SEQ_LEN)
    initializer_range: float
    pad_token_id: int | None

    @classmethod
    def from_fields(cls, fields: Any, where: str) -> HFConfig:
        """The configuration of ``config.json`` fields `fields`; ValueError naming `where` and what is
        wrong: an architecture with no plan, a missing or non-positive size, a vocabulary that cannot
        hold bytes, heads that do not divide the width."""
        if not isinstance(fields, dict):
            raise ValueError(f"{where}: holds a JSON {type(fields).__name__}, not an object; give a Hugging Face "
                             f"config.json (as save_pretrained writes it)")
        model_type = fields.get("model_type")
        if model_type not in ARCHITECTURES:
            raise ValueError(f"{where}: model_type {model_type!r} has no plan in ShardShift; supported: {supported()}")

        def size(key: str, default: int | None = None) -> int:
            return config_size(fields, key, where, default)

        hidden, heads = size("hidden_size"), size("num_attention_heads")
        head_dim = config_head_dim(fields, hidden, heads, where)
        vocab = size("vocab_size")
        check_byte_vocab(vocab, where)
        kv = size("num_key_value_heads", heads)
        if heads % kv:
            raise ValueError(f"{where}: num_key_value_heads={kv} does not divide num_attention_heads={heads}")
        pad = fields.get("pad_token_id")
        return cls(
            text=json.dumps(fields, sort_keys=True),
            model_type=model_type,
            vocab_size=vocab,
            hidden_size=hidden,
            num_layers=size("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            intermediate_size=size("intermediate_size"),
            tied=bool(fields.get("tie_word_embeddings", False)),
            seq_len=min(size("max_position_embeddings", MAX_SEQ_LEN), MAX_SEQ_LEN),
            initializer_range=float(fields.get("initializer_range", 0.02)),
            pad_token_id=pad if isinstance(pad, int) and 0 <= pad < vocab else None,
        )

    @functools.cached_property
    def fields(self) -> dict[str, Any]:
        """The whole config.json (a fresh copy for each caller is `json.loads(text)`)."""
        return json.loads(self.text)

    @property
    def architecture(self) -> str:
        return ARCHITECTURES[self.model_type]

    def biases(self) -> tuple[bool, bool, bool]:
        """Whether (q/k/v projections, the attention output, the MLP) have biases, as each
        architecture's modules decide."""
        attention = bool(self.fields.get("attention_bias", False))
        if self.model_type == "qwen2":
            return True, False, False
        if self.model_type == "mistral":
            return False, False, False
        return attention, attention, self.model_type == "llama" and bool(self.fields.get("mlp_bias", False))


def param_shapes(cfg: HFConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the model, by its Hugging Face name, with its shape (a tied head is the
    embeddings' parameter, so it is not listed twice)."""
    d, v, i = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    qkv_bias, o_bias, mlp_bias = cfg.biases()
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d)}
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        for name, rows, bias in (("q_proj", q, qkv_bias), ("k_proj", kv, qkv_bias), ("v_proj", kv, qkv_bias)):
            shapes[p + f"self_attn.{name}.weight"] = (rows, d)
            if bias:
                shapes[p + f"self_attn.{name}.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (d, q)
        if o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (d,)
        if cfg.model_type == "qwen3":
            shapes[p + "self_attn.q_norm.weight"] = (cfg.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (cfg.head_dim,)
        for name, shape in (("gate_proj", (i, d)), ("up_proj", (i, d)), ("down_proj", (d, i))):
            shapes[p + f"mlp.{name}.weight"] = shape
            if mlp_bias:
                shapes[p + f"mlp.{name}.bias"] = shape[:1]
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
    shapes["model.norm.weight"] = (d,)
    if not cfg.tied:
        shapes["lm_head.weight"] = (v, d)
    return shapes


def num_params(cfg: HFConfig) -> int:
    return sum(math.prod(shape) for shape in param_shapes(cfg).values())


def read_fields(directory: str, name: str) -> Any:
    """The JSON value of `directory`'s config.json; ValueError naming `name` (``hf:DIR``) when the
    directory or its config.json is missing or unreadable."""
    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"--model {name}: {'not a directory' if root.exists() else 'no such directory'}; give a "
                         f"directory holding a Hugging Face {CONFIG} (as save_pretrained writes it)")
    try:
        return read_json(root / CONFIG, "--model", "a Hugging Face config.json (as save_pretrained writes it)")
    except FileError as err:
        raise ValueError(f"--model {name}: its {CONFIG}: {err.problem}; give a Hugging Face {CONFIG} "
                         f"(as save_pretrained writes it)") from None


def weight_files(directory: str) -> dict[str, str]:
    """Which file of `directory` holds each saved tensor (empty: no weights): ``model.safetensors``,
    or the shards ``model.safetensors.index.json`` lists."""
    root = Path(directory)
    if (root / WEIGHTS).is_file():
        return {name: str(root / WEIGHTS) for name in safetensors_header(root / WEIGHTS)}
    if (root / WEIGHTS_INDEX).is_file():
        index = read_json(root / WEIGHTS_INDEX, None, "a safetensors index (as save_pretrained writes it)")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{root / WEIGHTS_INDEX}: has no weight_map; give the index save_pretrained wrote")
        return {str(name): str(root / str(file)) for name, file in weight_map.items()}
    return {}


def safetensors_header(path: Path) -> dict[str, dict]:
    """The tensors a safetensors file holds (name -> {"dtype", "shape", "data_offsets"}), read
    from its header alone; ValueError if the file is not one."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            (length,) = struct.unpack("<Q", raw) if len(raw) == 8 else (None,)
            header = json.loads(f.read(length)) if length is not None and length < 100 << 20 else None
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: cannot be read as safetensors ({err}); save the weights with save_pretrained")
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (no header); save the weights with save_pretrained")
    return {name: info for name, info in header.items() if name != "__metadata__"}


def check_weights(cfg: HFConfig, files: dict[str, str], where: str) -> None:
    """ValueError naming the first parameter that the weights lack, or hold with another shape."""
    headers = {file: safetensors_header(Path(file)) for file in sorted(set(files.values()))}
    for fqn, shape in param_shapes(cfg).items():
        if fqn not in files:
            raise ValueError(f"{where}: its weights lack {fqn}; save the whole model with save_pretrained, or "
                             f"remove the weights to start from the seed")
        saved = tuple(headers[files[fqn]].get(fqn, {}).get("shape", ()))
        if saved != shape:
            raise ValueError(f"{where}: its weights hold {fqn} with shape {list(saved)}, but config.json makes it "
                             f"{list(shape)}; save the weights and the configuration together")
