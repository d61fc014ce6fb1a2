"""The data stream: batches depend only on (seed, step), never on the layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardshift.train.data import BatchStream, data_slice, decode, encode, load_tokens, loss_weight


def test_shipped_corpus_is_real_text():
    tokens = load_tokens(None)
    assert len(tokens) > 1_000_000
    assert "To be, or not to be" in decode(tokens[:400_000])


def test_byte_tokenizer_round_trips_utf8():
    text = "Ophelia — nymph, in thy orisons"
    assert decode(encode(text)) == text
    assert encode(text).max() < 256


def test_data_rank_slices_concatenate_to_the_global_batch():
    stream = BatchStream(load_tokens(None), seq_len=16, global_batch=12, seed=7)
    full_x, full_y = stream.batch(position=36, data_rank=0, data_parallel=1)
    for parts in (2, 3, 4, 5, 6, 7, 11, 12):  # uneven splits too
        pieces = [stream.batch(36, r, parts) for r in range(parts)]
        assert torch.equal(torch.cat([p[0] for p in pieces]), full_x)
        assert torch.equal(torch.cat([p[1] for p in pieces]), full_y)
    assert torch.equal(full_x[:, 1:], full_y[:, :-1])  # targets are the next bytes


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


def test_epochs_visit_every_window_once_in_a_seeded_order():
    tokens = np.arange(1 + 10 * 4, dtype=np.uint8)  # 10 windows of 4 (+1) bytes
    stream = BatchStream(tokens, seq_len=4, global_batch=5, seed=1)
    first, second = stream.window_ids(0, 10), stream.window_ids(10, 10)
    assert sorted(first) == sorted(second) == list(range(10))
    assert list(first) != list(second)  # a new permutation each epoch
    assert list(stream.window_ids(3, 9)) == list(np.concatenate([first, second])[3:12])
    other = BatchStream(tokens, seq_len=4, global_batch=5, seed=2)
    assert list(other.window_ids(0, 10)) != list(first)


def test_too_short_text_is_refused(tmp_path):
    with pytest.raises(ValueError, match="fewer than one global batch"):
        BatchStream(encode("short text"), seq_len=8, global_batch=4, seed=0)
    with pytest.raises(ValueError, match="no such file"):
        load_tokens(str(tmp_path / "missing.txt"))
