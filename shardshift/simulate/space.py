"""The training state of a `ModelSpec` as logical tensors, and where each layout puts them: the
`StateSpace` the planner takes for models no process here could hold (pure metadata).

The state is GPTSpace's (`train/space.py`): per parameter ``param``, ``exp_avg``, ``exp_avg_sq`` (the
parameter's dtype) and AdamW's 0-d ``step``; then ``progress:train`` and ``rng:cpu``. The rules are
those a user of torchtitan-like parallelism expects:

- pipeline parallelism: each stage owns contiguous layers (`stage_blocks`); the embedding belongs to
  the first stage, the final norm and the LM head to the last. A tied embedding is held by the first
  stage only: the last stage's use of it (which would need a copy there) is not modelled;
- tensor parallelism (`SPLITS`): q, k, v, gate and up projections are column-parallel (``1/tp`` of
  the rows, dim 0), o and down projections row-parallel (``1/tp`` of the columns, dim 1); the
  embedding and the LM head are vocab-parallel (dim 0); norms and the router are whole;
- expert parallelism: a layer's stacked experts ``(E, ., .)`` are split over ``ep`` along dim 0 first,
  then over ``tp`` along the expert's own dims (gate and up: dim 1, down: dim 2); every other tensor
  is replicated along ``ep``;
- FSDP, as GPTSpace: when `uses_fsdp` (the layout has data ranks and is not pure replication), the
  piece a rank holds is chunked along dim 0 over ``fsdp``;
- AdamW's moments are placed like their parameter, its step whole on the parameter's stage; the
  progress and the RNG state whole on every rank.

`state_bytes` is the most state one rank holds under a layout, from the classes of coordinates
(`reshard.classes`), so it costs per distinct box, not per rank.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from shardshift.layout import Coord, Layout, divisors
from shardshift.reshard.classes import all_classes
from shardshift.reshard.space import LogicalTensor, Sharding, Split, StateSpace
from shardshift.simulate.specs import ModelSpec
from shardshift.train.presets import block_stages
from shardshift.train.space import MOMENTS, PROGRESS_KEY, RNG_KEY, RNG_STATE_BYTES, uses_fsdp, whole_sharding
from shardshift.units import format_size, parse_size

# Parameter (within a layer, or at the top) -> the splits of its piece before FSDP's: (axis, dim) each.
SPLITS = {
    "self_attn.q_proj.weight": (("tp", 0),),
    "self_attn.k_proj.weight": (("tp", 0),),
    "self_attn.v_proj.weight": (("tp", 0),),
    "self_attn.o_proj.weight": (("tp", 1),),
    "mlp.gate_proj.weight": (("tp", 0),),
    "mlp.up_proj.weight": (("tp", 0),),
    "mlp.down_proj.weight": (("tp", 1),),
    "mlp.experts.gate_proj": (("ep", 0), ("tp", 1)),
    "mlp.experts.up_proj": (("ep", 0), ("tp", 1)),
    "mlp.experts.down_proj": (("ep", 0), ("tp", 2)),
    "embed_tokens.weight": (("tp", 0),),
    "lm_head.weight": (("tp", 0),),
}
FIRST_STAGE = -1  # the layer index of what the first stage holds beyond its layers (the embedding)


class SpecSpace:
    """`StateSpace` of a `ModelSpec` trained with AdamW (module docstring). `tensors` is built once;
    `sharding` looks up each parameter's rule, made in the constructor (the planner calls it for
    thousands of tensors at thousands of ranks)."""

    def __init__(self, spec: ModelSpec, param_dtype: torch.dtype = torch.float32):
        self.spec = spec
        tensors = []
        self._rules: dict[str, tuple[int, str | None]] = {}  # name -> `_rule`
        for name, shape in spec.parameters():
            tensors.append(LogicalTensor(name, "param", shape, param_dtype))
            tensors.extend(LogicalTensor(name, kind, shape, param_dtype) for kind in MOMENTS)
            tensors.append(LogicalTensor(name, "step", (), torch.float32))
            self._rules[name] = self._rule(name)
        tensors.append(_by_key(PROGRESS_KEY, (2,), torch.int64))
        tensors.append(_by_key(RNG_KEY, (RNG_STATE_BYTES,), torch.uint8))
        self.tensors: tuple[LogicalTensor, ...] = tuple(tensors)

    def _rule(self, name: str) -> tuple[int, str | None]:
        """(the layer whose stage holds it, its key in `SPLITS` or None): a layer's index; FIRST_STAGE
        for the embedding; num_hidden_layers (past the last layer) for the final norm and the head."""
        parts = name.split(".")
        if parts[0] == "layers":
            return int(parts[1]), _known(".".join(parts[2:]))
        if parts[0] == "embed_tokens":
            return FIRST_STAGE, _known(name)
        return self.spec.num_hidden_layers, _known(name)

    def check(self, layout: Layout) -> None:
        """Refuse a layout the model cannot take, saying which constraint failed and what would do."""
        spec = self.spec
        if layout.ep > 1 and not spec.moe:
            raise ValueError(f"ep={layout.ep}: {spec.name} is dense, it has no experts to split; choose ep=1")
        if spec.moe and spec.num_experts % layout.ep:
            raise ValueError(f"ep={layout.ep} does not divide num_experts={spec.num_experts}; choose ep in "
                             f"{{{', '.join(map(str, divisors(spec.num_experts)))}}}")
        widths = {"num_attention_heads": spec.num_attention_heads, "num_key_value_heads": spec.num_key_value_heads}
        widths.update({"moe_intermediate_size": spec.moe_intermediate_size} if spec.moe
                      else {"intermediate_size": spec.intermediate_size})
        for name, size in widths.items():
            if size % layout.tp:
                valid = divisors(math.gcd(*widths.values()))
                raise ValueError(f"tp={layout.tp} does not divide {name}={size}; choose tp in "
                                 f"{{{', '.join(map(str, valid))}}}")
        if layout.pp > spec.num_hidden_layers:
            raise ValueError(f"pp={layout.pp} is larger than the number of layers num_hidden_layers="
                             f"{spec.num_hidden_layers}; choose pp <= {spec.num_hidden_layers}")

    def stage_of(self, name: str, pp: int) -> int:
        """The pipeline stage of `pp` that holds parameter `name` (module docstring)."""
        layer = self._rules[name][0]
        if layer == FIRST_STAGE:
            return 0
        if layer == self.spec.num_hidden_layers:
            return pp - 1
        return block_stages(self.spec.num_hidden_layers, pp)[layer]

    def sharding(self, layout: Layout, coord: Coord, tensor: LogicalTensor) -> Sharding:
        whole = whole_sharding(self, layout, tensor)
        if whole is not None:
            return whole
        return _sharding(self.stage_of(tensor.name, layout.pp), self._rules[tensor.name][1], layout, coord.ep, coord.tp, coord.fsdp)


def _known(name: str) -> str | None:
    return name if name in SPLITS else None


@functools.lru_cache(maxsize=1 << 14)
def _sharding(stage: int, rule: str | None, layout: Layout, ep: int, tp: int, fsdp: int) -> Sharding:
    """The sharding of a parameter or moment whose splits are `SPLITS[rule]` (None: whole), at the
    coordinate with these indices on the axes that split. Cached: the planner asks the same few rules
    at the same few coordinates for thousands of tensors."""
    index = {"ep": ep, "tp": tp}
    splits = [Split(dim, getattr(layout, axis), index[axis]) for axis, dim in SPLITS.get(rule, ())
              if getattr(layout, axis) > 1]
    if uses_fsdp(layout):
        splits.append(Split(0, layout.fsdp, fsdp))
    return Sharding(stage=stage, splits=tuple(splits))


def _by_key(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> LogicalTensor:
    """A non-parameter tensor named by its key (``kind:name``), as GPTSpace's."""
    kind, name = key.split(":")
    return LogicalTensor(name, kind, shape, dtype)


