"""Apply a layout to a model from outside, with PyTorch's own building blocks.

The order is fixed (as in torchtitan): build the model on the meta device (`ModelSpec.build`), keep
only this rank's pipeline stage, apply tensor parallelism, then FSDP2 over the data-parallel axes,
then allocate the local shards and fill them. No full tensor of the model is ever materialised on a
rank beyond one parameter at a time during initialisation.

- ``pp``: the model's pipeline split (`PipelineSplit`) keeps this stage's run of layers (contiguous,
  as even as possible: `reshard.training.stage_layers`) under their global names, and sets the
  modules of the first or the last stage to None on the others; the trainer runs the stages as a
  1F1B pipeline (`trainer.py`).
- ``tp``: ``parallelize_module`` with the model's plan (`ModelSpec.tp_plan`), its styles
  ``colwise`` and ``rowwise`` as PyTorch's ``ColwiseParallel`` and ``RowwiseParallel``, and
  ``replicated_with_grad_allreduce`` as its ``SequenceParallel`` over the input's first dim
  (`replicated_with_grad_allreduce`; the trainer sums their gradients: `sum_partial_gradients`).
- ``fsdp`` and ``dp``: ``fully_shard`` on every layer, then on the stage root. With ``dp == 1`` the
  mesh is 1-D (``fsdp``: plain FSDP); with ``dp > 1`` it is the 2-D ``(dp, fsdp)`` mesh, i.e. HSDP:
  sharded over ``fsdp`` and replicated over ``dp``. Pure replication (``dp > 1`` with ``fsdp`` and
  ``tp`` both 1) is `DistributedDataParallel` instead (see `wrap_for_training`): its bucketed
  all-reduce overlaps backward and is what FSDP2 with shards of one rank cannot match.

`models.space.state_space` states the same placement as pure metadata, for the planner.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from shardshift.compat import clear_sharding_caches, set_fsdp_idle
from shardshift.layout import Coord, Layout
from shardshift.models.spec import ModelSpec, plan_matcher
from shardshift.reshard.plan import increasing_on_every_axis
from shardshift.reshard.training import replicate_only, stage_layers, uses_fsdp
from shardshift.train.dispatch import AllToAllDispatch


def replicated_with_grad_allreduce() -> SequenceParallel:
    """The style of a module that each tp rank runs on its own rows of a split input (Qwen3's norm
    over each of the heads a rank holds): its parameters whole on every rank, their gradient the
    sum of every rank's.

    ``SequenceParallel`` makes the parameters Replicate DTensors and reads the input as split on
    `sequence_dim`: for a module acting on each row alone, any dim but the last serves, and the
    first is in every input. The output goes back to this rank's own rows (`use_local_output`).
    The gradient of a Replicate parameter comes out Partial (each rank's rows' share): FSDP2 sums
    it with the data axes' reduction; `sum_partial_gradients` sums what is left.
    """
    return SequenceParallel(sequence_dim=0, use_local_output=True)


@torch.no_grad()
def sum_partial_gradients(model: nn.Module) -> None:
    """Sum, over their mesh axes, the gradients still Partial after backward (an all-reduce each):
    those of `replicated_with_grad_allreduce` parameters when FSDP2 does not reduce them."""
    for param in model.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            param.grad = grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in grad.placements])


# `ModelSpec.tp_plan`'s vocabulary (`models.spec.TP_STYLES`)
_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
           "replicated_with_grad_allreduce": replicated_with_grad_allreduce}
MESH_AXES = ("pp", "dp", "fsdp", "ep", "tp")  # the training mesh's dims: the layout's axes, in its rank order
TREE_AXES = ("dp", "fsdp")  # the data axes, whose groups `build_parallel(trees=...)` runs on trees


@dataclasses.dataclass(frozen=True)
class Parallel:
    """The mesh of a layout, as seen from one rank."""

    layout: Layout
    mesh: DeviceMesh  # 4-D, axes MESH_AXES
    coord: Coord
    ranks: tuple[int, ...]  # the process rank at each of the layout's coordinates, in rank order
    trees: object = None  # ShardShiftOptions of the data axes' groups when they run on trees (`build_parallel`)

    @property
    def device(self) -> torch.device:
        if self.mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.mesh.device_type)

    @property
    def replicate_only(self) -> bool:
        """Data parallelism is whole copies of plain tensors: DDP's case."""
        return replicate_only(self.layout)

    @property
    def data_mesh(self) -> DeviceMesh | None:
        """Mesh that FSDP2 shards and replicates over, or None when FSDP2 is not used."""
        if not uses_fsdp(self.layout):
            return None
        if self.layout.dp > 1:
            return self.mesh["dp", "fsdp"]
        return self.mesh["fsdp"]

    @property
    def is_first_stage(self) -> bool:
        return self.coord.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coord.pp == self.layout.pp - 1


