"""Tokenizers of prepared data (``--tokenizer``): what turns a document into token ids.

Three kinds, named on the command line as `tokenizer_from_flag` reads them:

- ``bytes``: the ids are the document's UTF-8 bytes (0..255); the vocabulary is 256 and the
  end-of-document id is 0 (NUL, which no text holds).
- ``hf:PATH``: a ``tokenizer.json`` of Hugging Face's `tokenizers` (PATH is the file or the
  directory holding it, such as a model directory); the end of a document is the ``eos_token``
  of ``tokenizer_config.json`` beside it, else the first of `EOS_NAMES` in its vocabulary.
- ``bpe:N``: a byte-level BPE of at most N tokens trained on the documents themselves; id 0 is
  its end-of-document token ``<|endoftext|>``, ids 1..256 the 256 byte symbols.

A document's ids are those of its text alone: no BOS or other template tokens are added, and a
special token's name written in the text (``<|endoftext|>``) is tokenized as the text it is,
never as the special token. The end-of-document id is appended by whoever writes the stream.
`tokenizers` is imported only by the kinds that use it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from shardshift.textfile import FileError, decode_text, read_bytes, read_json

FLAG = "--tokenizer"
FILE = "tokenizer.json"  # the file a tokenizer is saved as in a prepared directory
EOD_TOKEN = "<|endoftext|>"  # the end-of-document token of a trained BPE (id 0)
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")
MIN_BPE_VOCAB = 257  # 256 byte symbols and the end-of-document token
MAX_VOCAB = 1 << 32  # ids are stored as uint32 at most
PIECE_CHARS = 1 << 16  # a trained BPE encodes (and trains on) long documents in pieces of about this many characters
SPECS = "bytes, hf:PATH (a tokenizer.json or a directory holding one) or bpe:N (N >= 257)"
HF_FILE = "a tokenizer.json of Hugging Face's tokenizers (the file, or a directory holding it)"


class Tokenizer:
    """A tokenizer of documents: `kind` ("bytes", "hf" or "bpe"), `spec` (the ``--tokenizer``
    value it came from), `vocab_size` (one more than the highest id it produces) and `eod`, the
    id that ends every document in a prepared stream."""

    kind: str

    def __init__(self, spec: str, vocab_size: int, eod: int) -> None:
        assert 0 <= eod < vocab_size <= MAX_VOCAB, (eod, vocab_size)
        self.spec, self.vocab_size, self.eod = spec, vocab_size, eod

    def encode(self, text: str) -> list[int]:
        """The ids of `text`."""
        return self.encode_arrays([text])[0].tolist()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """The ids of each of `texts`."""
        return [ids.tolist() for ids in self.encode_arrays(texts)]

    def encode_arrays(self, texts: list[str]) -> list[np.ndarray]:
        """The ids of each of `texts`, as integer arrays (any integer dtype)."""
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`."""
        raise NotImplementedError

    def save(self, directory: str | Path) -> dict:
        """Write what `load_tokenizer` needs into `directory`; the manifest entry describing it:
        ``kind``, ``vocab_size``, ``eod``, ``spec``, ``file`` and ``digest`` (None for bytes)."""
        return {"kind": self.kind, "vocab_size": self.vocab_size, "eod": self.eod, "spec": self.spec,
                "file": None, "digest": None}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r}, vocab_size={self.vocab_size}, eod={self.eod})"


