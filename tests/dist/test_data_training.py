"""Training on prepared data (`shardshift data prepare`) on real gloo processes: the numerics
contract holds for token shards read from disk as it does for a text file.

- A corpus prepared with a byte-level BPE trained on it (`bpe:300`) and one prepared as `bytes`:
  float64 losses under every 4-rank layout equal one process (relative 1e-9), with the ranks
  running their share of the batch two sequences at a time (``micro_batch_size=2``; one at a time
  where the batch of 6 splits 2, 2, 1, 1 and the short ranks end on an empty micro-batch), while
  one process runs the whole batch at once; the held-out losses are equal under every layout.
- The corpus is small (an epoch is a few steps): a switch and a DCP resume in the middle of an
  epoch, under other layouts, go on with the same samples, across the epoch's end.
- A prepared directory of more than 2 GB of tokens trains with each rank's resident memory that
  of the same job on a small corpus (within 32 MB): the shards are read with pread, never
  mapped or held, and opening them reads no shard.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from shardshift.data.manifest import DataManifest, DataSplit, Shard
from shardshift.data.prepare import prepare
from shardshift.data.stream import BatchStream
from shardshift.layout import Layout, all_layouts
from shardshift.models import model_spec
from shardshift.train import checkpoint
from shardshift.train.config import TrainConfig
from shardshift.train.trainer import Trainer
from support.dist import run_distributed

STEPS = 4
RTOL = 1e-9
LAYOUTS_4 = [str(layout) for layout in all_layouts(4)]
UNEVEN_4 = ["fsdp=4", "dp=2,fsdp=2", "dp=4"]


def _documents() -> list[str]:
    """Short documents cut from the shipped corpus."""
    from shardshift.data.corpus import load_tokens

    text = bytes(load_tokens(None)[20_000:20_600]).decode("utf-8", errors="ignore")
    return [text[i:i + 50] for i in range(0, len(text), 50)]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, str]:
    """The two prepared directories, each with a held-out split of two documents in five."""
    root = tmp_path_factory.mktemp("data")
    with open(root / "docs.jsonl", "w") as f:
        for doc in _documents():
            f.write(json.dumps({"text": doc}) + "\n")
    out = {}
    for name, tokenizer in (("bpe", "bpe:300"), ("bytes", "bytes")):
        prepare([str(root / "docs.jsonl")], tokenizer, root / name, val_fraction=0.4, shard_tokens=120)
        out[name] = str(root / name)
    return out


def _config(data: str, layout: str, *, global_batch: int = 8, micro_batch_size: int = 0, steps: int = STEPS):
    manifest = DataManifest.read(data)
    return TrainConfig(layout=Layout.parse(layout), model=model_spec("test", int(manifest.tokenizer["vocab_size"])),
                       steps=steps, dtype="float64", global_batch=global_batch, micro_batch_size=micro_batch_size,
                       data=data, seed=5, eval_batches=2)


def _run(trainer: Trainer, steps: int) -> dict:
    return {"losses": [trainer.train_step().loss for _ in range(steps)], "held_out": trainer.evaluate()}


def _one(rank: int, world_size: int, corpora: dict[str, str]) -> dict:
    return {"bpe": _run(Trainer(_config(corpora["bpe"], "dp=1"), rank, "cpu"), STEPS),
            "uneven": _run(Trainer(_config(corpora["bpe"], "dp=1", global_batch=6), rank, "cpu"), STEPS),
            "bytes": _run(Trainer(_config(corpora["bytes"], "dp=1"), rank, "cpu"), STEPS)}


def _four(rank: int, world_size: int, corpora: dict[str, str], root: str) -> dict:
    out = {}
    for layout in LAYOUTS_4:
        size = 1 if layout == "dp=2,pp=2" else 2  # 2 would make 2 micro-batches, which DDP with pp cannot take
        out["bpe", layout] = _run(Trainer(_config(corpora["bpe"], layout, micro_batch_size=size), rank, "cpu"), STEPS)
    for layout in UNEVEN_4:
        trainer = Trainer(_config(corpora["bpe"], layout, global_batch=6, micro_batch_size=1), rank, "cpu")
        out["uneven", layout] = _run(trainer, STEPS)
    for layout in ("fsdp=2,tp=2", "pp=2,dp=2"):
        out["bytes", layout] = _run(Trainer(_config(corpora["bytes"], layout), rank, "cpu"), STEPS)
    # In the middle of an epoch: a switch, and a save then a load under another layout.
    trainer = Trainer(_config(corpora["bpe"], "dp=4"), rank, "cpu")
    losses = [trainer.train_step().loss for _ in range(2)]
    trainer.switch(Layout.parse("fsdp=2,tp=2"))
    out["switch"] = {"losses": losses + [trainer.train_step().loss for _ in range(STEPS - 2)]}
    trainer = Trainer(_config(corpora["bpe"], "fsdp=4"), rank, "cpu")
    losses = [trainer.train_step().loss for _ in range(2)]
    saved = checkpoint.save(trainer, f"{root}/ckpt")
    trainer = Trainer(_config(corpora["bpe"], "pp=2,tp=2"), rank, "cpu")
    checkpoint.load(trainer, saved)
    out["resume"] = {"losses": losses + [trainer.train_step().loss for _ in range(STEPS - 2)]}
    return out


@pytest.fixture(scope="module")
def runs(corpora, tmp_path_factory):
    """Every run of the module's first tests: on one process, and on four (in one process start each)."""
    one = run_distributed(1, _one, corpora)[0]
    four = run_distributed(4, _four, corpora, str(tmp_path_factory.mktemp("four")))
    return one, four


