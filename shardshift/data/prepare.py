"""`shardshift data prepare`: documents read from text and JSON lines files, tokenized, written as
the token shards of a prepared directory (`shardshift.data.manifest`, docs/data.md).

The inputs are read as a stream (a text file is one document, read whole; a JSON lines file one
document per line, read line by line). Documents are tokenized in batches, on a thread of their
own while the next batch is read (tokenizers' batch encoding runs on every core), and every
document is followed by the end-of-document id in its split's stream. Everything is written into
``DIR.partial-PID`` beside ``--out DIR`` and renamed to DIR once complete and synced; a failure
or an interrupt removes it, and a later run removes the partial directories of dead processes.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import hashlib
import json
import os
import shutil
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from functools import lru_cache
from pathlib import Path

import numpy as np

from shardshift.console import ProgressLine
from shardshift.data.manifest import DataManifest, DataSplit, Shard, dtype_for, shard_name
from shardshift.data.tokenizer import Tokenizer, check_bpe_spec, tokenizer_from_flag
from shardshift.files import fsync_path, pid_alive
from shardshift.textfile import FileError, decode_text, read_bytes

FLAG = "--input"
TEXT = "a UTF-8 text file"
LINES = "a JSON lines file (one JSON object per line)"
SUFFIXES = (".txt", ".gz", ".jsonl", ".json")  # the files a folder's documents are read from
DEFAULT_SHARD_TOKENS = 1 << 28
_JSON = json.JSONDecoder()
BATCH_CHARS = 1 << 22  # documents are tokenized in batches of about this many characters
# Leading bytes of compressed formats, which would otherwise be read as (undecodable) text.
COMPRESSED = {b"\x1f\x8b": "gzip", b"PK\x03\x04": "zip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz",
              b"\x28\xb5\x2f\xfd": "zstd"}


@dataclasses.dataclass(frozen=True)
class InputFile:
    """An input file: JSON lines (`lines`, one document per line) or text (one document), gzipped
    or not, of `size` bytes on disk."""

    path: Path
    lines: bool
    gzipped: bool
    size: int


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What a prepare wrote: the directory, its manifest, and what it took."""

    out: Path
    manifest: DataManifest
    seconds: float
    input_bytes: int

    def summary(self) -> str:
        """The one line printed at the end."""
        train, val = self.manifest.split("train"), self.manifest.split("val")
        rate = self.input_bytes / 1e6 / max(self.seconds, 1e-9)
        return (f"prepared {_count(train.documents + val.documents, 'document')}: {train.tokens:,} train tokens "
                f"({_count(train.documents, 'document')}), {val.tokens:,} val tokens "
                f"({_count(val.documents, 'document')}), {_count(len(train.shards) + len(val.shards), 'shard')} of "
                f"{self.manifest.dtype.name} in {self.out}; {self.seconds:.1f} s, {rate:.1f} MB/s of input files")


def _count(number: int, noun: str) -> str:
    return f"{number:,} {noun}{'s' * (number != 1)}"


def prepare(inputs: Sequence[str], tokenizer: str, out: str | os.PathLike, *, field: str = "text",
            val_fraction: float = 0.0, shard_tokens: int = DEFAULT_SHARD_TOKENS,
            progress: bool | None = None) -> Prepared:
    """Tokenize the documents of `inputs` with ``--tokenizer`` `tokenizer` into the new directory
    `out` (docs/data.md). Bad input is refused with a ValueError (a `FileError` for a file) in one
    line naming the flag, before anything is written, or, for a fault found while reading (a bad
    JSON line), once what was written is removed. `progress`: a progress line on stderr (default:
    when stderr is a terminal)."""
    start = time.monotonic()
    if not 0 <= val_fraction < 1:
        raise ValueError(f"--val-fraction {val_fraction} is outside [0, 1); give e.g. 0.01 to hold out one "
                         "document in a hundred, or 0 for no val split")
    if shard_tokens < 1:
        raise ValueError(f"--shard-tokens {shard_tokens} must be at least 1; give e.g. 256M")
    out = Path(out)
    if out.exists() or out.is_symlink():
        raise ValueError(f"--out {out} exists; choose a new directory")
    trained = tokenizer.startswith("bpe:")
    model = None if trained else tokenizer_from_flag(tokenizer)
    if trained:
        check_bpe_spec(tokenizer)  # before reading the inputs
    sources = find_inputs(inputs)
    meter = ProgressLine(sum(s.size for s in sources), progress)
    try:
        if trained:
            meter.phase(f"training {tokenizer}")
            model = _train(tokenizer, lambda: read_documents(sources, field, meter.advance))
        partial = _claim(out)
        try:
            manifest = _write(partial, sources, model, field, val_fraction, shard_tokens, meter)
            if out.exists() or out.is_symlink():  # rename would replace an empty directory
                raise ValueError(f"--out {out} appeared while the data was prepared; choose a new directory")
            os.rename(partial, out)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    finally:
        meter.close()
    fsync_path(out.parent)
    return Prepared(out, manifest, time.monotonic() - start, sum(s.size for s in sources))


