"""Tokenizers of prepared data (`shardshift.data.tokenizer`): bytes, a Hugging Face tokenizer.json
(hf:PATH) and a byte-level BPE trained on the documents (bpe:N)."""

from __future__ import annotations

import gzip
import importlib.resources
import json

import numpy as np
import pytest

from shardshift.data.tokenizer import (
    EOD_TOKEN,
    cut_points,
    load_tokenizer,
    tokenizer_from_flag,
    train_bpe,
)
from shardshift.textfile import FileError

TEXT = "Ophelia — nymph, in thy orisons\nBe all my sins remember'd.\n\n  Soft you now!\tThe fair Ophelia!"
DOCUMENTS = [TEXT, "To be, or not to be: that is the question.", "ünïcödé 日本語 🙂 " * 3,
             "<|endoftext|> is text here"]


@pytest.fixture(scope="module")
def shakespeare() -> str:
    raw = importlib.resources.files("shardshift.data").joinpath("shakespeare.txt.gz").read_bytes()
    return gzip.decompress(raw).decode("utf-8")


def _backend(vocab: int = 300):
    """A tokenizers BPE trained on DOCUMENTS with `</s>` among its special tokens (no end-of-text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(DOCUMENTS * 4, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<pad>", "</s>", "<mine>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def test_bytes_are_utf8_with_eod_zero():
    tok = tokenizer_from_flag("bytes")
    assert (tok.kind, tok.vocab_size, tok.eod) == ("bytes", 256, 0)
    assert tok.encode("aé") == [97, 0xC3, 0xA9]
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert tok.encode_batch(DOCUMENTS) == [list(d.encode("utf-8")) for d in DOCUMENTS]
    assert tok.decode([0xC3]) == "\ufffd"  # half a character
    assert tok.decode([104, 300, 105]) == "h\ufffdi"  # an id no byte has
    assert tok.save("/nonexistent") == {"kind": "bytes", "vocab_size": 256, "eod": 0, "spec": "bytes",
                                        "file": None, "digest": None}


def test_bpe_training_is_deterministic_and_round_trips(tmp_path, shakespeare):
    one = tokenizer_from_flag("bpe:1000", [shakespeare])
    two = tokenizer_from_flag("bpe:1000", lambda: iter([shakespeare]))  # a factory of an iterator, read once
    assert one.json_text == two.json_text
    assert (one.kind, one.vocab_size, one.eod) == ("bpe", 1000, 0)
    ids = one.encode(TEXT)
    assert one.decode(ids) == TEXT
    assert max(ids) < 1000 and 0 not in ids
    assert len(one.encode(shakespeare[:20_000])) < 20_000 / 2  # merges learned: fewer ids than bytes
    entry = one.save(tmp_path)
    assert entry["file"] == "tokenizer.json" and entry["vocab_size"] == 1000 and entry["eod"] == 0
    assert json.loads((tmp_path / "tokenizer.json").read_text())["added_tokens"][0]["content"] == EOD_TOKEN
    again = load_tokenizer(tmp_path, entry)
    assert (again.kind, again.vocab_size, again.eod) == ("bpe", 1000, 0)
    assert again.encode_batch(DOCUMENTS) == one.encode_batch(DOCUMENTS)


def test_a_small_corpus_learns_fewer_tokens_than_asked():
    tok = tokenizer_from_flag("bpe:5000", ["abc abc abd"])
    assert 257 <= tok.vocab_size < 5000
    assert tok.decode(tok.encode("abd abc")) == "abd abc"


def test_a_special_token_written_in_the_text_is_text():
    tok = tokenizer_from_flag("bpe:300", DOCUMENTS)
    ids = tok.encode(EOD_TOKEN)
    assert tok.eod not in ids and len(ids) > 1
    assert tok.decode(ids) == EOD_TOKEN


def test_long_texts_are_encoded_in_pieces_with_the_ids_of_the_whole(shakespeare):
    tok = train_bpe([shakespeare], 2000)
    cuts = cut_points(shakespeare, 1 << 14)
    assert len(cuts) > 50
    assert all(shakespeare[c - 1] == "\n" and not shakespeare[c].isspace() and not shakespeare[c - 2].isspace()
               for c in cuts)
    whole = tok._backend.encode(shakespeare, add_special_tokens=False).ids
    assert np.array_equal(tok.encode_arrays([shakespeare])[0], whole)
    assert cut_points("a\n\nb\n c" * 10, 2) == []  # no newline between two non-space characters


def test_hf_directory_with_eos_in_tokenizer_config(tmp_path):
    backend = _backend()
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<mine>"}}))
    tok = tokenizer_from_flag(f"hf:{tmp_path}")
    assert (tok.kind, tok.eod, tok.vocab_size) == ("hf", backend.token_to_id("<mine>"), backend.get_vocab_size())
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert tok.encode_batch(DOCUMENTS) == [e.ids for e in backend.encode_batch(DOCUMENTS, add_special_tokens=False)]
    # Without a config the first usual name in the vocabulary ends a document.
    (tmp_path / "tokenizer_config.json").unlink()
    assert tokenizer_from_flag(f"hf:{tmp_path / 'tokenizer.json'}").eod == backend.token_to_id("</s>")


def test_hf_directory_written_by_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=_backend(), eos_token="<mine>")
    fast.save_pretrained(tmp_path)
    tok = tokenizer_from_flag(f"hf:{tmp_path}")
    assert tok.eod == fast.eos_token_id
    (tmp_path / "copy").mkdir()
    entry = tok.save(tmp_path / "copy")
    assert load_tokenizer(tmp_path / "copy", entry).encode(TEXT) == fast.encode(TEXT, add_special_tokens=False)


def test_hf_refusals(tmp_path):
    from tokenizers import Tokenizer, models

    with pytest.raises(FileError, match=r"^--tokenizer .*: the directory holds no tokenizer.json; give "):
        tokenizer_from_flag(f"hf:{tmp_path}")
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": "1.0", "model": 3}')
    with pytest.raises(FileError, match=r"^--tokenizer .*bad.json: does not load as a tokenizer \(.*\); give "):
        tokenizer_from_flag(f"hf:{bad}")
    Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[])).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(FileError, match=r"names no end-of-document token .* write the token's name as \"eos_token\""):
        tokenizer_from_flag(f"hf:{tmp_path}")
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    with pytest.raises(FileError, match=r"tokenizer_config.json: its eos_token '</s>' is not in the vocabulary"):
        tokenizer_from_flag(f"hf:{tmp_path}")


@pytest.mark.parametrize("spec, needle", [
    ("words", r"--tokenizer 'words' is not a tokenizer; give bytes, hf:PATH .* or bpe:N"),
    ("hf:", r"--tokenizer 'hf:' is not a tokenizer"),
    ("bpe:256", r"--tokenizer bpe:256: a byte-level BPE needs N in \[257, 2\*\*32\]"),
    ("bpe:lots", r"--tokenizer bpe:lots: 'lots' is not a whole number of tokens; give bpe:N with N >= 257"),
])
def test_bad_specs_are_refused(spec, needle):
    with pytest.raises(ValueError, match=needle):
        tokenizer_from_flag(spec, ["some text"])


def test_a_changed_tokenizer_file_is_refused(tmp_path):
    tok = tokenizer_from_flag("bpe:300", DOCUMENTS)
    entry = tok.save(tmp_path)
    (tmp_path / "tokenizer.json").write_text(tok.json_text.replace('"<|endoftext|>"', '"<|end|>"'))
    with pytest.raises(ValueError, match=r"^--data .*tokenizer.json: not the tokenizer the data was prepared with"):
        load_tokenizer(tmp_path, entry)
