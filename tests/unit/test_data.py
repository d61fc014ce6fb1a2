"""The data stream: batches depend only on (seed, position), never on the layout or the world
size; the epoch order is a permutation computed per index; a prepared directory is read from its
shard files with nothing of the corpus held in memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardshift.data.corpus import ShardFiles, TokenArray, load_tokens, open_corpus
from shardshift.data.manifest import DataManifest
from shardshift.data.order import permute
from shardshift.data.prepare import prepare
from shardshift.data.stream import BatchStream, data_slice, loss_weight
from shardshift.data.tokenizer import ByteTokenizer


def _stream(ids, seq_len=16, global_batch=12, seed=7) -> BatchStream:
    return BatchStream(TokenArray(np.asarray(ids)), seq_len=seq_len, global_batch=global_batch, seed=seed)


def test_shipped_corpus_is_real_text():
    tokens = load_tokens(None)
    assert len(tokens) > 1_000_000
    assert "To be, or not to be" in ByteTokenizer().decode(tokens[:400_000])


def test_data_rank_slices_concatenate_to_the_global_batch():
    stream = _stream(load_tokens(None))
    full_x, full_y = stream.batch(position=36, data_rank=0, data_parallel=1)
    for parts in (2, 3, 4, 5, 6, 7, 11, 12):  # uneven splits too
        pieces = [stream.batch(36, r, parts) for r in range(parts)]
        assert torch.equal(torch.cat([p[0] for p in pieces]), full_x)
        assert torch.equal(torch.cat([p[1] for p in pieces]), full_y)
    assert torch.equal(full_x[:, 1:], full_y[:, :-1])  # targets are the next tokens
    for parts in (1, 3, 5):  # held-out batches alike
        pieces = [stream.held_out(2, r, parts) for r in range(parts)]
        assert torch.equal(torch.cat([p[0] for p in pieces]), stream.held_out(2, 0, 1)[0])


def test_uneven_slices_and_their_weights_give_the_global_mean():
    """The longer slices come first and differ by one; weighting each rank's mean by its
    `loss_weight` and averaging over ranks (as DDP and FSDP average gradients) is the mean over
    the global batch."""
    assert [data_slice(10, 4, r) for r in range(4)] == [(0, 3), (3, 3), (6, 2), (8, 2)]
    assert [data_slice(8, 4, r) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert loss_weight(8, 4, 3) == 1.0
    values = torch.arange(10, dtype=torch.float64) ** 2
    for parts in range(1, 11):
        means = [values[start:start + count].mean() * loss_weight(10, parts, r)
                 for r, (start, count) in enumerate(data_slice(10, parts, r) for r in range(parts))]
        torch.testing.assert_close(torch.stack(means).mean(), values.mean(), rtol=1e-15, atol=0)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 17, 64, 100, 1000, 4097])
def test_an_epoch_order_is_a_permutation_of_every_size(n):
    order = permute(np.arange(n), n, seed=3, epoch=1)
    assert sorted(order.tolist()) == list(range(n))
    # one index at a time gives the same as all at once: nothing depends on the other indices asked
    assert [int(permute([i], n, 3, 1)[0]) for i in range(0, n, max(1, n // 7))] == order[::max(1, n // 7)].tolist()


def test_orders_differ_by_seed_and_epoch_and_mix_the_windows():
    n = 10_000
    base = permute(np.arange(n), n, 0, 0)
    assert not np.array_equal(base, permute(np.arange(n), n, 1, 0))
    assert not np.array_equal(base, permute(np.arange(n), n, 0, 1))
    assert np.array_equal(base, permute(np.arange(n), n, 0, 0))
    # not the identity and not a shift: consecutive indices land far apart, and about as often
    # below as above each other (a random permutation: half)
    jumps = np.abs(np.diff(base))
    assert np.median(jumps) > n / 10
    assert 0.45 < np.mean(base[1:] > base[:-1]) < 0.55
    # an index outside the domain is an error, not a silent wrap
    with pytest.raises(IndexError):
        permute([n], n, 0, 0)


def test_a_large_corpus_is_ordered_in_constant_memory():
    """16 million windows (a 2 GB corpus at seq_len 128): a batch of their order is computed
    without an array of the windows (the order of 64 samples, in a few vectorised passes)."""
    n = 16 * 2**20
    ids = permute(np.arange(5 * n - 32, 5 * n + 32) % n, n, seed=9, epoch=5)
    assert len(set(ids.tolist())) == 64 and ids.min() >= 0 and ids.max() < n


def test_epochs_visit_every_window_once_in_a_seeded_order():
    stream = _stream(np.arange(1 + 10 * 4, dtype=np.uint8), seq_len=4, global_batch=5, seed=1)  # 10 windows
    first, second = stream.window_ids(0, 10), stream.window_ids(10, 10)
    assert sorted(first) == sorted(second) == list(range(10))
    assert list(first) != list(second)  # a new permutation each epoch
    assert list(stream.window_ids(3, 9)) == list(np.concatenate([first, second])[3:12])
    other = _stream(np.arange(1 + 10 * 4, dtype=np.uint8), seq_len=4, global_batch=5, seed=2)
    assert list(other.window_ids(0, 10)) != list(first)


def test_too_short_text_is_refused(tmp_path):
    with pytest.raises(ValueError, match="fewer than one global batch"):
        _stream(ByteTokenizer().encode("short text"), seq_len=8, global_batch=4, seed=0)
    with pytest.raises(ValueError, match="no such file"):
        load_tokens(str(tmp_path / "missing.txt"))


def test_a_prepared_corpus_reads_across_shards_as_one_stream(tmp_path):
    """Shards of 1000 tokens: any stretch of the stream read from the files, crossing shard ends,
    is the stream; batches equal those of the same ids held in memory."""
    text = tmp_path / "text.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400)))
    prepare([str(text)], "bytes", tmp_path / "prepared", shard_tokens=1000)
    manifest = DataManifest.read(tmp_path / "prepared")
    files = ShardFiles(tmp_path / "prepared", manifest, "train")
    assert len(manifest.split("train").shards) > 5
    whole = np.concatenate([np.fromfile(tmp_path / "prepared" / s.file, dtype=manifest.dtype)
                            for s in manifest.split("train").shards]).astype(np.int64)
    assert len(files) == len(whole) and whole[-1] == 0  # the end-of-document id closes the stream
    for start, length in [(0, 10), (995, 10), (999, 1), (1000, 1), (1500, 2600), (len(whole) - 7, 7)]:
        assert np.array_equal(files.read(start, length), whole[start:start + length])
    with pytest.raises(IndexError):
        files.read(len(whole) - 3, 4)
    corpus = open_corpus(str(tmp_path / "prepared"))
    assert (corpus.prepared, corpus.vocab_size, corpus.eod, corpus.digest) == (True, 256, 0, manifest.digest)
    on_disk, in_memory = BatchStream(corpus.train, 32, 8, 5), _stream(whole, 32, 8, 5)
    for position in (0, 8, 8 * 40):
        for got, want in zip(on_disk.batch(position, 1, 3), in_memory.batch(position, 1, 3)):
            assert torch.equal(got, want)
    files.close()
