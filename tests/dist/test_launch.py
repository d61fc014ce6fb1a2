"""The launcher (`shardshift.launch`, behind `shardshift train` and the benchmarks): bad input exits
2 before any process starts, an error or a death in one rank stops the others, and a launcher that
is stopped or killed, while its ranks start or while they train, leaves no rank behind (checked by
PID)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from support.dist import pid_alive

TRAIN = [sys.executable, "-m", "shardshift", "train", "--nproc", "2", "--layout", "fsdp=2", "--model", "test"]


def _ranks(marker: str) -> list[int]:
    """PIDs of the ranks of the job whose command line holds `marker` (none is the launcher:
    its command line is the same, so the launcher's PID is left out by the caller)."""
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _gone(pids: list[int], seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(pid_alive(pid) for pid in pids)


def _training(tmp_path, *extra: str) -> tuple[subprocess.Popen, str]:
    """A 2-rank job that would train for ever; its own text file marks its processes."""
    text = tmp_path / "corpus.txt"
    text.write_text("All the world's a stage, and all the men and women merely players. " * 200)
    launcher = subprocess.Popen([*TRAIN, "--steps", "100000", "--data", str(text), "--timeout", "600", *extra],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return launcher, str(text)


def _wait_for_step(launcher: subprocess.Popen, step: int) -> None:
    for line in launcher.stdout:
        if line.startswith(f"step {step:5d}"):
            return
    raise AssertionError(f"the job ended before step {step}: {launcher.stderr.read()[-2000:]}")


def test_invalid_layout_from_the_shell_exits_2(budget):
    run = subprocess.run([*TRAIN[:4], "--nproc", "3", "--layout", "tp=3"], capture_output=True, text=True,
                         timeout=budget.left())
    assert run.returncode == 2
    assert "tp=3 does not divide n_head=8; choose tp in {1, 2, 4, 8}" in run.stderr


def test_worker_error_stops_the_job_with_its_message(tmp_path, budget):
    text = tmp_path / "short.txt"
    text.write_text("far too short for one batch")
    run = subprocess.run([*TRAIN, "--data", str(text)], capture_output=True, text=True, timeout=budget.left())
    assert run.returncode != 0
    assert "fewer than one global batch" in run.stderr
    assert "worker rank" in run.stderr and "stopped the other workers" in run.stderr
    assert _ranks(str(text)) == []


def test_a_killed_worker_stops_the_others_instead_of_hanging(tmp_path, budget):
    launcher, marker = _training(tmp_path)
    try:
        _wait_for_step(launcher, 2)
        ranks = [pid for pid in _ranks(marker) if pid != launcher.pid]
        assert len(ranks) == 2
        os.kill(ranks[1], signal.SIGKILL)
        # The collective timeout is 600 s: finishing well within the budget shows the launcher
        # stopped the survivor itself instead of waiting for gloo to notice.
        assert launcher.wait(timeout=budget.left()) == 128 + signal.SIGKILL
        assert "worker rank 1 exited with code -9; stopped the other workers" in launcher.stderr.read()
        assert _gone(ranks)
    finally:
        launcher.kill()


def test_sigterm_while_the_ranks_start_stops_them_all(tmp_path, budget):
    launcher, marker = _training(tmp_path)
    try:
        while not [pid for pid in _ranks(marker) if pid != launcher.pid]:  # until the first rank exists
            assert launcher.poll() is None, launcher.stderr.read()
            time.sleep(0.01)
        launcher.send_signal(signal.SIGTERM)  # the ranks are starting, or importing torch
        assert launcher.wait(timeout=budget.left()) == 128 + signal.SIGTERM
        assert _gone([pid for pid in _ranks(marker) if pid != launcher.pid])
        assert _ranks(marker) == []
    finally:
        launcher.kill()


def test_a_launcher_killed_mid_training_leaves_no_rank(tmp_path, budget):
    launcher, marker = _training(tmp_path)
    try:
        _wait_for_step(launcher, 2)
        ranks = [pid for pid in _ranks(marker) if pid != launcher.pid]
        assert len(ranks) == 2
        launcher.kill()  # SIGKILL: no handler runs; the ranks learn it from the kernel
        launcher.wait(timeout=30)
        assert _gone(ranks), [pid for pid in ranks if pid_alive(pid)]
    finally:
        launcher.kill()
