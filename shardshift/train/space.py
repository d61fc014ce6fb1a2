"""The GPT's virtual parameter space: its training state as logical tensors, and where each layout
puts them (pure metadata; the live state is `state.py`'s `TrainingState`).

This is the single statement of how `parallelize.py` shards the model, written so that the planner
can evaluate it for any layout and any rank without building anything:

- a block's parameters belong to the pipeline stage that runs the block (`stage_blocks`); the
  embeddings to the first stage, the final norm and the head to the last;
- tensor parallelism (`TP_STYLES`): a column-parallel linear holds ``1/tp`` of the rows of its
  weight and bias; a row-parallel one ``1/tp`` of the columns of its weight, and its bias whole;
- FSDP2 then chunks the piece a rank holds along dim 0 over ``fsdp`` (replicated over ``dp``);
  pure replication (DDP) and tp-only layouts add no split.

AdamW's ``exp_avg`` and ``exp_avg_sq`` are placed like their parameter; its ``step`` (a 0-d tensor
per parameter) is held whole by every rank holding the parameter. The training progress
(``[step, position]``) and the CPU RNG state are held whole by every rank. The LR schedule is a pure
function of the step, so the step carries it.
"""

from __future__ import annotations

import functools

import torch

from shardshift.layout import Coord, Layout
from shardshift.reshard.space import LogicalTensor, Sharding, Split
from shardshift.train.model import GPT
from shardshift.train.presets import ModelConfig, block_stages, check_layout

# Linear module (relative to a block) -> its tensor-parallel style.
TP_STYLES = {
    "attn.q": "colwise",
    "attn.k": "colwise",
    "attn.v": "colwise",
    "attn.out": "rowwise",
    "mlp.fc": "colwise",
    "mlp.proj": "rowwise",
}

MOMENTS = ("exp_avg", "exp_avg_sq")
RNG_STATE_BYTES = torch.get_rng_state().numel()
PROGRESS_KEY = "progress:train"  # [optimizer steps taken, samples of the data stream consumed]
RNG_KEY = "rng:cpu"  # the CPU generator's state


def whole_sharding(space, layout: Layout, tensor: LogicalTensor) -> Sharding | None:
    """Where the state held whole goes: the progress and the RNG state on every rank, AdamW's step
    on every rank of its parameter's stage (`space.stage_of`); None for a parameter or a moment,
    which a space splits by its own rules."""
    if tensor.kind in ("progress", "rng"):
        return Sharding(stage=None)
    if tensor.kind == "step":
        return Sharding(stage=space.stage_of(tensor.name, layout.pp))
    return None


def uses_fsdp(layout: Layout) -> bool:
    """FSDP2 wraps the model unless the layout is pure replication (DDP) or has no data axis."""
    replicate_only = layout.dp > 1 and layout.fsdp == 1 and layout.tp == 1
    return not replicate_only and layout.data_parallel > 1


@functools.lru_cache(maxsize=8)
def gpt_space(cfg: ModelConfig, param_dtype: torch.dtype) -> "GPTSpace":
    """The `GPTSpace` of a model and dtype, built once per process (it builds the model on the meta
    device to list its parameters)."""
    return GPTSpace(cfg, param_dtype)


class GPTSpace:
    """`StateSpace` of a GPT trained with AdamW under ShardShift's layouts.

    `tensors` lists every logical tensor in a fixed order: per parameter (in the model's order)
    ``param``, ``exp_avg``, ``exp_avg_sq``, ``step``; then ``progress:train`` and ``rng:cpu``. Their
    keys are the keys of `TrainingState.tensors()`.
    """

    def __init__(self, cfg: ModelConfig, param_dtype: torch.dtype):
        self.cfg = cfg
        with torch.device("meta"):
            params = [(fqn, tuple(p.shape)) for fqn, p in GPT(cfg).named_parameters()]
        tensors = []
        for fqn, shape in params:
            tensors.append(LogicalTensor(fqn, "param", shape, param_dtype))
            tensors.extend(LogicalTensor(fqn, kind, shape, param_dtype) for kind in MOMENTS)
            tensors.append(LogicalTensor(fqn, "step", (), torch.float32))
        tensors.append(LogicalTensor("train", "progress", (2,), torch.int64))
        tensors.append(LogicalTensor("cpu", "rng", (RNG_STATE_BYTES,), torch.uint8))
        self.tensors: tuple[LogicalTensor, ...] = tuple(tensors)

    def check(self, layout: Layout) -> None:
        check_layout(layout, self.cfg)

    def stage_of(self, fqn: str, pp: int) -> int:
        parts = fqn.split(".")
        if parts[0] == "blocks":
            return block_stages(self.cfg.n_layer, pp)[int(parts[1])]
        return 0 if parts[0] in ("tok_emb", "pos_emb") else pp - 1

    def sharding(self, layout: Layout, coord: Coord, tensor: LogicalTensor) -> Sharding:
        whole = whole_sharding(self, layout, tensor)
        if whole is not None:
            return whole
        stage = self.stage_of(tensor.name, layout.pp)
        splits = []
        style = _tp_style(tensor.name)
        if layout.tp > 1 and style is not None:
            leaf = tensor.name.rsplit(".", 1)[1]
            if style == "colwise":
                splits.append(Split(0, layout.tp, coord.tp))
            elif leaf == "weight":  # row-parallel weight; its bias stays whole
                splits.append(Split(1, layout.tp, coord.tp))
        if uses_fsdp(layout):
            splits.append(Split(0, layout.fsdp, coord.fsdp))
        return Sharding(stage=stage, splits=tuple(splits))


def _tp_style(fqn: str) -> str | None:
    parts = fqn.split(".")  # blocks.<i>.<attn|mlp>.<linear>.<weight|bias>
    if parts[0] != "blocks" or len(parts) != 5:
        return None
    return TP_STYLES.get(f"{parts[2]}.{parts[3]}")
