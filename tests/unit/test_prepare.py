"""`shardshift data prepare` in the test process: what it reads, the directory it writes, the
manifest's checks, and every refusal (`shardshift.data.prepare`, `shardshift.data.manifest`)."""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from shardshift.cli.main import main
from shardshift.data.manifest import DataManifest, is_prepared
from shardshift.data.prepare import held_out, prepare
from shardshift.data.tokenizer import load_tokenizer

DOCS = [f"document {i}: " + "word " * (i % 7) + "é\n" for i in range(20)]


def _stream(directory, split: str) -> np.ndarray:
    """The split's stream: its shards read back in order."""
    manifest = DataManifest.read(directory)
    parts = [np.fromfile(directory / s.file, dtype=manifest.dtype) for s in manifest.split(split).shards]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=manifest.dtype)


def _documents(directory, split: str) -> list[str]:
    """A bytes split's documents: its stream cut at every end-of-document id (the stream ends in one)."""
    raw = _stream(directory, split).tobytes()
    assert raw == b"" or raw.endswith(b"\x00")
    return [piece.decode("utf-8") for piece in raw.split(b"\x00")[:-1]]


def _jsonl(path, texts, field="text", **extra):
    path.write_text("".join(json.dumps({field: t, **extra}) + "\n" for t in texts))
    return path


def _nothing_written(tmp_path, out="out") -> bool:
    return not [p for p in tmp_path.iterdir() if p.name.startswith(out)]