def build_parallel(layout: Layout, rank: int, device_type: str, ranks: tuple[int, ...] | None = None,
                   trees=None) -> Parallel:
    """The meshes of `layout` (a collective: every rank calls it).

    `ranks[i]` is the process at the layout's i-th coordinate (row-major over the layout's axes); by default
    process i. A switch passes the order that keeps the most state where it already is.
    `trees` (ShardShiftOptions): the groups of the data axes (`dp`, `fsdp`), whose collectives are
    DDP's and FSDP2's, are `shardshift` groups running them on packed trees; each group packs on
    the part of the job's topology its ranks see. The other axes stay on the default backend.
    """
    ranks = tuple(range(layout.world_size)) if ranks is None else tuple(ranks)
    assert sorted(ranks) == list(range(layout.world_size)), ranks
    # FSDP2 shards by a process's rank in the axis group, which `new_group` sorts: the mesh must
    # run in increasing rank order along every axis for that to match DTensor's coordinates.
    assert increasing_on_every_axis(layout, ranks), f"rank order {ranks} runs backwards on an axis"
    grid = torch.tensor(ranks).reshape(tuple(getattr(layout, axis) for axis in MESH_AXES))
    backend = None
    if trees is not None:
        from shardshift.collectives.execution.backend import BACKEND_NAME

        backend = BACKEND_NAME
    groups = []
    for dim, axis in enumerate(MESH_AXES):
        # every rank makes every group of the axis, in the same order (`new_group` is collective)
        lines = grid.movedim(dim, -1).reshape(-1, grid.shape[dim]).tolist()
        axis_backend = backend if axis in TREE_AXES and grid.shape[dim] > 1 else None
        mine = [_GROUPS.get(tuple(line), axis_backend, trees) for line in lines]
        groups.append(next(group for line, group in zip(lines, mine) if rank in line))
    mesh = DeviceMesh.from_group(groups, device_type, grid, mesh_dim_names=MESH_AXES)
    return Parallel(layout=layout, mesh=mesh, coord=layout.coord(ranks.index(rank)), ranks=ranks, trees=trees)


class _Groups:
    """The process groups of this process's meshes, by their ranks and backend, made once each.

    A mesh's axes are made of groups: a layout's mesh takes the group that any earlier mesh made for
    the same ranks, and a group is made (`dist.new_group`, by every rank, in the same order) only
    for ranks no mesh had yet. So a job that switches back and forth holds one group per set of
    ranks it ever used, not one per switch (a group holds resources until destroyed: gloo three
    threads, NCCL a communicator and its device memory). It also keeps DTensor's caches right:
    they compare meshes by their ranks and axes, not by their groups, and may hand an op on the new
    mesh a spec made with an old one, whose groups are then the same. The groups go with the world
    whose default group they were made under (`forget_old_meshes` after it is destroyed)."""

    def __init__(self) -> None:
        self.world = None  # the default group they were made under
        self.made: dict[tuple[tuple[int, ...], str | None], dist.ProcessGroup] = {}

    def get(self, ranks: tuple[int, ...], backend: str | None, options) -> dist.ProcessGroup:
        """The group of `ranks` (a placeholder where this process is not one of them)."""
        if self.world is not dist.group.WORLD:
            self.forget()
            self.world = dist.group.WORLD
        key = (ranks, backend)
        if key not in self.made:
            if backend is None and ranks == tuple(range(dist.get_world_size())):
                self.made[key] = dist.group.WORLD
            else:
                self.made[key] = dist.new_group(list(ranks), backend=backend, pg_options=options,
                                                group_desc=f"mesh_{'_'.join(map(str, ranks))}")
        return self.made[key]

    def forget(self) -> None:
        self.world = None
        self.made.clear()


_GROUPS = _Groups()


def tree_options(cfg, timeout_s: float, topology=None):
    """The ShardShiftOptions of a run whose `cfg.collectives` is "trees" (else None): packed on
    `topology` (a `Topology` of the world: an elastic world's, `elastic.member`), else on
    `cfg.topology`; every collective bounded by `timeout_s`."""
    if cfg.collectives != "trees":
        return None
    from shardshift.collectives.execution.backend import ShardShiftOptions
    from shardshift.collectives.execution.runner import RunOptions

    return ShardShiftOptions(topology=topology if topology is not None else cfg.topology,
                             run=RunOptions(timeout_s=timeout_s))


