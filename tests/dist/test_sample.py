"""`shardshift sample`: text from a checkpoint, read into one process whatever layout saved it."""

from __future__ import annotations

import pytest

from shardshift.cli.main import main
from shardshift.layout import Layout
from shardshift.models import model_spec
from shardshift.train import checkpoint
from shardshift.train.config import TrainConfig
from shardshift.train.sample import sample
from shardshift.train.trainer import Trainer
from support.dist import run_distributed

pytestmark = pytest.mark.multiproc

LAYOUTS = ["fsdp=2,tp=2", "tp=2,pp=2", "dp=4"]


def _config(layout: str) -> TrainConfig:
    return TrainConfig(layout=Layout.parse(layout), model=model_spec("test"), steps=10,
                       dtype="float32", global_batch=8, seed=2)


def _save_under_every_layout(rank: int, world_size: int, root: str) -> None:
    """One state, saved under each of LAYOUTS: trained under the first, then loaded (resharded
    by DCP) and saved again under each other."""
    trainer = Trainer(_config(LAYOUTS[0]), rank, "cpu")
    for _ in range(3):
        trainer.train_step()
    saved = checkpoint.save(trainer, f"{root}/{LAYOUTS[0]}")
    for layout in LAYOUTS[1:]:
        other = Trainer(_config(layout), rank, "cpu")
        checkpoint.load(other, saved)
        checkpoint.save(other, f"{root}/{layout}")


def test_the_same_state_saved_under_three_layouts_writes_the_same_text(tmp_path, capsys):
    run_distributed(4, _save_under_every_layout, str(tmp_path))
    samples = [sample(str(tmp_path / layout), prompt="KING:\n", tokens=60, temperature=1.0, seed=7)
               for layout in LAYOUTS]
    assert [s.manifest.layout for s in samples] == LAYOUTS and {s.manifest.step for s in samples} == {3}
    assert len({s.text for s in samples}) == 1 and len(samples[0].text) > 0
    assert sample(str(tmp_path / LAYOUTS[0]), prompt="KING:\n", tokens=60, temperature=1.0, seed=8).text != \
        samples[0].text  # the seed matters
    greedy = [sample(str(tmp_path / layout), prompt="KING:\n", tokens=20, temperature=0).text for layout in LAYOUTS]
    assert len(set(greedy)) == 1

    # The command: the prompt and its continuation on stdout, which checkpoint on stderr.
    assert main(["sample", "--resume", str(tmp_path / "dp=4"), "--prompt", "KING:\n", "--tokens", "60",
                 "--temperature", "1", "--seed", "7"]) == 0
    out = capsys.readouterr()
    assert out.out == "KING:\n" + samples[0].text + "\n"
    assert "step-00000003 (step 3, saved under dp=4), seed 7" in out.err


def _train_on(rank: int, world_size: int, data: str, root: str) -> None:
    cfg = TrainConfig(layout=Layout(fsdp=2), model=model_spec("test", 300), steps=4, global_batch=8, seed=2, data=data)
    trainer = Trainer(cfg, rank, "cpu")
    for _ in range(4):
        trainer.train_step()
    checkpoint.save(trainer, root)


def test_a_run_on_prepared_data_samples_with_its_own_tokenizer(tmp_path):
    """Trained on a corpus prepared with a BPE: the checkpoint holds that tokenizer (the data may
    be gone), the prompt is encoded and the text decoded with it, and generation stops at the end
    of a document."""
    import shutil

    from shardshift.data.corpus import load_tokens
    from shardshift.data.prepare import prepare
    from shardshift.data.tokenizer import load_tokenizer
    from shardshift.train.sample import generate, load_model

    text = bytes(load_tokens(None)[:40_000]).decode("utf-8", errors="ignore")
    (tmp_path / "text.txt").write_text(text)
    prepared = prepare([str(tmp_path / "text.txt")], "bpe:300", tmp_path / "data")
    run_distributed(2, _train_on, str(tmp_path / "data"), str(tmp_path / "ckpt"))
    entry = prepared.manifest.tokenizer
    tokenizer = load_tokenizer(tmp_path / "data", entry)
    shutil.rmtree(tmp_path / "data")

    got = sample(str(tmp_path / "ckpt"), prompt="And that the ", tokens=40, temperature=0)
    assert got.manifest.tokenizer == entry and (got.checkpoint / "tokenizer.json").is_file()
    prompt = tokenizer.encode("And that the ")
    assert len(prompt) < len("And that the ")  # merged tokens, not bytes
    model, spec, _, _ = load_model(str(tmp_path / "ckpt"))
    ids = generate(model, spec.seq_len, prompt, 40, 0.0, 0, tokenizer.vocab_size, tokenizer.eod)
    assert got.text == tokenizer.decode(ids) and len(ids) > 0
    # Where the model's most likely next token is the end of a document, generation stops there.
    stopped = generate(_always(model, tokenizer.eod), spec.seq_len, prompt, 40, 0.0, 0, tokenizer.vocab_size,
                       tokenizer.eod)
    assert stopped == []


def _always(model, token: int):
    """`model` made to predict `token` at every position."""
    def forward(ids):
        logits = model(ids)
        logits[..., token] = logits.max() + 1.0
        return logits
    return forward


@pytest.mark.parametrize("argv, message", [
    (["--resume", "/nonexistent"], "--resume /nonexistent: no such directory"),
    (["--resume", "{tmp}"], "no complete checkpoint in it"),
    (["--resume", "{tmp}", "--tokens", "0"], "--tokens 0 must be >= 1"),
])
def test_sample_refuses_what_it_cannot_read(argv, message, tmp_path, capsys):
    assert main(["sample", *(a.format(tmp=tmp_path) for a in argv)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardshift: error: ") and message in err, err
