"""Crashes never wait out a timeout: a survivor blocked on another survivor that has left the broken
world leaves it at once (`elastic.watch`), and kill after kill inside a step of a 3-worker ring is
survived with pauses far below ``--timeout``, the losses the fixed run's. Every fault is real (a
SIGKILL inside the step, a wait in gloo on a live peer); each test ends with no process of the job
alive (checked by PID)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from shardshift.cli.bench import crash_ring
from shardshift.train.catalog import checkpoints, step_of
from support.cli import run_shardshift
from support.training import metrics, step_losses

RTOL = 1e-9
TIMEOUT = "120"  # --timeout: a wait that lasted it would show as a pause of two minutes
STRUCTURAL_S = 30  # far below the timeout: the pause did not wait for it (not a speed target)


def _run(tmp_path, steps: int, *args: str, timeout: float) -> subprocess.CompletedProcess:
    return run_shardshift(["train", "--model", "test", "--dtype", "float64", "--global-batch", "6", "--seed", "4",
                           "--steps", str(steps), "--log-every", "1", *args], timeout=timeout)


def _fixed_losses(tmp_path, steps: int, timeout: float) -> dict[int, float]:
    run = _run(tmp_path, steps, "--nproc", "1", "--metrics", str(tmp_path / "fixed.jsonl"), timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return step_losses(tmp_path / "fixed.jsonl")


def _alive(marker: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if int(p) != os.getpid()]


def _assert_same_losses(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want)
    torch.testing.assert_close(torch.tensor([got[s] for s in sorted(got)]),
                               torch.tensor([want[s] for s in sorted(want)]), rtol=RTOL, atol=0)
    assert want[1] != want[max(want)]  # not vacuous: training moved the loss


def test_a_survivor_blocked_on_a_survivor_that_left_to_recover_leaves_at_once(tmp_path, budget):
    """dp=3: inside step 3 rank 2 is SIGKILLed, and rank 0 waits to receive from rank 1, which
    never sends: rank 1 sees the crash in its vote and leaves the world to recover, while rank 0's
    wait is on rank 1's live connection, which gloo cannot cancel. Without leaving a broken world at
    once, rank 0 waits out --timeout (120 s) and the pause shows it; rank 0's watch severs its
    connections when the crash is recorded, its wait fails, and it recovers with rank 1 from the
    replicas: no step lost, the fixed run's losses."""
    want = _fixed_losses(tmp_path, 6, budget.left())
    run = _run(tmp_path, 6, "--elastic", "--nproc", "3", "--layout-for", "3:dp=3", "--layout-for", "2:dp=2",
               "--inject", "3:wedge=0", "--timeout", TIMEOUT, "--metrics", str(tmp_path / "elastic.jsonl"),
               "--log-dir", str(tmp_path / "logs"), timeout=budget.left())
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    events = [r for r in metrics(tmp_path / "elastic.jsonl") if r.get("event") == "membership"]
    assert [(e["kind"], e["from"], e["to"], e["steps_lost"]) for e in events] == [("crash", "dp=3", "dp=2", 0)]
    assert events[0]["pause_seconds"] < STRUCTURAL_S, events[0]
    _assert_same_losses(step_losses(tmp_path / "elastic.jsonl"), want)
    assert not _alive(str(tmp_path))


