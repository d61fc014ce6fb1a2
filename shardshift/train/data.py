"""Byte-level tokens and a data stream whose batches do not depend on the layout.

The text is cut into non-overlapping windows of ``seq_len + 1`` bytes. Epoch ``e`` visits the windows
in the order of a permutation drawn from ``(seed, e)``; the stream is the concatenation of epochs. The
global batch at position ``p`` (samples consumed so far) is stream items ``p .. p + B - 1``, and data
rank ``r`` of ``D`` reads a contiguous slice of it (`data_slice`: ``B / D`` each when ``D`` divides
``B``, else the first ``B mod D`` ranks read one more). So the global batch at step ``k`` is the same
samples under every layout and every world size, and the position ``p`` is the whole of the data
state (it is saved in checkpoints and carried across layout switches).

Where the slices differ in length, each rank's mean loss is weighted by its share of the batch
(`loss_weight`), so the gradient is still that of the global mean loss.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import importlib.resources
import zlib
from typing import TYPE_CHECKING

import numpy as np

from shardshift.textfile import decode_text, read_bytes

if TYPE_CHECKING:
    import torch

DEFAULT_CORPUS = "shakespeare.txt.gz"
BYTE_VALUES = 256  # token ids are bytes: a model needs a vocabulary of at least this many
TEXT = "a text file"  # what --data must be, for messages


def encode(text: str) -> np.ndarray:
    """Bytes of the UTF-8 encoding, as token ids 0..255."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def check_vocabulary(model: str, vocab_size: int) -> None:
    """Refuse to train `model` on bytes when its vocabulary does not hold every byte value."""
    if vocab_size < BYTE_VALUES:
        raise ValueError(f"--model {model} has a vocabulary of {vocab_size} tokens, but the data are read as bytes "
                         f"(token ids 0..{BYTE_VALUES - 1}); choose a model with vocab_size >= {BYTE_VALUES}")


def decode(tokens) -> str:
    return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


def digest(tokens: np.ndarray) -> str:
    """A digest of a token stream's bytes: the data a run trained on, as a checkpoint records it."""
    return hashlib.blake2b(np.ascontiguousarray(tokens).tobytes(), digest_size=16).hexdigest()


# Leading bytes of compressed formats, which would otherwise train on noise.
_COMPRESSED = {b"\x1f\x8b": "gzip", b"PK\x03\x04": "zip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz",
               b"\x28\xb5\x2f\xfd": "zstd"}


def load_tokens(path: str | None) -> np.ndarray:
    """Token ids of a UTF-8 text file (gzipped if its name ends in .gz), or of the shipped corpus
    when `path` is None. ValueError, naming ``--data``, for anything that is not text."""
    if path is None:
        raw = importlib.resources.files("shardshift.data").joinpath(DEFAULT_CORPUS).read_bytes()
        return np.frombuffer(gzip.decompress(raw), dtype=np.uint8)
    raw = read_bytes(path, "--data", TEXT)
    if path.endswith(".gz"):
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as err:
            raise ValueError(f"--data {path}: its name ends in .gz but it does not decompress as gzip ({err}); "
                             "give a whole gzip file, or plain text under another name") from None
    kind = next((name for magic, name in _COMPRESSED.items() if raw.startswith(magic)), None)
    if kind is not None:
        raise ValueError(f"--data {path}: the file is {kind}-compressed; decompress it"
                         + (", or name it .gz" if kind == "gzip" else ""))
    decode_text(raw, path, "--data", TEXT)  # refuses what is not text
    return np.frombuffer(raw, dtype=np.uint8)


def data_slice(global_batch: int, data_parallel: int, data_rank: int) -> tuple[int, int]:
    """(start, count) of data rank `data_rank`'s slice of a global batch split among `data_parallel`:
    contiguous, as even as can be, the longer slices first."""
    base, extra = divmod(global_batch, data_parallel)
    return data_rank * base + min(data_rank, extra), base + (data_rank < extra)


def loss_weight(global_batch: int, data_parallel: int, data_rank: int) -> float:
    """What a data rank's mean loss is multiplied by before its backward, so that averaging the
    gradients over the data ranks (as DDP and FSDP do) gives the gradient of the mean over the
    global batch: the rank's share of the batch times the number of data ranks (1 on an even split)."""
    _, count = data_slice(global_batch, data_parallel, data_rank)
    return 1.0 if global_batch % data_parallel == 0 else count * data_parallel / global_batch


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: hashed by identity, for the epoch cache
class BatchStream:
    """Global batches of ``global_batch`` windows; see the module docstring for the order."""

    tokens: np.ndarray  # (n,) uint8
    seq_len: int
    global_batch: int
    seed: int

    def __post_init__(self) -> None:
        if self.num_windows < self.global_batch:
            raise ValueError(
                f"the text has {len(self.tokens)} bytes: {self.num_windows} windows of "
                f"seq_len+1={self.seq_len + 1} bytes, fewer than one global batch of "
                f"{self.global_batch}; use a longer text, a shorter sequence or a smaller batch"
            )

    @functools.cached_property
    def digest(self) -> str:
        return digest(self.tokens)

    @property
    def num_windows(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    @functools.lru_cache(maxsize=4)
    def _epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)

    def window_ids(self, position: int, count: int) -> np.ndarray:
        """Stream items ``position .. position + count - 1`` as window indices."""
        items = np.arange(position, position + count)
        epochs, within = np.divmod(items, self.num_windows)
        return np.array([self._epoch_order(int(e))[i] for e, i in zip(epochs, within)], dtype=np.int64)

    def batch(self, position: int, data_rank: int, data_parallel: int) -> tuple["torch.Tensor", "torch.Tensor"]:
        """Inputs and targets (local_batch, seq_len) int64 of one data rank at stream `position`."""
        start, count = data_slice(self.global_batch, data_parallel, data_rank)
        assert count > 0, (self.global_batch, data_parallel, data_rank)
        ids = self.window_ids(position + start, count)
        starts = ids * self.seq_len
        rows = np.stack([self.tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int64)
        import torch  # here: a launcher reads the data to check it, and never batches it

        rows_t = torch.from_numpy(rows)
        return rows_t[:, :-1].contiguous(), rows_t[:, 1:].contiguous()