class ByteTokenizer(Tokenizer):
    """``bytes``: ids are UTF-8 bytes, vocabulary 256, end of document 0 (NUL)."""

    kind = "bytes"

    def __init__(self, spec: str = "bytes") -> None:
        super().__init__(spec, vocab_size=256, eod=0)

    def encode_arrays(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Invalid UTF-8, and ids outside 0..255, decode as U+FFFD."""
        ids = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.int64)
        raw = np.where((ids >= 0) & (ids < 256), ids, 0xFF).astype(np.uint8)  # 0xFF is never UTF-8
        return raw.tobytes().decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    """``hf:PATH`` and ``bpe:N``: a `tokenizers.Tokenizer` and the JSON it was read from or
    trained into (`json_text`, what `save` writes)."""

    def __init__(self, kind: str, spec: str, backend, json_text: str, eod: int, vocab_size: int | None = None) -> None:
        self.kind = kind
        backend.encode_special_tokens = True  # a special token's name in a document is text
        self._backend, self.json_text = backend, json_text
        super().__init__(spec, vocab_size if vocab_size is not None else _vocab_size(backend), eod)

    def encode_arrays(self, texts: list[str]) -> list[np.ndarray]:
        """All of `texts` in one `encode_batch` (tokenizers encodes them on every core). A trained
        BPE cuts long texts into pieces first, so that one long document also uses every core;
        the ids are those of the whole (`cut_points`)."""
        if self.kind != "bpe":  # another tokenizer's pre-tokenizer may join across a newline: never cut
            encoded = self._backend.encode_batch_fast(texts, add_special_tokens=False)
            return [np.asarray(e.ids, dtype=np.int64) for e in encoded]
        pieces, owners = [], []
        for index, text in enumerate(texts):
            bounds = [0, *cut_points(text, PIECE_CHARS), len(text)]
            pieces += [text[a:b] for a, b in zip(bounds, bounds[1:])]
            owners += [index] * (len(bounds) - 1)
        encoded = self._backend.encode_batch_fast(pieces, add_special_tokens=False)
        parts: list[list[np.ndarray]] = [[] for _ in texts]
        for owner, encoding in zip(owners, encoded):
            parts[owner].append(np.asarray(encoding.ids, dtype=np.int64))
        return [np.concatenate(p) if len(p) != 1 else p[0] for p in parts]

    def decode(self, ids: Iterable[int]) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, directory: str | Path) -> dict:
        raw = self.json_text.encode("utf-8")
        with open(Path(directory) / FILE, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        return {**super().save(directory), "file": FILE, "digest": file_digest(raw)}


def file_digest(raw: bytes) -> str:
    """The digest a manifest records of a file's bytes: BLAKE2b of 16 bytes, in hex."""
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


def cut_points(text: str, size: int) -> list[int]:
    """Offsets, about `size` characters apart, where `text` may be cut without changing the ids
    of a byte-level BPE (`bpe:N`): just after a newline that has a non-space character on each
    side. Its pre-tokenizer (GPT-2's pattern) always ends a piece there, so the ids of the parts
    are those of the whole. A text with no such place is not cut."""
    points, start = [], size
    while start < len(text):
        at = text.find("\n", start)
        while at != -1 and not (0 < at < len(text) - 1 and not text[at - 1].isspace() and not text[at + 1].isspace()):
            at = text.find("\n", at + 1)
        if at == -1:
            break
        points.append(at + 1)
        start = at + 1 + size
    return points


def tokenizer_from_flag(spec: str, documents: Callable[[], Iterable[str]] | Iterable[str] | None = None) -> Tokenizer:
    """The tokenizer ``--tokenizer spec`` names. ``bpe:N`` trains on `documents` (a list of
    texts, or a function returning a fresh iterable of them, read once); ValueError (a
    `FileError` for a file) in one line naming ``--tokenizer`` for anything else."""
    kind, _, rest = spec.partition(":")
    if spec == "bytes":
        return ByteTokenizer(spec)
    if kind == "hf" and rest:
        return _load_hf(spec, Path(rest))
    if kind == "bpe" and rest:
        vocab = check_bpe_spec(spec)
        if documents is None:
            raise ValueError(f"{FLAG} {spec} trains on the documents; none were given")
        return train_bpe(documents() if callable(documents) else documents, vocab, spec)
    raise ValueError(f"{FLAG} {spec!r} is not a tokenizer; give {SPECS}")


def check_bpe_spec(spec: str) -> int:
    """N of ``bpe:N``; ValueError naming ``--tokenizer`` unless it is an integer in [257, 2**32]."""
    text = spec.partition(":")[2]
    try:
        vocab = int(text)
    except ValueError:
        raise ValueError(f"{FLAG} {spec}: {text!r} is not a whole number of tokens; give bpe:N with N >= "
                         f"{MIN_BPE_VOCAB}, e.g. bpe:8192") from None
    if not MIN_BPE_VOCAB <= vocab <= MAX_VOCAB:
        raise ValueError(f"{FLAG} {spec}: a byte-level BPE needs N in [{MIN_BPE_VOCAB}, 2**32] (256 byte symbols "
                         f"and {EOD_TOKEN}); give e.g. bpe:8192")
    return vocab


def train_bpe(documents: Iterable[str], vocab_size: int, spec: str | None = None) -> HFTokenizer:
    """A byte-level BPE of at most `vocab_size` tokens trained on `documents`, read once as an
    iterator. Deterministic: the same documents and size give the same tokenizer.json. Its
    vocabulary is smaller when the documents hold fewer distinct merges."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(_pieces(documents), trainer)
    eod = backend.token_to_id(EOD_TOKEN)
    assert eod == 0, eod
    return HFTokenizer("bpe", spec or f"bpe:{vocab_size}", backend, backend.to_str(), eod)


def _pieces(documents: Iterable[str]) -> Iterator[str]:
    """`documents` cut at `cut_points`: the trainer counts the same words, on every core."""
    for text in documents:
        bounds = [0, *cut_points(text, PIECE_CHARS), len(text)]
        yield from (text[a:b] for a, b in zip(bounds, bounds[1:]))


def _load_hf(spec: str, path: Path) -> HFTokenizer:
    """``hf:PATH``: the tokenizer.json at PATH (or in directory PATH) and its end of document."""
    file = path / FILE if path.is_dir() else path
    if path.is_dir() and not file.exists():
        raise FileError(FLAG, path, f"the directory holds no {FILE}", f"give {HF_FILE}")
    json_text = decode_text(read_bytes(file, FLAG, HF_FILE), file, FLAG, HF_FILE)
    backend = _parse(json_text, file)
    eod = _end_of_document(backend, file)
    return HFTokenizer("hf", spec, backend, json_text, eod)


def _parse(json_text: str, file: Path | str, flag: str = FLAG):
    from tokenizers import Tokenizer as Backend

    try:
        return Backend.from_str(json_text)
    except Exception as err:  # tokenizers raises a bare Exception for every kind of bad file
        problem = " ".join(str(err).split())[:200]
        raise FileError(flag, file, f"does not load as a tokenizer ({problem})", f"give {HF_FILE}") from None


def _end_of_document(backend, file: Path) -> int:
    """The id of the ``eos_token`` of tokenizer_config.json beside `file`, else of the first of
    `EOS_NAMES` the vocabulary holds."""
    config = file.parent / "tokenizer_config.json"
    if config.is_file():
        eos = read_json(config, FLAG, "a tokenizer_config.json (JSON)")
        eos = eos.get("eos_token") if isinstance(eos, dict) else None
        eos = eos.get("content") if isinstance(eos, dict) else eos  # older files write {"content": ...}
        if isinstance(eos, str) and eos:
            found = backend.token_to_id(eos)
            if found is None:
                raise FileError(FLAG, config, f"its eos_token {eos!r} is not in the vocabulary of {file}",
                                "name a token of that vocabulary as eos_token")
            return found
    for name in EOS_NAMES:
        if (found := backend.token_to_id(name)) is not None:
            return found
    raise FileError(FLAG, file, f"names no end-of-document token (no eos_token in {config.name} beside it, and none "
                                f"of {', '.join(EOS_NAMES)} in its vocabulary)",
                    f"write the token's name as \"eos_token\" in {config}")


def _vocab_size(backend) -> int:
    """One more than the highest id: `get_vocab_size(with_added_tokens=True)`, or more where
    added tokens leave a gap."""
    size = backend.get_vocab_size(with_added_tokens=True)
    top = max(backend.get_vocab(with_added_tokens=True).values(), default=-1)
    return max(size, top + 1)


def load_tokenizer(directory: str | Path, entry: dict, flag: str = "--data") -> Tokenizer:
    """The tokenizer of a prepared directory from its manifest entry (`DataManifest.tokenizer`);
    ValueError naming `flag` when its file is missing or not the one the manifest records."""
    kind = entry.get("kind")
    if kind == "bytes":
        return ByteTokenizer(entry.get("spec", "bytes"))
    if kind not in ("hf", "bpe"):
        raise ValueError(f"{flag} {directory}: the manifest names tokenizer kind {kind!r}; prepare the data again "
                         "with this version of shardshift")
    file = Path(directory) / entry["file"]
    raw = read_bytes(file, flag, "the tokenizer.json the data was prepared with")
    if file_digest(raw) != entry["digest"]:
        raise ValueError(f"{flag} {file}: not the tokenizer the data was prepared with (its digest differs from the "
                         "manifest's); prepare the data again")
    json_text = decode_text(raw, file, flag, "a tokenizer.json")
    return HFTokenizer(kind, entry["spec"], _parse(json_text, file, flag), json_text, int(entry["eod"]),
                       vocab_size=int(entry["vocab_size"]))