@pytest.mark.parametrize("layout, redundancy", [("dp", "0"), ("fsdp", "1")])
def test_kill_after_kill_inside_a_step_of_a_three_worker_ring_never_waits_for_the_timeout(tmp_path, budget, layout,
                                                                                          redundancy):
    """A 3-worker ring (dp=3: pieces from replicas; fsdp=3: from the copies --redundancy 1 keeps)
    loses a worker inside steps 2, 4, 6, 8 and 10 (SIGKILL before its vote, a different rank each
    time) and gets one back after steps 3, 5, 7, 9 and 11: five crashes per ring, ten over both.
    Every crash's pause is far below --timeout (120 s), no step is lost, and the losses are the
    fixed run's."""
    steps, kills = 12, 5
    want = _fixed_losses(tmp_path, steps, budget.left())
    injects = [arg for event in crash_ring(kills) for arg in ("--inject", event)]  # as `bench elastic --crashes`
    run = _run(tmp_path, steps, "--elastic", "--nproc", "3", "--max-nproc", "3", "--redundancy", redundancy,
               "--layout-for", f"3:{layout}=3", "--layout-for", f"2:{layout}=2", *injects, "--timeout", TIMEOUT,
               "--metrics", str(tmp_path / "elastic.jsonl"), "--log-dir", str(tmp_path / "logs"),
               timeout=budget.left())
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    events = [r for r in metrics(tmp_path / "elastic.jsonl") if r.get("event") == "membership"]
    crashes = [e for e in events if e["kind"] == "crash"]
    assert len(crashes) == kills and len(events) == 2 * kills, [(e["kind"], e["step"]) for e in events]
    assert all(e["steps_lost"] == 0 and e["pause_seconds"] < STRUCTURAL_S for e in crashes), crashes
    _assert_same_losses(step_losses(tmp_path / "elastic.jsonl"), want)
    assert not _alive(str(tmp_path))