def _train(spec: str, documents: Callable[[], Iterator[str]]) -> Tokenizer:
    """``bpe:N`` trained on `documents` on a thread of its own. The trainer reads the documents on
    its own threads, where no signal handler runs, so the main thread waits for it instead: a stop
    signal reaches it at once, and the next document read then ends the training."""
    stop, outcome = threading.Event(), {}

    def stoppable() -> Iterator[str]:
        for document in documents():
            if stop.is_set():
                raise KeyboardInterrupt
            yield document

    def work() -> None:
        try:
            outcome["tokenizer"] = tokenizer_from_flag(spec, stoppable)
        except BaseException as err:  # handed to the main thread
            outcome["error"] = err

    thread = threading.Thread(target=work, name="train-bpe", daemon=True)
    thread.start()
    try:
        thread.join()
    except BaseException:
        stop.set()
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["tokenizer"]


def _write(partial: Path, sources: list[InputFile], model: Tokenizer, field: str, val_fraction: float,
           shard_tokens: int, meter: ProgressLine) -> DataManifest:
    """Tokenize every document into `partial`'s shards; write the tokenizer and, last, the manifest."""
    dtype = dtype_for(model.vocab_size).newbyteorder("<")
    writers = {name: _ShardWriter(partial, name, shard_tokens, dtype) for name in ("train", "val")}
    meter.phase("tokenizing")
    index = 0
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode") as pool:
        pending = None
        for batch in batches(read_documents(sources, field, meter.advance)):
            encoded = pool.submit(_encode, model, batch, dtype)
            if pending is not None:
                index = _append(writers, *pending.result(), index, val_fraction)
            pending = encoded
        if pending is not None:
            index = _append(writers, *pending.result(), index, val_fraction)
    splits = {name: writer.finish() for name, writer in writers.items()}
    if val_fraction > 0 and splits["val"].documents == 0:
        raise ValueError(f"--val-fraction {val_fraction} holds out no document of the {index}: a split holds out "
                         f"floor(documents x fraction); give at least {_at_least(val_fraction)} documents or a "
                         f"larger --val-fraction")
    entry = model.save(partial)
    inputs = [{"path": str(s.path), "bytes": s.size} for s in sources]
    manifest = DataManifest.build(entry, dtype, splits, inputs, field if any(s.lines for s in sources) else None,
                              val_fraction)
    manifest.write(partial)
    fsync_path(partial)
    return manifest


