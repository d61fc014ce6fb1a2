"""``--compile [BACKEND]``: each layer's forward compiled by ``torch.compile`` (inductor by default).

Per layer (every module of the model's `PipelineSplit.layers`), as torchtitan does: the layers are
where the time goes and alike, so one compiled graph serves all of a model's layers, and what sits
between them (FSDP2's gathers, the pipeline's sends, DDP's hooks, the loss) stays eager. The
layer's ``forward`` is replaced on the instance, together with activation checkpointing
(`train.checkpointing.wrap_layers`, which says in which order). Parameter names do not change and
FSDP2's hooks, registered on the layer's call, run outside the compiled code.

**Recompiled or reused.** The compiled code is cached per function (a layer's ``forward``) and
guarded by what it was traced with: the shapes, dtypes and kinds of its inputs and parameters
(plain tensors, or DTensors with their placements and mesh sizes). A switch or a change of world
builds new modules and compiles their ``forward`` again: where the new layout gives a layer the same
local shapes and placements as one compiled before in this process, the cached code is reused with
no new compilation; otherwise (another tp degree, another local batch) that layer is compiled
anew, and that cost falls on the first step after the switch. The progress line and the metrics
report how many graphs each step compiled (`StepResult.compiled`, counted by `compiled_graphs`):
that step's time is the compilation's cost.

Compiled code computes the same function in a different order (fused kernels, other reductions), so
losses agree with eager ones to rounding, not bit for bit (docs/architecture.md, the numerics
contract).
"""

from __future__ import annotations

import torch

from shardshift.compat import compile_backend, raise_recompile_limit
from shardshift.train.config import COMPILE_BACKENDS

# Layouts a process has run, each compiling a layer anew where shapes or placements differ: more than
# torch's default of 8 cached versions of one function, after which it would run eager.
RECOMPILE_LIMIT = 64


class _Counted:
    """A torch.compile backend that counts the graphs it compiles. One per backend and process:
    compiled code is reused only under the backend object that compiled it."""

    def __init__(self, name: str) -> None:
        self.compile = compile_backend(name)
        self.graphs = 0

    def __call__(self, graph, example_inputs):
        self.graphs += 1
        return self.compile(graph, example_inputs)


_BACKENDS: dict[str, _Counted] = {}


def compiled_graphs() -> int:
    """The graphs `compile_function`'s functions have compiled in this process so far."""
    return sum(backend.graphs for backend in _BACKENDS.values())


def compile_function(forward, backend: str):
    """`forward` (a layer's) compiled with `backend`, one of `COMPILE_BACKENDS`; it compiles when
    first called, or takes code this process compiled for the same guards."""
    assert backend in COMPILE_BACKENDS, backend
    raise_recompile_limit(RECOMPILE_LIMIT)
    if backend not in _BACKENDS:
        _BACKENDS[backend] = _Counted(backend)
    return torch.compile(forward, backend=_BACKENDS[backend])
