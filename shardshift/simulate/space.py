"""The training state of a `DecoderSpec` (a published config's shapes) as logical tensors, and where
each layout puts them: the `StateSpace` the planner takes for models no process here could hold
(pure metadata).

It is a `reshard.training.TrainingSpace` (the state and the placement rules every model shares),
whose per-parameter rules are read off the config's parameter names as a user of torchtitan-like
parallelism expects:

- pipeline parallelism: each stage owns contiguous layers; the embedding belongs to the first
  stage, the final norm and the LM head to the last. A tied embedding is held by the first stage
  only: the last stage's use of it (which would need a copy there) is not modelled;
- tensor parallelism (`SPLITS`): q, k, v, gate and up projections are column-parallel (``1/tp`` of
  the rows, dim 0), o and down projections row-parallel (``1/tp`` of the columns, dim 1); the
  embedding and the LM head are vocab-parallel (dim 0); norms and the router are whole;
- expert parallelism: a layer's stacked experts ``(E, ., .)`` are split over ``ep`` along dim 0 first,
  then over ``tp`` along the expert's own dims (gate and up: dim 1, down: dim 2); every other tensor
  is replicated along ``ep``.

`state_bytes` is the most state one rank holds under a layout, from the classes of coordinates
(`reshard.classes`), so it costs per distinct box, not per rank.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from shardshift.layout import Layout
from shardshift.models.spec import check_divides, check_stages
from shardshift.reshard.classes import all_classes
from shardshift.reshard.space import StateSpace
from shardshift.reshard.training import FIRST, LAST, ParamRule, TrainingSpace
from shardshift.simulate.specs import DecoderSpec
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


class SpecSpace(TrainingSpace):
    """`StateSpace` of a `DecoderSpec` trained with AdamW (module docstring)."""

    def __init__(self, spec: DecoderSpec, param_dtype: torch.dtype = torch.float32):
        self.spec = spec
        params = [(name, shape, _rule(name)) for name, shape in spec.parameters()]
        super().__init__(params, spec.num_hidden_layers, param_dtype, self._check_spec)

    def _check_spec(self, layout: Layout) -> None:
        """Refuse a layout the model cannot take, saying which constraint failed and what would do."""
        spec = self.spec
        if layout.ep > 1 and not spec.moe:
            raise ValueError(f"ep={layout.ep}: {spec.name} is dense, it has no experts to split; choose ep=1")
        if spec.moe:
            check_divides("ep", layout.ep, [(f"num_experts={spec.num_experts}", spec.num_experts)])
        widths = {"num_attention_heads": spec.num_attention_heads, "num_key_value_heads": spec.num_key_value_heads}
        widths.update({"moe_intermediate_size": spec.moe_intermediate_size} if spec.moe
                      else {"intermediate_size": spec.intermediate_size})
        check_divides("tp", layout.tp, [(f"{name}={size}", size) for name, size in widths.items()])
        check_stages(layout.pp, spec.num_hidden_layers, f"num_hidden_layers={spec.num_hidden_layers}")


def _rule(name: str) -> ParamRule:
    """A parameter's layer (FIRST for the embedding, LAST for the final norm and the head) and splits."""
    parts = name.split(".")
    if parts[0] == "layers":
        return ParamRule(int(parts[1]), SPLITS.get(".".join(parts[2:]), ()))
    return ParamRule(FIRST if parts[0] == "embed_tokens" else LAST, SPLITS.get(name, ()))


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