def _close(got, want, what: str) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=RTOL, atol=0, msg=what)


def test_the_corpus_is_small_enough_that_training_crosses_an_epoch(corpora):
    cfg = _config(corpora["bpe"], "dp=1")
    from shardshift.data.corpus import open_corpus

    corpus = open_corpus(corpora["bpe"])
    windows = BatchStream(corpus.train, cfg.model.seq_len, 8, cfg.seed).num_windows
    assert 2 * 8 < windows < STEPS * 8  # the switch and the save happen mid-epoch; the run goes past its end
    assert corpus.vocab_size == 300 and cfg.model.vocab_size == 300  # a built-in model takes the data's vocabulary
    assert len(DataManifest.read(corpora["bpe"]).split("train").shards) > 1  # windows cross shard files


@pytest.mark.parametrize("corpus", ["bpe", "bytes"])
def test_every_four_rank_layout_in_micro_batches_trains_as_one_process(runs, corpus):
    one, four = runs
    reference = one[corpus]
    assert abs(reference["losses"][0] - reference["losses"][-1]) > 1e-3  # not vacuous: training moves the loss
    layouts = LAYOUTS_4 if corpus == "bpe" else ["fsdp=2,tp=2", "pp=2,dp=2"]
    for layout in layouts:
        for rank, results in enumerate(four):
            _close(results[corpus, layout]["losses"], reference["losses"], f"{corpus} {layout} rank {rank}")
            _close([results[corpus, layout]["held_out"]], [reference["held_out"]],
                   f"held-out {corpus} {layout} rank {rank}")
    assert reference["held_out"] != reference["losses"][-1]  # another split, not the last batch again


def test_an_uneven_batch_in_micro_batches_of_one_trains_as_one_process(runs):
    """6 sequences over 4 data ranks: 2, 2, 1, 1, in two micro-batches on every rank (FSDP2 gathers
    once per micro-batch on each), the last two ranks' second one empty."""
    one, four = runs
    for layout in UNEVEN_4:
        for rank, results in enumerate(four):
            _close(results["uneven", layout]["losses"], one["uneven"]["losses"], f"{layout} rank {rank}")
            _close([results["uneven", layout]["held_out"]], [one["uneven"]["held_out"]], f"{layout} rank {rank}")


@pytest.mark.parametrize("how", ["switch", "resume"])
def test_a_switch_or_a_resume_mid_epoch_goes_on_with_the_same_samples(runs, how):
    one, four = runs
    for rank, results in enumerate(four):
        _close(results[how]["losses"], one["bpe"]["losses"], f"{how} rank {rank}")


# ---- a corpus larger than memory should matter --------------------------------------------------

BIG_TOKENS = (2 << 30) + 12345  # more than 2 GiB of uint8 tokens, in three shards
MEMORY_MARGIN = 32 << 20


