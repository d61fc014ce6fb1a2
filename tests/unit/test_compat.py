"""Each private PyTorch API that `shardshift.compat` wraps still does what ShardShift relies on, and
nothing else in the package touches a private torch name.

A failure names the compat function, the torch API and what to change. Tests that need a process
group use a one-rank gloo group on a file store (or torch's fake backend, for another rank's view
of a sharded parameter)."""

from __future__ import annotations

import ast
import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardshift import compat
from support import REPO

PACKAGE = REPO / "shardshift"
COMPAT = PACKAGE / "compat.py"

# Private torch names that only compat.py may use (attribute, imported name, or getattr string).
PRIVATE_NAMES = {
    "_swap_data_ptr_", "_functional_collectives", "_get_fsdp_state", "_fsdp_param_groups", "_training_state",
    "_fully_shard", "_fsdp_common", "_clear_sharding_prop_cache", "_redistribute", "_op_dispatcher",
    "_propagate_tensor_meta_cached", "_world", "group_count", "_register_backend", "_set_default_backend",
    "_StridedShard", "_dynamo", "recompile_limit", "lookup_backend", "_foreach_copy_",
}


def _broken(function: str, api: str, change: str) -> str:
    return (f"shardshift.compat.{function} relies on {api}, which no longer holds in torch {torch.__version__} "
            f"(checked against 2.13.0): {change}")


@pytest.fixture
def world(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_storages_swap_their_bytes():
    why = _broken("swap_storages", "torch.UntypedStorage._swap_data_ptr_(a, b) exchanging the two storages' bytes",
                  "follow its replacement, or make can_swap_storages return False (the switch then copies)")
    assert callable(getattr(torch.UntypedStorage, "_swap_data_ptr_", None)), why
    assert compat.can_swap_storages(), why
    old, new = torch.arange(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64)
    old_ptr, new_ptr = old.data_ptr(), new.data_ptr()
    compat.swap_storages(new.untyped_storage(), old.untyped_storage())
    assert torch.equal(new, torch.arange(6, dtype=torch.float64)) and torch.equal(old, torch.zeros(6)), why
    assert (new.data_ptr(), old.data_ptr()) == (old_ptr, new_ptr), why


def test_all_to_all_is_differentiable(world):
    from torch.distributed import _functional_collectives as funcol

    why = _broken("all_to_all_autograd", "torch.distributed._functional_collectives.all_to_all_single_autograd "
                  "(input, output_split_sizes, input_split_sizes, group) and wait_tensor",
                  "follow the functional collective's new name or signature (train.dispatch's expert exchange)")
    assert callable(getattr(funcol, "all_to_all_single_autograd", None)), why
    assert callable(getattr(funcol, "wait_tensor", None)), why
    rows = torch.arange(10, dtype=torch.float64).view(5, 2).requires_grad_()
    out = compat.all_to_all_autograd(rows, [5], [5], world)
    assert torch.equal(out, rows.detach()), why
    (out * 3).sum().backward()
    assert torch.equal(rows.grad, torch.full((5, 2), 3.0, dtype=torch.float64)), why


def test_fsdp_param_groups_have_a_training_state(world):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh

    why = _broken("set_fsdp_idle", "FSDPModule._get_fsdp_state()._fsdp_param_groups, each with a _training_state "
                  "of torch.distributed.fsdp._fully_shard._fsdp_common.TrainingState",
                  "find where FSDP2 now keeps a parameter group's state and set it idle there "
                  "(train.parallelize.reshard_after_break; tests/unit/test_fsdp_break.py)")
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    except ImportError as e:
        raise AssertionError(why) from e
    assert hasattr(TrainingState, "IDLE") and hasattr(TrainingState, "FORWARD"), why
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[1], mesh=init_device_mesh("cpu", (1,)))
    assert callable(getattr(model[1], "_get_fsdp_state", None)), why
    groups = getattr(model[1]._get_fsdp_state(), "_fsdp_param_groups", None)
    assert isinstance(groups, list) and groups, why
    seen = []
    model[1].register_forward_pre_hook(lambda *args: seen.append([g._training_state for g in groups]))
    model(torch.randn(2, 4))
    assert seen == [[TrainingState.FORWARD]], why  # FSDP2 itself sets the state we set back
    compat.set_fsdp_idle(model[1])
    assert [g._training_state for g in groups] == [TrainingState.IDLE], why


