"""Model specs from published configs (`simulate.specs`) and their training state's space
(`simulate.space`): parameter counts of the shipped models, boxes that tile every tensor as the
parallelism rules say, refusals that name what would do, and configs read as Hugging Face writes them."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from shardshift.layout import Coord, Layout, divisors
from shardshift.reshard.space import Box, holding
from shardshift.reshard.training import PROGRESS_KEY, RNG_KEY, uses_fsdp
from shardshift.simulate.space import SpecSpace, check_memory, state_bytes
from shardshift.simulate.specs import DecoderSpec, load_spec, shipped_specs

DENSE = SpecSpace(DecoderSpec(name="tiny-dense", hidden_size=8, num_hidden_layers=3, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=12, vocab_size=10))
# Tied, with q/k norms and a head_dim that is not hidden/heads; 10 tokens split unevenly over tp=4.
MOE = SpecSpace(DecoderSpec(name="tiny-moe", hidden_size=8, num_hidden_layers=3, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=3, intermediate_size=12, vocab_size=10,
                          tie_word_embeddings=True, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=6, qk_norm=True))
# Parameters split over tp (column-, row- or vocab-parallel); norms and the router are whole.
TP_SPLIT = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head"}


def _layouts(space: SpecSpace, world: int) -> list[Layout]:
    """Every layout of `world` ranks over the five axes that `space` takes."""
    out = []
    for pp, dp, fsdp, ep in itertools.product(divisors(world), repeat=4):
        if world % (pp * dp * fsdp * ep) == 0:
            layout = Layout(pp=pp, dp=dp, fsdp=fsdp, ep=ep, tp=world // (pp * dp * fsdp * ep))
            try:
                space.check(layout)
                out.append(layout)
            except ValueError:
                pass
    return out


def _replicas(layout: Layout, tensor) -> int:
    """How many ranks hold each element of `tensor`, by the rules (simulate/space.py's docstring)."""
    if tensor.kind in ("progress", "rng"):
        return layout.world_size
    if tensor.kind == "step":
        return layout.world_size // layout.pp
    parts = set(tensor.name.split("."))
    ep = 1 if "experts" in parts else layout.ep
    tp = 1 if parts & TP_SPLIT else layout.tp
    fsdp = 1 if uses_fsdp(layout) else layout.fsdp
    return layout.dp * ep * tp * fsdp


def _box(space: SpecSpace, layout: Layout, name: str, **coord) -> Box:
    tensor = next(t for t in space.tensors if t.key == f"param:{name}")
    return holding(space, layout, Coord(**{"pp": 0, "dp": 0, "fsdp": 0, "ep": 0, "tp": 0, **coord}), tensor)


# ---- the shipped specs ------------------------------------------------------------------------------


@pytest.mark.parametrize("name, total, active", [
    ("llama3-70b", 70.6e9, 70.6e9),
    ("llama3-405b", 405.9e9, 405.9e9),
    ("qwen3-235b-a22b", 235.1e9, 22.2e9),
])
def test_shipped_specs_count_the_published_parameters(name, total, active):
    spec = load_spec(name)
    assert spec.num_params() == pytest.approx(total, rel=1e-3)
    assert spec.active_params() == pytest.approx(active, rel=1e-2)
    assert spec.describe().startswith(f"{name}: ")


def test_shipped_specs_are_listed():
    assert shipped_specs() == ["llama3-405b", "llama3-70b", "qwen3-235b-a22b"]


def test_the_space_names_parameters_as_hugging_face_does():
    space = SpecSpace(load_spec("qwen3-235b-a22b"))
    shapes = {t.key: t.shape for t in space.tensors}
    assert shapes["param:layers.0.self_attn.k_proj.weight"] == (512, 4096)
    assert shapes["exp_avg:layers.93.self_attn.q_norm.weight"] == (128,)
    assert shapes["param:layers.5.mlp.experts.down_proj"] == (128, 4096, 1536)
    assert shapes["param:lm_head.weight"] == (151936, 4096)
    assert shapes["step:embed_tokens.weight"] == ()
    assert [t.key for t in space.tensors[-2:]] == [PROGRESS_KEY, RNG_KEY]
    assert len(space.tensors) == 4 * (94 * 12 + 3) + 2


# ---- boxes --------------------------------------------------------------------------------------


@pytest.mark.parametrize("space, layout", [(s, layout) for s in (DENSE, MOE) for n in (4, 8)
                                           for layout in _layouts(s, n)], ids=str)
def test_every_element_is_held_by_its_replicas_exactly(space, layout):
    for tensor in space.tensors:
        count = np.zeros(tensor.shape, dtype=np.int64)
        for coord in layout.coords():
            box = holding(space, layout, coord, tensor)
            if box is not None:
                count[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))] += 1
        assert (count == _replicas(layout, tensor)).all(), (tensor.key, count)


