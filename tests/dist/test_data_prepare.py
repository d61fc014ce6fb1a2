"""`shardshift data prepare` as a user starts it, stopped midway: SIGTERM or Ctrl-C removes what it
wrote; after SIGKILL no directory appears under --out's name, what is left is never read as
prepared data, and the next prepare to the same directory succeeds and removes it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from shardshift.data.manifest import DataManifest, is_prepared

LINES = 2_000_000  # about 60 MB of JSON lines: several seconds of work, stopped within the first


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    line = json.dumps({"text": "a short document, one of many"}) + "\n"
    with open(path, "w") as f:
        for _ in range(LINES // 10_000):
            f.write(line * 10_000)
    return path


def _start(corpus, out) -> subprocess.Popen:
    """The command, started as from a terminal: with SIGINT's default action, even where this test
    runs with SIGINT ignored (a job started in the background), which the command would inherit."""
    return subprocess.Popen([sys.executable, "-m", "shardshift", "data", "prepare", "--input", str(corpus),
                             "--tokenizer", "bytes", "--out", str(out), "--shard-tokens", "1M"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _midway(job: subprocess.Popen, out, budget) -> os.PathLike:
    """The job's partial directory, once it holds a shard (the job is then writing)."""
    partial = out.parent / f"{out.name}.partial-{job.pid}"
    deadline = time.monotonic() + min(budget.left(), 60)
    while not (partial.is_dir() and any(partial.glob("train-*.tokens"))):
        assert job.poll() is None, f"the job ended before it was stopped: {job.communicate()}"
        assert time.monotonic() < deadline, "the job wrote no shard"
        time.sleep(0.01)
    return partial


def _gone(pid: int) -> bool:
    """Whether no process has `pid` (the job was reaped by `wait`: nothing of it runs on)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_removes_what_was_written(tmp_path, corpus, budget, signum):
    out = tmp_path / "out"
    job = _start(corpus, out)
    partial = _midway(job, out, budget)
    job.send_signal(signum)
    stdout, stderr = job.communicate(timeout=budget.left())
    assert job.returncode == 128 + signum, (stdout, stderr)
    assert f"stopped by {signal.Signals(signum).name}; {out} was not written" in stderr
    assert not out.exists() and not partial.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert _gone(job.pid)


def test_after_a_kill_nothing_is_read_as_prepared_and_the_next_prepare_succeeds(tmp_path, corpus, budget):
    out = tmp_path / "out"
    job = _start(corpus, out)
    partial = _midway(job, out, budget)
    job.kill()
    job.communicate(timeout=budget.left())
    assert job.returncode == -signal.SIGKILL and _gone(job.pid)
    assert not out.exists() and partial.is_dir()  # left as it was
    assert not is_prepared(partial)
    with pytest.raises(ValueError, match="an unfinished `shardshift data prepare`"):
        DataManifest.read(partial)
    small = tmp_path / "small.txt"
    small.write_text("a document small enough to prepare at once")
    done = _start(small, out)
    stdout, stderr = done.communicate(timeout=budget.left())
    assert done.returncode == 0, stderr
    assert stdout.startswith("prepared 1 document: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "small.txt"]  # the stale partial is removed
    manifest = DataManifest.read(out)
    manifest.verify(out)
    assert manifest.split("train").tokens == len(small.read_bytes()) + 1
