"""Bad input gets a clear error and a non-zero exit, and no worker is left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from shardshift.cli.main import main


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--nproc", "4", "--layout", "dp=3"], "layout dp=3 has 3 ranks .* but 4 processes"),
        (["--nproc", "3", "--layout", "tp=3"], "tp=3 does not divide n_head=8"),
        (["--nproc", "16", "--layout", "pp=16"], "pp=16 is larger than the number of layers n_layer=8"),
        (["--layout", "xp=2"], "unknown axis 'xp'"),
        (["--layout", "dp=-1"], "dp=-1"),
        (["--layout", "dp=2", "--global-batch", "3"], "--global-batch 3 does not split among dp\\*fsdp=2"),
        (["--dtype", "float16"], "--dtype 'float16' is not supported"),
        (["--model", "huge"], "--model 'huge' is unknown"),
        (["--steps", "0"], "--steps 0 must be >= 1"),
        (["--resume", "/nonexistent/ckpt"], "--resume /nonexistent/ckpt: no such directory"),
        (["--data", "/nonexistent/text.txt"], "--data /nonexistent/text.txt: no such file"),
        (["--nproc", "0"], "--nproc 0 must be >= 1"),
        (["--switch", "fsdp=4"], "--switch 'fsdp=4' is not STEP:LAYOUT"),
        (["--switch", "10:dp=2"], "--switch 10:dp=2 has 2 ranks but the job has 4"),
        (["--switch", "10:tp=3,dp=1"], "unknown axis|has 3 ranks"),
        (["--switch", "10:pp=4", "--global-batch", "4"], "--switch 10:pp=4: .*micro-batches|--switch 10:pp=4"),
        (["--switch", "60:fsdp=4"], "switch steps must increase and lie in \\[1, --steps 50\\]"),
        (["--switch", "20:fsdp=4", "--switch", "10:dp=4"], "switch steps must increase"),
        (["--nproc", "3", "--layout", "dp=3", "--global-batch", "3", "--switch", "10:tp=3"],
         "--switch 10:tp=3: tp=3 does not divide n_head=8"),
        (["--switch-budget", "1K"], "--switch-budget 1024 bytes is too small"),
    ],
)
def test_invalid_input_is_refused_before_any_process_starts(args, needle, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardshift: error: ")
    assert re.search(needle, err), err


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.multiproc
def test_invalid_layout_from_the_shell_exits_non_zero():
    run = subprocess.run(
        [sys.executable, "-m", "shardshift", "train", "--nproc", "3", "--layout", "tp=3"],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 2
    assert "tp=3 does not divide n_head=8; choose tp in {1, 2, 4, 8}" in run.stderr


@pytest.mark.multiproc
def test_worker_error_stops_the_job_with_its_message(tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("far too short for one batch")
    run = subprocess.run(
        [sys.executable, "-m", "shardshift", "train", "--nproc", "2", "--layout", "dp=2",
         "--model", "test", "--data", str(text)],
        capture_output=True, text=True, timeout=180,
    )
    assert run.returncode != 0
    assert "fewer than one global batch" in run.stderr
    assert "worker rank" in run.stderr and "stopped the other workers" in run.stderr
    leftover = subprocess.run(["pgrep", "-f", str(text)], capture_output=True, text=True).stdout
    assert leftover.strip() == ""


@pytest.mark.multiproc
def test_a_killed_worker_stops_the_others_instead_of_hanging():
    launcher = subprocess.Popen(
        [sys.executable, "-m", "shardshift", "train", "--nproc", "2", "--layout", "fsdp=2",
         "--model", "test", "--steps", "100000", "--timeout", "600"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        for line in launcher.stdout:  # wait until training is under way
            if line.startswith("step     2"):
                break
        workers = _children(launcher.pid)
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGKILL)
        # The collective timeout is 600 s: finishing within the 120 s below shows the launcher
        # stopped the survivor itself instead of waiting for gloo to notice.
        code = launcher.wait(timeout=120)
        assert code != 0
        assert "stopped the other workers" in launcher.stderr.read()
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in workers)
    finally:
        if launcher.poll() is None:
            launcher.kill()