def reshard_after_break(model: nn.Module) -> None:
    """Put every FSDP2 module of `model` back in its sharded form, whatever its forward or backward
    was doing when it stopped (a peer died in a collective, or a forward ran with no backward).

    FSDP2 registers a layer's gathered parameters while it runs and its sharded ones after; a
    forward that raised leaves some layers gathered, and the root (which keeps its parameters
    gathered from forward to backward) in its forward state, where `FSDPModule.reshard` does
    nothing. Every reader of the state by parameter name (the optimizer's state, a switch, a
    checkpoint) needs the sharded parameters, so each parameter group is set idle first
    (`compat.set_fsdp_idle`: private in PyTorch 2.13)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        set_fsdp_idle(module)
        module.reshard()


def forget_old_meshes() -> None:
    """Drop DTensor's caches of sharding decisions, after this process left a world's groups.

    They are keyed by meshes compared by value (device type, ranks, axis names) and hold the mesh
    objects they were computed with. In a new world whose mesh equals an earlier world's, a cached
    decision would hand out the earlier mesh, and with it this process's coordinate in that world:
    DTensors made by later ops then claim the wrong shard (DCP then saw two ranks at one offset).
    The caches are private in PyTorch 2.13 (`compat.clear_sharding_caches`). The groups the world's
    meshes were made of are forgotten too (`_Groups`).
    """
    clear_sharding_caches()
    _GROUPS.forget()


def build_stage_model(spec: ModelSpec, par: Parallel, dtype: torch.dtype, seed: int,
                      mixed_precision: str = "none") -> nn.Module:
    """This rank's part of the model, parallelized, with its local shards initialised."""
    model = build_stage_skeleton(spec, par, dtype, mixed_precision)
    shared = shared_parameters(model)
    model.to_empty(device=par.device)
    tie(model, shared)
    init_local_shards(model, spec, seed)
    return model


def shared_parameters(model: nn.Module) -> dict[str, str]:
    """The parameters `model` reaches under a second name (tied weights: a head whose weight is the
    embeddings'), by that name -> the name `named_parameters` lists them by.

    Allocating a model's parameters from the meta device (``to_empty``, `materialize`) gives every
    module a parameter of its own, or (DTensors) gives the one parameter new storage once per
    module that holds it: `untie` first when allocating module by module, then `tie`.
    """
    first: dict[int, str] = {}
    shared = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            shared[fqn] = first[id(param)]
        else:
            first[id(param)] = fqn
    return shared


def untie(model: nn.Module, shared: dict[str, str]) -> None:
    """Remove the second names of the parameters `shared` names (`shared_parameters`), until `tie`."""
    for fqn in shared:
        parent, _, leaf = fqn.rpartition(".")
        delattr(model.get_submodule(parent), leaf)


def tie(model: nn.Module, shared: dict[str, str]) -> None:
    """Make each parameter `shared` names (`shared_parameters`, taken before allocating) the one it
    shares again."""
    for fqn, source in shared.items():
        parent, _, leaf = fqn.rpartition(".")
        setattr(model.get_submodule(parent), leaf, model.get_parameter(source))


def build_stage_skeleton(spec: ModelSpec, par: Parallel, dtype: torch.dtype, mixed_precision: str = "none") -> nn.Module:
    """This rank's part of the model, parallelized, with every parameter still on the meta device.
    Under ``mixed_precision="bf16"`` FSDP2 gathers and computes with bfloat16 copies of its
    parameters and reduces their gradients in float32 (`MixedPrecisionPolicy`); the parameters it
    holds, and so the state, stay in `dtype`.

    Its parameters are allocated later: all at once (``to_empty``), or leaf module by leaf module
    while a switch fills them (`materialize`). Its buffers, which no checkpoint or switch moves,
    are allocated on the device and filled here (`ModelSpec.init_buffers`).
    """
    with torch.device("meta"):
        model = spec.build()
    split = spec.pipeline
    layers = model.get_submodule(split.layers)
    keep = stage_layers(split.num_layers, par.layout.pp)[par.coord.pp]
    for index in list(layers.keys()):
        if int(index) not in keep:
            del layers[index]
    for name in (() if par.is_first_stage else split.first) + (() if par.is_last_stage else split.last):
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, None)
    model.to(dtype)

    if par.layout.tp > 1:
        style_of = plan_matcher(spec.tp_plan)
        plan = {name: _STYLES[style]() for name, _ in model.named_modules() if (style := style_of(name))}
        parallelize_module(model, par.mesh["tp"], plan)
    experts = split_experts(model, spec, par) if par.layout.ep > 1 else []
    data_mesh = par.data_mesh
    if data_mesh is not None:
        # Under pp the stage runs several micro-batches per step: keep parameters gathered between
        # forward and backward instead of gathering them twice per micro-batch.
        reshard = par.layout.pp == 1
        # FSDP2 warns when a module returns a view, in case the caller modifies it in place; the
        # head's output is a view and the loss reads it out of place.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if mixed_precision == "bf16" else MixedPrecisionPolicy()
        for module in experts:  # a unit of their own: their parameters live on the ep mesh
            fully_shard(module, mesh=data_mesh, reshard_after_forward=reshard, mp_policy=policy)
        for layer in layers.values():
            fully_shard(layer, mesh=data_mesh, reshard_after_forward=reshard, mp_policy=policy)
        fully_shard(model, mesh=data_mesh, reshard_after_forward=reshard, mp_policy=policy)
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            setattr(module, name, torch.empty_like(buffer, device=par.device))
    spec.init_buffers(model)
    return model


