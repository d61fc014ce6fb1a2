"""`shardshift bench data`: a small run reports every figure, consistent with one another; bad
input is refused in one line.

No timing is asserted: the checks are that every rate is there and positive, that medians, ranges
and ratios are what the rounds give, and the bench's own checks of the work (the prepares' ids
agree with tokenizers', the two trainers' losses are equal).
"""

from __future__ import annotations

import json
import statistics

import pytest

from support import REPO
from support.cli import run_shardshift


def _check_rate(rate: dict, rounds: int, unit: str) -> None:
    assert rate["unit"] == unit and len(rate["rounds"]) == rounds, rate
    assert all(value > 0 for value in rate["rounds"]), rate
    assert rate["median"] == pytest.approx(statistics.median(rate["rounds"]))
    assert (rate["min"], rate["max"]) == (min(rate["rounds"]), max(rate["rounds"]))


def _check_ratio(ratio: dict, rates: dict[str, dict]) -> None:
    a, b = rates[ratio["numerator"]], rates[ratio["denominator"]]
    assert ratio["rounds"] == pytest.approx([x / y for x, y in zip(a["rounds"], b["rounds"])])
    assert ratio["median"] == pytest.approx(statistics.median(ratio["rounds"]))
    assert (ratio["min"], ratio["max"]) == (min(ratio["rounds"]), max(ratio["rounds"]))


def test_a_small_run_reports_every_figure(budget):
    run = run_shardshift(
        ["bench", "data", "--corpus-size", "96K", "--tokenizer", "bpe:300", "--model", "test", "--steps", "2",
         "--rounds", "2", "--warmup", "1", "--json", "--timeout", str(budget.left())],
        timeout=budget.left(), cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert out["rounds"] == 2 and out["cores"] >= 1

    prepared = out["prepare"]
    rates = {rate["name"]: rate for rate in prepared["rates"]}
    assert list(rates) == ["prepare", "prepare_encode", "tokenizers"]
    for rate in rates.values():
        _check_rate(rate, 2, "MB/s")
    assert (prepared["ratio"]["numerator"], prepared["ratio"]["denominator"]) == ("prepare_encode", "tokenizers")
    _check_ratio(prepared["ratio"], rates)
    assert prepared["ids_agree"] is True
    assert prepared["tokenizer"] == "bpe:300" and prepared["input_bytes"] >= 96 << 10
    assert 0 < prepared["documents"] < prepared["tokens"]

    training = out["training"]
    rates = {rate["name"]: rate for rate in training["rates"]}
    assert list(rates) == ["shards", "memory"]
    for rate in rates.values():
        _check_rate(rate, 2, "tokens/s")
    assert (training["ratio"]["numerator"], training["ratio"]["denominator"]) == ("shards", "memory")
    _check_ratio(training["ratio"], rates)
    assert training["loss_mismatches"] == 0  # the same work from either reading of the data
    assert (training["model"], training["layout"], training["nproc"]) == ("test", "dp=2", 2)
    assert training["tokens_per_step"] == 16 * 13 and training["steps"] == 2  # the test model's seq_len is 13


def test_bytes_from_a_given_file_has_no_tokenizers_reference(budget, tmp_path):
    text = tmp_path / "plays.txt"
    text.write_text("ROMEO:\nBut soft, what light through yonder window breaks?\n" * 400)
    run = run_shardshift(
        ["bench", "data", "--input", text, "--tokenizer", "bytes", "--model", "test", "--nproc", "1", "--steps",
         "1", "--rounds", "1", "--warmup", "0", "--json", "--timeout", str(budget.left())],
        timeout=budget.left(), cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    prepared = out["prepare"]
    assert [rate["name"] for rate in prepared["rates"]] == ["prepare"] and prepared["ratio"] is None
    assert prepared["inputs"] == [str(text)] and prepared["input_bytes"] == text.stat().st_size
    assert prepared["tokens"] == text.stat().st_size + 1 and prepared["ids_agree"] is True  # its bytes and an end
    assert out["training"]["layout"] == "dp=1" and out["training"]["loss_mismatches"] == 0


@pytest.mark.parametrize("argv, says", [
    (["--input", "no/such/file.jsonl"], "--input no/such/file.jsonl: no such file or directory"),
    (["--input", "README.md", "--corpus-size", "1M"], "--corpus-size sizes the generated corpus"),
    (["--tokenizer", "bpe:100"], "--tokenizer bpe:100: a byte-level BPE needs N in [257, 2**32]"),
    (["--tokenizer", "words"], "--tokenizer 'words' is not a tokenizer"),
    (["--layout", "dp=4"], "layout dp=4 has 4 ranks (product of its degrees) but 2 processes were asked for"),
    (["--rounds", "0"], "--rounds 0 must be >= 1"),
    (["--corpus-size", "1K", "--tokenizer", "bytes", "--model", "test", "--global-batch", "4096"],
     "fewer than one global batch of 4096"),  # found once the data is prepared, before any rank starts
])
def test_bad_input_is_refused_in_one_line(budget, argv, says):
    run = run_shardshift(["bench", "data", *argv], timeout=budget.left(), cwd=REPO)
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert run.stderr.startswith("shardshift: error: ") and run.stderr.count("\n") == 1, run.stderr
    assert says in run.stderr, run.stderr


def test_a_stop_signal_while_preparing_removes_the_bench_directory(budget, tmp_path):
    """SIGTERM during the prepare part (a corpus large enough to take seconds): exit 128 + 15, one
    line, and no `shardshift-bench-data-*` directory left in the temporary directory."""
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "shardshift", "bench", "data", "--corpus-size", "64M",
                             "--tokenizer", "bpe:4096", "--model", "test"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("shardshift-bench-data-*/corpus.jsonl")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(tmp_path.glob("shardshift-bench-data-*")), "the bench never started preparing"
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=budget.left())
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "bench data stopped by SIGTERM" in err and "Traceback" not in err, err[-2000:]
    assert not list(tmp_path.glob("shardshift-bench-data-*"))
