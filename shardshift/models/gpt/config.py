"""The GPT's sizes: `GPTConfig` and the named `PRESETS` (pure data)."""

from __future__ import annotations

import dataclasses

VOCAB_SIZE = 256  # byte-level tokens


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_head: int
    d_model: int
    seq_len: int
    d_ff: int = 0  # hidden width of the MLP; 0 means 4 * d_model
    vocab_size: int = VOCAB_SIZE

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "d_model", "seq_len", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {name}={getattr(self, name)} must be >= 1")
        if self.d_ff < 0:
            raise ValueError(f"model d_ff={self.d_ff} must be >= 0 (0 means 4 * d_model)")
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_head={self.n_head}; "
                f"choose d_model as a multiple of n_head"
            )
        if self.d_ff == 0:
            object.__setattr__(self, "d_ff", 4 * self.d_model)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def num_params(self) -> int:
        d, f, v = self.d_model, self.d_ff, self.vocab_size
        block = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d  # attention, MLP, two norms
        return v * d + self.seq_len * d + self.n_layer * block + 2 * d + d * v + v


# Named sizes. `tiny` allows every layout of up to 8 ranks (layers, heads, widths divisible by 8).
# `test` has sizes that cut shards unevenly (seq_len 13, 5 layers) for the equivalence tests.
PRESETS: dict[str, GPTConfig] = {
    "test": GPTConfig(n_layer=5, n_head=4, d_model=24, seq_len=13, d_ff=40),
    "tiny": GPTConfig(n_layer=8, n_head=8, d_model=128, seq_len=128),
    "small": GPTConfig(n_layer=8, n_head=8, d_model=256, seq_len=256),
    "medium": GPTConfig(n_layer=12, n_head=8, d_model=512, seq_len=256),
    "base": GPTConfig(n_layer=16, n_head=12, d_model=768, seq_len=256),  # 114M parameters
}
