"""Jobs that stop early lose nothing: a job killed during a save, a job stopped by SIGTERM, a job
whose loss diverges. Each fault is real (a process killed, a signal sent, a learning rate that
overflows); each test ends with no process of the job alive (checked by PID) and no temporary
directory of the launcher left. After a resume, the float64 losses equal the uninterrupted run's."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import torch

from shardshift.train.catalog import PARTIAL_PREFIX, check_intact, checkpoints
from support.cli import run_shardshift
from support.dist import pid_alive
from support.faults import fault_env
from support.training import metrics, step_losses

STEPS = 8
RUN = ["--model", "tiny", "--dtype", "float64", "--global-batch", "4", "--seed", "7", "--steps", str(STEPS),
       "--log-every", "1"]


def _train(tmp_path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "shardshift", "train", *RUN, *args, "--log-dir", str(tmp_path / "logs")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _job_pids(marker: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _all_gone(marker: str, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while _job_pids(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _job_pids(marker)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The uninterrupted run's loss at every step, on one process."""
    tmp = tmp_path_factory.mktemp("reference")
    run = run_shardshift(["train", *RUN, "--nproc", "1", "--metrics",
                          str(tmp / "ref.jsonl")], timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    return step_losses(tmp / "ref.jsonl")


def _resume_and_compare(tmp_path, reference, budget, *args: str) -> list[dict]:
    """Resume from --save's newest complete checkpoint; the losses must be the uninterrupted run's."""
    run = run_shardshift(["train", *RUN, *args, "--save", str(tmp_path / "ckpt"),
                          "--resume", "auto", "--metrics", str(tmp_path / "run.jsonl"), "--log-dir",
                          str(tmp_path / "logs")], timeout=budget.left())
    assert run.returncode == 0, run.stderr[-3000:]
    got = step_losses(tmp_path / "run.jsonl")
    assert sorted(got) == list(range(1, STEPS + 1))
    torch.testing.assert_close(torch.tensor([got[s] for s in sorted(got)]),
                               torch.tensor([reference[s] for s in sorted(got)]), rtol=1e-9, atol=0)
    return metrics(tmp_path / "run.jsonl")


def _kill_during_a_save(tmp_path, budget, victim: str) -> None:
    """Start a run that saves after every step; as soon as a save is being written after one has
    completed, SIGKILL the launcher or one rank; wait until every process of the job is gone."""
    ckpt = tmp_path / "ckpt"
    job = _train(tmp_path, "--nproc", "2", "--layout", "fsdp=2", "--save", str(ckpt), "--save-every", "1",
                 "--metrics", str(tmp_path / "run.jsonl"))
    try:
        while job.poll() is None and not (checkpoints(ckpt) and list(ckpt.glob(PARTIAL_PREFIX + "step-*/*.distcp"))):
            time.sleep(0.002)
        ranks = [pid for pid in _job_pids(str(ckpt)) if pid != job.pid]
        subprocess.run(["kill", "-9", str(job.pid if victim == "launcher" else ranks[-1])])
        job.wait(timeout=budget.left())
    finally:
        job.kill()
        job.wait()
    assert _all_gone(str(ckpt)), [pid for pid in _job_pids(str(ckpt)) if pid_alive(pid)]


def test_a_worker_killed_during_a_save_leaves_the_previous_checkpoint_to_resume_from(tmp_path, reference, budget):
    for attempt in range(5):  # until the kill lands while a save is being written (its files stay unfinished)
        job_dir = tmp_path / f"try-{attempt}"
        job_dir.mkdir()
        _kill_during_a_save(job_dir, budget, "worker")
        if list((job_dir / "ckpt").glob(PARTIAL_PREFIX + "step-*")):
            break
    else:
        pytest.skip("the kill never landed during a save in 5 tries")  # timing, not a failure of the code
    newest = checkpoints(job_dir / "ckpt")[0]
    records = _resume_and_compare(job_dir, reference, budget, "--nproc", "2", "--layout", "tp=2")
    assert [r["checkpoint"] for r in records if r.get("event") == "resume"][-1] == str(newest)


def test_a_launcher_killed_during_a_save_leaves_ranks_that_finish_it_and_stop(tmp_path, reference, budget):
    """The ranks learn of their launcher's death (SIGTERM from the kernel) and stop as after any
    SIGTERM: the step, a checkpoint, exit. Nothing is left behind, and the run resumes exactly."""
    ckpt = tmp_path / "ckpt"
    _kill_during_a_save(tmp_path, budget, "launcher")
    assert not list(ckpt.glob(PARTIAL_PREFIX + "step-*")), "the ranks finished the save they were writing"
    newest = checkpoints(ckpt)[0]
    records = _resume_and_compare(tmp_path, reference, budget, "--nproc", "2", "--layout", "tp=2")
    assert [r["checkpoint"] for r in records if r.get("event") == "resume"][-1] == str(newest)


def test_sigterm_saves_and_the_run_continues_exactly(tmp_path, reference, budget):
    ckpt = tmp_path / "ckpt"
    job = _train(tmp_path, "--nproc", "2", "--layout", "fsdp=2", "--save", str(ckpt), "--save-every", "100",
                 "--keep-checkpoints", "1", "--metrics", str(tmp_path / "run.jsonl"))
    try:
        for line in job.stdout:
            if line.startswith("step     3"):
                job.send_signal(signal.SIGTERM)  # to the launcher, as a scheduler preempting the job would
                break
        assert job.wait(timeout=budget.left()) == 128 + signal.SIGTERM
        err = job.stderr.read()
    finally:
        job.kill()
    assert _all_gone(str(ckpt))
    saved = checkpoints(ckpt)
    assert len(saved) == 1 and 3 <= int(saved[0].name.split("-")[1]) < STEPS, saved  # saved at the stop, not at 100
    assert f"resume with --resume {ckpt}" in err, err
    _resume_and_compare(tmp_path, reference, budget, "--nproc", "2", "--layout", "fsdp=2", "--keep-checkpoints", "1")
    assert [p.name for p in checkpoints(ckpt)] == [f"step-{STEPS:08d}"]  # only the newest is kept


def test_a_closed_terminal_still_saves(tmp_path, budget):
    """The terminal goes: the launcher gets SIGHUP, and rank 0's output (the launcher's stdout)
    has no reader any more. The ranks still finish their step, save, and exit 128 + SIGHUP."""
    ckpt = tmp_path / "ckpt"
    job = _train(tmp_path, "--nproc", "2", "--layout", "fsdp=2", "--save", str(ckpt), "--save-every", "100")
    try:
        for line in job.stdout:
            if line.startswith("step     3"):
                break
        job.stdout.close()  # rank 0's next line meets a broken pipe
        job.send_signal(signal.SIGHUP)
        assert job.wait(timeout=budget.left()) == 128 + signal.SIGHUP, job.stderr.read()[-3000:]
        err = job.stderr.read()
    finally:
        job.kill()
    assert _all_gone(str(ckpt))
    saved = checkpoints(ckpt)
    assert len(saved) == 1 and 3 <= int(saved[0].name.split("-")[1]) < STEPS, (saved, err[-3000:])
    check_intact(saved[0])
    assert "shardshift: stopped by signal 1\n" in err, err[-3000:]  # every rank stopped cleanly


def test_a_diverging_run_stops_and_saves_nothing_of_it(tmp_path, budget):
    ckpt = tmp_path / "ckpt"
    run = run_shardshift(["train", *RUN, "--nproc", "2", "--layout", "fsdp=2",
                          "--lr", "1e12", "--warmup", "0", "--save", str(ckpt), "--save-every", "1", "--log-dir",
                          str(tmp_path / "logs")], timeout=budget.left())
    assert run.returncode == 3, run.stderr[-3000:]
    diverged = int(run.stderr.split("step ")[-1].split(" diverged")[0]) if " diverged" in run.stderr else None
    assert diverged is not None, run.stderr[-3000:]
    assert "Lower --lr" in run.stderr
    assert all(int(p.name.split("-")[1]) < diverged for p in checkpoints(ckpt))


def test_a_switch_whose_peer_dies_stops_the_job_and_names_the_checkpoint(tmp_path, budget):
    """Rank 1 is SIGKILLed by itself as it starts moving its state (an injected fault); rank 0
    fails the switch naming rank 1 and the round, and says which checkpoint to resume from, which
    is intact."""
    env = fault_env(tmp_path, 1, "run_program", "os.kill(os.getpid(), signal.SIGKILL)")
    ckpt = tmp_path / "ckpt"
    run = subprocess.run([sys.executable, "-m", "shardshift", "train", "--model", "test", "--global-batch", "4",
                          "--steps", "4", "--nproc", "2", "--layout", "fsdp=2", "--switch", "3:tp=2", "--save",
                          str(ckpt), "--save-every", "1", "--timeout", "60", "--log-dir", str(tmp_path / "logs")],
                         capture_output=True, text=True, timeout=budget.left(), env=env)
    assert run.returncode != 0
    assert "worker rank 1 exited with code -9" in run.stderr, run.stderr[-3000:]
    assert "rank 0: switch round 1 of" in run.stderr and "rank 1" in run.stderr, run.stderr[-3000:]
    assert f"resume with --resume {ckpt}, which takes its newest intact checkpoint (the newest there is " \
           "step-00000002)" in run.stderr, run.stderr[-3000:]
    assert [p.name for p in checkpoints(ckpt)] == ["step-00000002", "step-00000001"]
    check_intact(ckpt / "step-00000002")