def test_sharding_caches_can_be_cleared(world):
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh

    why = _broken("clear_sharding_caches", "torch.distributed.tensor.debug._clear_sharding_prop_cache, "
                  "torch.distributed.tensor._redistribute.clear_redistribute_planner_cache and "
                  "DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_cached.cache_clear",
                  "find DTensor's caches keyed by mesh and clear those (train.parallelize.forget_old_meshes)")
    try:
        from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError as e:
        raise AssertionError(why) from e
    assert callable(clear_redistribute_planner_cache) and callable(_clear_sharding_prop_cache), why
    propagator = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    cached = getattr(propagator, "_propagate_tensor_meta_cached", None)
    assert callable(getattr(cached, "cache_clear", None)), why
    x = distribute_tensor(torch.ones(4, 2), init_device_mesh("cpu", (1,)), [Shard(0)])
    (x + x).sum()
    compat.clear_sharding_caches()
    assert cached.cache_info().currsize == 0, why


def test_unnamed_groups_are_named_by_the_counter(world):
    from torch.distributed import distributed_c10d

    why = _broken("reset_group_count", "torch.distributed.distributed_c10d._world.group_count, the int that names "
                  "the next process group made without a name",
                  "find what names unnamed groups now and set it back there (elastic.membership.forget_group_names)")
    world_state = getattr(distributed_c10d, "_world", None)
    assert isinstance(getattr(world_state, "group_count", None), int), why
    world_state.group_count = 7
    assert dist.new_group([0]).group_name == "7" and world_state.group_count == 8, why
    compat.reset_group_count()
    assert world_state.group_count == 0, why


def test_a_process_group_delegates_to_gloo(tmp_path):
    why = _broken("delegate_to_gloo", "ProcessGroup._register_backend(device, backend_type, backend) and "
                  "ProcessGroup._set_default_backend(backend_type)",
                  "find how a Python ProcessGroup now hands its operations to another backend "
                  "(collectives.execution.backend.ShardShiftProcessGroup)")
    assert callable(getattr(dist.ProcessGroup, "_register_backend", None)), why
    assert callable(getattr(dist.ProcessGroup, "_set_default_backend", None)), why
    store = dist.FileStore(str(tmp_path / "store"), 1)
    group = dist.ProcessGroup(0, 1)
    with pytest.raises(RuntimeError):  # not vacuous: with no backend, nothing runs
        group.allreduce([torch.ones(3)]).wait()
    gloo = dist.ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=30))
    compat.delegate_to_gloo(group, gloo)
    tensor = torch.ones(3)
    group.allreduce([tensor]).wait()
    assert torch.equal(tensor, torch.ones(3)), why
    assert group._get_backend(torch.device("cpu")) is gloo, why


def test_the_recompile_limit_is_raised():
    import torch._dynamo

    before = torch._dynamo.config.recompile_limit
    try:
        compat.raise_recompile_limit(before + 5)
        assert torch._dynamo.config.recompile_limit == before + 5, _broken(
            "raise_recompile_limit", "torch._dynamo.config.recompile_limit", "find the setting that bounds recompiles")
        compat.raise_recompile_limit(1)
        assert torch._dynamo.config.recompile_limit == before + 5, "a lower limit must leave a higher one"
    finally:
        torch._dynamo.config.recompile_limit = before


def test_foreach_copy_copies_each_pair_across_dtypes_and_strides():
    base = torch.arange(24.0).reshape(4, 6)
    targets = [torch.empty(2, 3), torch.empty(4, dtype=torch.float64), torch.empty(0)]
    sources = [base[1:3, ::2], base[0, :4].double(), torch.empty(0)]
    compat.foreach_copy(targets, sources)
    for target, source in zip(targets, sources):
        assert torch.equal(target, source), _broken("foreach_copy", "torch._foreach_copy_",
                                                    "copy the pairs one by one with Tensor.copy_")


