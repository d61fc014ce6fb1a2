"""The built-in GPT as a `ModelSpec`: its tensor-parallel plan, its pipeline split, and the layouts
it refuses, over its sizes (`config.py`). Pure data: no torch until the model is built."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from shardshift.layout import Layout
from shardshift.models.gpt.config import PRESETS, GPTConfig
from shardshift.models.spec import PipelineSplit, SizedSpec, check_divides, check_stages

# Module -> its tensor-parallel style: each rank holds n_head / tp heads' worth of query, key and value
# columns and d_ff / tp hidden units; the attention output and the MLP's second projection are
# row-parallel (one all-reduce each, forward and backward). Embeddings, norms and the head stay whole.
TP_PLAN = {
    "blocks.*.attn.q": "colwise",
    "blocks.*.attn.k": "colwise",
    "blocks.*.attn.v": "colwise",
    "blocks.*.attn.out": "rowwise",
    "blocks.*.mlp.fc": "colwise",
    "blocks.*.mlp.proj": "rowwise",
}


@dataclasses.dataclass(frozen=True)
class GPTSpec(SizedSpec):
    """A GPT with a byte-level vocabulary (`model.GPT`): LayerNorm, GELU, learned positions, full
    multi-head attention."""

    name: str
    config: GPTConfig

    @classmethod
    def preset(cls, name: str) -> GPTSpec:
        return cls(name, PRESETS[name])

    @property
    def hidden_size(self) -> int:
        return self.config.d_model

    @property
    def pipeline(self) -> PipelineSplit:
        return PipelineSplit("blocks", self.config.n_layer, first=("tok_emb", "pos_emb"), last=("ln_f", "head"))

    @property
    def tp_plan(self) -> Mapping[str, str]:
        return TP_PLAN

    def check_layout(self, layout: Layout) -> None:
        cfg = self.config
        if layout.ep > 1:
            raise ValueError(
                f"ep={layout.ep}: the GPT has no experts to split; ep is for planning mixture-of-experts "
                f"models with `shardshift simulate` (train with ep=1)"
            )
        check_divides("tp", layout.tp, [(f"n_head={cfg.n_head}", cfg.n_head), (f"d_ff={cfg.d_ff}", cfg.d_ff)])
        check_stages(layout.pp, cfg.n_layer, f"n_layer={cfg.n_layer}")

    def build(self):
        from shardshift.models.gpt.model import GPT

        return GPT(self.config)

    def init_value(self, fqn, shape, dtype, seed):
        from shardshift.models.gpt.model import init_value

        return init_value(self.config, fqn, shape, dtype, seed)

    def loss(self, logits, targets):
        from shardshift.models.loss import next_token_loss

        return next_token_loss(logits, targets)