def test_layouts_cover_every_axis():
    assert {layout.ep for layout in _layouts(MOE, 8)} == {1, 2, 4}
    assert {layout.ep for layout in _layouts(DENSE, 8)} == {1}
    assert {layout.pp for layout in _layouts(MOE, 8)} == {1, 2}  # 3 layers: pp=4 refused


def test_experts_are_split_over_ep_then_tp():
    layout = Layout(ep=2, tp=2)
    assert _box(MOE, layout, "layers.0.mlp.experts.gate_proj", ep=1, tp=1) == Box((2, 3, 0), (2, 3, 8))
    assert _box(MOE, layout, "layers.0.mlp.experts.down_proj", ep=1, tp=0) == Box((2, 0, 0), (2, 8, 3))
    # FSDP chunks the ep piece (experts 2 and 3) along dim 0 again.
    assert _box(MOE, Layout(ep=2, fsdp=2), "layers.2.mlp.experts.up_proj", ep=1, fsdp=1) == Box((3, 0, 0), (1, 6, 8))


def test_dense_tensors_are_replicated_along_ep():
    layout = Layout(ep=2, tp=2)
    for name in ("layers.1.self_attn.q_proj.weight", "layers.1.mlp.gate.weight", "embed_tokens.weight"):
        assert _box(MOE, layout, name, ep=0, tp=1) == _box(MOE, layout, name, ep=1, tp=1)
    assert _box(MOE, layout, "layers.1.self_attn.q_proj.weight", ep=1, tp=1) == Box((6, 0), (6, 8))
    assert _box(MOE, layout, "layers.1.mlp.gate.weight", ep=1, tp=1) == Box((0, 0), (4, 8))  # the router: whole


def test_tensor_parallel_styles():
    layout = Layout(tp=2)
    assert _box(DENSE, layout, "lm_head.weight", tp=1) == Box((5, 0), (5, 8))  # vocab-parallel
    assert _box(DENSE, layout, "embed_tokens.weight", tp=1) == Box((5, 0), (5, 8))
    assert _box(DENSE, layout, "layers.0.self_attn.o_proj.weight", tp=1) == Box((0, 4), (8, 4))  # row-parallel
    assert _box(DENSE, layout, "layers.0.mlp.down_proj.weight", tp=1) == Box((0, 6), (8, 6))
    assert _box(DENSE, layout, "layers.0.mlp.up_proj.weight", tp=1) == Box((6, 0), (6, 8))  # column-parallel
    assert _box(DENSE, layout, "layers.0.post_attention_layernorm.weight", tp=1) == Box((0,), (8,))


def test_pipeline_stages_own_contiguous_layers_embedding_first_head_last():
    layout = Layout(pp=2)
    assert [DENSE.stage_of(f"layers.{i}.input_layernorm.weight", 2) for i in range(3)] == [0, 0, 1]
    assert DENSE.stage_of("embed_tokens.weight", 2) == 0
    assert DENSE.stage_of("norm.weight", 2) == DENSE.stage_of("lm_head.weight", 2) == 1
    assert _box(DENSE, layout, "lm_head.weight", pp=0) is None
    assert not any(t.name == "lm_head.weight" for t in MOE.tensors)  # tied: the embedding on stage 0 only


@pytest.mark.parametrize("layout", [Layout(pp=2, ep=2, tp=2), Layout(dp=2, ep=4), Layout(fsdp=2, ep=2, tp=2),
                                    Layout(pp=3, fsdp=2, tp=4)], ids=str)
def test_state_bytes_is_the_busiest_ranks_state(layout):
    per_rank = [sum(t.itemsize * box.numel for t in MOE.tensors
                    if (box := holding(MOE, layout, coord, t)) is not None) for coord in layout.coords()]
    assert state_bytes(MOE, layout) == max(per_rank)


