"""The GPT's sizes (`ModelConfig`, the named `PRESETS`) and the rules a layout must follow for a
size: pure data, no torch, so that a launcher can check a run before any rank starts (importing torch
costs more than a second of CPU)."""

from __future__ import annotations

import dataclasses
import functools

from shardshift.layout import Layout

VOCAB_SIZE = 256  # byte-level tokens


@dataclasses.dataclass(frozen=True)
class ModelConfig:
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
PRESETS: dict[str, ModelConfig] = {
    "test": ModelConfig(n_layer=5, n_head=4, d_model=24, seq_len=13, d_ff=40),
    "tiny": ModelConfig(n_layer=8, n_head=8, d_model=128, seq_len=128),
    "small": ModelConfig(n_layer=8, n_head=8, d_model=256, seq_len=256),
    "medium": ModelConfig(n_layer=12, n_head=8, d_model=512, seq_len=256),
    "base": ModelConfig(n_layer=16, n_head=12, d_model=768, seq_len=256),  # 114M parameters
}


def stage_blocks(n_layer: int, pp: int) -> list[range]:
    """Block indices of each pipeline stage: contiguous, the first ``n_layer % pp`` stages one longer."""
    base, extra = divmod(n_layer, pp)
    out, start = [], 0
    for stage in range(pp):
        stop = start + base + (1 if stage < extra else 0)
        out.append(range(start, stop))
        start = stop
    return out


@functools.lru_cache(maxsize=64)
def block_stages(n_layer: int, pp: int) -> tuple[int, ...]:
    """The pipeline stage of each block (`stage_blocks` inverted)."""
    return tuple(stage for stage, blocks in enumerate(stage_blocks(n_layer, pp)) for _ in blocks)


def check_layout(layout: Layout, cfg: ModelConfig) -> None:
    """Refuse a layout this model cannot take, saying which constraint failed and what would do."""
    if layout.ep > 1:
        raise ValueError(
            f"ep={layout.ep}: the GPT has no experts to split; ep is for planning mixture-of-experts "
            f"models with `shardshift simulate` (train with ep=1)"
        )
    if layout.tp > 1:
        for name, size in (("n_head", cfg.n_head), ("d_ff", cfg.d_ff)):
            if size % layout.tp:
                valid = [t for t in range(1, cfg.n_head + 1) if cfg.n_head % t == 0 and cfg.d_ff % t == 0]
                raise ValueError(
                    f"tp={layout.tp} does not divide {name}={size}; choose tp in "
                    f"{{{', '.join(map(str, valid))}}}"
                )
    if layout.pp > cfg.n_layer:
        raise ValueError(
            f"pp={layout.pp} is larger than the number of layers n_layer={cfg.n_layer}; "
            f"choose pp <= {cfg.n_layer}"
        )
