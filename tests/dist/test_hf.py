"""Hugging Face models trained under ShardShift's layouts on real gloo processes, checked against
transformers' own forward and against one process; then exported and read back by transformers.

- The weights transformers saved (``save_pretrained``) are what training starts from: the first
  step's loss under dp=2,tp=2 and pp=2,fsdp=2 is transformers' own loss on the same batch.
- A Qwen2 model (grouped-query attention, q/k/v biases, 5 layers) trains under every 4-rank layout
  with the losses of one process (float64, relative 1e-9: only the order of sums differs, as in
  test_train_equivalence.py). Qwen3 (per-head norms: whole, their gradients summed over tp),
  Mistral (a sliding window shorter than the sequence) and a Llama whose head is tied to its
  embeddings (across an online switch too) train as one process does.
- ``shardshift export`` writes a checkpoint saved under pp=2,fsdp=2 as a directory that
  ``from_pretrained`` reads, computing the logits ShardShift's own forward computes; an
  interrupted export leaves no directory; the GPT, with no Hugging Face form, is refused.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from shardshift.cli.main import main
from shardshift.data.corpus import open_corpus
from shardshift.data.stream import BatchStream
from shardshift.layout import Layout, all_layouts
from shardshift.models import model_spec
from shardshift.train import checkpoint
from shardshift.train.config import TrainConfig
from shardshift.train.export import export
from shardshift.train.sample import load_model
from shardshift.train.trainer import Trainer
from support.dist import run_distributed
from support.hf import save_hf_model

STEPS = 3
RTOL = 1e-9
LAYOUTS_4 = [str(layout) for layout in all_layouts(4)]
# Two steps of each other architecture, under layouts that exercise what is particular to it.
OTHERS_4 = {"qwen3": ["pp=2,tp=2", "dp=2,tp=2"], "mistral": ["dp=2,tp=2"], "llama": ["fsdp=2,tp=2"]}


def _config(name: str, layout: str, steps: int = STEPS) -> TrainConfig:
    parsed = Layout.parse(layout)
    return TrainConfig(layout=parsed, model=model_spec(name), steps=steps, dtype="float64", global_batch=8,
                       micro_batches=4 if parsed.pp == 4 else 0, seed=3)


def _train(rank: int, world_size: int, models: dict[str, str], root: str) -> dict:
    """Every run of the module on `world_size` processes: losses by (kind, layout)."""
    out = {}
    for layout in ["dp=1"] if world_size == 1 else LAYOUTS_4:
        trainer = Trainer(_config(models["qwen2"], layout), rank, "cpu")
        out["qwen2", layout] = [trainer.train_step().loss for _ in range(STEPS)]
        if layout == "fsdp=2,pp=2":
            checkpoint.save(trainer, f"{root}/qwen2")
    for kind, layouts in OTHERS_4.items():
        for layout in ["dp=1"] if world_size == 1 else layouts:
            trainer = Trainer(_config(models[kind], layout), rank, "cpu")
            out[kind, layout] = [trainer.train_step().loss for _ in range(2)]
    if world_size == 4:  # the tied weight moved by an online switch, as one parameter
        trainer = Trainer(_config(models["llama"], "dp=4"), rank, "cpu")
        first = trainer.train_step().loss
        trainer.switch(Layout(fsdp=4))
        out["llama", "dp=4 then fsdp=4"] = [first, trainer.train_step().loss]
    else:  # a model with no Hugging Face form, for export to refuse
        trainer = Trainer(_config("test", "dp=1", steps=1), rank, "cpu")
        trainer.train_step()
        checkpoint.save(trainer, f"{root}/gpt")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    models = {kind: save_hf_model(kind, root / kind, seed=i) for i, kind in enumerate(["qwen2", *OTHERS_4])}
    one = run_distributed(1, _train, models, str(root / "one"))[0]
    four = run_distributed(4, _train, models, str(root / "four"))
    return models, root, one, four


def _transformers_loss(directory, spec) -> float:
    """transformers' own loss on the first global batch of a run (`_config`), in float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64)
    inputs, targets = BatchStream(open_corpus(None).train, spec.seq_len, 8, 3).batch(0, 0, 1)
    with torch.no_grad():
        logits = model(inputs).logits
    return float(F.cross_entropy(logits.flatten(0, 1), targets.flatten()))


def test_training_starts_from_the_weights_transformers_saved(runs):
    models, root, one, four = runs
    expected = _transformers_loss(root / "qwen2", model_spec(models["qwen2"]))
    for layout in ("dp=2,tp=2", "fsdp=2,pp=2"):
        for rank, results in enumerate(four):
            assert results["qwen2", layout][0] == pytest.approx(expected, rel=RTOL, abs=0), (layout, rank)


def test_every_four_rank_layout_trains_as_one_process(runs):
    _, _, one, four = runs
    reference = torch.tensor(one["qwen2", "dp=1"])
    assert (reference[0] - reference[-1]).abs() > 1e-3  # not vacuous: training moves the loss
    for layout in LAYOUTS_4:
        for rank, results in enumerate(four):
            torch.testing.assert_close(torch.tensor(results["qwen2", layout]), reference, rtol=RTOL, atol=0,
                                       msg=f"{layout} rank {rank}")
    for kind, layouts in OTHERS_4.items():
        expected = torch.tensor(one[kind, "dp=1"])
        for layout in layouts + (["dp=4 then fsdp=4"] if kind == "llama" else []):
            for rank, results in enumerate(four):
                torch.testing.assert_close(torch.tensor(results[kind, layout]), expected, rtol=RTOL, atol=0,
                                           msg=f"{kind} {layout} rank {rank}")


def test_an_exported_checkpoint_is_what_transformers_reads(runs, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    models, root, _, _ = runs
    saved = root / "four" / "qwen2"
    assert main(["export", "--resume", str(saved), "--out", str(tmp_path / "qwen2")]) == 0
    assert "wrote" in capsys.readouterr().out
    config = json.loads((tmp_path / "qwen2" / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["dtype"] == "float64"
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "qwen2", dtype=torch.float64)
    ours, spec, _, manifest = load_model(str(saved))
    assert manifest.layout == "fsdp=2,pp=2"
    ids = torch.randint(0, 256, (2, spec.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids), rtol=RTOL, atol=1e-12)
        # Not vacuous: the weights are the trained ones, not those training started from.
        start = AutoModelForCausalLM.from_pretrained(root / "qwen2", dtype=torch.float64)
        assert (start(ids).logits - ours(ids)).abs().max() > 1e-4

    # The directory exists only once complete: an export interrupted while writing leaves none.
    import safetensors.torch

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(safetensors.torch, "save_file", interrupted)
        with pytest.raises(KeyboardInterrupt):
            export(str(saved), str(tmp_path / "again"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["qwen2"]
    (tmp_path / ".again.partial").mkdir()  # as a killed export would leave it
    export(str(saved), str(tmp_path / "again"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "qwen2"]

    capsys.readouterr()
    for argv, needle in (
        (["--resume", str(saved), "--out", str(tmp_path / "qwen2")], "exists already; give a new directory"),
        (["--resume", str(root / "one" / "gpt"), "--out", str(tmp_path / "gpt")],
         "its model 'test' has no Hugging Face form; export takes a model that has one"),
    ):
        assert main(["export", *argv]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err
    assert not (tmp_path / "gpt").exists()
