"""What ``--data`` names, opened for training: a text file read as bytes, or a directory
`shardshift data prepare` wrote, read lazily.

A `Corpus` has the token stream of each split (`TokenArray` in memory, `ShardFiles` on disk),
the tokenizer's vocabulary and end-of-document id, and its identity (`digest`), which a checkpoint
records. A text file's digest is that of its bytes; a prepared directory's is its manifest's,
computed from the shards' digests when it was written, so opening it reads no shard.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import importlib.resources
import os
import shutil
import threading
import zlib
from pathlib import Path
from typing import Protocol

import numpy as np

from shardshift.data.manifest import DataManifest, is_prepared
from shardshift.data.prepare import COMPRESSED
from shardshift.textfile import decode_text, read_bytes

DEFAULT_CORPUS = "shakespeare.txt.gz"
BYTE_VALUES = 256  # a text file's token ids are its bytes: a model needs a vocabulary of at least this many
TEXT = "a text file or a directory `shardshift data prepare` wrote"  # what --data must be, for messages



class Tokens(Protocol):
    """A split's token stream: its length and any stretch of it, as int64."""

    def __len__(self) -> int: ...

    def read(self, start: int, length: int) -> np.ndarray: ...


@dataclasses.dataclass(frozen=True, eq=False)
class TokenArray:
    """A stream held in memory (a text file's bytes)."""

    ids: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)

    def read(self, start: int, length: int) -> np.ndarray:
        return self.ids[start:start + length].astype(np.int64)


