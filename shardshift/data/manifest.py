"""A prepared data directory: token shards and the manifest.json that describes them (docs/data.md).

    DIR/manifest.json          format, tokenizer, dtype, splits and their shards, inputs, digest
    DIR/tokenizer.json         the tokenizer (hf: and bpe: only)
    DIR/train-00000.tokens     raw little-endian ids of `dtype`, consecutive pieces of one stream
    DIR/val-00000.tokens       ... of the held-out documents (none when no val split)

Each split is one stream, every document followed by the end-of-document id (``d1 EOD d2 EOD
... dn EOD``), cut into shards of a fixed number of tokens (the last shorter). `DataManifest.read`
checks what is cheap (the manifest itself, every shard's size); `DataManifest.verify` reads every
shard and compares its digest. The manifest's `digest` is the data's identity: the BLAKE2b
(16 bytes) of the canonical JSON of what the ids are (`identity`), not of where they came from.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardshift.textfile import FileError, read_json

FORMAT = "shardshift-tokens/1"
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
DTYPES = ("uint8", "uint16", "uint32")
PARTIAL = re.compile(r"\.partial-\d+$")  # a directory `shardshift data prepare` is still writing (or was killed in)
WANTED = "a directory written by `shardshift data prepare` (docs/data.md)"
_CHUNK = 8 << 20  # bytes read at a time when verifying


def dtype_for(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer type holding ids 0 .. vocab_size - 1."""
    return np.dtype(np.uint8 if vocab_size <= 1 << 8 else np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def shard_name(split: str, index: int) -> str:
    """``train-00000.tokens``: the file of shard `index` of `split`."""
    return f"{split}-{index:05d}.tokens"


def identity(tokenizer: dict, dtype: str, splits: dict) -> str:
    """The digest of the data: BLAKE2b (16 bytes, hex) of ``json.dumps({"tokenizer", "dtype",
    "splits"}, sort_keys=True, separators=(",", ":"))``, the tokenizer entry without its
    ``spec`` (the same tokenizer named by another path is the same data)."""
    entry = {key: value for key, value in tokenizer.items() if key != "spec"}
    text = json.dumps({"tokenizer": entry, "dtype": dtype, "splits": splits}, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()


@dataclass(frozen=True)
class Shard:
    """One file of a split: its name in the directory, its tokens, the BLAKE2b digest of its bytes."""

    file: str
    tokens: int
    digest: str


@dataclass(frozen=True)
class DataSplit:
    """A split's stream: `tokens` in all (end-of-document ids included), `documents`, its shards in order."""

    tokens: int
    documents: int
    shards: tuple[Shard, ...]

    def as_json(self) -> dict:
        return {"tokens": self.tokens, "documents": self.documents,
                "shards": [{"file": s.file, "tokens": s.tokens, "digest": s.digest} for s in self.shards]}


@dataclass(frozen=True)
class DataManifest:
    """What manifest.json says. `tokenizer` is its entry (`shardshift.data.tokenizer.load_tokenizer`
    builds the tokenizer from it); `dtype` the numpy dtype of the ids; `splits` the ``train`` and
    ``val`` streams; `inputs` the files read (``path``, ``bytes``); `digest` the data's identity."""

    tokenizer: dict
    dtype: np.dtype
    splits: dict[str, DataSplit]
    inputs: tuple[dict, ...]
    field: str | None
    val_fraction: float
    digest: str

    def split(self, name: str) -> DataSplit:
        """The split called `name` (``train`` or ``val``)."""
        if name not in self.splits:
            raise ValueError(f"no split {name!r}; a prepared directory has {', '.join(self.splits)}")
        return self.splits[name]

    def as_json(self) -> dict:
        return {"format": FORMAT, "tokenizer": self.tokenizer, "dtype": self.dtype.name,
                "splits": {name: split.as_json() for name, split in self.splits.items()},
                "inputs": list(self.inputs), "field": self.field, "val_fraction": self.val_fraction,
                "digest": self.digest}

    @classmethod
    def build(cls, tokenizer: dict, dtype: np.dtype, splits: dict[str, DataSplit], inputs: list[dict],
              field: str | None, val_fraction: float) -> DataManifest:
        """A manifest with its `digest` computed from the rest."""
        digest = identity(tokenizer, np.dtype(dtype).name, {n: s.as_json() for n, s in splits.items()})
        return cls(dict(tokenizer), np.dtype(dtype), dict(splits), tuple(inputs), field, val_fraction, digest)

    def write(self, directory: str | Path) -> None:
        """Write manifest.json into `directory`, synced to disk."""
        with open(Path(directory) / MANIFEST, "w") as f:
            json.dump(self.as_json(), f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())

    @classmethod
    def read(cls, directory: str | Path, flag: str = "--data") -> DataManifest:
        """The manifest of prepared directory `directory`, checked: its format and digest, and
        every shard present with the size its tokens give. ValueError in one line naming `flag`
        and the file otherwise."""
        directory = Path(directory)
        path = directory / MANIFEST
        if PARTIAL.search(directory.name):
            raise ValueError(f"{flag} {directory}: an unfinished `shardshift data prepare` (stopped before it "
                             f"completed); prepare the data again")
        if not directory.is_dir():
            raise FileError(flag, directory, "no such directory" if not directory.exists() else "not a directory",
                            f"give {WANTED}")
        if not path.exists():
            raise FileError(flag, directory, f"holds no {MANIFEST}", f"give {WANTED}")
        raw = read_json(path, flag, f"the {MANIFEST} of {WANTED}")
        try:
            manifest = cls._parse(raw)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            problem = f"has no {err}" if isinstance(err, KeyError) else str(err)
            raise FileError(flag, path, f"not a valid manifest ({problem})", "prepare the data again") from None
        if manifest.digest != identity(manifest.tokenizer, manifest.dtype.name,
                                       {n: s.as_json() for n, s in manifest.splits.items()}):
            raise FileError(flag, path, "its digest is not that of its content (it was edited)",
                            "prepare the data again")
        for split in manifest.splits.values():
            for shard in split.shards:
                file = directory / shard.file
                expected = shard.tokens * manifest.dtype.itemsize
                size = file.stat().st_size if file.is_file() else None
                if size != expected:
                    found = "is missing" if size is None else f"has {size} bytes"
                    raise FileError(flag, file, f"incomplete: the shard {found}, the manifest says {expected} "
                                                f"({shard.tokens} tokens of {manifest.dtype.name})",
                                    "prepare the data again")
        return manifest

    @classmethod
    def _parse(cls, raw) -> DataManifest:
        """A manifest from parsed JSON; KeyError, TypeError or ValueError saying what is wrong."""
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        if raw.get("format") != FORMAT:
            raise ValueError(f"format {raw.get('format')!r}, not {FORMAT!r}")
        if raw["dtype"] not in DTYPES:
            raise ValueError(f"dtype {raw['dtype']!r} is not one of {', '.join(DTYPES)}")
        splits = {}
        for name in SPLITS:
            entry = raw["splits"][name]
            shards = tuple(Shard(str(s["file"]), int(s["tokens"]), str(s["digest"])) for s in entry["shards"])
            if any(Path(s.file).name != s.file or not s.file.endswith(".tokens") for s in shards):
                raise ValueError(f"a {name} shard is not a .tokens file in the directory")
            if sum(s.tokens for s in shards) != int(entry["tokens"]):
                raise ValueError(f"the {name} shards do not add up to its {entry['tokens']} tokens")
            splits[name] = DataSplit(int(entry["tokens"]), int(entry["documents"]), shards)
        tokenizer = raw["tokenizer"]
        if not isinstance(tokenizer, dict):
            raise ValueError("its tokenizer is not a JSON object")
        missing = [key for key in ("kind", "vocab_size", "eod", "file", "digest") if key not in tokenizer]
        if missing:
            raise KeyError(f"tokenizer.{missing[0]}")
        return cls(tokenizer, np.dtype(raw["dtype"]), splits, tuple(raw.get("inputs", ())), raw.get("field"),
                   float(raw.get("val_fraction", 0.0)), str(raw["digest"]))

    def verify(self, directory: str | Path, flag: str = "--data",
               progress: Callable[[int, int], None] | None = None) -> None:
        """Read every shard in `directory` and compare its digest with the manifest's; ValueError
        naming `flag` and the first shard (in manifest order) that differs. Shards are hashed on
        several threads (hashlib releases the GIL on large buffers), each read in chunks.
        `progress(done, total)` is called with the bytes hashed so far."""
        shards = [shard for split in self.splits.values() for shard in split.shards]
        total = sum(shard.tokens for shard in shards) * self.dtype.itemsize
        done, lock = [0], threading.Lock()

        def count(nbytes: int) -> None:
            if progress is not None:
                with lock:
                    done[0] += nbytes
                    progress(done[0], total)

        with ThreadPoolExecutor(max_workers=max(1, min(len(shards), os.cpu_count() or 1))) as pool:
            digests = list(pool.map(lambda shard: hash_file(Path(directory) / shard.file, count), shards))
        for shard, digest in zip(shards, digests):
            if digest != shard.digest:
                raise FileError(flag, Path(directory) / shard.file,
                                "its digest differs from the manifest's: the shard was changed after it was written",
                                "prepare the data again")


def hash_file(path: Path, count: Callable[[int], None] | None = None) -> str:
    """The BLAKE2b (16 bytes, hex) of the file at `path`, read in chunks."""
    digest = hashlib.blake2b(digest_size=16)
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while nbytes := f.readinto(buffer):
            digest.update(view[:nbytes])
            if count is not None:
                count(nbytes)
    return digest.hexdigest()


def is_prepared(path: str | os.PathLike) -> bool:
    """Whether `path` is a prepared directory (one holding manifest.json, not one still being written)."""
    path = Path(path)
    return path.is_dir() and (path / MANIFEST).is_file() and not PARTIAL.search(path.name)
