"""Hugging Face mixtures of experts (``--model hf:DIR`` of a ``Qwen3MoeForCausalLM`` or a
``MixtralForCausalLM``) built by ShardShift's own mixture of experts, in one process: config.json
read into its configuration (and transformers' defaults where a key is left out), the weights
transformers saved mapped in (in the form ``save_pretrained`` writes, or fused as transformers'
modules hold them), the float64 logits and language-model loss of transformers' forward, the
balancing term as transformers computes it for one sequence, the built-in presets' ``config.json``
and tensors written out for ``from_pretrained``, and every refusal in one line before any process
starts.

transformers computes RMSNorm, the rotary angles and the router's softmax in float32 whatever the
model's dtype: float64 logits differ from ours by about 1e-7 relative (measured; asserted below
1e-6); with those three computed in float64 (`support.hf.moe_in_float64`, transformers' formulas
without the casts) they agree to 1e-9. Training under layouts and ``shardshift export`` are in
tests/dist/test_moe_hf_training.py.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
import torch.nn.functional as F

from shardshift.cli.main import main
from shardshift.layout import Layout
from shardshift.models import model_spec, recorded_spec
from shardshift.models.hf.moe import DEFAULTS, HFMoESpec
from shardshift.models.moe.model import balance_terms
from shardshift.models.moe.spec import MoESpec
from shardshift.models.space import state_space
from support.cli import forbid_processes
from support.hf import hf_model, load_moe, moe_in_float64, save_hf_model
from support.training import materialised

transformers = pytest.importorskip("transformers")
KINDS = ["qwen3_moe", "mixtral"]
RTOL = 1e-9


@pytest.fixture(autouse=True)
def _not_a_worker(monkeypatch):
    forbid_processes(monkeypatch)


def _ids(spec, batch: int = 3, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, spec.seq_len), generator=torch.Generator().manual_seed(seed))


def _lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of `ids` under `logits`, as the trainer's and transformers' losses take it."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


# ---- config.json ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_config_json_configures_shardshifts_moe(kind, tmp_path):
    spec = model_spec(save_hf_model(kind, tmp_path, weights=False))
    assert isinstance(spec, HFMoESpec) and spec.name == f"hf:{tmp_path}"
    cfg, theirs = spec.config, hf_model(kind).config
    assert (cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.hidden_size, cfg.vocab_size, cfg.seq_len) == (
        theirs.num_hidden_layers, theirs.num_attention_heads, theirs.num_key_value_heads, theirs.hidden_size,
        theirs.vocab_size, theirs.max_position_embeddings)
    assert (cfg.num_experts, cfg.top_k, cfg.router_aux_loss_coef, cfg.rms_norm_eps, cfg.rope_theta) == (
        theirs.num_local_experts, theirs.num_experts_per_tok, theirs.router_aux_loss_coef, theirs.rms_norm_eps,
        theirs.rope_parameters["rope_theta"])
    assert cfg.shared_expert_intermediate_size == 0 and cfg.norm_topk_prob
    if kind == "qwen3_moe":  # per-head norms, and heads of 16 over a width of 32 in 4 heads
        assert cfg.qk_norm and cfg.head_dim == 16 and cfg.moe_intermediate_size == theirs.moe_intermediate_size
    else:
        assert not cfg.qk_norm and cfg.head_dim == 8 and cfg.moe_intermediate_size == theirs.intermediate_size
    with torch.device("meta"):
        ours = spec.build()
    assert {name: tuple(p.shape) for name, p in ours.named_parameters()} == cfg.param_shapes()
    assert spec.num_params() == sum(p.numel() for p in ours.parameters())
    space = state_space(spec, torch.float64)
    assert {t.name for t in space.tensors if t.kind == "param"} == set(cfg.param_shapes())


@pytest.mark.parametrize("kind", KINDS)
def test_keys_config_json_leaves_out_take_transformers_defaults(kind, tmp_path):
    """DEFAULTS are those of transformers' configuration classes, which a config.json of sizes alone
    gets: its norms' eps, RoPE's theta, the renormalisation, the balancing coefficient."""
    config_class = getattr(transformers, {"qwen3_moe": "Qwen3MoeConfig", "mixtral": "MixtralConfig"}[kind])
    defaults = config_class()
    expected = DEFAULTS[kind]
    assert defaults.rms_norm_eps == expected["rms_norm_eps"]
    assert defaults.rope_parameters["rope_theta"] == expected["rope_theta"]
    assert defaults.router_aux_loss_coef == expected["router_aux_loss_coef"]
    assert defaults.initializer_range == expected["initializer_range"]
    assert getattr(defaults, "norm_topk_prob", True) == expected["norm_topk_prob"]  # Mixtral: no flag, always
    save_hf_model(kind, tmp_path, weights=False)
    sizes = json.loads((tmp_path / "config.json").read_text())
    kept = {key: sizes[key] for key in sizes if key.endswith(("_size", "_heads", "_layers", "head_dim", "experts",
                                                              "_tok", "embeddings", "model_type"))}
    (tmp_path / "config.json").write_text(json.dumps(kept))
    cfg = model_spec(f"hf:{tmp_path}").config
    assert (cfg.rms_norm_eps, cfg.rope_theta, cfg.router_aux_loss_coef, cfg.norm_topk_prob) == (
        expected["rms_norm_eps"], expected["rope_theta"], expected["router_aux_loss_coef"], expected["norm_topk_prob"])


def test_a_checkpoint_records_config_json_and_builds_the_model_from_it_alone(tmp_path):
    spec = model_spec(save_hf_model("qwen3_moe", tmp_path))
    assert spec.weights and spec.hf_config() == json.loads((tmp_path / "config.json").read_text())
    assert spec.with_config(spec.config_dict()) == spec and hash(spec) == hash(model_spec(f"hf:{tmp_path}"))
    recorded = recorded_spec(spec.name, spec.config_dict())  # no directory read
    assert isinstance(recorded, HFMoESpec) and recorded.config == spec.config and recorded.weights == ()


def test_without_weights_every_parameter_starts_from_the_seed_and_its_name(tmp_path):
    spec = model_spec(save_hf_model("mixtral", tmp_path, weights=False))
    assert spec.weights == ()
    shape = torch.Size((4, 24, 32))
    fqn = "model.layers.0.mlp.experts.gate_proj"
    first = spec.init_value(fqn, shape, torch.float64, seed=3)
    assert torch.equal(first, spec.init_value(fqn, shape, torch.float64, 3))
    assert not torch.equal(first, spec.init_value(fqn.replace("gate", "up"), shape, torch.float64, 3))
    assert not torch.equal(first, spec.init_value(fqn, shape, torch.float64, 4))
    assert 0.015 < float(first.std()) < 0.025  # normal(0, initializer_range=0.02)
    assert torch.equal(spec.init_value("model.norm.weight", (32,), torch.float64, 3), torch.ones(32, dtype=torch.float64))


# ---- weights in, and the forward ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_the_model_computes_what_transformers_computes(kind, tmp_path, monkeypatch):
    """From the weights transformers saved: float64 logits and the language-model loss to 1e-9 once
    transformers' three float32 computations are float64 (1e-7 before: module docstring)."""
    spec = model_spec(save_hf_model(kind, tmp_path, seed=2))
    assert spec.weights, "the weights saved by transformers are read"
    ours = materialised(spec)
    theirs = load_moe(tmp_path)
    ids = _ids(spec)
    with torch.no_grad():
        logits, _ = ours(ids)
        as_is = theirs(ids).logits
        difference = float((logits - as_is).abs().max() / as_is.abs().max())
        assert 1e-9 < difference < 1e-6, difference  # float32's rounding in its norms, rotation and router
        moe_in_float64(monkeypatch, kind)
        expected = theirs(ids).logits
    torch.testing.assert_close(logits, expected, rtol=RTOL, atol=1e-12)
    assert float(_lm_loss(logits, ids)) == pytest.approx(float(_lm_loss(expected, ids)), rel=RTOL, abs=0)
    assert logits.std() > 0.05  # not vacuous: the logits vary
    # Not vacuous: routing matters (the second expert's weight dropped changes the logits).
    one = dataclasses.replace(spec, config=dataclasses.replace(spec.config, top_k=1))
    with torch.no_grad():
        assert (materialised(one)(ids)[0] - logits).abs().max() > 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_the_balance_term_of_each_sequence_is_transformers(kind, tmp_path):
    """Each sequence's term from our routing statistics is transformers' `load_balancing_loss_func`
    on that sequence's router logits, which it sums in float32 (6e-8 relative)."""
    spec = model_spec(save_hf_model(kind, tmp_path, seed=1))
    ids = _ids(spec, batch=2)
    with torch.no_grad():
        _, stats = materialised(spec)(ids)
        routed = load_moe(tmp_path)(ids, output_router_logits=True)
    ours = balance_terms(stats, spec.config.n_layers, spec.seq_len)
    modeling = __import__(f"transformers.models.{kind}.modeling_{kind}", fromlist=["load_balancing_loss_func"])
    t, experts, top_k = spec.seq_len, spec.config.num_experts, spec.config.top_k
    for s in range(2):
        layers = tuple(logits[s * t:(s + 1) * t] for logits in routed.router_logits)
        theirs = modeling.load_balancing_loss_func(layers, num_experts=experts, top_k=top_k)
        assert float(ours[s]) == pytest.approx(float(theirs), rel=6e-8, abs=0)
    assert abs(float(ours[0]) - top_k) > 1e-3  # not vacuous: routing is uneven