def _encode(model: Tokenizer, documents: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The stream of `documents`, each followed by the end-of-document id, and each document's
    length in it (its end-of-document id included)."""
    arrays = model.encode_arrays(documents)
    lengths = np.fromiter((len(a) + 1 for a in arrays), dtype=np.int64, count=len(arrays))
    ids = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
    assert ids.size == 0 or (ids.min() >= 0 and ids.max() < model.vocab_size), "an id outside the vocabulary"
    stream = np.empty(ids.size + len(arrays), dtype=dtype)
    ends = np.cumsum(lengths) - 1
    text = np.ones(stream.size, dtype=bool)
    text[ends] = False
    stream[text] = ids
    stream[ends] = model.eod
    return stream, lengths


def _append(writers: dict[str, _ShardWriter], stream: np.ndarray, lengths: np.ndarray, index: int,
            val_fraction: float) -> int:
    """Write documents `index`, `index + 1`, ... (`stream`, of documents of `lengths`) to their
    splits; the index of the next document."""
    val = held_out_mask(index, len(lengths), val_fraction)
    if not val.any():
        writers["train"].write(stream, len(lengths))
    else:
        in_val = np.repeat(val, lengths)
        writers["train"].write(stream[~in_val], int((~val).sum()))
        writers["val"].write(stream[in_val], int(val.sum()))
    return index + len(lengths)


@lru_cache(maxsize=None)
def _ratio(fraction: float) -> tuple[int, int]:
    """`fraction` as the exact ratio of the decimal it is written as (0.1 → 1/10)."""
    exact = Fraction(repr(fraction))
    return exact.numerator, exact.denominator


def held_out(index: int, fraction: float) -> bool:
    """Whether document `index` (0-based over all documents) goes to the val split: iff
    ``floor((index + 1) * fraction) > floor(index * fraction)``, in exact arithmetic on the decimal
    `fraction` is written as. So the val documents are evenly spaced (0.1: documents 9, 19, 29,
    ...), the first N documents hold out floor(N * fraction) of them, and document 0 is never one."""
    p, q = _ratio(fraction)
    return (index + 1) * p // q > index * p // q


def held_out_mask(start: int, count: int, fraction: float) -> np.ndarray:
    """`held_out` of documents `start` .. `start + count - 1`, as a boolean array."""
    p, q = _ratio(fraction)
    if p == 0:
        return np.zeros(count, dtype=bool)
    if (start + count + 1) * p < 1 << 62:  # int64 holds every product
        index = np.arange(start, start + count, dtype=np.int64)
        return (index + 1) * p // q > index * p // q
    return np.fromiter((held_out(i, fraction) for i in range(start, start + count)), dtype=bool, count=count)


def _at_least(fraction: float) -> int:
    """The fewest documents of which `fraction` holds out one."""
    p, q = _ratio(fraction)
    return -(-q // p)


class _ShardWriter:
    """One split's stream, written as consecutive shards of `shard_tokens` ids, each hashed as it
    is written and synced when complete."""

    def __init__(self, directory: Path, split: str, shard_tokens: int, dtype: np.dtype) -> None:
        self.directory, self.split, self.shard_tokens, self.dtype = directory, split, shard_tokens, dtype
        self.shards: list[Shard] = []
        self.documents = 0
        self._file = None
        self._hash = None
        self._count = 0

    def write(self, tokens: np.ndarray, documents: int) -> None:
        assert tokens.dtype == self.dtype
        self.documents += documents
        offset = 0
        while offset < len(tokens):
            if self._file is None:
                self._file = open(self.directory / shard_name(self.split, len(self.shards)), "wb")
                self._hash, self._count = hashlib.blake2b(digest_size=16), 0
            take = min(len(tokens) - offset, self.shard_tokens - self._count)
            view = memoryview(tokens[offset:offset + take]).cast("B")
            self._file.write(view)
            self._hash.update(view)
            self._count += take
            offset += take
            if self._count == self.shard_tokens:
                self._close()

    def _close(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        name = shard_name(self.split, len(self.shards))
        self.shards.append(Shard(name, self._count, self._hash.hexdigest()))
        self._file = None

    def finish(self) -> DataSplit:
        if self._file is not None:
            self._close()
        return DataSplit(sum(s.tokens for s in self.shards), self.documents, tuple(self.shards))


def find_inputs(paths: Sequence[str]) -> list[InputFile]:
    """The files `paths` name, in order: a file as it is, a folder's files with `SUFFIXES`
    (recursively, hidden ones left out) and a glob's matches, each sorted by path. `FileError`
    naming ``--input`` for a path that does not exist, matches nothing or is an empty file."""
    if not paths:
        raise ValueError(f"{FLAG} names no file; give text or JSON lines files, folders or globs")
    found: list[Path] = []
    for text in paths:
        path = Path(text)
        if path.exists():
            found += _folder(path) if path.is_dir() else [path]
        elif glob.has_magic(text):
            matches = sorted(glob.glob(text, recursive=True))
            if not matches:
                raise ValueError(f"{FLAG} {text!r} matches nothing; give an existing file, folder or glob")
            for match in map(Path, matches):
                found += _folder(match) if match.is_dir() else [match]
        else:
            raise FileError(FLAG, text, "no such file or directory",
                            "give a text or JSON lines file, a folder or a glob")
    sources = []
    for path in found:
        try:
            size = path.stat().st_size
        except OSError as err:
            raise FileError(FLAG, path, f"cannot be read ({err.strerror or err})", "check its permissions") from None
        if size == 0:
            raise FileError(FLAG, path, "the file is empty", "give a file that holds documents, or leave it out")
        name = path.name.lower()
        gzipped = name.endswith(".gz")
        sources.append(InputFile(path, name.removesuffix(".gz").endswith((".jsonl", ".json")), gzipped, size))
    return sources


def _folder(folder: Path) -> list[Path]:
    """The files under `folder` named with `SUFFIXES`, not hidden, sorted by path."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name.lower().endswith(SUFFIXES)
                   and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    if not files:
        raise FileError(FLAG, folder, f"the folder holds no {', '.join(SUFFIXES)} file",
                        "give a folder of text or JSON lines files")
    return files


def read_documents(sources: Sequence[InputFile], field: str,
                   advance: Callable[[int], None] | None = None) -> Iterator[str]:
    """The documents of `sources` in order; `advance(nbytes)` is told the bytes of input read.
    `FileError` naming ``--input``, the file (and the line) for what is not a document."""
    for source in sources:
        if source.lines:
            yield from _json_lines(source, field, advance)
        else:
            yield _text(source)
            if advance is not None:
                advance(source.size)


def _text(source: InputFile) -> str:
    """A text file's one document."""
    raw = read_bytes(source.path, FLAG, TEXT)
    if source.gzipped:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as err:
            raise FileError(FLAG, source.path, f"its name ends in .gz but it does not decompress as gzip ({err})",
                            "give a whole gzip file, or plain text under another name") from None
    else:
        _refuse_compressed(raw[:8], source.path)
    return decode_text(raw, source.path, FLAG, TEXT)


def _refuse_compressed(head: bytes, path: Path) -> None:
    kind = next((name for magic, name in COMPRESSED.items() if head.startswith(magic)), None)
    if kind is not None:
        raise FileError(FLAG, path, f"the file is {kind}-compressed",
                        "decompress it" + (", or name it .gz" if kind == "gzip" else ""))


def _json_lines(source: InputFile, field: str, advance: Callable[[int], None] | None) -> Iterator[str]:
    """The `field` of each line of a JSON lines file, read line by line (blank lines skipped)."""
    documents, told, number = 0, 0, 0
    try:
        raw = open(source.path, "rb")
    except OSError as err:
        raise FileError(FLAG, source.path, f"cannot be read ({err.strerror or err})", "check its permissions") from None
    with raw:
        if not source.gzipped:
            _refuse_compressed(raw.peek(8)[:8], source.path)
        stream = gzip.GzipFile(fileobj=raw, mode="rb") if source.gzipped else raw
        try:
            for number, line in enumerate(stream, 1):
                if stripped := line.strip():
                    yield _document(stripped, number, source.path, field, len(line) - len(line.lstrip()))
                    documents += 1
                if advance is not None and number % 256 == 0:
                    now = raw.tell()
                    advance(now - told)
                    told = now
        except (OSError, EOFError, zlib.error) as err:
            if not source.gzipped:
                raise
            raise FileError(FLAG, source.path, f"does not decompress as gzip after line {number} ({err})",
                            "give a whole gzip file, or plain JSON lines under another name") from None
    if advance is not None:
        advance(source.size - told)
    if documents == 0:
        raise FileError(FLAG, source.path, "holds no JSON line, only blank ones", f"give {LINES}, or leave it out")


def _document(line: bytes, number: int, path: Path, field: str, indent: int = 0) -> str:
    """The text of `field` of JSON line `number` (stripped of `indent` leading and any trailing
    white space); `FileError` naming the file and the line."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        raise FileError(FLAG, path, f"line {number} is not UTF-8 text (byte {err.start} of the line is "
                                    f"{line[err.start]:#04x})", f"give {LINES} in UTF-8") from None
    try:
        record, end = _JSON.raw_decode(text)  # json.loads less its checks and white space skipping: 3x faster
        if end != len(text):  # the line is stripped: what follows is more than white space
            raise json.JSONDecodeError("Extra data", text, len(text) - len(text[end:].lstrip()))
    except json.JSONDecodeError as err:
        raise FileError(FLAG, path, f"line {number} is not JSON ({err.msg} at column {err.colno + indent})",
                        f"give {LINES}") from None
    if not isinstance(record, dict):
        raise FileError(FLAG, path, f"line {number} is a JSON {_json_type(record)}, not an object", f"give {LINES}")
    if field not in record:
        fields = ", ".join(sorted(record)[:8]) or "none"
        raise FileError(FLAG, path, f"line {number} has no field {field!r} (its fields: {fields})",
                        "name the field that holds the text with --field NAME")
    document = record[field]
    if not isinstance(document, str):
        raise FileError(FLAG, path, f"line {number}: field {field!r} is a JSON {_json_type(document)}, not a string",
                        "name the field that holds the text with --field NAME")
    if "\\u" in text:  # only an escape can put NUL or a lone surrogate into a JSON string
        if "\x00" in document:
            raise FileError(FLAG, path, f"line {number}: field {field!r} holds a NUL character (\\u0000), which text "
                                        "does not", "remove it")
        try:
            document.encode("utf-8")
        except UnicodeEncodeError:
            raise FileError(FLAG, path, f"line {number}: field {field!r} holds an unpaired surrogate escape "
                                        "(\\ud800-\\udfff), which is not text", "remove it") from None
    return document


def _json_type(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def batches(documents: Iterator[str]) -> Iterator[list[str]]:
    """`documents` in lists of about `BATCH_CHARS` characters (a longer document alone): what
    `prepare` tokenizes at once."""
    batch, chars = [], 0
    for document in documents:
        batch.append(document)
        chars += len(document)
        if chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _claim(out: Path) -> Path:
    """A new ``OUT.partial-PID`` beside `out`, after removing those of processes that are gone."""
    parent = out.parent
    parent.mkdir(parents=True, exist_ok=True)
    prefix = f"{out.name}.partial-"
    for name in os.listdir(parent):
        pid = name[len(prefix):]
        if name.startswith(prefix) and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(parent / name, ignore_errors=True)
    partial = parent / f"{prefix}{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)  # left by an earlier process of this pid
    partial.mkdir()
    return partial


