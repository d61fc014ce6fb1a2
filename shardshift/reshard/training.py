"""The training state every model shares, as logical tensors, and how any layout places it.

Whatever the model, ShardShift trains it with AdamW, so its state is, per parameter, the parameter,
AdamW's two moments (``exp_avg``, ``exp_avg_sq``, the parameter's dtype and shape) and AdamW's
``step`` (a 0-d float32 tensor); then ``progress:train`` (``[optimizer steps taken, samples of the
data stream consumed]``; the LR schedule is a function of the step) and ``rng:cpu`` (the CPU
generator's state). `TrainingSpace` is the `StateSpace` of such a state, built from a description of
each parameter (`ParamRule`): which pipeline stage holds it, and how tensor and expert parallelism
split it before FSDP. A model's rules are derived from the model itself (`shardshift.models`); the
simulator writes them from a published config. The placement rules are the same for all:

- a parameter belongs to one pipeline stage (`ParamRule.layer`: a layer's index, `FIRST` for what
  the first stage holds beyond its layers, `LAST` for what the last stage holds);
- its splits (`ParamRule.splits`, (axis, dim) pairs) take one ``torch.chunk`` piece along ``dim``
  over the axis's ranks, in order (tensor parallelism splits the full tensor first);
- FSDP2 then chunks the piece along dim 0 over ``fsdp`` whenever the layout uses FSDP (`uses_fsdp`),
  replicated over ``dp``; pure replication (DDP) and layouts with no data axis add no split;
- the moments are placed like their parameter; AdamW's step whole on every rank of the parameter's
  stage; the progress and the RNG state whole on every rank.

Nothing here imports ``torch.distributed``, and torch itself only once a space is built: a launcher
checks a run's layout with the rest before any rank starts.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from shardshift.layout import Coord, Layout
from shardshift.reshard.space import LogicalTensor, Sharding, Split

if TYPE_CHECKING:
    import torch

MOMENTS = ("exp_avg", "exp_avg_sq")
OPTIMIZER_KINDS = (*MOMENTS, "step")  # AdamW's state per parameter
PROGRESS_KEY = "progress:train"  # [optimizer steps taken, samples of the data stream consumed]
RNG_KEY = "rng:cpu"  # the CPU generator's state
FIRST = -1  # `ParamRule.layer` of what the first stage holds beyond its layers (embeddings)
LAST = 1 << 30  # `ParamRule.layer` of what the last stage holds beyond its layers (final norm, head)


def replicate_only(layout: Layout) -> bool:
    """Data parallelism is whole copies of plain tensors (DDP): dp alone, no tp and no experts split."""
    return layout.dp > 1 and layout.fsdp == 1 and layout.tp == 1 and layout.ep == 1


def uses_fsdp(layout: Layout) -> bool:
    """FSDP2 wraps the model unless the layout is pure replication (DDP) or has no data axis."""
    return not replicate_only(layout) and layout.data_parallel > 1


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """Layer indices of each pipeline stage: contiguous, the first ``num_layers % pp`` stages one longer."""
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for stage in range(pp):
        stop = start + base + (1 if stage < extra else 0)
        out.append(range(start, stop))
        start = stop
    return out


@functools.lru_cache(maxsize=64)
def layer_stages(num_layers: int, pp: int) -> tuple[int, ...]:
    """The pipeline stage of each layer (`stage_layers` inverted)."""
    return tuple(stage for stage, layers in enumerate(stage_layers(num_layers, pp)) for _ in layers)


@dataclasses.dataclass(frozen=True)
class ParamRule:
    """Where a parameter goes under any layout, said once for all layouts."""

    layer: int  # the layer whose stage holds it; FIRST or LAST for what sits beyond the layers
    splits: tuple[tuple[str, int], ...] = ()  # (axis, dim): tp or ep splits before FSDP's, in order

    def __post_init__(self) -> None:
        for axis, dim in self.splits:
            assert axis in ("tp", "ep") and dim >= 0, self


class TrainingSpace:
    """`StateSpace` of a model trained with AdamW under ShardShift's layouts (module docstring).

    `params` are the model's parameters in its own order, (name, shape, rule) each; `num_layers` its
    layers (the pipeline splits them with `stage_layers`); `check` refuses a layout the model cannot
    take. `tensors` lists every logical tensor in a fixed order: per parameter ``param``,
    ``exp_avg``, ``exp_avg_sq``, ``step``; then ``progress:train`` and ``rng:cpu``. Their keys are
    the keys of `train.state.TrainingState.tensors()`.
    """

    def __init__(self, params: Sequence[tuple[str, tuple[int, ...], ParamRule]], num_layers: int,
                 param_dtype: torch.dtype, check: Callable[[Layout], None]):
        import torch

        self.num_layers = num_layers
        self._check = check
        self._rules: dict[str, ParamRule] = {}
        tensors = []
        for name, shape, rule in params:
            assert rule.layer in (FIRST, LAST) or 0 <= rule.layer < num_layers, (name, rule)
            self._rules[name] = rule
            tensors.append(LogicalTensor(name, "param", tuple(shape), param_dtype))
            tensors.extend(LogicalTensor(name, kind, tuple(shape), param_dtype) for kind in MOMENTS)
            tensors.append(LogicalTensor(name, "step", (), torch.float32))
        tensors.append(LogicalTensor("train", "progress", (2,), torch.int64))
        tensors.append(LogicalTensor("cpu", "rng", (torch.get_rng_state().numel(),), torch.uint8))
        self.tensors: tuple[LogicalTensor, ...] = tuple(tensors)

    def check(self, layout: Layout) -> None:
        """Raise ValueError (saying what to choose instead) if the model cannot take `layout`."""
        self._check(layout)

    def rule(self, name: str) -> ParamRule:
        return self._rules[name]

    def stage_of(self, name: str, pp: int) -> int:
        """The pipeline stage of `pp` that holds parameter `name`."""
        layer = self._rules[name].layer
        if layer == FIRST:
            return 0
        if layer == LAST:
            return pp - 1
        return layer_stages(self.num_layers, pp)[layer]

    def sharding(self, layout: Layout, coord: Coord, tensor: LogicalTensor) -> Sharding:
        if tensor.kind in ("progress", "rng"):
            return Sharding(stage=None)
        if tensor.kind == "step":
            return Sharding(stage=self.stage_of(tensor.name, layout.pp))
        rule = self._rules[tensor.name]
        return _sharding(self.stage_of(tensor.name, layout.pp), rule.splits, layout, coord.ep, coord.tp, coord.fsdp)


@functools.lru_cache(maxsize=1 << 14)
def _sharding(stage: int, splits: tuple[tuple[str, int], ...], layout: Layout, ep: int, tp: int,
              fsdp: int) -> Sharding:
    """The sharding of a parameter or moment with `splits`, at the coordinate with these indices on
    the axes that split. Cached: the planner asks the same few rules at the same few coordinates for
    thousands of tensors."""
    index = {"ep": ep, "tp": tp}
    out = [Split(dim, getattr(layout, axis), index[axis]) for axis, dim in splits if getattr(layout, axis) > 1]
    if uses_fsdp(layout):
        out.append(Split(0, layout.fsdp, fsdp))
    return Sharding(stage=stage, splits=tuple(out))
