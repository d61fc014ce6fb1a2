"""The Llama family through the model interface: its state space derived from its plan, its
initialisation, the layouts it refuses, its rotary buffer after the meta device, and (when
`transformers` is installed) its logits against Hugging Face's ``LlamaForCausalLM`` with the same
weights under the same names."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from shardshift.data.corpus import open_corpus
from shardshift.layout import Coord, Layout
from shardshift.models import model_names, model_spec
from shardshift.models.llama.config import PRESETS, LlamaConfig
from shardshift.models.llama.model import RotaryEmbedding, inverse_frequencies
from shardshift.models.llama.spec import LlamaSpec
from shardshift.models.space import state_space
from shardshift.reshard.space import Box, holding
from shardshift.train.config import TrainConfig

TINY = model_spec("llama-tiny")


def _llama(base: str = "llama-test", **changes) -> LlamaSpec:
    spec = model_spec(base)
    return LlamaSpec(f"{base}-variant", dataclasses.replace(spec.config, **changes))


def _boxes(spec, layout: Layout, coord: Coord) -> dict:
    space = state_space(spec, torch.float32)
    return {t.key: holding(space, layout, coord, t) for t in space.tensors}


def test_the_presets_resolve_by_name_and_round_trip_their_config():
    assert [name for name in model_names() if name.startswith("llama-")] == list(PRESETS)
    for name in PRESETS:
        spec = model_spec(name)
        assert isinstance(spec, LlamaSpec) and spec.name == name
        assert spec.with_config(spec.config_dict()) == spec and hash(spec) == hash(model_spec(name))


@pytest.mark.parametrize("name", ["llama-test", "llama-tiny"])
def test_the_parameter_count_and_names_are_the_built_models(name):
    spec = model_spec(name)
    with torch.device("meta"):
        model = spec.build()
    assert spec.num_params() == sum(p.numel() for p in model.parameters())
    n = spec.config.n_layers
    layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"]
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    expected |= {f"model.layers.{i}.{m}.weight" for i in range(n) for m in layer}
    assert {fqn for fqn, _ in model.named_parameters()} == expected  # Hugging Face's names, no biases
    assert set(model.state_dict()) == expected  # inv_freq is not saved


def test_the_tiny_space_follows_the_plan_and_the_split():
    """llama-tiny: hidden 128, 16 query heads of 8 over 8 key-value heads, MLP width 352, 8 layers."""
    layout = Layout(tp=2, pp=2)
    last = _boxes(TINY, layout, layout.coord(layout.world_size - 1))  # last stage, tp rank 1
    assert last["param:model.layers.7.self_attn.q_proj.weight"] == Box((64, 0), (64, 128))  # 8 query heads
    assert last["param:model.layers.7.self_attn.k_proj.weight"] == Box((32, 0), (32, 128))  # their 4 kv heads
    assert last["param:model.layers.7.self_attn.o_proj.weight"] == Box((0, 64), (128, 64))  # rowwise
    assert last["param:model.layers.7.mlp.gate_proj.weight"] == Box((176, 0), (176, 128))
    assert last["param:model.layers.7.mlp.down_proj.weight"] == Box((0, 176), (128, 176))
    assert last["param:model.layers.7.input_layernorm.weight"] == Box((0,), (128,))  # not in the plan: whole
    assert last["param:model.norm.weight"] == Box((0,), (128,))
    assert last["param:lm_head.weight"] == Box((0, 0), (256, 128))
    assert last["param:model.embed_tokens.weight"] is None  # the first stage's
    assert last["param:model.layers.3.self_attn.q_proj.weight"] is None  # layers 0..3 are the first stage's
    assert last["param:model.layers.4.mlp.up_proj.weight"] == Box((176, 0), (176, 128))

    layout = Layout(fsdp=4)
    third = _boxes(TINY, layout, layout.coord(3))
    assert third["param:model.layers.0.self_attn.k_proj.weight"] == Box((48, 0), (16, 128))  # dim 0 in four
    assert third["exp_avg:model.embed_tokens.weight"] == Box((192, 0), (64, 128))
    assert third["param:lm_head.weight"] == Box((192, 0), (64, 128))

    layout = Layout(dp=2, tp=4)
    replica = _boxes(TINY, layout, layout.coord(5))  # the second replica's tp rank 1
    assert replica["param:model.layers.2.self_attn.v_proj.weight"] == Box((16, 0), (16, 128))  # 2 kv heads
    assert replica == _boxes(TINY, layout, layout.coord(1))  # replicas hold the same boxes


def test_a_tied_model_has_one_matrix_for_the_embedding_and_the_head():
    spec = _llama(tie_word_embeddings=True)
    space = state_space(spec, torch.float32)
    names = [t.name for t in space.tensors if t.kind == "param"]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert spec.num_params() == sum(math.prod(t.shape) for t in space.tensors if t.kind == "param")
    assert spec.pipeline.last == ("model.norm",)


def test_initial_values_depend_on_the_seed_and_the_name_only():
    fqn, shape = "model.layers.2.self_attn.q_proj.weight", torch.Size((128, 128))
    first = TINY.init_value(fqn, shape, torch.float64, seed=7)
    assert torch.equal(first, TINY.init_value(fqn, shape, torch.float64, seed=7))
    assert not torch.equal(first, TINY.init_value(fqn, shape, torch.float64, seed=8))
    assert not torch.equal(first, TINY.init_value(fqn.replace("q_proj", "k_proj"), shape, torch.float64, seed=7))
    assert torch.equal(TINY.init_value(fqn, shape, torch.float32, seed=7), first.float())  # drawn once, rounded
    assert abs(first.std().item() - 0.02) < 1e-3
    down = TINY.init_value("model.layers.0.mlp.down_proj.weight", torch.Size((128, 352)), torch.float64, seed=7)
    assert abs(down.std().item() - 0.02 / 4) < 1e-3  # residual projections: 1/sqrt(2 * 8 layers)
    assert torch.equal(TINY.init_value("model.norm.weight", torch.Size((128,)), torch.float64, 7), torch.ones(128))


def test_the_rotary_buffer_is_rebuilt_after_the_meta_device():
    for dtype in (torch.float32, torch.float64):
        with torch.device("meta"):
            model = TINY.build()
        model.to(dtype).to_empty(device="cpu")
        rotary = model.model.rotary_emb
        rotary.inv_freq.fill_(float("nan"))  # what an uninitialised buffer may hold
        TINY.init_buffers(model)
        expected = inverse_frequencies(8, 10000.0).to(dtype)  # head_dim 8: 4 frequencies
        assert rotary.inv_freq.dtype == dtype and torch.equal(rotary.inv_freq, expected)
        assert torch.equal(expected, 1.0 / 10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8).to(dtype))
        built = TINY.build().to(dtype)
        TINY.init_buffers(built)
        assert torch.equal(built.model.rotary_emb.inv_freq, rotary.inv_freq)
    cos, sin = RotaryEmbedding(TINY.config)(3, torch.float64)
    assert cos.shape == (3, 8) and torch.equal(cos[0], torch.ones(8)) and torch.equal(sin[0], torch.zeros(8))


def test_layouts_the_model_cannot_take_are_refused_with_the_fix():
    test = model_spec("llama-test")  # 8 query heads, 4 key-value heads, MLP width 44, 5 layers
    cases = [
        (test, Layout(tp=3), r"^tp=3 does not divide n_heads=8; choose tp in \{1, 2, 4\}$"),
        (test, Layout(tp=8), r"^tp=8 does not divide n_kv_heads=4; choose tp in \{1, 2, 4\}$"),
        (_llama(intermediate_size=42), Layout(tp=4), r"^tp=4 does not divide intermediate_size=42; choose tp in \{1, 2\}$"),
        (test, Layout(pp=6), r"^pp=6 is larger than the number of layers n_layers=5; choose pp <= 5$"),
        (test, Layout(ep=2), r"^ep=2: llama-test has no experts to split; .*\(train with ep=1\)$"),
        (_llama(tie_word_embeddings=True), Layout(pp=2, fsdp=2),
         r"^pp=2: llama-test-variant ties its head to its embedding, .*choose pp=1, or a model with tie_word_embeddings false$"),
    ]
    for spec, layout, message in cases:
        with pytest.raises(ValueError, match=message):
            spec.check_layout(layout)
        assert "\n" not in message
    for layout in (Layout(tp=4), Layout(pp=5), Layout(dp=2, tp=2, pp=2)):
        test.check_layout(layout)  # taken
    _llama(tie_word_embeddings=True).check_layout(Layout(fsdp=2, tp=4))
    with pytest.raises(ValueError, match=r"^tp=3 does not divide n_heads=8"):  # before any process starts
        TrainConfig(layout=Layout(tp=3), model=test, steps=1)


def test_a_vocabulary_smaller_than_the_byte_values_is_refused():
    """The data are bytes: a trainer refuses a model that cannot hold every byte value, before it
    builds anything (here: no process group exists), as the launcher does before any process starts."""
    from shardshift.train.trainer import Trainer

    cfg = TrainConfig(layout=Layout(), model=_llama(vocab_size=200), steps=1)
    with pytest.raises(ValueError, match=r"^--model llama-test-variant has a vocabulary of 200 tokens, but the data "
                                         r"are read as bytes \(token ids 0..255\); choose a model with vocab_size >= 256$"):
        Trainer(cfg, 0, "cpu")
    open_corpus(None).check_vocabulary("llama-test", model_spec("llama-test").vocab_size)  # 259: the bytes and 3 more
    open_corpus(None).check_vocabulary("gpt", 256)


def test_configurations_that_build_no_llama_are_refused():
    base = dict(n_layers=2, n_heads=4, n_kv_heads=2, hidden_size=16, intermediate_size=24, seq_len=8)
    for changes, message in [
        (dict(n_kv_heads=3), "n_kv_heads=3 does not divide n_heads=4"),
        (dict(hidden_size=18), "hidden_size=18 is not divisible by n_heads=4"),
        (dict(hidden_size=12), "head_dim=3 .* is odd"),
        (dict(n_layers=0), "n_layers=0 must be >= 1"),
        (dict(rms_norm_eps=0.0), "must be > 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            LlamaConfig(**{**base, **changes})


# ---- against Hugging Face's model -----------------------------------------------------------------


def _with_weights(spec: LlamaSpec, dtype: torch.dtype):
    """Our model in `dtype`, its initial weights, norm gains moved off 1 (so a misplaced gain shows)."""
    model = spec.build().to(dtype)
    spec.init_buffers(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for fqn, param in model.named_parameters():
            param.copy_(spec.init_value(fqn, param.shape, dtype, seed=1))
            if fqn.endswith("norm.weight"):
                param.add_(0.3 * torch.randn(param.shape, generator=generator, dtype=torch.float64).to(dtype))
    return model.eval()


def _hugging_face(spec: LlamaSpec, ours, dtype: torch.dtype):
    """``transformers.LlamaForCausalLM`` of `spec.hf_config()`, with our parameters by their names."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**spec.hf_config())).to(dtype).eval()
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    assert unexpected == [] and missing == (["lm_head.weight"] if spec.config.tie_word_embeddings else [])
    if spec.config.tie_word_embeddings:
        assert hf.lm_head.weight is hf.model.embed_tokens.weight  # Hugging Face ties it to ours
    return hf


