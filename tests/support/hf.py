"""Hugging Face model directories for tests: small random models of each supported architecture,
written by transformers' own ``save_pretrained`` (config.json and model.safetensors), as a user's
directory would be."""

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

ARCHITECTURES = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM", QWEN2),
                 "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", QWEN3),
                 "mistral": ("MistralConfig", "MistralForCausalLM", MISTRAL),
                 "llama": ("LlamaConfig", "LlamaForCausalLM", LLAMA_TIED)}


def hf_model(kind: str, seed: int = 0, **overrides):
    """A random transformers model of architecture `kind` (a key of ARCHITECTURES), in float32."""
    import torch
    import transformers

    config_class, model_class, sizes = ARCHITECTURES[kind]
    config = getattr(transformers, config_class)(**{**sizes, **overrides})
    torch.manual_seed(seed)
    return getattr(transformers, model_class)(config)


def save_hf_model(kind: str, directory: Path, seed: int = 0, weights: bool = True, **overrides) -> str:
    """``save_pretrained`` of `hf_model(kind, seed)` into `directory` (without its weights unless
    `weights`); returns ``hf:DIRECTORY`` for --model."""
    model = hf_model(kind, seed, **overrides)
    if weights:
        model.save_pretrained(directory)
    else:
        model.config.save_pretrained(directory)
    return f"hf:{directory}"