def test_weights_fused_as_transformers_modules_hold_them_load_alike(tmp_path):
    """A directory holding transformers' own state dict (``gate_up_proj`` fused, Mixtral's router
    under ``mlp.``) starts from the same values as save_pretrained's (one matrix per expert)."""
    from safetensors.torch import save_file

    saved = model_spec(save_hf_model("mixtral", tmp_path / "saved", seed=4))
    assert any(".block_sparse_moe.experts.0.w1.weight" in name for name, _ in saved.weights)
    model = hf_model("mixtral", seed=4)
    model.config.save_pretrained(tmp_path / "fused")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "fused" / "model.safetensors"))
    fused = model_spec(f"hf:{tmp_path / 'fused'}")
    assert any(name.endswith("experts.gate_up_proj") for name, _ in fused.weights)
    for fqn, shape in saved.config.param_shapes().items():
        assert torch.equal(fused.init_value(fqn, shape, torch.float64, 0), saved.init_value(fqn, shape, torch.float64, 0)), fqn


# ---- out: config.json and tensors for from_pretrained ------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_an_hf_model_gives_back_what_save_pretrained_wrote(kind, tmp_path):
    spec = model_spec(save_hf_model(kind, tmp_path, seed=5))
    ours = materialised(spec)
    written = spec.hf_state_dict(dict(ours.state_dict()))
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert sorted(written) == sorted(f.keys())
        for name in written:
            assert torch.equal(written[name], f.get_tensor(name).double()), name