def test_a_killed_coordinator_loses_nothing_the_workers_save_and_say_how_to_resume(tmp_path, budget):
    """The coordinator of a dp=2 job is SIGKILLed during training: its store goes with it. The
    workers find it gone (in their vote, at the boundary or from their watch), end the step alike
    (applied on both or on neither), save, say to resume with --resume auto, and exit; nothing is
    left. Resumed so, the job's losses are the fixed run's."""
    common = ["train", "--model", "test", "--dtype", "float64", "--global-batch", "6", "--seed", "4", "--steps", "400",
              "--log-every", "1"]
    save = tmp_path / "ckpt"
    job = subprocess.Popen([sys.executable, "-m", "shardshift", *common, "--elastic", "--nproc", "2", "--save",
                            str(save), "--metrics", str(tmp_path / "elastic.jsonl"), "--timeout", "60",
                            "--log-dir", str(tmp_path / "logs")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in job.stdout:
            if line.startswith("step     3"):
                break
        job.kill()  # the coordinator; its workers live on, holding its stdout and stderr
        out, err = job.communicate(timeout=budget.left())
    finally:
        job.kill()
    deadline = time.monotonic() + 60
    while _alive(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(str(tmp_path))
    assert "the job's coordinator at 127.0.0.1:" in err and "resume with the same command and --resume auto" in err, \
        err[-3000:]
    [saved] = checkpoints(save)
    stopped_at = step_of(saved)
    assert stopped_at >= 3 and f"stopped after step {stopped_at};" in err, err[-3000:]

    resumed = run_shardshift([*common, "--nproc", "2", "--layout", "dp=2", "--stop-at", str(stopped_at + 2),
                              "--save", str(save), "--resume", "auto", "--metrics", str(tmp_path / "resumed.jsonl")],
                             timeout=budget.left())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    fixed = run_shardshift([*common, "--nproc", "1", "--stop-at", str(stopped_at + 2), "--metrics",
                            str(tmp_path / "fixed.jsonl")], timeout=budget.left())
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    got = {**step_losses(tmp_path / "elastic.jsonl"), **step_losses(tmp_path / "resumed.jsonl")}
    want = step_losses(tmp_path / "fixed.jsonl")
    assert min(step_losses(tmp_path / "resumed.jsonl")) == stopped_at + 1  # it went on from the saved step
    _assert_same_losses({s: got[s] for s in want}, want)


def test_two_workers_killed_at_once_are_survived_from_the_copies_of_redundancy_2(tmp_path, budget):
    """fsdp=4 with --redundancy 2 (every piece kept by three workers): ranks 1 and 2 are SIGKILLed
    inside the same step; the two survivors take every piece from a surviving copy, lose no step,
    and compute the fixed run's losses."""
    want = _fixed_losses(tmp_path, 6, budget.left())
    run = _run(tmp_path, 6, "--elastic", "--nproc", "4", "--redundancy", "2", "--layout-for", "4:fsdp=4",
               "--layout-for", "2:fsdp=2", "--inject", "3:kill=1,2", "--timeout", TIMEOUT,
               "--metrics", str(tmp_path / "elastic.jsonl"), "--log-dir", str(tmp_path / "logs"), timeout=budget.left())
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    events = [r for r in metrics(tmp_path / "elastic.jsonl") if r.get("event") == "membership"]
    assert [(e["kind"], e["from_world"], e["to_world"], e["recovered_from"], e["steps_lost"]) for e in events] == [
        ("crash", 4, 2, "redundancy", 0)]
    _assert_same_losses(step_losses(tmp_path / "elastic.jsonl"), want)
    assert not _alive(str(tmp_path))


@pytest.fixture(scope="module")
def fixed8(tmp_path_factory):
    """The losses of 8 steps in one process: what every run below must compute."""
    path = tmp_path_factory.mktemp("fixed8")
    return _fixed_losses(path, 8, 300)


def _changes(path) -> list[tuple]:
    return [(e["kind"], e["from_world"], e["to_world"], e["recovered_from"], e["steps_lost"])
            for e in metrics(path) if e.get("event") == "membership"]


@pytest.mark.parametrize("victim, changes", [
    # process 1 of the 2 -> 3 change: worker 1 of the old world. Its pieces come from the copy worker 0
    # kept of them (--redundancy 1); the joiner comes along.
    (1, [("crash", 2, 2, "rollback", 0)]),
    # process 2: the joiner, admitted, dies as the state starts to move; the old world goes on.
    (2, [("crash", 2, 2, "rollback", 0)]),
], ids=["old-worker", "joiner"])
def test_a_worker_killed_while_the_state_moves_sends_the_change_back_to_the_old_world(tmp_path, budget, fixed8,
                                                                                      victim, changes):
    """After step 3 a joiner is admitted (2 -> 3 workers, fsdp: no replica); as the state starts to
    move, one process of the change gets a real SIGKILL. Every worker of the change kept its old
    state whole (a small model: it fits the switch's budget twice), so the change is decided
    failed and tried again from the old world without the dead worker: no checkpoint (none is
    given), no step lost, the fixed run's losses, and nobody waits for --timeout."""
    run = _run(tmp_path, 8, "--elastic", "--nproc", "2", "--max-nproc", "3", "--redundancy", "1", "--layout-for",
               "2:fsdp=2", "--layout-for", "3:fsdp=3", "--inject", "3:join=1", "--inject", f"2:movekill={victim}",
               "--timeout", TIMEOUT, "--metrics", str(tmp_path / "elastic.jsonl"), "--log-dir", str(tmp_path / "logs"),
               timeout=budget.left())
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    lost = 1 if victim == 1 else 2
    assert f"workers [{lost}] were lost while the state moved into epoch 1; trying again" in run.stderr
    assert _changes(tmp_path / "elastic.jsonl") == changes
    (event,) = [e for e in metrics(tmp_path / "elastic.jsonl") if e.get("event") == "membership"]
    assert event["pause_seconds"] < STRUCTURAL_S, event
    _assert_same_losses(step_losses(tmp_path / "elastic.jsonl"), fixed8)
    assert not _alive(str(tmp_path))


def test_a_second_crash_while_recovering_from_the_first_is_survived_from_the_copies(tmp_path, budget, fixed8):
    """fsdp=4 with --redundancy 2: worker 1 is SIGKILLed inside step 3, and worker 2 as the survivors
    start to move the state into their world (process 1 of that change). The recovery is decided
    failed and tried again without both, every piece from a surviving copy: no step lost, the fixed
    run's losses."""
    run = _run(tmp_path, 8, "--elastic", "--nproc", "4", "--redundancy", "2", "--layout-for", "4:fsdp=4",
               "--layout-for", "3:fsdp=3", "--layout-for", "2:fsdp=2", "--inject", "3:kill=1", "--inject",
               "2:movekill=1", "--timeout", TIMEOUT, "--metrics", str(tmp_path / "elastic.jsonl"), "--log-dir",
               str(tmp_path / "logs"), timeout=budget.left())
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    assert "workers [1, 2] were lost while the state moved into epoch 1; trying again" in run.stderr
    assert _changes(tmp_path / "elastic.jsonl") == [("crash", 4, 2, "rollback", 0)]
    _assert_same_losses(step_losses(tmp_path / "elastic.jsonl"), fixed8)
    assert not _alive(str(tmp_path))
