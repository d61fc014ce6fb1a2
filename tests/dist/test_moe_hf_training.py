"""Hugging Face mixtures of experts (Qwen3-MoE, Mixtral) built by ShardShift's own mixture of
experts, trained on real gloo processes from the weights transformers saved, and exported back.

- The first step's loss under fsdp=2,tp=2, pp=2,dp=2 and ep=2,fsdp=2 (the experts split over two
  ranks, token slots exchanged by all-to-all) is transformers' on the same batch (float64,
  relative 1e-9): its cross entropy plus ``router_aux_loss_coef`` times the mean of its
  ``load_balancing_loss_func`` over each sequence. transformers computes RMSNorm, the rotary
  angles and the router in float32 whatever the dtype; here they are computed in float64
  (`support.hf.moe_in_float64`). Its balancing term sums in float32 (3e-8 relative), which the
  coefficient (0.001, 0.02) scales below 1e-9 of the loss (measured: 1e-11, 1e-10).
- The second step's loss is the same under every layout.
- ``shardshift export`` writes a checkpoint saved under pp=2,dp=2 as a directory that
  ``from_pretrained`` reads (one matrix per expert, as ``save_pretrained`` writes), computing the
  logits of ShardShift's own forward of that checkpoint.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from shardshift.cli.main import main
from shardshift.data.corpus import open_corpus
from shardshift.data.stream import BatchStream
from shardshift.layout import Layout
from shardshift.models import model_spec
from shardshift.train import checkpoint
from shardshift.train.config import TrainConfig
from shardshift.train.sample import load_model
from shardshift.train.trainer import Trainer
from support.dist import run_distributed
from support.hf import load_moe, moe_in_float64, save_hf_model

KINDS = ["qwen3_moe", "mixtral"]
LAYOUTS = ["fsdp=2,tp=2", "pp=2,dp=2", "ep=2,fsdp=2"]
RTOL = 1e-9
BATCH, SEED = 8, 3


def _config(name: str, layout: str) -> TrainConfig:
    return TrainConfig(layout=Layout.parse(layout), model=model_spec(name), steps=2, dtype="float64",
                       global_batch=BATCH, seed=SEED)


def _train(rank: int, world_size: int, models: dict[str, str], root: str) -> dict:
    """Two steps of each model under each layout: losses by (kind, layout)."""
    out = {}
    for kind, name in models.items():
        for layout in LAYOUTS:
            trainer = Trainer(_config(name, layout), rank, "cpu")
            out[kind, layout] = [trainer.train_step().loss for _ in range(2)]
            if kind == "qwen3_moe" and layout == "pp=2,dp=2":
                checkpoint.save(trainer, f"{root}/{kind}")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-hf")
    models = {kind: save_hf_model(kind, root / kind, seed=i) for i, kind in enumerate(KINDS)}
    return models, root, run_distributed(4, _train, models, str(root / "four"))


def _transformers_loss(kind: str, directory) -> float:
    """transformers' loss on the first global batch of a run (`_config`), in float64: cross entropy
    plus router_aux_loss_coef times the mean of each sequence's balancing term."""
    spec = model_spec(f"hf:{directory}")
    modeling = __import__(f"transformers.models.{kind}.modeling_{kind}", fromlist=["load_balancing_loss_func"])
    inputs, targets = BatchStream(open_corpus(None).train, spec.seq_len, BATCH, SEED).batch(0, 0, 1)
    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        moe_in_float64(patch, kind)
        model = load_moe(directory)
        out = model(inputs, output_router_logits=True)
    t, cfg = spec.seq_len, spec.config
    terms = [float(modeling.load_balancing_loss_func(tuple(logits[s * t:(s + 1) * t] for logits in out.router_logits),
                                                     num_experts=cfg.num_experts, top_k=cfg.top_k))
             for s in range(BATCH)]
    cross_entropy = float(F.cross_entropy(out.logits.flatten(0, 1), targets.flatten()))
    assert model.config.router_aux_loss_coef == cfg.router_aux_loss_coef
    return cross_entropy + cfg.router_aux_loss_coef * sum(terms) / BATCH


def test_training_starts_from_the_weights_transformers_saved(runs):
    models, root, four = runs
    for kind in KINDS:
        expected = _transformers_loss(kind, root / kind)
        for layout in LAYOUTS:
            for rank, results in enumerate(four):
                assert results[kind, layout][0] == pytest.approx(expected, rel=RTOL, abs=0), (kind, layout, rank)
        second = [results[kind, layout][1] for results in four for layout in LAYOUTS]
        assert max(second) == pytest.approx(min(second), rel=RTOL, abs=0), (kind, second)
        assert abs(second[0] - expected) > 1e-4  # not vacuous: the first step moved the weights


def test_an_exported_checkpoint_is_what_transformers_reads(runs, tmp_path, capsys, monkeypatch):
    _, root, _ = runs
    saved = root / "four" / "qwen3_moe"
    assert main(["export", "--resume", str(saved), "--out", str(tmp_path / "out")]) == 0
    assert "wrote" in capsys.readouterr().out
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["dtype"] == "float64"
    ours, spec, _, manifest = load_model(str(saved))
    assert Layout.parse(manifest.layout) == Layout(pp=2, dp=2)
    ids = torch.randint(0, 256, (2, spec.seq_len), generator=torch.Generator().manual_seed(0))
    moe_in_float64(monkeypatch, "qwen3_moe")
    theirs = load_moe(tmp_path / "out")
    with torch.no_grad():
        logits = spec.logits(ours(ids))
        torch.testing.assert_close(theirs(ids).logits, logits, rtol=RTOL, atol=1e-12)
        # Not vacuous: the weights are the trained ones, not those training started from.
        start = load_moe(root / "qwen3_moe")
        assert (start(ids).logits - logits).abs().max() > 1e-5