def test_compile_backends_are_found_by_name():
    backend = compat.compile_backend("aot_eager")
    assert callable(backend), _broken("compile_backend", "torch._dynamo.lookup_backend", "find the backend registry")
    graphs = []

    def counted(graph, example_inputs):
        graphs.append(graph)
        return backend(graph, example_inputs)

    compiled = torch.compile(lambda x: torch.sin(x) * 2, backend=counted)
    x = torch.arange(4.0)
    torch.testing.assert_close(compiled(x), torch.sin(x) * 2)
    assert len(graphs) == 1, "a backend of one's own is called once per captured graph"


def test_fsdp_over_tp_places_chunks_of_chunks():
    """FSDP2 over a tp-sharded dim: `(_StridedShard(0, split_factor=tp), Shard(0))`, not a `Shard`
    subclass, each rank holding the `torch.chunk` piece of its tp piece (`reshard.space`); checked
    for every rank of a (fsdp=3, tp=2) mesh on torch's fake backend, on an uneven size."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    why = _broken("(none: reshard.space, train.optim)", "FSDP2 placing a tp-sharded parameter as "
                  "(_StridedShard(0, split_factor=tp), Shard(0)), not a Shard subclass, holding chunks of tp chunks",
                  "make reshard.space's boxes and train.optim._copies follow the new placement")
    assert not issubclass(_StridedShard, Shard) and not _StridedShard(0, split_factor=2).is_replicate(), why
    rows, fsdp, tp = 13, 3, 2
    for rank in range(fsdp * tp):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=fsdp * tp)
        try:
            mesh = init_device_mesh("cpu", (fsdp, tp), mesh_dim_names=("fsdp", "tp"))
            model = nn.Sequential(nn.Linear(4, rows, bias=False))
            parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
            fully_shard(model, mesh=mesh["fsdp"])
            weight = model[0].weight
            f, t = mesh.get_coordinate()
            expected = torch.arange(rows).chunk(tp)[t].chunk(fsdp)
            assert tuple(weight.placements) == (_StridedShard(0, split_factor=tp), Shard(0)), why
            assert weight.to_local().shape[0] == (len(expected[f]) if f < len(expected) else 0), (rank, why)
        finally:
            dist.destroy_process_group()
            compat.clear_sharding_caches()


def _torch_aliases(tree: ast.Module) -> set[str]:
    """The names a module binds to torch or anything imported from it."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "torch"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names |= {a.asname or a.name for a in node.names}
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    torch_names = _torch_aliases(tree)
    found = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names
                      if a.name.startswith("torch.") and any(map(_private, a.name.split(".")))]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            if any(map(_private, node.module.split("."))) or any(_private(a.name) for a in node.names):
                found.append(f"{where} from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Attribute):
            chain, root = [node.attr], node.value
            while isinstance(root, ast.Attribute):
                chain.append(root.attr)
                root = root.value
            # torch.ops.aten._name.default is an operator's name (a selective checkpoint's policy), not an API
            through_ops = isinstance(root, ast.Name) and "ops" in [root.id, *chain[::-1]][:2]
            if node.attr in PRIVATE_NAMES or (isinstance(root, ast.Name) and root.id in torch_names
                                              and not through_ops and any(map(_private, chain))):
                found.append(f"{where} .{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in PRIVATE_NAMES:
            found.append(f"{where} {node.value!r}")
    return found


def test_only_compat_uses_private_torch_apis():
    """New uses of a private torch API go through `shardshift.compat`, with a test here."""
    found = [use for path in sorted(PACKAGE.rglob("*.py")) if path != COMPAT for use in _private_uses(path)]
    assert found == [], f"private torch APIs outside shardshift/compat.py (move them there): {found}"


def test_compat_lists_every_private_name_it_uses():
    text = COMPAT.read_text()
    docstring = ast.get_docstring(ast.parse(text))
    missing = sorted(name for name in PRIVATE_NAMES if name not in docstring)
    assert missing == [], f"shardshift/compat.py's docstring does not say what it uses {missing} for"
    assert _private_uses(COMPAT), "the scan finds nothing in compat.py itself: it is vacuous"
