"""Hugging Face models (``--model hf:DIR``) in one process: the directory read as data agrees with
what transformers builds, the model computes what transformers' own forward computes, and every
configuration or layout that cannot train is refused before any process starts, in one line.

Training under layouts, and export, are in tests/dist/test_hf.py.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from shardshift.cli.main import main
from shardshift.layout import Layout
from shardshift.models import model_spec, recorded_spec
from shardshift.models.hf.config import ARCHITECTURES, param_shapes
from shardshift.models.space import state_space
from support.cli import forbid_processes
from support.hf import hf_model, save_hf_model
from support.training import materialised

KINDS = ["qwen2", "qwen3", "mistral", "llama"]


@pytest.fixture(autouse=True)
def _not_a_worker(monkeypatch):
    forbid_processes(monkeypatch)


@pytest.mark.parametrize("kind", KINDS)
def test_the_parameters_read_from_config_json_are_those_transformers_builds(kind, tmp_path):
    spec = model_spec(save_hf_model(kind, tmp_path, weights=False))
    with torch.device("meta"):
        theirs = dict(hf_model(kind).named_parameters())
        ours = spec.build()
    shapes = {name: tuple(p.shape) for name, p in theirs.items()}
    assert param_shapes(spec.config) == shapes
    assert spec.num_params() == sum(p.numel() for p in theirs.values())
    assert [name for name, _ in ours.named_parameters()] == list(theirs)  # Hugging Face's names, in its order
    assert spec.config.architecture == ARCHITECTURES[kind]
    space = state_space(spec, torch.float64)
    assert {t.name for t in space.tensors if t.kind == "param"} == set(theirs)


@pytest.mark.parametrize("kind", KINDS)
def test_the_model_computes_what_transformers_computes(kind, tmp_path):
    """Its saved weights, run by ShardShift's stage-by-stage forward and by transformers' own, give
    the same float64 logits: the same modules, the same operations in the same order."""
    from transformers import AutoModelForCausalLM

    spec = model_spec(save_hf_model(kind, tmp_path))
    assert spec.weights, "the weights saved by transformers are read"
    ours = materialised(spec)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    ids = torch.randint(0, 256, (3, spec.seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=0, atol=1e-12)
        if kind == "mistral":  # not vacuous: its window (5) is shorter than the sequence (16), and matters
            ours.windows = (None,) * len(ours.windows)
            assert (ours(ids) - theirs(ids).logits).abs().max() > 1e-6


def test_without_weights_every_parameter_starts_from_the_seed_and_its_name(tmp_path):
    spec = model_spec(save_hf_model("qwen2", tmp_path, weights=False))
    assert spec.weights == ()
    shape = torch.Size((8, 32))
    first = spec.init_value("model.layers.0.self_attn.q_proj.weight", shape, torch.float64, seed=3)
    assert torch.equal(first, spec.init_value("model.layers.0.self_attn.q_proj.weight", shape, torch.float64, 3))
    assert not torch.equal(first, spec.init_value("model.layers.1.self_attn.q_proj.weight", shape, torch.float64, 3))
    assert not torch.equal(first, spec.init_value("model.layers.0.self_attn.q_proj.weight", shape, torch.float64, 4))
    assert 0.01 < float(first.std()) < 0.03  # normal(0, initializer_range=0.02)
    assert torch.equal(spec.init_value("model.layers.0.self_attn.q_proj.bias", (8,), torch.float64, 3),
                       torch.zeros(8, dtype=torch.float64))
    assert torch.equal(spec.init_value("model.norm.weight", (32,), torch.float64, 3), torch.ones(32, dtype=torch.float64))


def test_a_checkpoint_records_config_json_and_builds_the_model_from_it_alone(tmp_path):
    spec = model_spec(save_hf_model("qwen3", tmp_path))
    assert spec.name == f"hf:{tmp_path}" and spec.hf_config() == json.loads((tmp_path / "config.json").read_text())
    assert spec.with_config(spec.config_dict()) == spec and hash(spec) == hash(model_spec(f"hf:{tmp_path}"))
    recorded = recorded_spec(spec.name, spec.config_dict())  # no directory read
    assert recorded.config == spec.config and recorded.weights == ()
    assert model_spec("test").hf_config() is None  # the GPT has no Hugging Face form


def test_simulate_plans_switches_of_an_hf_model_from_its_spec(tmp_path):
    from shardshift.simulate.switch import model_space

    name = save_hf_model("qwen2", tmp_path, weights=False)
    assert model_space(name, "float32") is state_space(model_spec(name), torch.float32)


def test_the_command_line_of_a_run_names_its_hf_model(tmp_path):
    """Harnesses that start a run of their own (`bench switch`'s restart baseline) pass hf:DIR on."""
    from shardshift.cli.main import build_parser
    from shardshift.cli.train import config_from_args, train_argv
    from shardshift.train.config import TrainConfig

    name = save_hf_model("qwen2", tmp_path, weights=False)
    cfg = TrainConfig(layout=Layout(fsdp=2), model=model_spec(name), steps=4, global_batch=8)
    argv = train_argv(cfg, nproc=2, timeout_s=10.0)
    assert f"--model=hf:{tmp_path}" in argv
    assert config_from_args(build_parser(argv).parse_args(argv), cfg.layout) == cfg


def _refused(capsys, argv: list[str]) -> str:
    capsys.readouterr()  # what saving the model printed
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("kind, overrides, layout, needle", [
    ("qwen2", {}, "tp=8", "tp=8 does not divide num_key_value_heads=4 of Qwen2ForCausalLM; choose tp in {1, 2, 4}"),
    ("qwen2", {"intermediate_size": 42}, "tp=4", "tp=4 does not divide intermediate_size=42 .*choose tp in {1, 2}"),
    ("qwen2", {}, "pp=8", "pp=8 is larger than the number of layers num_hidden_layers=5; choose pp <= 5"),
    ("llama", {}, "pp=2", "pp=2: LlamaForCausalLM ties its head to its embeddings .*train it with pp=1"),
])
def test_layouts_the_model_cannot_take_are_refused_before_launch(kind, overrides, layout, needle, tmp_path, capsys):
    name = save_hf_model(kind, tmp_path, weights=False, **overrides)
    err = _refused(capsys, ["train", "--layout", layout, "--nproc", str(Layout.parse(layout).world_size),
                            "--model", name])
    assert re.search(needle, err), err


def _config_json(tmp_path, **changes) -> str:
    save_hf_model("qwen2", tmp_path, weights=False)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return f"hf:{tmp_path}"


def test_configurations_that_cannot_train_are_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    cases = {
        f"hf:{tmp_path}/none": "no such directory; give a directory holding a Hugging Face config.json",
        f"hf:{tmp_path}/empty": "its config.json: no such file; give a Hugging Face config.json",
        _config_json(tmp_path / "gemma", model_type="gemma"):
            "model_type .gemma. has no plan in ShardShift; supported: llama .LlamaForCausalLM., mistral",
        _config_json(tmp_path / "small", vocab_size=200):
            "vocab_size=200 is below 256: training reads bytes .*give a model with vocab_size >= 256",
        _config_json(tmp_path / "size", num_hidden_layers=0): "num_hidden_layers is 0; it must be a whole number >= 1",
        "hf:": "give the directory after hf:",
    }
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    cases[f"hf:{tmp_path}/broken"] = "its config.json: .*JSON"
    for name, needle in cases.items():
        err = _refused(capsys, ["train", "--model", name])
        assert re.search(needle, err), (name, err)


def test_weights_that_do_not_fit_config_json_are_refused(tmp_path, capsys):
    save_hf_model("qwen2", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    err = _refused(capsys, ["train", "--model", f"hf:{tmp_path}"])
    assert "its weights hold model.layers.0.mlp.gate_proj.weight with shape [40, 32], but config.json makes it " \
           "[48, 32]" in err


def test_without_transformers_hf_models_name_the_extra_to_install(tmp_path, capsys, monkeypatch):
    import importlib.util

    name = save_hf_model("qwen2", tmp_path, weights=False)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda module, *a: None if module == "transformers"
                        else find_spec(module, *a))
    err = _refused(capsys, ["train", "--model", name])
    assert f"--model hf:{tmp_path} needs transformers, not installed here: pip install 'shardshift[hf]'" in err