def test_text_gzip_json_lines_folders_and_globs_in_order(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text(DOCS[0])
    (tmp_path / "b.gz").write_bytes(gzip.compress(DOCS[1].encode()))
    _jsonl(tmp_path / "c.jsonl", DOCS[2:5], field="body", id=3)
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(("\n" + json.dumps({"body": DOCS[5]}) + "\n\n").encode()))
    folder = tmp_path / "folder" / "sub"
    folder.mkdir(parents=True)
    (folder / "z.txt").write_text(DOCS[6])  # sorted by path: folder/sub/z.txt before folder/y.json
    (folder.parent / "y.json").write_text(json.dumps({"body": DOCS[7]}) + "\n")  # JSON lines under .json
    (folder / "skip.csv").write_text("not read")
    (folder / ".hidden.txt").write_text("not read")
    for i in (9, 8):
        (tmp_path / f"g{i}.txt").write_text(DOCS[i])
    inputs = ["a.txt", "b.gz", "c.jsonl", "d.jsonl.gz", "folder", "g*.txt"]
    monkeypatch.chdir(tmp_path)
    result = prepare(inputs, "bytes", tmp_path / "out", field="body")
    assert _documents(tmp_path / "out", "train") == DOCS[:10]  # g*.txt sorted: g8 before g9
    manifest = DataManifest.read(tmp_path / "out")
    assert manifest.digest == result.manifest.digest
    train = manifest.split("train")
    assert (train.documents, train.tokens) == (10, sum(len(d.encode()) + 1 for d in DOCS[:10]))
    assert manifest.split("val").tokens == 0 and manifest.split("val").shards == ()
    assert manifest.dtype == np.uint8 and manifest.field == "body" and manifest.val_fraction == 0
    assert manifest.tokenizer == {"kind": "bytes", "vocab_size": 256, "eod": 0, "spec": "bytes", "file": None,
                                  "digest": None}
    assert [i["path"] for i in manifest.inputs] == [*inputs[:4], "folder/sub/z.txt", "folder/y.json", "g8.txt",
                                                    "g9.txt"]
    assert manifest.inputs[0] == {"path": "a.txt", "bytes": len(DOCS[0].encode())}
    assert is_prepared(tmp_path / "out") and not is_prepared(tmp_path)
    manifest.verify(tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["manifest.json", "train-00000.tokens"]


def test_shards_cut_one_stream_with_an_end_after_every_document(tmp_path):
    _jsonl(tmp_path / "docs.jsonl", DOCS)
    prepare([str(tmp_path / "docs.jsonl")], "bytes", tmp_path / "out", shard_tokens=37)
    manifest = DataManifest.read(tmp_path / "out")
    shards = manifest.split("train").shards
    assert [s.file for s in shards] == [f"train-{i:05d}.tokens" for i in range(len(shards))]
    assert all(s.tokens == 37 for s in shards[:-1]) and 1 <= shards[-1].tokens <= 37
    stream = _stream(tmp_path / "out", "train")
    assert stream.tobytes() == b"".join(d.encode() + b"\x00" for d in DOCS)
    assert manifest.field == "text" and manifest.split("train").documents == 20
    assert DataManifest.read(tmp_path / "out").digest == manifest.digest


def test_the_val_split_holds_out_evenly_spaced_documents(tmp_path):
    assert [i for i in range(40) if held_out(i, 0.1)] == [9, 19, 29, 39]
    assert [i for i in range(10) if held_out(i, 0.25)] == [3, 7]
    assert sum(held_out(i, 0.29) for i in range(100)) == 29  # exact: floor(100 x 0.29), not 28
    assert not any(held_out(0, f) for f in (0.0, 0.5, 0.999))
    _jsonl(tmp_path / "docs.jsonl", DOCS)
    prepare([str(tmp_path / "docs.jsonl")], "bytes", tmp_path / "out", val_fraction=0.1, shard_tokens=16)
    assert _documents(tmp_path / "out", "val") == [DOCS[9], DOCS[19]]
    assert _documents(tmp_path / "out", "train") == [d for i, d in enumerate(DOCS) if i not in (9, 19)]
    manifest = DataManifest.read(tmp_path / "out")
    assert manifest.split("val").documents == 2 and manifest.split("train").documents == 18
    assert manifest.split("val").shards[0].file == "val-00000.tokens" and manifest.val_fraction == 0.1
    manifest.verify(tmp_path / "out")


def test_too_few_documents_for_the_val_fraction_are_refused(tmp_path, capsys):
    _jsonl(tmp_path / "docs.jsonl", DOCS[:5])
    assert main(["data", "prepare", "--input", str(tmp_path / "docs.jsonl"), "--tokenizer", "bytes",
                 "--out", str(tmp_path / "out"), "--val-fraction", "0.1"]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"shardshift: error: --val-fraction 0.1 holds out no document of the 5: .*give at least 10 "
                        r"documents or a larger --val-fraction\n", err), err
    assert _nothing_written(tmp_path)


def test_a_trained_bpe_stream_decodes_to_the_documents(tmp_path):
    _jsonl(tmp_path / "docs.jsonl", DOCS)
    prepare([str(tmp_path / "docs.jsonl")], "bpe:300", tmp_path / "out")
    manifest = DataManifest.read(tmp_path / "out")
    assert manifest.dtype == np.uint16 and manifest.tokenizer["kind"] == "bpe"
    assert manifest.tokenizer["eod"] == 0 and manifest.tokenizer["file"] == "tokenizer.json"
    tok = load_tokenizer(tmp_path / "out", manifest.tokenizer)
    stream = _stream(tmp_path / "out", "train")
    ends = np.flatnonzero(stream == 0)
    assert len(ends) == 20 and ends[-1] == len(stream) - 1
    documents = [tok.decode(piece) for piece in np.split(stream, ends + 1)[:-1]]
    assert [d.removesuffix(tok.decode([0])) for d in documents] == DOCS
    assert manifest.split("train").tokens == len(stream) < sum(len(d.encode()) + 1 for d in DOCS)


def test_a_vocabulary_over_65536_ids_is_stored_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("w0 w69999 w65536 nothing")
    prepare([str(tmp_path / "a.txt")], f"hf:{tmp_path}", tmp_path / "out")
    manifest = DataManifest.read(tmp_path / "out")
    assert manifest.dtype == np.uint32 and manifest.tokenizer["vocab_size"] == 70_002
    assert _stream(tmp_path / "out", "train").tolist() == [2, 70_001, 65_538, 0, 1]


def test_read_and_verify_refuse_a_damaged_directory(tmp_path):
    _jsonl(tmp_path / "docs.jsonl", DOCS)
    out = tmp_path / "out"
    prepare([str(tmp_path / "docs.jsonl")], "bytes", out, shard_tokens=50)
    manifest = DataManifest.read(out)
    told = []
    manifest.verify(out, progress=lambda done, total: told.append((done, total)))
    assert len(told) == len(manifest.split("train").shards) and told[-1] == (manifest.split("train").tokens,) * 2
    shard = out / "train-00001.tokens"
    data = bytearray(shard.read_bytes())
    data[7] ^= 1
    shard.write_bytes(data)
    DataManifest.read(out)  # the size is right: only reading every byte finds it
    with pytest.raises(ValueError, match=r"^--data \S+/out/train-00001.tokens: its digest differs from the "
                                         r"manifest's: .*; prepare the data again$"):
        manifest.verify(out)
    shard.write_bytes(data[:-3])
    with pytest.raises(ValueError, match=r"^--data \S+/train-00001.tokens: incomplete: the shard has 47 bytes, the "
                                         r"manifest says 50 \(50 tokens of uint8\); prepare the data again$"):
        DataManifest.read(out)
    shard.unlink()
    with pytest.raises(ValueError, match=r"train-00001.tokens: incomplete: the shard is missing"):
        DataManifest.read(out, flag="--eval-data")
    text = (out / "manifest.json").read_text()
    (out / "manifest.json").write_text(text.replace('"documents": 20', '"documents": 21'))
    with pytest.raises(ValueError, match=r"manifest.json: its digest is not that of its content \(it was edited\)"):
        DataManifest.read(out)
    (out / "manifest.json").write_text(text.replace("shardshift-tokens/1", "shardshift-tokens/9"))
    with pytest.raises(ValueError, match=r"manifest.json: not a valid manifest \(format 'shardshift-tokens/9'"):
        DataManifest.read(out)
    (out / "manifest.json").write_text("{")
    with pytest.raises(ValueError, match=r"manifest.json: not valid JSON"):
        DataManifest.read(out)
    (out / "manifest.json").unlink()
    with pytest.raises(ValueError, match=r"^--data \S+/out: holds no manifest.json; give a directory written by"):
        DataManifest.read(out)
    assert not is_prepared(out)


def test_a_partial_directory_is_never_read_and_a_dead_ones_is_removed(tmp_path):
    _jsonl(tmp_path / "docs.jsonl", DOCS)
    prepare([str(tmp_path / "docs.jsonl")], "bytes", tmp_path / "done")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"out.partial-{int(dead.stdout)}"
    os.rename(tmp_path / "done", stale)  # complete inside, as after a kill between the manifest and the rename
    assert not is_prepared(stale)
    with pytest.raises(ValueError, match=r"out.partial-\d+: an unfinished `shardshift data prepare`"):
        DataManifest.read(stale)
    mine = tmp_path / f"out.partial-{os.getpid()}-x"  # not a partial name: kept
    mine.mkdir()
    prepare([str(tmp_path / "docs.jsonl")], "bytes", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "out", mine.name]


def test_a_fault_found_while_reading_removes_what_was_written(tmp_path, capsys):
    _jsonl(tmp_path / "a.jsonl", DOCS)
    (tmp_path / "b.jsonl").write_text('{"text": "fine"}\n{"text": "fine"}\n{"text": 3}\n')
    argv = ["data", "prepare", "--input", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"),
            "--tokenizer", "bytes", "--out", str(tmp_path / "out"), "--shard-tokens", "16"]
    assert main(argv) == 2
    assert "b.jsonl: line 3: field 'text' is a JSON number, not a string" in capsys.readouterr().err
    assert _nothing_written(tmp_path)


def test_the_command_prints_one_line(tmp_path, capsys):
    (tmp_path / "a.txt").write_text(DOCS[0])
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)
    assert main(["data", "prepare", "--input", str(tmp_path / "a.txt"), "--tokenizer", "bytes",
                 "--out", str(tmp_path / "out"), "--shard-tokens", "7"]) == 0
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)) == handlers  # put back
    out = capsys.readouterr().out
    tokens = len(DOCS[0].encode()) + 1
    assert re.fullmatch(rf"prepared 1 document: {tokens} train tokens \(1 document\), 0 val tokens \(0 documents\), "
                        rf"3 shards of uint8 in \S+/out; \d+\.\d s, \d+\.\d MB/s of input files\n", out), out