# ---- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize("space, layout, message", [
    (DENSE, Layout(tp=4), "tp=4 does not divide num_key_value_heads=2; choose tp in {1, 2}"),
    (DENSE, Layout(tp=3), "tp=3 does not divide num_attention_heads=4; choose tp in {1, 2}"),
    (MOE, Layout(tp=4), "tp=4 does not divide num_key_value_heads=2"),
    (DENSE, Layout(ep=2), "ep=2: tiny-dense is dense, it has no experts to split; choose ep=1"),
    (MOE, Layout(ep=3), "ep=3 does not divide num_experts=4; choose ep in {1, 2, 4}"),
    (MOE, Layout(pp=4), "pp=4 is larger than the number of layers num_hidden_layers=3; choose pp <= 3"),
])
def test_layouts_the_model_cannot_take_are_refused(space, layout, message):
    with pytest.raises(ValueError, match=message.replace("{", r"\{").replace("}", r"\}")):
        space.check(layout)


def test_state_that_does_not_fit_is_refused():
    space = SpecSpace(load_spec("llama3-70b"))
    with pytest.raises(ValueError, match=r"layout fsdp=8 puts 98\.\d GiB of state on its busiest rank, which has "
                                         r"80\.0 GiB; split the state about 2x further with more pp, tp or fsdp"):
        check_memory(space, Layout(fsdp=8), "80G")
    check_memory(space, Layout(fsdp=16), "80G")


# ---- loading ------------------------------------------------------------------------------------


def test_an_unknown_name_lists_the_shipped_specs():
    with pytest.raises(ValueError, match="no model spec named 'llama9'.*llama3-405b, llama3-70b, qwen3-235b-a22b"):
        load_spec("llama9")


def test_a_missing_key_is_named_with_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 8, "num_hidden_layers": 2, "intermediate_size": 16, "vocab_size": 10}))
    with pytest.raises(ValueError, match=f"{path} lacks 'num_attention_heads', which a model spec needs"):
        load_spec(path)
    path.write_text(json.dumps({"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
                                "intermediate_size": 16, "vocab_size": 10, "num_experts": 4}))
    with pytest.raises(ValueError, match="lacks 'num_experts_per_tok'"):
        load_spec(path)


def test_a_hugging_face_config_loads_as_published(tmp_path):
    folder = tmp_path / "Qwen3-tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 8,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 3,
        "intermediate_size": 12, "moe_intermediate_size": 6, "num_experts": 4, "num_experts_per_tok": 2,
        "vocab_size": 10, "tie_word_embeddings": False, "rope_theta": 1e6, "mlp_only_layers": []}))
    spec = load_spec(folder / "config.json")
    assert (spec.name, spec.qk_norm, spec.num_experts, spec.moe_intermediate_size) == ("Qwen3-tiny", True, 4, 6)


def test_a_mixtral_config_names_its_experts_and_their_width_otherwise(tmp_path):
    path = tmp_path / "mixtral.yaml"
    path.write_text("model_type: mixtral\nhidden_size: 8\nnum_hidden_layers: 2\nnum_attention_heads: 4\n"
                    "num_key_value_heads: 2\nintermediate_size: 12\nnum_local_experts: 4\nnum_experts_per_tok: 2\n"
                    "vocab_size: 10\n")
    spec = load_spec(path)
    assert (spec.name, spec.num_experts, spec.moe_intermediate_size, spec.qk_norm) == ("mixtral", 4, 12, False)


@pytest.mark.parametrize("change, message", [
    ({"num_key_value_heads": 3}, "num_key_value_heads=3 does not divide num_attention_heads=4"),
    ({"hidden_size": 0}, "hidden_size=0 must be a positive integer"),
    ({"hidden_size": 10}, "num_attention_heads=4 does not divide hidden_size=10; give head_dim"),
    ({"num_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok=5 is more than num_experts=4"),
    ({"num_experts": 4}, "num_experts_per_tok=0 must be a positive integer"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings='yes' must be true or false"),
])
def test_invalid_specs_are_refused(change, message):
    base = dict(name="x", hidden_size=8, num_hidden_layers=2, num_attention_heads=4, intermediate_size=12,
                vocab_size=10)
    with pytest.raises(ValueError, match=message):
        DecoderSpec(**base | change)


def test_a_config_error_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("hidden_size: 8\nnum_hidden_layers: 2\nnum_attention_heads: 4\nnum_key_value_heads: 3\n"
                    "intermediate_size: 12\nvocab_size: 10\n")
    with pytest.raises(ValueError, match=f"{path}: num_key_value_heads=3 does not divide"):
        load_spec(path)
