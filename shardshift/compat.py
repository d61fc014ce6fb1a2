"""Every private PyTorch API ShardShift uses, each behind one function, checked against torch 2.13.0.

No other module of the package touches a private torch name (tests/unit/test_structure.py and
tests/unit/test_compat.py check both: that nothing else does, and that each assumption below
still holds, saying what to change when one does not).

- ``torch.UntypedStorage._swap_data_ptr_`` (`can_swap_storages`, `swap_storages`): a switch gives
  a new piece the bytes of an old one of the same size by swapping their storages' data pointers
  instead of copying (`reshard.execute`). Without it, the executor copies.
- ``torch._foreach_copy_`` (`foreach_copy`): a switch copies all the pieces into (or out of) one
  message's buffer, and a round's local copies, in one call each (`reshard.execute`).
- ``torch.distributed._functional_collectives.all_to_all_single_autograd`` and ``wait_tensor``
  (`all_to_all_autograd`): expert parallelism's token exchange, an all-to-all with uneven splits
  whose backward sends the gradients back the same way (`train.dispatch`).
- ``FSDPModule._get_fsdp_state()._fsdp_param_groups``, each group's ``_training_state``, and
  ``TrainingState`` from ``torch.distributed.fsdp._fully_shard._fsdp_common`` (`set_fsdp_idle`):
  a module whose forward or backward broke midway is set idle, so that `FSDPModule.reshard`
  registers its sharded parameters again (`train.parallelize.reshard_after_break`).
- ``torch.distributed.tensor.debug._clear_sharding_prop_cache``,
  ``torch.distributed.tensor._redistribute.clear_redistribute_planner_cache`` and
  ``DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_cached``
  (`clear_sharding_caches`): DTensor's caches of sharding decisions hold the meshes they were made
  with, so they are emptied when a process leaves a world (`train.parallelize.forget_old_meshes`).
- ``torch.distributed.distributed_c10d._world.group_count`` (`reset_group_count`): the counter
  that names process groups made without a name, set back to 0 after a default group whose
  rendezvous failed (`elastic.membership.forget_group_names`).
- ``ProcessGroup._register_backend`` and ``ProcessGroup._set_default_backend``
  (`delegate_to_gloo`): the ``shardshift`` process group hands every operation it does not run
  itself to a gloo group (`collectives.execution.backend`).
- ``torch._dynamo.config.recompile_limit`` (`raise_recompile_limit`): how many compiled versions
  of one function torch keeps before it runs that function eager; ``--compile`` raises it, as each
  layout a process runs may compile its layers anew (`train.compiling`).
- ``torch._dynamo.lookup_backend`` (`compile_backend`): the function behind a torch.compile
  backend's name, which ``--compile`` calls from a backend of its own that counts the graphs it
  compiles (`train.compiling`).

Assumed, not called: FSDP2 on a tensor already split by tensor parallelism along the same dim
places it as ``(_StridedShard(dim, split_factor=tp), Shard(dim))``, which is not a `Shard`
subclass and gives each rank the ``torch.chunk`` piece of its tp-local ``torch.chunk`` piece, as
`reshard.space` computes boxes (`train.optim` counts every non-Replicate placement as a split).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_SWAP = getattr(torch.UntypedStorage, "_swap_data_ptr_", None)


def can_swap_storages() -> bool:
    """Whether `swap_storages` can run: torch has ``UntypedStorage._swap_data_ptr_``."""
    return _SWAP is not None


def swap_storages(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    """Exchange the data pointers of two storages of the same size (what each tensor on them reads)."""
    _SWAP(a, b)


def foreach_copy(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``targets[i].copy_(sources[i])`` for every i, in one call (shapes alike pairwise)."""
    torch._foreach_copy_(targets, sources)


def all_to_all_autograd(tensor: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
                        group: dist.ProcessGroup) -> torch.Tensor:
    """All-to-all of `tensor`'s rows over `group`, split as given, waited for; its backward sends
    the gradients back the same way."""
    from torch.distributed import _functional_collectives as funcol

    out = funcol.all_to_all_single_autograd(tensor, output_split_sizes, input_split_sizes, group)
    return funcol.wait_tensor(out)


def set_fsdp_idle(module) -> None:
    """Set every parameter group of FSDP2 module `module` idle, whatever its forward or backward
    was doing when it stopped, so that `FSDPModule.reshard` reshards it."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    groups = getattr(module._get_fsdp_state(), "_fsdp_param_groups", None)
    if groups is None or any(not hasattr(group, "_training_state") for group in groups):
        raise RuntimeError("FSDP2's state no longer has _fsdp_param_groups with a _training_state: "
                           "shardshift.compat.set_fsdp_idle must follow it")
    for group in groups:
        group._training_state = TrainingState.IDLE


def clear_sharding_caches() -> None:
    """Empty DTensor's caches of sharding propagation and redistribution plans."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_cached.cache_clear()
    clear_redistribute_planner_cache()


def reset_group_count() -> None:
    """Name this process's next unnamed process group "0" again, as destroying the default group does."""
    from torch.distributed import distributed_c10d

    world = getattr(distributed_c10d, "_world", None)
    if world is None or not hasattr(world, "group_count"):
        raise RuntimeError("torch.distributed no longer counts unnamed groups in distributed_c10d._world.group_count; "
                           "shardshift.compat.reset_group_count must follow it")
    world.group_count = 0


def delegate_to_gloo(group: dist.ProcessGroup, gloo: dist.ProcessGroupGloo) -> None:
    """Make `gloo` run every CPU operation of `group` that `group` does not override."""
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)


def compile_backend(name: str):
    """The torch.compile backend named `name`: a function of a captured graph and its example inputs."""
    import torch._dynamo

    return torch._dynamo.lookup_backend(name)


def raise_recompile_limit(limit: int) -> None:
    """Let torch.compile keep at least `limit` compiled versions of one function."""
    import torch._dynamo

    config = torch._dynamo.config
    if not isinstance(getattr(config, "recompile_limit", None), int):
        raise RuntimeError("torch._dynamo.config has no integer recompile_limit; shardshift.compat.raise_recompile_limit "
                           "must follow it")
    config.recompile_limit = max(config.recompile_limit, limit)
