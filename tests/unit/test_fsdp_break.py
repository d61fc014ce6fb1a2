"""A step that broke midway leaves FSDP2's gathered parameters registered; leaving the world puts
the sharded ones back (`train.parallelize.reshard_after_break`), so that the state can still be
read by parameter name. Checked on a real one-process gloo group with a forward that raises."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, init_device_mesh

from shardshift.train.parallelize import reshard_after_break


@pytest.fixture
def world(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


class _Broken(Exception):
    pass


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_parameters_are_sharded_again_after_a_step_that_broke(world, where):
    """The root's own parameters (as a model's embeddings are) stay gathered from forward to
    backward, where `FSDPModule.reshard` alone leaves them; a layer breaks in its forward, or in
    the backward."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    mesh = init_device_mesh("cpu", (1,))
    for layer in model[1:]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # model[0]'s parameters are the root's
    sharded = {name: param for name, param in model.named_parameters()}
    assert all(isinstance(p, DTensor) for p in sharded.values())

    def fail(*args):  # a peer died in this layer's collective
        raise _Broken

    if where == "forward":
        hook = model[2].register_forward_pre_hook(fail)
        with pytest.raises(_Broken):
            model(torch.randn(4, 8))
    else:
        hook = model[2].register_full_backward_pre_hook(fail)
        with pytest.raises(_Broken):
            model(torch.randn(4, 8)).sum().backward()
    hook.remove()
    gathered = {name for name, param in model.named_parameters() if param is not sharded[name]}
    assert "0.weight" in gathered  # not vacuous: the break left the root's parameters gathered
    reshard_after_break(model)
    assert all(param is sharded[name] for name, param in model.named_parameters())
    model(torch.randn(4, 8)).sum().backward()  # and the model still trains
    assert all(p.grad is not None for p in model.parameters())
