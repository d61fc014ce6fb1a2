"""The Llama family's sizes: `LlamaConfig` and the named `PRESETS` (pure data).

The fields are those of Hugging Face's ``LlamaConfig`` that change the model's shape or its
arithmetic, under shorter names (`LlamaSpec.hf_config` writes them back under Hugging Face's);
``max_position_embeddings`` is the sequence length the model trains on.
"""

from __future__ import annotations

import dataclasses

VOCAB_SIZE = 256  # byte-level tokens


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    n_layers: int  # num_hidden_layers
    n_heads: int  # num_attention_heads (query heads)
    n_kv_heads: int  # num_key_value_heads: each serves n_heads / n_kv_heads query heads (grouped-query attention)
    hidden_size: int
    intermediate_size: int  # the width of the SwiGLU MLP (gate, up and down projections)
    seq_len: int  # max_position_embeddings
    vocab_size: int = VOCAB_SIZE
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False  # the head reads the embedding's weight (and has none of its own)

    def __post_init__(self) -> None:
        for name in ("n_layers", "n_heads", "n_kv_heads", "hidden_size", "intermediate_size", "seq_len", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {name}={getattr(self, name)} must be >= 1")
        if self.hidden_size % self.n_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by n_heads={self.n_heads}; "
                             f"choose hidden_size as a multiple of n_heads")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads}: each key-value "
                             f"head serves a whole group of query heads; choose n_kv_heads dividing n_heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} (hidden_size / n_heads) is odd; rotary embeddings rotate "
                             f"pairs of dims: choose an even head_dim")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps} and rope_theta={self.rope_theta} must be > 0")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads

    def num_params(self) -> int:
        h, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        kv = self.n_kv_heads * self.head_dim
        layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h  # q and o, k and v, gate, up and down, two norms
        return v * h + self.n_layers * layer + h + (0 if self.tie_word_embeddings else h * v)


# Named sizes, like the GPT's of the same name (`models.gpt.config.PRESETS`): the same layers,
# hidden size and sequence length; twice the GPT's query heads grouped over as many key-value heads
# (`llama-base`: its 12 query heads over 4); a SwiGLU width of about 8/3 hidden_size rounded up to a
# multiple of 32 (as many MLP parameters as the GPT's two matrices of width 4 * d_model).
# `llama-tiny`, `llama-small` and `llama-medium` take every layout of up to 8 ranks; `llama-base`
# and `llama-test` take tp in {1, 2, 4}. `llama-test` cuts shards unevenly for the equivalence
# tests: 5 layers, and a vocabulary of 259 (the 256 byte values and 3 never read) whose rows split
# 65, 65, 65, 64 over 4 ranks.
PRESETS: dict[str, LlamaConfig] = {
    "llama-test": LlamaConfig(n_layers=5, n_heads=8, n_kv_heads=4, hidden_size=32, intermediate_size=44, seq_len=13,
                              vocab_size=259),
    "llama-tiny": LlamaConfig(n_layers=8, n_heads=16, n_kv_heads=8, hidden_size=128, intermediate_size=352,
                              seq_len=128),
    "llama-small": LlamaConfig(n_layers=8, n_heads=16, n_kv_heads=8, hidden_size=256, intermediate_size=704,
                               seq_len=256),
    "llama-medium": LlamaConfig(n_layers=12, n_heads=16, n_kv_heads=8, hidden_size=512, intermediate_size=1376,
                                seq_len=256),
    "llama-base": LlamaConfig(n_layers=16, n_heads=12, n_kv_heads=4, hidden_size=768, intermediate_size=2048,
                              seq_len=256),
}
