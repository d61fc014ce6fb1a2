"""The model interface: plans in Hugging Face's vocabulary, pipeline splits that keep names, and the
state space derived from a model and its plan (checked against PyTorch's own TP styles elsewhere:
tests/dist/test_train_equivalence.py compares it with every DTensor a trainer builds)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from shardshift.layout import Coord, Layout
from shardshift.models import model_names, model_spec
from shardshift.models.gpt.spec import GPTSpec
from shardshift.models.space import state_space
from shardshift.models.spec import PipelineSplit, plan_matcher
from shardshift.reshard.space import Box, holding
from shardshift.reshard.training import FIRST, LAST, layer_stages
from support.models import gpt


def test_a_star_in_a_plan_stands_for_one_name_part():
    style_of = plan_matcher({"layers.*.attn.q": "colwise", "layers.*.mlp.down": "rowwise"})
    assert style_of("layers.3.attn.q") == "colwise"
    assert style_of("layers.12.mlp.down") == "rowwise"
    assert style_of("layers.3.x.attn.q") is None  # `*` is one part, not any run of them
    assert style_of("layers.attn.q") is None
    assert style_of("layers.3.attn.qq") is None


def test_a_pipeline_split_places_every_parameter():
    split = PipelineSplit("blocks", 5, first=("tok_emb", "pos_emb"), last=("ln_f", "head"))
    assert split.layer_of("blocks.4.attn.q.weight") == 4
    assert split.layer_of("tok_emb.weight") == FIRST
    assert split.layer_of("head.bias") == LAST
    with pytest.raises(AssertionError, match="in no layer"):
        split.layer_of("tok_embx.weight")


def test_the_gpt_space_is_derived_from_its_plan():
    spec = gpt(n_layer=3, n_head=2, d_model=8, seq_len=5, d_ff=12, vocab_size=11)
    space = state_space(spec, torch.float32)
    layout = Layout(tp=2, pp=3)
    coord = layout.coord(layout.world_size - 1)  # last stage, tp rank 1
    box = {t.key: holding(space, layout, coord, t) for t in space.tensors}
    assert box["param:blocks.2.attn.q.weight"] == Box((4, 0), (4, 8))  # colwise: half of the rows
    assert box["param:blocks.2.attn.q.bias"] == Box((4,), (4,))
    assert box["param:blocks.2.attn.out.weight"] == Box((0, 4), (8, 4))  # rowwise: half of the columns
    assert box["param:blocks.2.attn.out.bias"] == Box((0,), (8,))  # and its bias whole
    assert box["param:blocks.0.attn.q.weight"] is None  # on the first stage
    assert box["param:head.weight"] == Box((0, 0), (11, 8))  # not in the plan: whole, on the last stage
    assert box["param:tok_emb.weight"] is None
    assert box["step:head.weight"] == Box((), ())
    assert [t.key for t in space.tensors[-2:]] == ["progress:train", "rng:cpu"]
    assert layer_stages(3, 3) == (0, 1, 2)


def test_a_plan_that_names_a_module_it_cannot_split_is_refused():
    class Odd(GPTSpec):
        @property
        def tp_plan(self):
            return {"blocks.*.ln1": "colwise"}

    odd = Odd("odd", gpt(n_layer=1, n_head=2, d_model=8, seq_len=5, d_ff=12).config)
    with pytest.raises(ValueError, match="blocks.0.ln1 .LayerNorm. colwise.*fix the plan"):
        state_space(odd, torch.float32)


def test_an_embedding_follows_torchs_styles():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(12, 6)
            self.layers = nn.ModuleDict({"0": nn.Linear(6, 6)})

    @dataclasses.dataclass(frozen=True)
    class Spec(GPTSpec):
        style: str = "rowwise"

        def build(self):
            return Tied()

        @property
        def pipeline(self):
            return PipelineSplit("layers", 1, first=("emb",))

        @property
        def tp_plan(self):
            return {"emb": self.style}

    base = gpt(n_layer=1, n_head=2, d_model=8, seq_len=5, d_ff=12).config
    coord = Coord(pp=0, dp=0, fsdp=0, ep=0, tp=1)
    for style, box in (("rowwise", Box((6, 0), (6, 6))), ("colwise", Box((0, 3), (12, 3)))):
        space = state_space(Spec("emb", base, style), torch.float32)
        assert holding(space, Layout(tp=2), coord, space.tensors[0]) == box, style


def test_built_in_models_resolve_by_name_and_round_trip_their_config():
    assert "tiny" in model_names()
    tiny = model_spec("tiny")
    assert tiny.name == "tiny" and tiny.with_config(tiny.config_dict()) == tiny
    assert hash(tiny) == hash(model_spec("tiny"))  # a key of caches
    with pytest.raises(ValueError, match="--model 'huge' is unknown; choose one of test, tiny"):
        model_spec("huge")
