"""`shardshift bench elastic`: bad input is refused before anything starts; the default suite runs end
to end on the test model, and a one-event run with its restart and the redundancy jobs. No timing
is asserted: every event and column must be there, no step lost, and every restart must have run."""

from __future__ import annotations

import json

import pytest

from shardshift.cli.main import main
from shardshift.elastic.moving import PHASES
from support import REPO
from support.cli import run_shardshift


def test_bad_input_exits_2_before_anything_starts(capsys):
    for args, needle in [
        (["--nproc", "3", "--suite"], "the default suite is for 4 workers"),
        (["--nproc", "2"], "no events: give --suite, --crashes N or --inject"),
        (["--nproc", "2", "--inject", "1:leave=1", "--inject", "2:leave=0"], "the events leave 0 workers"),
        (["--suite", "--inject", "1:leave=1"], "give one of --suite, --inject and --crashes"),
        (["--crashes", "2", "--suite"], "give one of --suite, --inject and --crashes"),
        (["--crashes", "2", "--nproc", "5"], "--crashes runs its own 3-worker ring"),
        (["--crashes", "-1"], "--crashes -1 must be >= 1"),
        (["--suite", "--overhead-steps", "1"], "give 0 (skip) or at least 2"),
    ]:
        assert main(["bench", "elastic", *args, "--model", "test"]) == 2, args
        assert needle in capsys.readouterr().err, args


def test_the_suite_reports_every_event_beside_its_restart(budget):
    """The suite's six events (their restarts and the redundancy jobs: the next test)."""
    run = run_shardshift(["bench", "elastic", "--suite", "--model", "test",
                          "--global-batch", "6", "--json", "--timeout", "120", "--no-restart", "--overhead-steps", "0"],
                         timeout=budget.left(), cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    events = out["events"]
    assert [(e["kind"], e["from_world"], e["to_world"], e["from"], e["to"], e["recovered_from"]) for e in events] == [
        ("crash", 4, 3, "dp=2,fsdp=2", "fsdp=3", "replica"), ("leave", 3, 2, "fsdp=3", "fsdp=2", "none"),
        ("join", 2, 3, "fsdp=2", "fsdp=3", "none"), ("join", 3, 4, "fsdp=3", "dp=2,fsdp=2", "none"),
        ("crash", 4, 3, "dp=2,fsdp=2", "fsdp=3", "replica"), ("join", 3, 4, "fsdp=3", "dp=2,fsdp=2", "none")]
    assert all(e["bytes_moved"] > 0 and e["steps_lost"] == 0 and e["pause_seconds"] > 0 for e in events)
    for e in events:
        assert set(e["phases"]) == set(PHASES) and e["pause_seconds"] >= max(e["phases"].values()), e
        assert e["restart_seconds"] is None and e["restart_over_pause"] is None
    assert out["redundancy_overhead"] is None and out["redundancy"] is None


def test_an_event_is_timed_beside_its_restart_and_redundancy_beside_none(budget):
    """A leave beside its restart, and the two fixed jobs that measure --redundancy 1 (joins beside
    their restarts: the suite's own runs, which do not time restarts in this test)."""
    run = run_shardshift(["bench", "elastic", "--nproc", "2", "--inject", "2:leave=1",
                          "--model", "test", "--global-batch", "6", "--json", "--timeout", "120", "--overhead-steps", "2"],
                         timeout=budget.left(), cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    [event] = out["events"]
    assert (event["kind"], event["from_world"], event["to_world"], event["from"], event["to"], event["steps_lost"]) == (
        "leave", 2, 1, "fsdp=2", "dp=1", 0)
    assert event["bytes_moved"] > 0 and isinstance(event["planned_ahead"], bool)
    assert set(event["phases"]) == set(PHASES) and event["pause_seconds"] >= max(event["phases"].values())
    assert event["restart_error"] is None and event["restart_seconds"] > 0
    assert event["restart_over_pause"] == event["restart_seconds"] / event["pause_seconds"]
    assert out["geomean_restart_over_pause"] == {"join_leave": pytest.approx(event["restart_over_pause"]), "crash": None}
    redundancy = out["redundancy"]
    assert redundancy["layout"] == "fsdp=2" and redundancy["steps"] == 2
    assert redundancy["step_seconds"] > 0 and redundancy["step_seconds_redundancy_1"] > 0
    assert out["redundancy_overhead"] == 1 - redundancy["step_seconds"] / redundancy["step_seconds_redundancy_1"]


def test_crashes_are_kills_in_a_three_worker_ring_with_their_pauses_summed_up(budget):
    """`--crashes 2`: a 3-worker ring loses a worker inside steps 2 and 4 and gets one back after
    steps 3 and 5; the crashes' pauses are counted, their median and maximum given."""
    run = run_shardshift(["bench", "elastic", "--crashes", "2", "--model", "test", "--global-batch", "6", "--json",
                          "--timeout", "120"], timeout=budget.left(), cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert [(e["kind"], e["step"], e["from"], e["to"]) for e in out["events"]] == [
        ("crash", 1, "dp=3", "dp=2"), ("join", 3, "dp=2", "dp=3"), ("crash", 3, "dp=3", "dp=2"),
        ("join", 5, "dp=2", "dp=3")]
    pauses = sorted(e["pause_seconds"] for e in out["events"] if e["kind"] == "crash")
    assert out["crash_pauses"] == {"count": 2, "median": pytest.approx(sum(pauses) / 2), "max": pauses[-1]}
    assert all(e["restart_seconds"] is None and e["steps_lost"] == 0 for e in out["events"])
    assert out["redundancy"] is None