def split_experts(model: nn.Module, spec: ModelSpec, par: Parallel) -> list[nn.Module]:
    """Split the stacked experts of `model` (still on the meta device) over ``ep``: each parameter
    of a module `ModelSpec.expert_modules` names becomes a DTensor sharded along dim 0 (its
    experts) on the ep mesh, and the module's parent sends its rows through an
    `AllToAllDispatch` on that mesh's group. Returns the modules."""
    holds = plan_matcher(dict.fromkeys(spec.expert_modules, "experts"))
    mesh = par.mesh["ep"]
    found = []
    for name, module in list(model.named_modules()):
        if not holds(name):
            continue
        for leaf, param in list(module.named_parameters(recurse=False)):
            local = torch.empty((param.shape[0] // mesh.size(), *param.shape[1:]), dtype=param.dtype, device="meta")
            split = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=param.shape,
                                       stride=param.stride())
            setattr(module, leaf, nn.Parameter(split, requires_grad=param.requires_grad))
        model.get_submodule(name.rpartition(".")[0]).dispatch = AllToAllDispatch(mesh.get_group(), param.shape[0])
        found.append(module)
    return found


@torch.no_grad()
def average_over_ep(model: nn.Module, spec: ModelSpec, par: Parallel) -> None:
    """Make the gradients averages over every data rank, ``dp x fsdp x ep``, under ``ep > 1``.

    FSDP2 (or nothing, on one data rank) averages them over ``dp x fsdp``. A dense parameter is
    replicated along ep: its gradient is averaged over the ep group too (one all-reduce of all of
    them). An expert's gradient already sums what every rank of its ep group sent it (the
    dispatch's backward): it is divided by ep."""
    ep = par.layout.ep
    if ep == 1:
        return
    holds = plan_matcher(dict.fromkeys(spec.expert_modules, "experts"))
    dense = []
    for fqn, param in model.named_parameters():
        if param.grad is None:
            continue
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        if holds(fqn.rpartition(".")[0]):
            grad.div_(ep)
        else:
            dense.append(grad)
    if dense:
        flat = torch.cat([grad.reshape(-1) for grad in dense])
        dist.all_reduce(flat, group=par.mesh["ep"].get_group())
        flat.div_(ep)
        for grad, part in zip(dense, flat.split([grad.numel() for grad in dense])):
            grad.copy_(part.view_as(grad))


def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate (uninitialised) the parameters `module` itself owns, leaving its children and its
    buffers (filled by `build_stage_skeleton`) alone.

    FSDP2 accepts this one module at a time: its lazy initialisation picks up the new storage.
    """
    buffers = dict(module.named_buffers(recurse=False))
    module.to_empty(device=device, recurse=False)
    for name, buffer in buffers.items():
        setattr(module, name, buffer)


@torch.no_grad()
def init_local_shards(model: nn.Module, spec: ModelSpec, seed: int) -> None:
    """Fill every parameter's local shard with its slice of `ModelSpec.init_value`, one parameter
    at a time; then the buffers no checkpoint holds (`ModelSpec.init_buffers`)."""
    for fqn, param in model.named_parameters():
        full = spec.init_value(fqn, param.shape, param.dtype, seed)
        if isinstance(param, DTensor):
            # src_data_rank=None: every rank slices its own copy; no communication.
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(local.to_local())
        else:
            param.copy_(full)
    spec.init_buffers(model)


def wrap_for_training(model: nn.Module, par: Parallel, sync: bool = True) -> nn.Module:
    """The module that runs forward and backward: a DDP wrapper under pure replication, else `model`.

    The wrapper shares `model`'s parameters; state (checkpoints, switching) is always read from
    `model` itself, whose parameter names are the same in every layout. `sync=False` skips DDP's
    broadcast of every parameter from rank 0, for replicas already bit-identical (after a switch).
    """
    if not par.replicate_only:
        return model
    return DistributedDataParallel(model, process_group=par.mesh["dp"].get_group(), init_sync=sync)