@pytest.mark.parametrize("qk_norm, architecture", [(True, "Qwen3MoeForCausalLM"), (False, "MixtralForCausalLM")])
def test_a_built_in_model_is_read_by_from_pretrained(qk_norm, architecture, tmp_path, monkeypatch):
    """`hf_config` and `hf_state_dict` of a built-in model with no shared expert (moe-tiny's kind)
    make a directory transformers reads, computing our logits (1e-9 in float64 as above)."""
    from safetensors.torch import save_file

    base = model_spec("moe-test")
    spec = MoESpec("moe-test-hf", dataclasses.replace(base.config, shared_expert_intermediate_size=0, qk_norm=qk_norm,
                                                     router_aux_loss_coef=0.01))
    config = spec.hf_config()
    assert config["architectures"] == [architecture]
    ours = materialised(spec, seed=6)
    (tmp_path / "config.json").write_text(json.dumps({**config, "dtype": "float64"}))
    save_file(spec.hf_state_dict(dict(ours.state_dict())), str(tmp_path / "model.safetensors"))
    theirs = load_moe(tmp_path)
    assert type(theirs).__name__ == architecture
    assert theirs.config.router_aux_loss_coef == 0.01 and theirs.config.num_experts_per_tok == 2
    moe_in_float64(monkeypatch, config["model_type"])
    ids = _ids(spec)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids)[0], theirs(ids).logits, rtol=RTOL, atol=1e-12)
    # The directory is an hf: model again: the same configuration, from the tensors written.
    again = model_spec(f"hf:{tmp_path}")
    assert dataclasses.replace(again.config, seq_len=spec.seq_len) == spec.config
    assert torch.equal(again.init_value("model.layers.1.mlp.experts.up_proj", (4, 24, 32), torch.float64, 0),
                       ours.get_parameter("model.layers.1.mlp.experts.up_proj"))


def test_models_neither_architecture_expresses_have_no_hugging_face_form():
    assert model_spec("moe-test").hf_config() is None  # a shared expert
    assert model_spec("moe-tiny").hf_config()["architectures"] == ["Qwen3MoeForCausalLM"]
    assert model_spec("moe-small").hf_config()["architectures"] == ["Qwen3MoeForCausalLM"]
    plain = model_spec("moe-tiny")
    plain = MoESpec("plain", dataclasses.replace(plain.config, qk_norm=False, norm_topk_prob=False))
    assert plain.hf_config() is None  # Mixtral always renormalises; Qwen3-MoE has head norms


# ---- refusals -----------------------------------------------------------------------------------------