def _sparse_corpus(directory, tokens: int) -> str:
    """A prepared directory of `tokens` byte tokens, made cheaply: shards that are sparse files
    (all end-of-document ids but a stretch of text at the start of each) and a manifest whose
    digests are those of the files."""
    from shardshift.data.manifest import hash_file

    directory.mkdir()
    text = np.frombuffer(("the quick brown fox jumps over the lazy dog. " * 2000).encode(), dtype=np.uint8)
    sizes = [tokens // 3, tokens // 3, tokens - 2 * (tokens // 3)]
    shards = []
    for index, size in enumerate(sizes):
        path = directory / f"train-{index:05d}.tokens"
        with open(path, "wb") as f:
            f.write(text.tobytes())
            f.truncate(size)
        shards.append(Shard(path.name, size, hash_file(path)))
    splits = {"train": DataSplit(tokens, 3, tuple(shards)), "val": DataSplit(0, 0, ())}
    tokenizer = {"kind": "bytes", "vocab_size": 256, "eod": 0, "spec": "bytes", "file": None, "digest": None}
    DataManifest.build(tokenizer, np.uint8, splits, [], None, 0.0).write(directory)
    return str(directory)


def _resident(rank: int, world_size: int, data: str) -> dict:
    """Train 3 steps on `data` under fsdp=2; this rank's resident memory (VmRSS) after, and the
    windows it read, far apart in the corpus."""
    cfg = TrainConfig(layout=Layout(fsdp=2), model=model_spec("test"), steps=3, dtype="float32", global_batch=8,
                      data=data, seed=1)
    trainer = Trainer(cfg, rank, "cpu")
    for _ in range(3):
        trainer.train_step()
    windows = trainer.stream.window_ids(0, 24)
    with open(f"/proc/{os.getpid()}/status") as status:
        resident = next(int(line.split()[1]) << 10 for line in status if line.startswith("VmRSS:"))
    return {"resident": resident, "windows": windows, "tokens": len(trainer.corpus.train)}


def test_a_corpus_of_more_than_2_gb_trains_in_the_memory_of_a_small_one(tmp_path, budget):
    big = _sparse_corpus(tmp_path / "big", BIG_TOKENS)
    small = _sparse_corpus(tmp_path / "small", 1 << 20)
    on_big = run_distributed(2, _resident, big, timeout_s=budget.left())
    on_small = run_distributed(2, _resident, small, timeout_s=budget.left())
    for rank in range(2):
        assert on_big[rank]["tokens"] == BIG_TOKENS and on_small[rank]["tokens"] == 1 << 20
        assert max(on_big[rank]["windows"]) * 13 > 1 << 30  # it read windows from all over the corpus
        assert on_big[rank]["resident"] - on_small[rank]["resident"] < MEMORY_MARGIN, (rank, on_big, on_small)


def test_micro_batches_are_what_the_size_asks_for(corpora):
    assert _config(corpora["bpe"], "pp=2,dp=2", micro_batch_size=1).micro_batches == 4  # 4 sequences a rank
    assert _config(corpora["bpe"], "pp=2,tp=2", micro_batch_size=4).micro_batches == 2
    assert _config(corpora["bpe"], "pp=2,dp=2").micro_batches == 4  # 2 * pp without a size
    uneven = _config(corpora["bpe"], "dp=4", global_batch=6, micro_batch_size=1)
    assert uneven.micro_slices(2) == [1, 1] and uneven.micro_slices(1) == [1, 0]
    assert _config(corpora["bpe"], "dp=1", micro_batch_size=3).micro_slices(8) == [3, 3, 2]
    with pytest.raises(ValueError, match="fewer than pp=2 stages"):
        _config(corpora["bpe"], "pp=2,dp=2", micro_batch_size=4)
    with pytest.raises(ValueError, match="do not split into equal micro-batches of at most --micro-batch-size 3"):
        _config(corpora["bpe"], "pp=2", micro_batch_size=3)
    with pytest.raises(ValueError, match="as many micro-batches as stages .* breaks DDP's replication"):
        _config(corpora["bpe"], "pp=2,dp=2", micro_batch_size=2)