SPECS = {"gqa": model_spec("llama-test"), "tied": _llama(tie_word_embeddings=True, n_kv_heads=8, rope_theta=500.0)}


@pytest.mark.parametrize("case", SPECS)
def test_float32_logits_are_hugging_faces(case):
    """The same operations in the same order: Hugging Face's logits to float32 rounding (here they
    agree to the bit; 1e-6 leaves room for another kernel's order of sums)."""
    spec = SPECS[case]
    ours = _with_weights(spec, torch.float32)
    hf = _hugging_face(spec, ours, torch.float32)
    tokens = torch.randint(0, 256, (3, spec.seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, expected = ours(tokens), hf(tokens).logits
    assert got.shape == (3, spec.seq_len, spec.vocab_size)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert got.std() > 0.1  # not vacuous: the logits vary
    with torch.no_grad():
        assert not torch.allclose(ours(tokens.flip(1)).flip(1), got, atol=1e-3)  # position matters (RoPE, causal)


@pytest.mark.parametrize("case", SPECS)
def test_float64_logits_are_hugging_faces_to_1e9(case, monkeypatch):
    """In float64, Hugging Face still computes RMSNorm and the rotary angles in float32 (a 1e-7
    difference, measured); ours computes them in float64. With those two computed in float64 as
    well (their formulas unchanged: only the float32 casts are dropped), every other part of its
    model (names, shapes, attention and its scale, grouped heads, rotation, SwiGLU, the tied
    head) agrees with ours to 1e-9."""
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama")

    def norm_forward(self, x):  # LlamaRMSNorm.forward without `.to(torch.float32)`
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rotary_forward(self, x, position_ids):  # LlamaRotaryEmbedding.forward without `.float()`
        freqs = position_ids[..., None].to(self.inv_freq.dtype) * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return (angles.cos() * self.attention_scaling).to(x.dtype), (angles.sin() * self.attention_scaling).to(x.dtype)

    spec = SPECS[case]
    ours = _with_weights(spec, torch.float64)
    hf = _hugging_face(spec, ours, torch.float64)
    tokens = torch.randint(0, 256, (2, spec.seq_len), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        as_is = hf(tokens).logits
        got = ours(tokens)
    difference = ((got - as_is).abs().max() / as_is.abs().max()).item()
    assert difference < 1e-5, difference  # float32's rounding in its norm and rotation (1e-7 with transformers 5.25)
    monkeypatch.setattr(modeling.LlamaRMSNorm, "forward", norm_forward)
    monkeypatch.setattr(modeling.LlamaRotaryEmbedding, "forward", rotary_forward)
    head_dim = spec.config.head_dim
    hf.model.rotary_emb.inv_freq = 1.0 / spec.config.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    with torch.no_grad():
        expected = hf(tokens).logits
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


def test_the_hugging_face_config_describes_the_model():
    transformers = pytest.importorskip("transformers")
    spec = _llama(tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-6)
    config = transformers.LlamaConfig(**spec.hf_config())
    cfg = spec.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, config.hidden_size,
            config.intermediate_size, config.vocab_size, config.max_position_embeddings, config.head_dim) == (
        cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size,
        cfg.seq_len, cfg.head_dim)
    assert config.rope_parameters["rope_theta"] == 500000.0 and config.rms_norm_eps == 1e-6
    assert config.tie_word_embeddings and config.hidden_act == "silu"
    assert not config.attention_bias and not config.mlp_bias
    assert spec.hf_config()["architectures"] == ["LlamaForCausalLM"] and spec.hf_config()["model_type"] == "llama"
