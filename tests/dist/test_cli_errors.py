"""Bad input gets a clear error and a non-zero exit, and no worker is left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest



def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_invalid_layout_from_the_shell_exits_non_zero():
    run = subprocess.run(
        [sys.executable, "-m", "shardshift", "train", "--nproc", "3", "--layout", "tp=3"],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 2
    assert "tp=3 does not divide n_head=8; choose tp in {1, 2, 4, 8}" in run.stderr


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
