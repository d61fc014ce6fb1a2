"""A Hugging Face causal LM as a module the engine can split: transformers' own layers, run by
ShardShift stage by stage, under Hugging Face's parameter names.

transformers' ``LlamaModel.forward`` (and its Qwen and Mistral copies) runs every layer of a
``ModuleList`` after the embeddings and computes RoPE and the mask at the top: a pipeline stage
that holds some of the layers cannot run it. `HFCausalLM` holds the same modules, taken from the
model transformers builds, under the same names (``model.embed_tokens``, ``model.layers.N``,
``model.norm``, ``lm_head``); only the container of the layers differs (a ``ModuleDict`` keyed by
the global index, which names its children as the ``ModuleList`` did), so that a stage keeping
layers 3..5 still calls them ``model.layers.3`` .. ``model.layers.5``. Its forward runs what the
stage holds: the embeddings if it has them, each of its layers with RoPE's cos and sin for
positions 0..t-1 (computed on every stage by the same ``rotary_emb``, which holds no parameter),
then the final norm and the head if it has them.

Attention is PyTorch's ``scaled_dot_product_attention`` (transformers' ``sdpa``): on the CPU it is
exact in float64 (its eager attention takes the softmax in float32). A layer whose sliding window
is shorter than the sequence (Mistral; Qwen's ``sliding_attention`` layers) gets a boolean mask that
lets position i see j when ``0 <= i - j < window``, as transformers' own mask does; every other
layer is causal, with no mask. transformers computes RMSNorm and RoPE's angles in float32
whatever the dtype: a float64 run is float64 everywhere else, and exactly transformers' forward.
"""

from __future__ import annotations

import json

import torch
from torch import nn

from shardshift.models.hf.config import HFConfig
from shardshift.models.init import seeded_normal


class Backbone(nn.Module):
    """What transformers' ``LlamaModel`` holds, with the layers keyed by their index."""

    def __init__(self, embed_tokens: nn.Embedding, layers: nn.ModuleList, norm: nn.Module, rotary_emb: nn.Module):
        super().__init__()
        self.embed_tokens: nn.Embedding | None = embed_tokens
        self.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(layers)})
        self.norm: nn.Module | None = norm
        self.rotary_emb = rotary_emb


class HFCausalLM(nn.Module):
    """A causal LM of the Llama family, run stage by stage (module docstring)."""

    def __init__(self, causal_lm: nn.Module, windows: tuple[int | None, ...]):
        super().__init__()
        inner = causal_lm.model
        self.model = Backbone(inner.embed_tokens, inner.layers, inner.norm, inner.rotary_emb)
        self.lm_head: nn.Linear | None = causal_lm.lm_head  # tied: its weight is the embeddings' parameter
        self.windows = windows  # per layer: its sliding window, None for full causal attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """tokens (b, t) int64 -> logits (b, t, vocab); without the embeddings it takes hidden states
        (b, t, d), without the head it returns them."""
        backbone = self.model
        if backbone.embed_tokens is not None:
            x = backbone.embed_tokens(x)  # (b, t, d)
        t = x.shape[1]
        positions = torch.arange(t, device=x.device)[None]  # (1, t)
        rope = backbone.rotary_emb(x, positions)  # cos and sin, each (1, t, head_dim), in x's dtype
        for index, layer in backbone.layers.items():
            x = layer(x, attention_mask=self._mask(int(index), t, x.device), position_ids=positions,
                      position_embeddings=rope)
        if self.lm_head is not None:
            x = self.lm_head(backbone.norm(x))  # (b, t, vocab)
        return x

    def _mask(self, layer: int, t: int, device: torch.device) -> torch.Tensor | None:
        """None (causal, SDPA's own) unless the layer's window is shorter than `t`; then (1, 1, t, t),
        True where query i may see key j."""
        window = self.windows[layer]
        if window is None or window >= t:
            return None
        i = torch.arange(t, device=device)[:, None]
        j = torch.arange(t, device=device)[None, :]
        return ((j <= i) & (i - j < window))[None, None]


def transformers_config(cfg: HFConfig):
    """transformers' configuration object for `cfg`, with SDPA attention and the sizes ShardShift read."""
    from transformers import CONFIG_MAPPING

    fields = json.loads(cfg.text)
    fields.update(tie_word_embeddings=cfg.tied, num_key_value_heads=cfg.num_kv_heads)
    return CONFIG_MAPPING[cfg.model_type].from_dict(fields, attn_implementation="sdpa")


def windows(config) -> tuple[int | None, ...]:
    """The sliding window of each layer of transformers' `config` (None: full causal attention):
    Qwen's per layer (``layer_types``), Mistral's for every layer."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        return tuple(window if kind == "sliding_attention" else None for kind in types)
    return (window,) * config.num_hidden_layers


def build(cfg: HFConfig) -> HFCausalLM:
    """The model of `cfg`, built by transformers (on the current default device: the engine's meta)."""
    import transformers

    config = transformers_config(cfg)
    causal_lm = getattr(transformers, cfg.architecture)(config)
    return HFCausalLM(causal_lm, windows(config))


def initial_value(cfg: HFConfig, file: str | None, fqn: str, shape: torch.Size, dtype: torch.dtype,
                  seed: int) -> torch.Tensor:
    """The initial value of parameter `fqn`, whole: the tensor saved in `file` (a safetensors file,
    read lazily: only this tensor), else `seeded_value`, so that every layout starts from the same
    weights."""
    if file is not None:
        from safetensors import safe_open

        with safe_open(file, framework="pt") as f:
            saved = f.get_tensor(fqn)
        if tuple(saved.shape) != tuple(shape):
            raise ValueError(f"{file}: {fqn} has shape {list(saved.shape)}, the model {list(shape)}")
        return saved.to(dtype)
    return seeded_value(fqn, shape, dtype, seed, cfg.initializer_range, cfg.pad_token_id)


def seeded_value(fqn: str, shape: torch.Size, dtype: torch.dtype, seed: int, std: float,
                 pad_token_id: int | None) -> torch.Tensor:
    """Parameter `fqn`'s value as transformers initialises it, a function of (seed, fqn) alone:
    zeros for biases, ones for norms' gains, normal(0, `std`) for matrices (the padding token's
    embedding zero)."""
    module, leaf = fqn.split(".")[-2:]
    if leaf == "bias":
        return torch.zeros(shape, dtype=dtype)
    if module.endswith("norm"):  # input_layernorm, post_attention_layernorm, norm, q_norm, k_norm
        return torch.ones(shape, dtype=dtype)
    value = seeded_normal(fqn, shape, torch.float64, seed, std)
    if module == "embed_tokens" and pad_token_id is not None:
        value[pad_token_id] = 0
    return value.to(dtype)


@torch.no_grad()
def fill_rope_buffers(model: nn.Module) -> None:
    """RoPE's inverse frequencies (buffers no checkpoint holds), computed afresh by transformers'
    own rotary embedding and copied into `model`'s, in whatever dtype and device they are."""
    rotary = model.get_submodule("model.rotary_emb")
    with torch.device("cpu"):
        fresh = type(rotary)(config=rotary.config)
    for name, buffer in fresh.named_buffers():
        rotary.get_buffer(name).copy_(buffer)