class ShardFiles:
    """A prepared split's stream, read from its shard files with ``pread`` on each call: nothing of
    the corpus is kept (nor mapped) in memory, only one open file per shard."""

    def __init__(self, directory: str | os.PathLike, manifest: DataManifest, split: str) -> None:
        shards = manifest.split(split).shards
        self.paths = [Path(directory) / shard.file for shard in shards]
        self.dtype = manifest.dtype
        self.ends = np.cumsum([shard.tokens for shard in shards], dtype=np.int64)
        self._files: dict[int, int] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def _fd(self, index: int) -> int:
        with self._lock:
            if index not in self._files:
                self._files[index] = os.open(self.paths[index], os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            return self._files[index]

    def read(self, start: int, length: int) -> np.ndarray:
        if start < 0 or start + length > len(self):
            raise IndexError(f"tokens {start}..{start + length} lie outside the stream of {len(self)}")
        out, itemsize = [], self.dtype.itemsize
        index = int(np.searchsorted(self.ends, start, side="right"))
        while length > 0:
            first = int(self.ends[index - 1]) if index else 0
            take = min(length, int(self.ends[index]) - start)
            raw = os.pread(self._fd(index), take * itemsize, (start - first) * itemsize)
            out.append(np.frombuffer(raw, dtype=self.dtype))
            start, length, index = start + take, length - take, index + 1
        return np.concatenate(out).astype(np.int64) if len(out) != 1 else out[0].astype(np.int64)

    def close(self) -> None:
        with self._lock:
            for fd in self._files.values():
                os.close(fd)
            self._files.clear()

    def __del__(self) -> None:
        if hasattr(self, "_files"):
            self.close()


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
    """The data of a run: `train` (and `val`, the held-out split, or None), the tokenizer's
    `vocab_size` and end-of-document id `eod` (None for a text file: one document), `digest`.
    `tokenizer` is a prepared directory's manifest entry for its tokenizer (None: bytes)."""

    path: str | None  # as --data gave it; None: the shipped corpus
    train: Tokens
    val: Tokens | None
    vocab_size: int
    eod: int | None
    digest: str
    tokenizer: dict | None = None

    @property
    def prepared(self) -> bool:
        return self.tokenizer is not None

    def copy_tokenizer(self, directory: str | os.PathLike) -> None:
        """Copy the tokenizer's file (if it has one) into `directory`, as its manifest entry names it."""
        if self.tokenizer is not None and self.tokenizer.get("file"):
            shutil.copyfile(Path(self.path) / self.tokenizer["file"], Path(directory) / self.tokenizer["file"])

    def check_vocabulary(self, model: str, vocab_size: int) -> None:
        """Refuse to train `model` when its vocabulary does not hold every id of the data."""
        if vocab_size >= self.vocab_size:
            return
        if not self.prepared:
            raise ValueError(f"--model {model} has a vocabulary of {vocab_size} tokens, but the data are read as "
                             f"bytes (token ids 0..{BYTE_VALUES - 1}); choose a model with vocab_size >= "
                             f"{BYTE_VALUES}")
        smaller = f"bpe:{vocab_size}" if vocab_size > BYTE_VALUES else "bytes"
        raise ValueError(f"--data {self.path}: its tokenizer has {self.vocab_size} tokens, more than --model {model}'s "
                         f"vocabulary of {vocab_size}; choose a model with vocab_size >= {self.vocab_size}, or prepare "
                         f"the data with a tokenizer that fits (--tokenizer {smaller})")


def open_corpus(path: str | None) -> Corpus:
    """The corpus `path` names (None: the shipped one). ValueError naming ``--data``, in one line,
    for what is neither text nor a complete prepared directory (`DataManifest.read`; the shards'
    digests are checked by `verify_corpus`, once, before a job starts)."""
    if path is not None and Path(path).is_dir():
        if not is_prepared(path):
            raise ValueError(f"--data {path}: a directory with no manifest.json; give {TEXT} (a directory is "
                             "prepared complete or not at all: prepare it again)")
        manifest = DataManifest.read(path, "--data")
        val = manifest.split("val")
        return Corpus(path, ShardFiles(path, manifest, "train"), ShardFiles(path, manifest, "val") if val.shards else None,
                      int(manifest.tokenizer["vocab_size"]), int(manifest.tokenizer["eod"]), manifest.digest,
                      dict(manifest.tokenizer))
    ids = load_tokens(path)
    return Corpus(path, TokenArray(ids), None, BYTE_VALUES, None, digest(ids))


def vocabulary(path: str | None) -> int | None:
    """The vocabulary of the tokenizer a prepared directory `path` was tokenized with (its manifest
    alone is read); None for a text file (bytes)."""
    if path is None or not is_prepared(path):
        return None
    return int(DataManifest.read(path, "--data").tokenizer["vocab_size"])


def verify_corpus(corpus: Corpus, progress=None) -> None:
    """Read every shard of a prepared corpus and compare it with its manifest's digest."""
    if corpus.prepared:
        DataManifest.read(corpus.path, "--data").verify(corpus.path, "--data", progress)


@functools.lru_cache(maxsize=2)
def _shipped() -> np.ndarray:
    raw = importlib.resources.files("shardshift.data").joinpath(DEFAULT_CORPUS).read_bytes()
    return np.frombuffer(gzip.decompress(raw), dtype=np.uint8)


def load_tokens(path: str | None) -> np.ndarray:
    """Token ids of a UTF-8 text file (gzipped if its name ends in .gz), its bytes, or of the shipped
    corpus when `path` is None. ValueError, naming ``--data``, for anything that is not text."""
    if path is None:
        return _shipped()
    raw = read_bytes(path, "--data", TEXT)
    if path.endswith(".gz"):
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as err:
            raise ValueError(f"--data {path}: its name ends in .gz but it does not decompress as gzip ({err}); "
                             "give a whole gzip file, or plain text under another name") from None
    kind = next((name for magic, name in COMPRESSED.items() if raw.startswith(magic)), None)  # else: noise
    if kind is not None:
        raise ValueError(f"--data {path}: the file is {kind}-compressed; decompress it"
                         + (", or name it .gz" if kind == "gzip" else ""))
    decode_text(raw, path, "--data", TEXT)  # refuses what is not text
    return np.frombuffer(raw, dtype=np.uint8)


def digest(tokens: np.ndarray) -> str:
    """A digest of a token array's bytes: a text file's identity, as a checkpoint records it."""
    return hashlib.blake2b(np.ascontiguousarray(tokens).tobytes(), digest_size=16).hexdigest()