def _refused(capsys, argv: list[str]) -> str:
    capsys.readouterr()  # what saving the model printed
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def _config_json(directory, kind: str = "qwen3_moe", **changes) -> str:
    save_hf_model(kind, directory, weights=False)
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))
    return f"hf:{directory}"


def test_configurations_it_does_not_compute_are_refused_in_one_line(tmp_path, capsys):
    where = r"--model hf:\S+: config.json: "
    cases = {
        _config_json(tmp_path / "tied", tie_word_embeddings=True):
            "tie_word_embeddings is true, but ShardShift's mixture of experts has a head of its own; give a model "
            "with tie_word_embeddings false",
        _config_json(tmp_path / "step", decoder_sparse_step=2):
            r"decoder_sparse_step=2 and mlp_only_layers=\[\] make layers \[0\] dense MLPs, .*experts in every "
            r"layer; give decoder_sparse_step 1 and mlp_only_layers \[\]",
        _config_json(tmp_path / "dense", mlp_only_layers=[1]):
            r"decoder_sparse_step=1 and mlp_only_layers=\[1\] make layers \[1\] dense",
        _config_json(tmp_path / "window", use_sliding_window=True, sliding_window=5):
            r"sliding_window=5 is shorter than the sequence \(16 positions\).*give a model without a sliding window",
        _config_json(tmp_path / "mixtral-window", "mixtral", sliding_window=8): "sliding_window=8 is shorter",
        _config_json(tmp_path / "yarn", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}):
            "rope_parameters rope_type is 'yarn', but ShardShift's mixture of experts rotates by rope_theta alone",
        _config_json(tmp_path / "bias", attention_bias=True): "attention_bias is true, which ShardShift's mixture "
                                                              "of experts does not compute; give a model with "
                                                              "attention_bias false",
        _config_json(tmp_path / "gelu", hidden_act="gelu"): 'hidden_act is "gelu".*hidden_act "silu"',
        _config_json(tmp_path / "jitter", "mixtral", router_jitter_noise=0.1): "router_jitter_noise is 0.1",
        _config_json(tmp_path / "dropout", attention_dropout=0.1): "attention_dropout is 0.1",
        _config_json(tmp_path / "top", num_experts_per_tok=5):
            "num_experts_per_tok=5 is more than the 4 experts; give at most 4",
        _config_json(tmp_path / "none", num_local_experts=0): "num_local_experts is 0; it must be a whole number >= 1",
        _config_json(tmp_path / "vocab", "mixtral", vocab_size=200): "vocab_size=200 is below 256",
        _config_json(tmp_path / "odd", head_dim=7): "head_dim=7 is odd",
    }
    for name, needle in cases.items():
        err = _refused(capsys, ["train", "--model", name])
        assert re.search(where + needle, err), (name, err)
    err = _refused(capsys, ["train", "--model", _config_json(tmp_path / "gemma", model_type="gemma")])
    assert "supported: llama (LlamaForCausalLM), mistral (MistralForCausalLM), qwen2 (Qwen2ForCausalLM), qwen3 " \
           "(Qwen3ForCausalLM), qwen3_moe (Qwen3MoeForCausalLM), mixtral (MixtralForCausalLM)" in err


def test_weights_that_do_not_fit_config_json_are_refused(tmp_path, capsys):
    save_hf_model("qwen3_moe", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 20}))
    err = _refused(capsys, ["train", "--model", f"hf:{tmp_path}"])
    assert "its weights hold model.layers.0.mlp.experts.0.gate_proj.weight with shape [24, 32], but config.json " \
           "makes it [20, 32]; save the weights and the configuration together" in err
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_local_experts": 5}))
    err = _refused(capsys, ["train", "--model", f"hf:{tmp_path}"])
    assert "its weights hold model.layers.0.mlp.gate.weight with shape [4, 32], but config.json makes it [5, 32]" in err
    (tmp_path / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    err = _refused(capsys, ["train", "--model", f"hf:{tmp_path}"])
    assert "its weights lack model.layers.1.mlp.experts.2.up_proj.weight; save the whole model with " \
           "save_pretrained, or remove the weights to start from the seed" in err


def test_layouts_it_cannot_take_are_refused_before_launch(tmp_path, capsys):
    name = save_hf_model("qwen3_moe", tmp_path, weights=False)
    err = _refused(capsys, ["train", "--layout", "tp=4", "--nproc", "4", "--model", name])
    assert "tp=4 does not divide n_kv_heads=2; choose tp in {1, 2}" in err
    model_spec(name).check_layout(Layout(tp=2, pp=2))
