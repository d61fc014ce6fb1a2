"""Activation checkpointing (`train.checkpointing`): the same gradients, the layers' work done
again in the backward (all of it under ``full``, none of the matrix products under ``selective``),
parameter names unchanged."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from shardshift.models import model_spec
from shardshift.train.checkpointing import wrap_layers

SPEC = model_spec("llama-test")


def _model(mode: str):
    torch.manual_seed(0)
    model = SPEC.build().double()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(SPEC.init_value(name, param.shape, param.dtype, seed=1))
    SPEC.init_buffers(model)
    wrap_layers(model, SPEC.pipeline.layers, mode)
    return model


def _step(model):
    ids = torch.randint(0, 256, (2, SPEC.seq_len), generator=torch.Generator().manual_seed(3))
    calls = []
    hooks = [layer.self_attn.register_forward_hook(lambda *_: calls.append(1))
             for layer in model.get_submodule(SPEC.pipeline.layers).children()]
    with FlopCounterMode(display=False) as flops:
        loss = SPEC.loss(model(ids), ids)
        loss.backward()
    for hook in hooks:
        hook.remove()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, flops.get_total_flops(), len(calls)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointed_layers_give_the_same_gradients_and_redo_their_work_in_the_backward(mode):
    loss, grads, flops, calls = _step(_model("none"))
    loss_ac, grads_ac, flops_ac, calls_ac = _step(_model(mode))
    assert loss_ac == loss
    assert grads_ac.keys() == grads.keys()  # the same parameter names
    for name in grads:
        torch.testing.assert_close(grads_ac[name], grads[name], rtol=1e-12, atol=0, msg=name)
    layers = SPEC.pipeline.num_layers
    assert calls == layers and calls_ac == 2 * layers  # every layer's forward ran again
    if mode == "full":
        assert flops_ac > flops  # the matrix products ran twice
    else:
        assert flops_ac == flops  # kept: only cheap elementwise work was done again


def test_checkpointing_twice_checkpoints_once_and_none_changes_nothing():
    model = _model("full")
    layer = next(model.get_submodule(SPEC.pipeline.layers).children())
    wrapped = layer.forward
    wrap_layers(model, SPEC.pipeline.layers, "full")
    assert layer.forward is wrapped
    plain = _model("none")
    assert "forward" not in vars(next(plain.get_submodule(SPEC.pipeline.layers).children()))
