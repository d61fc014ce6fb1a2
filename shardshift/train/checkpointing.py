"""What wraps each layer's forward: activation checkpointing (``--activation-checkpointing``), a
layer's activations not kept for the backward but computed again in it, trading compute for memory;
and ``--compile`` (`train.compiling`).

Per layer (every module of the model's `PipelineSplit.layers`), with PyTorch's non-reentrant
``torch.utils.checkpoint``:

- ``full``: nothing of the layer is kept but its inputs; its whole forward runs again in the
  backward;
- ``selective``: the outputs of the layer's matrix products and attention are kept
  (``torch.utils.checkpoint``'s selective policy: ``mm``, ``addmm``, ``bmm`` and scaled dot-product
  attention must be saved), and only what is cheap to compute again (norms, activations,
  elementwise products, reshapes) is recomputed.

The layer's ``forward`` is replaced on the instance, so parameter names do not change (no wrapper
module) and FSDP2's hooks, registered on the layer's call, still gather its parameters for the
forward and for the recomputation within its backward. The numbers are the same as without it: the
same operations on the same values (no dropout).

A layer holding an FSDP2 unit of its own (a mixture's experts, sharded apart: `parallelize`) is
checkpointed in full under ``selective`` too: that unit's hooks run inside the layer's forward and
gather differently when it runs again in the backward, which the selective policy, replaying the
forward's operations in order, does not allow (PyTorch 2.13 stops the backward).

Under ``--compile`` the order of the two wrappers depends on the mode. ``selective``: the compiled
function takes in the checkpointed forward (torch.compile traces the checkpoint and its policy,
and the recomputation is compiled too). ``full`` and ``none``: the layer's own forward is compiled,
and ``full``'s checkpoint runs the compiled code again in the backward. (A checkpoint that
recomputes a DTensor operation inside compiled code stops PyTorch 2.13's compiled forward: it
saves a device mesh among the tensors for the backward; under ``selective`` the operations that
compute with DTensors, the matrix products, are saved, not recomputed.)
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from shardshift.train.compiling import compile_function

MODES = ("none", "full", "selective")
_SAVED = {
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
}
_MARK = "_shardshift_wrapped"


def wrap_layers(model: nn.Module, layers: str, mode: str, compile: str = "none") -> None:
    """Checkpoint every layer in `model`'s container `layers` as `mode` says, and compile it with
    backend `compile` unless that is "none" (module docstring); a layer wrapped already is left as
    it is."""
    assert mode in MODES, mode
    if mode == "none" and compile == "none":
        return
    for layer in model.get_submodule(layers).children():
        if getattr(layer, _MARK, False):
            continue
        nested = any(isinstance(m, FSDPModule) for m in layer.modules() if m is not layer)
        selective = mode == "selective" and not nested
        forward = layer.forward
        if compile != "none" and not selective:
            forward = compile_function(forward, compile)
        if mode != "none":
            forward = functools.partial(_checkpointed, forward, selective)
        if compile != "none" and selective:
            forward = compile_function(forward, compile)
        layer.forward = forward
        setattr(layer, _MARK, True)


def _checkpointed(forward, selective: bool, *args, **kwargs):
    context = functools.partial(create_selective_checkpoint_contexts, _policy) if selective else None
    if context is None:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED else CheckpointPolicy.PREFER_RECOMPUTE