def state_bytes(space: StateSpace, layout: Layout) -> int:
    """The most bytes of state (parameters, moments, steps, progress, RNG) any one rank of `layout`
    holds; gradients and activations come on top. Summed per class of coordinates: tensors whose
    classes split the ranks alike share one vector of bytes per class, spread over the ranks once."""
    groups: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
    for tensor, classes in zip(space.tensors, all_classes(space, layout)):
        per_class = np.array([tensor.itemsize * box.numel for box in classes.boxes] + [0], dtype=np.int64)
        of_coord, total = groups.get(classes.signature, (classes.of_coord, 0))
        groups[classes.signature] = (of_coord, total + per_class)  # the last entry: NOTHING's (-1) bytes
    held = sum(total[of_coord] for of_coord, total in groups.values())
    return int(np.max(held))


def check_memory(space: StateSpace, layout: Layout, memory_per_rank: int | str) -> None:
    """Refuse a layout whose busiest rank's state (`state_bytes`) does not fit in `memory_per_rank`
    (bytes, or a size such as ``"80G"``), saying by how much to split it further."""
    has = parse_size(memory_per_rank, "memory per rank")
    needs = state_bytes(space, layout)
    if needs > has:
        raise ValueError(f"layout {layout} puts {format_size(needs)} of state on its busiest rank, which has "
                         f"{format_size(has)}; split the state about {math.ceil(needs / has)}x further with more "
                         f"pp, tp or fsdp (or ep, for the experts of a mixture-of-experts model)")
