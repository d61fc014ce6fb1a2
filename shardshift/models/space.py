"""A model's state space, derived from the model and its plan: never written by hand per model.

The model is built once on the meta device (no memory) to list its parameters in its own order;
each parameter's `reshard.training.ParamRule` then follows from the spec alone:

- its layer: the pipeline split's (`PipelineSplit.layer_of`);
- its tensor-parallel splits: the style its module has in the plan, applied as PyTorch's
  ``ColwiseParallel`` and ``RowwiseParallel`` apply it (`TP_DIMS`): a column-parallel linear
  holds ``1/tp`` of its weight's rows and of its bias, a row-parallel one ``1/tp`` of its weight's
  columns and its bias whole; an embedding's weight is split along its embedding dim (colwise) or
  its vocabulary (rowwise). A ``replicated_with_grad_allreduce`` module, of any type, keeps its
  parameters whole (only their gradients are summed over tp);
- its expert-parallel split: a parameter of a module holding stacked experts
  (`ModelSpec.expert_modules`) is split along dim 0 (its experts) over ``ep``.

`train.parallelize` applies the same plan with the same styles, and the tests check the two against
DTensor's own placement of every parameter.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from shardshift.models.spec import ModelSpec, plan_matcher
from shardshift.reshard.training import ParamRule, TrainingSpace

REPLICATED = "replicated_with_grad_allreduce"  # whole on every rank, whatever the module

# (module type, style, parameter leaf) -> the tensor dim that tensor parallelism splits (None: whole).
TP_DIMS = {
    (nn.Linear, "colwise", "weight"): 0,
    (nn.Linear, "colwise", "bias"): 0,
    (nn.Linear, "rowwise", "weight"): 1,
    (nn.Linear, "rowwise", "bias"): None,
    (nn.Embedding, "colwise", "weight"): 1,
    (nn.Embedding, "rowwise", "weight"): 0,
}


@functools.lru_cache(maxsize=16)
def state_space(spec: ModelSpec, param_dtype: torch.dtype) -> TrainingSpace:
    """The `TrainingSpace` of `spec` with parameters of `param_dtype`, built once per process."""
    with torch.device("meta"):
        model = spec.build()
    style_of = plan_matcher(spec.tp_plan)
    holds_experts = plan_matcher(dict.fromkeys(spec.expert_modules, "experts"))
    modules = dict(model.named_modules())
    params = []
    for fqn, param in model.named_parameters():
        module_name, _, leaf = fqn.rpartition(".")
        style = style_of(module_name)
        splits = ()
        if style is not None and style != REPLICATED:
            module = modules[module_name]
            kind = next((k for k in (nn.Linear, nn.Embedding) if isinstance(module, k)), None)
            if kind is None or (kind, style, leaf) not in TP_DIMS:
                raise ValueError(f"{spec.name}: the tensor-parallel plan makes {module_name} ({type(module).__name__}) "
                                 f"{style}, which applies to linear and embedding modules only; fix the plan")
            dim = TP_DIMS[kind, style, leaf]
            splits = () if dim is None else (("tp", dim),)
        if holds_experts(module_name):
            splits = (("ep", 0), *splits)
        params.append((fqn, tuple(param.shape), ParamRule(spec.pipeline.layer_of(fqn), splits)))
    return TrainingSpace(params, spec.pipeline.num_layers, param_dtype, spec.check_layout)