def _refusal_cases(tmp_path):
    """(arguments after `data prepare`, the message) for every bad input."""
    t = tmp_path
    (t / "good.txt").write_text("good text")
    (t / "empty.txt").write_bytes(b"")
    (t / "latin1.txt").write_bytes("café".encode("latin-1"))
    (t / "nul.txt").write_bytes(b"a\x00b")
    (t / "broken.gz").write_bytes(b"\x1f\x8b\x08\x00 not gzip at all")
    (t / "packed.txt").write_bytes(gzip.compress(b"text"))
    (t / "bad.jsonl").write_text('{"text": "ok"}\n  {"text": "ok",}\n')
    (t / "extra.jsonl").write_text('{"text": "ok"} {"text": "ok"}\n')
    (t / "nofield.jsonl").write_text('{"text": "ok"}\n\n{"body": "no text", "id": 1}\n')
    (t / "number.jsonl").write_text('{"text": 3}\n')
    (t / "list.jsonl").write_text('["text"]\n')
    (t / "escape.jsonl").write_text('{"text": "a\\u0000b"}\n')
    (t / "surrogate.jsonl").write_text('{"text": "a\\ud800b"}\n')
    (t / "blank.jsonl").write_text("\n\n")
    (t / "bad-utf8.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    (t / "empty-folder").mkdir()
    (t / "taken").mkdir()
    (t / "tok").mkdir()
    (t / "tok" / "tokenizer.json").write_text("{not json")
    good = ["--input", str(t / "good.txt")]
    out = ["--out", str(t / "out")]
    bytes_ = ["--tokenizer", "bytes"]
    return [
        (["--input", str(t / "missing.txt"), *bytes_, *out], r"--input \S+missing.txt: no such file or directory"),
        (["--input", str(t / "*.nothing"), *bytes_, *out], r"--input '\S+\*.nothing' matches nothing"),
        (["--input", str(t / "empty-folder"), *bytes_, *out], r"empty-folder: the folder holds no .txt, .gz"),
        (["--input", str(t / "empty.txt"), *bytes_, *out], r"empty.txt: the file is empty; give a file that holds"),
        (["--input", str(t / "latin1.txt"), *bytes_, *out], r"latin1.txt: not UTF-8 text \(byte 3 is 0xe9\)"),
        (["--input", str(t / "nul.txt"), *bytes_, *out], r"nul.txt: it holds NUL bytes, which text does not"),
        (["--input", str(t / "broken.gz"), *bytes_, *out], r"broken.gz: its name ends in .gz but it does not "
                                                           r"decompress as gzip"),
        (["--input", str(t / "packed.txt"), *bytes_, *out], r"packed.txt: the file is gzip-compressed; decompress "
                                                            r"it, or name it .gz"),
        (["--input", str(t / "bad.jsonl"), *bytes_, *out], r"bad.jsonl: line 2 is not JSON \(Expecting property "
                                                           r"name enclosed in double quotes at column 17\)"),
        (["--input", str(t / "extra.jsonl"), *bytes_, *out], r"extra.jsonl: line 1 is not JSON \(Extra data at "
                                                             r"column 16\); give a JSON lines file"),
        (["--input", str(t / "bad.jsonl"), "--tokenizer", "bpe:300", *out], r"bad.jsonl: line 2 is not JSON"),
        (["--input", str(t / "nofield.jsonl"), *bytes_, *out],
         r"--input \S+nofield.jsonl: line 3 has no field 'text' \(its fields: body, id\); name the field that "
         r"holds the text with --field NAME"),
        (["--input", str(t / "good.txt"), str(t / "nofield.jsonl"), *bytes_, *out, "--field", "body"],
         r"nofield.jsonl: line 1 has no field 'body' \(its fields: text\)"),
        (["--input", str(t / "number.jsonl"), *bytes_, *out], r"number.jsonl: line 1: field 'text' is a JSON "
                                                              r"number, not a string; name the field"),
        (["--input", str(t / "list.jsonl"), *bytes_, *out], r"list.jsonl: line 1 is a JSON array, not an object"),
        (["--input", str(t / "escape.jsonl"), *bytes_, *out], r"escape.jsonl: line 1: field 'text' holds a NUL "
                                                              r"character"),
        (["--input", str(t / "surrogate.jsonl"), *bytes_, *out], r"surrogate.jsonl: line 1: field 'text' holds an "
                                                                 r"unpaired surrogate"),
        (["--input", str(t / "blank.jsonl"), *bytes_, *out], r"blank.jsonl: holds no JSON line, only blank ones"),
        (["--input", str(t / "bad-utf8.jsonl"), *bytes_, *out], r"bad-utf8.jsonl: line 2 is not UTF-8 text \(byte "
                                                                r"13 of the line is 0xe9\)"),
        ([*good, "--tokenizer", "words", *out], r"--tokenizer 'words' is not a tokenizer; give bytes, hf:PATH"),
        ([*good, "--tokenizer", f"hf:{t / 'tok'}", *out], r"--tokenizer \S+tokenizer.json: does not load as a "
                                                          r"tokenizer \("),
        ([*good, "--tokenizer", f"hf:{t / 'none'}", *out], r"--tokenizer \S+none: no such file"),
        ([*good, "--tokenizer", "bpe:100", *out], r"--tokenizer bpe:100: a byte-level BPE needs N in \[257, 2\*\*32\]"),
        ([*good, "--tokenizer", "bpe:1e3", *out], r"--tokenizer bpe:1e3: '1e3' is not a whole number of tokens"),
        ([*good, *bytes_, *out, "--val-fraction", "1"], r"--val-fraction 1.0 is outside \[0, 1\)"),
        ([*good, *bytes_, *out, "--val-fraction", "-0.1"], r"--val-fraction -0.1 is outside \[0, 1\)"),
        ([*good, *bytes_, *out, "--shard-tokens", "0"], r"--shard-tokens '0' is not a positive number of tokens"),
        ([*good, *bytes_, *out, "--shard-tokens", "1.5M"], r"--shard-tokens '1.5M' is not a positive number"),
        ([*good, *bytes_, "--out", str(t / "taken")], r"--out \S+taken exists; choose a new directory"),
    ]


def test_every_bad_input_is_refused_in_one_line_and_writes_nothing(tmp_path, capsys):
    cases = _refusal_cases(tmp_path)
    for args, needle in cases:
        assert main(["data", "prepare", *args]) == 2, args
        captured = capsys.readouterr()
        assert captured.out == "", args
        assert re.fullmatch(rf"shardshift: error: .*{needle}.*\n", captured.err), (args, captured.err)
        assert captured.err.count("\n") == 1, captured.err
        assert _nothing_written(tmp_path), args
    assert len(cases) == 29
