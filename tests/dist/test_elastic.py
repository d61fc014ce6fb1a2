"""Elastic membership (`shardshift train --elastic`): workers leave on notice and join while the job
trains, the state moves to each new world in the running processes, and the float64 losses and
final state equal a fixed run's. Every event is real: a SIGTERM to a worker, processes started by
the coordinator that join, a SIGTERM or SIGKILL from outside. Each test ends with no process of
the job alive (checked by PID)."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from shardshift.train.catalog import checkpoints
from support import EXAMPLE_MODEL
from support.cli import coordinator_address, run_shardshift
from support.hf import save_hf_model
from support.training import metrics, step_losses

STEPS = 8
RUN = ["--model", "test", "--dtype", "float64", "--global-batch", "6", "--seed", "4", "--steps", str(STEPS),
       "--log-every", "1"]
RTOL = 1e-9
SHARDED = ["--layout-for", "4:fsdp=4", "--layout-for", "3:fsdp=3", "--layout-for", "2:fsdp=2"]  # no replicas


def _train(tmp_path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    return run_shardshift(["train", *RUN, *args], timeout=timeout)


@pytest.fixture(scope="module")
def fixed_runs(tmp_path_factory):
    """The run every elastic run of RUN is compared with, for a --model (run when first asked for):
    one process, no event (the numerics contract: any world computes what one process computes).
    Its metrics and final checkpoint."""
    paths = {}

    def of(model: str):
        if model not in paths:
            path = tmp_path_factory.mktemp("fixed-" + re.sub(r"\W", "-", Path(model).name))
            run = run_shardshift(["train", *RUN, "--model", model, "--nproc", "1", "--metrics",
                                  str(path / "fixed.jsonl"), "--save", str(path / "ckpt")], timeout=300)
            assert run.returncode == 0, run.stderr[-3000:]
            paths[model] = path
        return paths[model]

    return of


@pytest.fixture(scope="module")
def fixed(fixed_runs):
    """The fixed run of RUN (the `test` GPT)."""
    return fixed_runs("test")


def _job_pids(marker: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if int(p) != os.getpid()]


def _named(prefix: str) -> list[int]:
    """PIDs of the processes whose name starts with `prefix` (the coordinator names its forks as their logs)."""
    out = subprocess.run(["pgrep", f"^{prefix}"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _all_gone(marker: str, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while _job_pids(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _job_pids(marker)


def _assert_same_losses(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want)
    torch.testing.assert_close(torch.tensor([got[s] for s in sorted(got)]), torch.tensor([want[s] for s in sorted(want)]),
                               rtol=RTOL, atol=0)


def _final_state(ckpt) -> dict[str, torch.Tensor]:
    """Every logical tensor of the newest checkpoint in `ckpt`, whole (read in this process)."""
    newest = checkpoints(ckpt)[0]
    out = newest.parent / f"{newest.name}.pt"
    dcp_to_torch_save(str(newest), str(out))
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> str:
    """--model for a Qwen2 directory saved by transformers (grouped-query attention, 5 layers)."""
    pytest.importorskip("transformers")
    return save_hf_model("qwen2", tmp_path_factory.mktemp("hf") / "qwen2")


# A mixture of experts moves its experts between worlds with expert parallelism: 4 workers as
# ep=2,fsdp=2 (two experts a worker pair), 3 as fsdp=3, 2 as ep=2.
WITH_EP = ["--layout-for", "4:ep=2,fsdp=2", "--layout-for", "3:fsdp=3", "--layout-for", "2:ep=2"]


@pytest.mark.parametrize("model", ["test", EXAMPLE_MODEL, "qwen2", "moe-test"],
                         ids=["test", "own-module", "hf-qwen2", "moe-test"])
def test_a_world_that_shrinks_and_grows_computes_what_a_fixed_world_computes(tmp_path, budget, fixed_runs, model,
                                                                             request):
    """4 workers (fsdp=4, --redundancy 1: each worker's pieces also kept by the next); after step 2
    worker 3 gets SIGTERM and leaves (4 -> 3, fsdp=3); inside step 4 rank 1 is SIGKILLed before
    the step is committed (3 -> 2, its pieces from the copies rank 2 kept, step 4 run again); after
    step 6 two workers the coordinator started join (2 -> 4). The global batch of 6 splits
    unevenly among 4 workers. Losses and the final parameters and AdamW state equal the fixed
    run's (one process: by the numerics contract, what any fixed world computes), and no step is lost, for
    the `test` GPT, the README's own module (a plain nn.Module), a Qwen2 model run by
    transformers' modules (`hf:DIR`, its saved weights) and the mixture of experts `moe-test`
    (under `WITH_EP`). (Recovery from a layout's replicas: the next test.)"""
    if model == "qwen2":
        model = request.getfixturevalue("qwen2")
    fixed = fixed_runs(model)
    layouts = WITH_EP if model == "moe-test" else SHARDED
    run = _train(tmp_path, "--model", model, "--elastic", "--nproc", "4", "--max-nproc", "4", "--redundancy", "1",
                 *layouts, "--inject", "2:leave=3", "--inject", "4:kill=1", "--inject", "6:join=2",
                 "--metrics", str(tmp_path / "elastic.jsonl"), "--save", str(tmp_path / "elastic"),
                 "--log-dir", str(tmp_path / "logs"), timeout=budget.left())
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    assert _all_gone(str(tmp_path))

    events = [r for r in metrics(tmp_path / "elastic.jsonl") if r.get("event") == "membership"]
    four, two = ("fsdp=2,ep=2", "ep=2") if model == "moe-test" else ("fsdp=4", "fsdp=2")
    assert [(e["step"], e["kind"], e["from_world"], e["to_world"], e["from"], e["to"], e["recovered_from"])
            for e in events] == [
        (2, "leave", 4, 3, four, "fsdp=3", "none"), (3, "crash", 3, 2, "fsdp=3", two, "redundancy"),
        (6, "join", 2, 4, two, four, "none")]
    assert all(e["steps_lost"] == 0 and e["pause_seconds"] > 0 and e["bytes_moved"] > 0 for e in events)
    # A crash is not seen coming; whether the others were (`lookout`) depends on the timing.
    assert events[1]["planned_ahead"] is False and all(isinstance(e["planned_ahead"], bool) for e in events)
    assert "leave: 4 -> 3 workers after step 2" in run.stdout
    summary = metrics(tmp_path / "elastic.jsonl")[-1]  # said and recorded at the end, by the last world's rank 0
    assert (summary["event"], summary["step"], summary["change"], summary["changes"]) == (
        "summary", STEPS, "change of world", len(events))
    assert f"done: {summary['steps']} steps" in run.stdout and f"; {len(events)} changes of world took" in run.stdout
    assert "exited with code -9; the others go on without it" in run.stderr
    got, want = step_losses(tmp_path / "elastic.jsonl"), step_losses(fixed / "fixed.jsonl")
    assert sorted(got) == list(range(1, STEPS + 1))
    _assert_same_losses(got, want)
    assert want[1] != want[STEPS]  # not vacuous: training moved the loss

    elastic, reference = _final_state(tmp_path / "elastic"), _final_state(fixed / "ckpt")
    tensors = [k for k in reference if k.startswith(("param:", "exp_avg"))]
    assert tensors and set(elastic) == set(reference)
    # transformers' RMSNorm and rotary angles run in float32 in a float64 model: a sum taken in another
    # order can round one of their outputs the other way, which eight AdamW steps carry into the state
    # at float32's relative precision (the losses above still agree to 1e-9).
    rtol, atol = (1e-6, 1e-8) if model.startswith("hf:") else (RTOL, 1e-12)
    for key in tensors:
        torch.testing.assert_close(elastic[key], reference[key], rtol=rtol, atol=atol, msg=key)
    assert torch.equal(elastic["progress:train"], reference["progress:train"])


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
    """A corpus prepared with a byte-level BPE of 300 tokens, a fifth of its documents held out."""
    from shardshift.data.corpus import load_tokens
    from shardshift.data.prepare import prepare

    root = tmp_path_factory.mktemp("prepared")
    text = bytes(load_tokens(None)[:60_000]).decode("utf-8", errors="ignore")
    for i in range(0, len(text), 2000):
        (root / f"doc-{i:06d}.txt").write_text(text[i:i + 2000])
    prepare([str(root / "doc-*.txt")], "bpe:300", root / "data", val_fraction=0.2)
    return str(root / "data")


def test_an_elastic_run_on_prepared_data_in_micro_batches_of_one_computes_what_four_workers_compute(
        tmp_path, budget, prepared):
    """The run of the first test on a prepared BPE corpus, each worker running its share of the
    global batch of 6 one sequence at a time (--micro-batch-size 1: 2 micro-batches on 4 workers,
    the last two ending on an empty one, 2 on 3, 3 on 2), with the held-out loss every 4 steps:
    losses and held-out losses equal the fixed run of 4 workers under fsdp=4, whole batches."""
    data = ["--data", prepared, "--eval-every", "4", "--eval-batches", "2"]
    fixed = _train(tmp_path, *data, "--nproc", "4", "--layout", "fsdp=4", "--metrics", str(tmp_path / "fixed.jsonl"),
                   timeout=budget.left())
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    run = _train(tmp_path, *data, "--micro-batch-size", "1", "--elastic", "--nproc", "4", "--max-nproc", "4",
                 "--redundancy", "1", *SHARDED, "--inject", "2:leave=3", "--inject", "4:kill=1", "--inject",
                 "6:join=2", "--metrics", str(tmp_path / "elastic.jsonl"), "--log-dir", str(tmp_path / "logs"),
                 timeout=budget.left())
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    assert _all_gone(str(tmp_path))
    events = [r for r in metrics(tmp_path / "elastic.jsonl") if r.get("event") == "membership"]
    assert [(e["kind"], e["from_world"], e["to_world"]) for e in events] == [
        ("leave", 4, 3), ("crash", 3, 2), ("join", 2, 4)]
    got, want = step_losses(tmp_path / "elastic.jsonl"), step_losses(tmp_path / "fixed.jsonl")
    assert sorted(got) == list(range(1, STEPS + 1))
    _assert_same_losses(got, want)

    def held_out(path):
        return {r["step"]: r["held_out_loss"] for r in metrics(path) if r.get("event") == "eval"}

    assert sorted(held_out(tmp_path / "fixed.jsonl")) == [4, 8]
    _assert_same_losses(held_out(tmp_path / "elastic.jsonl"), held_out(tmp_path / "fixed.jsonl"))
    assert "held-out" in run.stdout.splitlines()[-1]  # the end-of-run line gives it


def test_without_layout_for_the_policy_picks_the_layouts_that_fit_the_memory_given(tmp_path, budget, fixed):
    """No --layout-for: the layout policy picks each world's layout. Under --memory-per-worker
    900K the test model's state replicated on every worker does not fit (the policy's first choice
    without a limit), so both worlds get a sharded layout; each is the one the policy computes
    from the same command line (calibrating on one layout's steps only scales the prices, which
    keeps the choice), and the losses stay the fixed run's."""
    from shardshift.cli.main import build_parser
    from shardshift.cli.train import elastic_job
    from shardshift.elastic.config import check_every_world

    argv = ["train", *RUN, "--elastic", "--nproc", "4", "--min-nproc", "3", "--memory-per-worker", "900K"]
    _, cfg, ecfg = elastic_job(build_parser(argv).parse_args(argv))
    expected = check_every_world(ecfg, cfg)
    unlimited = check_every_world(dataclasses.replace(ecfg, memory_per_worker=None), cfg)
    assert expected[4] != unlimited[4] and expected[3] != unlimited[3]
    run = run_shardshift([*argv, "--inject", "2:leave=3", "--metrics",
                          str(tmp_path / "elastic.jsonl"), "--log-dir", str(tmp_path / "logs")],
                         timeout=budget.left())
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    assert f"elastically under {expected[4]} on 4 cpu workers" in run.stdout
    events = [r for r in metrics(tmp_path / "elastic.jsonl") if r.get("event") == "membership"]
    assert [(e["from"], e["to"]) for e in events] == [(str(expected[4]), str(expected[3]))]
    got, want = step_losses(tmp_path / "elastic.jsonl"), step_losses(fixed / "fixed.jsonl")
    _assert_same_losses(got, want)
    assert _all_gone(str(tmp_path))


def test_a_leave_noticed_while_the_state_moves_waits_for_the_next_boundary(tmp_path, budget, fixed):
    """Worker 3 leaves after step 3 (4 -> 3); while that change moves the state, worker 1 gets a
    real SIGTERM. The move completes; worker 1 leaves after step 4 (3 -> 2), and the losses stay
    the fixed run's. Then a worker joins after step 5: fsdp=3 again, with a fresh worker at another
    coordinate, saving after every step. (DTensor caches sharding decisions by mesh value; a stale
    one gave a world shaped like an earlier one that world's coordinates, and DCP refused the
    save.) The last checkpoint equals the fixed run's. The workers' layers are compiled
    (``--compile aot_eager``), and compiled again in each world; TensorBoard's reader reads the three
    changes of world from the files the worlds' rank 0 wrote."""
    run = _train(tmp_path, "--elastic", "--nproc", "4", "--max-nproc", "4", *SHARDED, "--inject", "3:leave=3",
                 "--inject", "2:term=1", "--inject", "5:join=1", "--save", str(tmp_path / "elastic"), "--save-every",
                 "1", "--metrics", str(tmp_path / "elastic.jsonl"), "--log-dir", str(tmp_path / "logs"),
                 "--compile", "aot_eager", "--tensorboard", str(tmp_path / "tb"), timeout=budget.left())
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    events = [r for r in metrics(tmp_path / "elastic.jsonl") if r.get("event") == "membership"]
    assert [(e["step"], e["kind"], e["from_world"], e["to_world"]) for e in events] == [
        (3, "leave", 4, 3), (4, "leave", 3, 2), (5, "join", 2, 3)]
    assert "worker 1 left after step 4" in (tmp_path / "logs" / "worker-1.log").read_text()
    got, want = step_losses(tmp_path / "elastic.jsonl"), step_losses(fixed / "fixed.jsonl")
    assert sorted(got) == list(range(1, STEPS + 1))
    _assert_same_losses(got, want)
    assert [p.name for p in checkpoints(tmp_path / "elastic")][0] == f"step-{STEPS:08d}"
    elastic, reference = _final_state(tmp_path / "elastic"), _final_state(fixed / "ckpt")
    for key in (k for k in reference if k.startswith(("param:", "exp_avg"))):
        torch.testing.assert_close(elastic[key], reference[key], rtol=RTOL, atol=1e-12, msg=key)
    compiled = {r["step"]: r.get("compiled_graphs", 0) for r in metrics(tmp_path / "elastic.jsonl") if "loss" in r}
    assert compiled[1] > 0, compiled
    board = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    board.Reload()
    assert [(e.step, e.value) for e in board.Scalars("membership/world_size")] == [(3, 3), (4, 2), (5, 3)]
    assert [(e.step, e.value) for e in board.Scalars("train/loss")] == [
        (step, pytest.approx(loss, rel=1e-6)) for step, loss in sorted(got.items())]
    assert _all_gone(str(tmp_path))


def test_a_crash_with_no_copy_goes_on_from_the_checkpoint_and_reports_the_steps_lost(tmp_path, budget, fixed):
    """fsdp=2 keeps one copy of each piece: when rank 1 is SIGKILLed inside step 4, the survivor
    loads the step-2 checkpoint (step 3 is lost and run again), and the losses from there on are
    the uninterrupted run's."""
    run = _train(tmp_path, "--elastic", "--nproc", "2", *SHARDED, "--inject", "4:kill=1", "--save", str(tmp_path / "ckpt"),
                 "--save-every", "2", "--metrics", str(tmp_path / "elastic.jsonl"), "--log-dir", str(tmp_path / "logs"),
                 timeout=budget.left())
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    assert _all_gone(str(tmp_path))
    events = [r for r in metrics(tmp_path / "elastic.jsonl") if r.get("event") == "membership"]
    assert [(e["step"], e["kind"], e["from_world"], e["to_world"], e["steps_lost"], e["recovered_from"])
            for e in events] == [(2, "crash", 2, 1, 1, "checkpoint")]
    assert "1 step(s) lost, from" in run.stdout
    got, want = step_losses(tmp_path / "elastic.jsonl"), step_losses(fixed / "fixed.jsonl")
    assert sorted(got) == list(range(1, STEPS + 1))
    _assert_same_losses(got, want)


def test_more_crashes_at_once_than_the_redundancy_covers_stop_the_job_saying_so(tmp_path, budget):
    """fsdp=4 with --redundancy 1: ranks 1 and 2 are SIGKILLed inside the same step; rank 1's
    pieces were only on ranks 1 and 2, and there is no checkpoint: the job stops, naming both."""
    run = _train(tmp_path, "--elastic", "--nproc", "4", *SHARDED, "--redundancy", "1", "--inject", "3:kill=1,2",
                 "--log-dir", str(tmp_path / "logs"), timeout=budget.left())
    assert run.returncode == 1, run.stderr[-3000:]
    assert "workers [1, 2] were lost after step 2 and " in run.stderr
    assert "(more workers failed at once than --redundancy 1 covers); there is no checkpoint either" in run.stderr
    assert _all_gone(str(tmp_path))


def test_a_crash_below_the_smallest_world_stops_the_job_naming_it(tmp_path, budget):
    run = _train(tmp_path, "--elastic", "--nproc", "2", "--min-nproc", "2", "--inject", "3:kill=1",
                 "--log-dir", str(tmp_path / "logs"), timeout=budget.left())
    assert run.returncode == 1, run.stderr[-3000:]
    assert "workers [1] were lost after step 2, leaving 1, fewer than --min-nproc 2: the job stops" in run.stderr
    assert _all_gone(str(tmp_path))


def test_leaving_below_the_smallest_world_stops_the_job_and_saves(tmp_path, budget):
    run = _train(tmp_path, "--elastic", "--nproc", "2", "--min-nproc", "2", "--inject", "3:leave=1",
                 "--save", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "logs"), timeout=budget.left())
    assert run.returncode == 128 + signal.SIGTERM, run.stderr[-3000:]
    assert "would leave 1, fewer than --min-nproc 2: stopping the job" in run.stdout + run.stderr
    assert [p.name for p in checkpoints(tmp_path / "ckpt")] == ["step-00000003"]
    assert _all_gone(str(tmp_path))


def test_a_signal_to_the_coordinator_stops_every_worker_after_a_save(tmp_path, budget):
    job = subprocess.Popen([sys.executable, "-m", "shardshift", "train", *RUN[:-4], "--steps", "100000", "--log-every",
                            "1", "--elastic", "--nproc", "2", "--save", str(tmp_path / "ckpt"), "--log-dir",
                            str(tmp_path / "logs"), "--timeout", "60"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in job.stdout:
            if line.startswith("step     3"):
                break
        job.send_signal(signal.SIGTERM)
        out, err = job.communicate(timeout=budget.left())
    finally:
        job.kill()
    assert job.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert checkpoints(tmp_path / "ckpt"), out + err
    assert _all_gone(str(tmp_path))


def _signal_a_joiner(tmp_path, budget, sig: int, *args: str) -> tuple[subprocess.Popen, str]:
    """Run a 2-worker elastic job with `args` (scripted joins), send `sig` to the first joiner the
    coordinator starts as soon as it exists; the ended job and its stderr."""
    job = subprocess.Popen([sys.executable, "-m", "shardshift", "train", *RUN, "--elastic", "--nproc", "2", *args,
                            "--metrics", str(tmp_path / "elastic.jsonl"), "--log-dir", str(tmp_path / "logs")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (joiners := _named("joiner-")) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert joiners, "no joiner was started"
        os.kill(min(joiners), sig)
        _, err = job.communicate(timeout=budget.left())
    finally:
        job.kill()
    return job, err


def test_a_joiner_killed_before_it_is_admitted_is_passed_over(tmp_path, budget, fixed):
    """The coordinator starts two joiners for a scripted join of two; one is SIGKILLed as soon as
    it exists. The job admits the other after step 4 (2 -> 3 workers), finishes, and computes the
    fixed run's losses; no process is left."""
    job, err = _signal_a_joiner(tmp_path, budget, signal.SIGKILL, "--max-nproc", "4", "--inject", "4:join=2")
    assert job.returncode == 0, err[-3000:]
    assert "exited with code -9 before it was admitted; the job goes on" in err
    events = [r for r in metrics(tmp_path / "elastic.jsonl") if r.get("event") == "membership"]
    assert [(e["step"], e["kind"], e["from_world"], e["to_world"]) for e in events] == [(4, "join", 2, 3)]
    got, want = step_losses(tmp_path / "elastic.jsonl"), step_losses(fixed / "fixed.jsonl")
    _assert_same_losses(got, want)
    assert _all_gone(str(tmp_path)) and _all_gone("shardshift join --coordinator")


def test_a_joiner_stuck_getting_ready_is_waited_for_until_the_timeout_then_the_job_goes_on(tmp_path, budget):
    """The coordinator starts a joiner for a scripted join; it is SIGSTOPped as soon as it exists
    (a frozen host: neither ready nor dead). The job waits for it after step 3 for half of --timeout,
    says so, goes on with the workers it has, and finishes; the stopped joiner is killed at the
    end and nothing is left."""
    job, err = _signal_a_joiner(tmp_path, budget, signal.SIGSTOP, "--inject", "3:join=1", "--timeout", "6")
    assert job.returncode == 0, err[-3000:]
    assert "0 of the 1 worker(s) to join after step 3 were ready within 3 s (half of --timeout); the job goes on" in err
    assert not [r for r in metrics(tmp_path / "elastic.jsonl") if r.get("event") == "membership"]
    assert sorted(step_losses(tmp_path / "elastic.jsonl")) == list(range(1, STEPS + 1))
    assert _all_gone(str(tmp_path)) and _all_gone("shardshift join --coordinator")


def test_a_worker_killed_while_the_state_moves_with_no_copy_goes_on_from_the_checkpoint(tmp_path, budget, fixed):
    """After step 3 a joiner is admitted (2 -> 3 workers, fsdp: no replica); as the state starts to
    move, worker 1 of the old world gets a real SIGKILL. Its pieces have no other holder, so the
    two that live (worker 0 and the joiner) form a world from the checkpoint of step 3, losing no
    step (one is saved every step), and the job ends with the fixed run's losses, without waiting
    for the workers' --timeout (300 s, more than this test allows)."""
    ckpt = tmp_path / "ckpt"
    run = _train(tmp_path, "--elastic", "--nproc", "2", *SHARDED, "--inject", "3:join=1", "--inject", "2:movekill=1",
                 "--save", str(ckpt), "--save-every", "1", "--timeout", "300", "--log-dir", str(tmp_path / "logs"),
                 "--metrics", str(tmp_path / "elastic.jsonl"), timeout=min(budget.left(), 150))
    assert run.returncode == 0, run.stderr[-3000:]
    events = [r for r in metrics(tmp_path / "elastic.jsonl") if r.get("event") == "membership"]
    assert [(e["kind"], e["from_world"], e["to_world"], e["recovered_from"], e["steps_lost"]) for e in events] == [
        ("crash", 2, 2, "checkpoint", 0)]
    _assert_same_losses(step_losses(tmp_path / "elastic.jsonl"), step_losses(fixed / "fixed.jsonl"))
    assert _all_gone(str(tmp_path)) and _all_gone("shardshift join --coordinator")


def test_a_killed_coordinator_leaves_no_worker_behind(tmp_path, budget):
    """The coordinator serves the store every worker needs: when it is SIGKILLed, its workers get
    SIGTERM from the kernel and, with the store gone, cannot go on; they all exit, and remove the
    coordinator's directory of default logs (checked by the autouse fixture)."""
    job = subprocess.Popen([sys.executable, "-m", "shardshift", "train", *RUN[:-4], "--steps", "100000", "--log-every",
                            "1", "--elastic", "--nproc", "2", "--inject", "100000:join=1", "--metrics",
                            str(tmp_path / "run.jsonl"), "--timeout", "30"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in job.stdout:
            if line.startswith("step     3"):
                break
        assert len(_job_pids(str(tmp_path))) >= 3  # the coordinator and its two workers
        job.kill()
        job.wait(timeout=30)
        assert _all_gone(str(tmp_path), seconds=60), _job_pids(str(tmp_path))
        assert _all_gone("shardshift join --coordinator", seconds=30)
    finally:
        job.kill()


def test_a_frozen_worker_is_found_by_its_missing_heartbeat_and_the_job_goes_on(tmp_path, budget):
    """SIGSTOP freezes worker 1 of a dp=2 job (its connections stay open: gloo alone would wait for
    the collective timeout). Its heartbeat stops; after --heartbeat-timeout the coordinator kills
    it, and worker 0 goes on alone from its replica, losing no step."""
    fixed = _train(tmp_path, "--nproc", "1", "--steps", "30", "--metrics", str(tmp_path / "fixed.jsonl"),
                   timeout=budget.left())
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    job = subprocess.Popen([sys.executable, "-m", "shardshift", "train", *RUN, "--steps", "30", "--elastic",
                            "--nproc", "2", "--layout", "dp=2", "--heartbeat-timeout", "2", "--timeout", "120",
                            "--metrics", str(tmp_path / "elastic.jsonl"), "--log-dir", str(tmp_path / "logs")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in job.stdout:
            if line.startswith("step     2"):
                break
        frozen = [pid for pid in _job_pids(str(tmp_path / "logs")) if pid in _named("worker-1")]
        assert len(frozen) == 1
        os.kill(frozen[0], signal.SIGSTOP)
        out, err = job.communicate(timeout=budget.left())
    finally:
        job.kill()
    assert job.returncode == 0, err[-3000:]
    assert "worker-1 sent no heartbeat for 2 s; killed it" in err
    events = [r for r in metrics(tmp_path / "elastic.jsonl") if r.get("event") == "membership"]
    assert [(e["kind"], e["from_world"], e["to_world"], e["steps_lost"], e["recovered_from"]) for e in events] == [
        ("crash", 2, 1, 0, "replica")]
    got, want = step_losses(tmp_path / "elastic.jsonl"), step_losses(tmp_path / "fixed.jsonl")
    assert sorted(got) == list(range(1, 31))
    _assert_same_losses(got, want)
    assert _all_gone(str(tmp_path))


def _wait_for(found, what: str, job: subprocess.Popen, log, budget):
    """`found()`'s first value that is not None, polled while `job` runs (up to half the test's time
    left); the job's output `log` shows if none comes."""
    deadline = time.monotonic() + budget.left() / 2
    while (value := found()) is None and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.05)
    assert value is not None, f"no {what}:\n{log.read_text()[-3000:]}"
    return value


def test_a_worker_started_elsewhere_that_dies_is_found_by_its_heartbeat_and_the_job_goes_on(tmp_path, budget):
    """A worker this test starts itself (`shardshift join`: not the coordinator's child, so no exit
    status tells it apart) joins a dp=2 job (2 -> 3 workers, dp=3) and is SIGKILLed. Its heartbeat
    stops; after --heartbeat-timeout the coordinator takes it for crashed, and the others take its
    pieces from their replicas and go on, losing no step, until the job is stopped; nothing is left."""
    log, events_file = tmp_path / "job.out", tmp_path / "elastic.jsonl"

    def wait_for(found, what: str):
        return _wait_for(found, what, job, log, budget)

    def event(kind: str):
        records = metrics(events_file) if events_file.exists() else []
        return next((r for r in records if r.get("event") == "membership" and r["kind"] == kind), None)

    with open(log, "w") as out:
        job = subprocess.Popen([sys.executable, "-m", "shardshift", "train", *RUN[:-4], "--steps", "100000",
                                "--log-every", "1", "--elastic", "--nproc", "2", "--max-nproc", "3", "--layout", "dp=2",
                                "--layout-for", "3:dp=3", "--heartbeat-timeout", "2", "--timeout", "30", "--metrics",
                                str(events_file), "--log-dir", str(tmp_path / "logs")],
                               stdout=out, stderr=subprocess.PIPE, text=True)
    joiner = None
    try:
        address = wait_for(lambda: (m := re.search(r"coordinator at (\S+?:\d+):", log.read_text())) and m.group(1),
                           "coordinator address")
        joiner = subprocess.Popen([sys.executable, "-m", "shardshift", "join", "--coordinator", address, "--timeout",
                                   "120"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: event("join"), "join")
        # Killed during a step, a survivor may be blocked in a collective with the other survivor
        # (a ring's other side), which gloo cannot cancel: it waits out --timeout (30 s here).
        joiner.kill()
        joiner.wait(timeout=30)
        crash = wait_for(lambda: event("crash"), "crash")
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=budget.left())
    finally:
        for proc in (job, joiner):
            if proc is not None:
                proc.kill()
    assert job.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "worker 2 (started elsewhere) sent no heartbeat for 2 s; the others go on without it" in err
    assert (crash["from_world"], crash["to_world"], crash["recovered_from"], crash["steps_lost"]) == (3, 2, "replica", 0)
    assert _all_gone(str(tmp_path)) and _all_gone("shardshift join --coordinator")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_join_nproc_starts_workers_that_leave_on_notice_when_it_is_stopped_or_killed(tmp_path, budget, sig):
    """`shardshift join --nproc 2` from a shell starts two workers, admitted together or one
    boundary apart (2 -> 4 workers). A SIGTERM to it is a notice to each; a SIGKILL leaves them its
    death signal (a SIGTERM from the kernel): either way both leave at a step boundary, their state
    moved to the others, and the job goes on with 2 until it is stopped; nothing is left."""
    log, events_file = tmp_path / "job.out", tmp_path / "elastic.jsonl"

    def wait_for(found, what: str):
        return _wait_for(found, what, job, log, budget)

    def events() -> list[dict]:
        records = metrics(events_file) if events_file.exists() else []
        return [r for r in records if r.get("event") == "membership"]

    with open(log, "w") as out:
        job = subprocess.Popen([sys.executable, "-m", "shardshift", "train", *RUN[:-4], "--steps", "100000",
                                "--log-every", "1", "--elastic", "--nproc", "2", "--max-nproc", "4", *SHARDED,
                                "--timeout", "60", "--metrics", str(events_file), "--log-dir", str(tmp_path / "logs")],
                               stdout=out, stderr=subprocess.PIPE, text=True)
    joiners = None
    try:
        address = wait_for(lambda: (m := re.search(r"coordinator at (\S+?:\d+):", log.read_text())) and m.group(1),
                           "coordinator address")
        joiners = subprocess.Popen([sys.executable, "-m", "shardshift", "join", "--coordinator", address, "--nproc",
                                    "2", "--timeout", "120"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   text=True)
        wait_for(lambda: next((e for e in events() if e["to_world"] == 4), None), "world of 4")
        workers = _job_pids(f"join --coordinator {address} --timeout")
        assert len(workers) == 2, workers  # the two it started (their command line has no --nproc)
        joiners.send_signal(sig)
        joiners.wait(timeout=60)
        wait_for(lambda: next((e for e in events() if e["kind"] == "leave" and e["to_world"] == 2), None),
                 "both leaving")
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=budget.left())
    finally:
        for proc in (job, joiners):
            if proc is not None:
                proc.kill()
    assert job.returncode == 128 + signal.SIGTERM, err[-3000:]
    leaves = [(e["from_world"], e["to_world"], e["steps_lost"]) for e in events() if e["kind"] == "leave"]
    assert leaves in ([(4, 2, 0)], [(4, 3, 0), (3, 2, 0)]), leaves
    assert joiners.returncode == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
    assert _all_gone(str(tmp_path)) and _all_gone(f"join --coordinator {address}")
    assert not [pid for pid in workers if _running(pid)]


def _running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (one whose parent was killed may wait for a
    reaper that never comes: it is dead all the same)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


HOSTS_TOPOLOGY = """\
name: two-hosts
ranks: [a, b]
links:
  - {between: [a, b], bandwidth: 1 Gbit/s}
"""


def test_an_elastic_job_runs_its_data_axes_on_trees_packed_for_each_world(tmp_path, budget, fixed):
    """--collectives trees under --elastic, on a topology whose ranks name hosts (every worker here
    says it runs on host a): each world's FSDP2 collectives run on trees packed on the part of the
    network its workers see, through a join (2 -> 3) and a leave (3 -> 2); the float64 losses equal
    one process on gloo, and the last world counted its calls on trees. A worker on a host the
    topology does not name is refused, naming it."""
    topology = tmp_path / "hosts.yaml"
    topology.write_text(HOSTS_TOPOLOGY)
    env = {**os.environ, "SHARDSHIFT_HOST": "a"}
    args = ["train", *RUN, "--elastic", "--nproc", "2", "--max-nproc", "3", *SHARDED, "--collectives", "trees",
            "--topology", str(topology), "--inject", "3:join=1", "--inject", "5:leave=1"]
    run = run_shardshift([*args, "--metrics", str(tmp_path / "elastic.jsonl")], timeout=budget.left(), env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    records = metrics(tmp_path / "elastic.jsonl")
    changes = [(e["kind"], e["from_world"], e["to_world"]) for e in records if e.get("event") == "membership"]
    assert changes == [("join", 2, 3), ("leave", 3, 2)]
    _assert_same_losses(step_losses(tmp_path / "elastic.jsonl"), step_losses(fixed / "fixed.jsonl"))
    summary = records[-1]
    assert summary["event"] == "summary" and summary["tree_calls"].get("allgather", 0) > 0, summary
    refused = run_shardshift(args, timeout=budget.left(), env={**env, "SHARDSHIFT_HOST": "c"})
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "no rank named c (a worker's host)" in refused.stderr


def test_join_without_a_job_there_says_so(budget):
    run = run_shardshift(["join", "--coordinator", "127.0.0.1:9", "--timeout", "2"],
                         timeout=budget.left())
    assert run.returncode == 2
    assert "--coordinator 127.0.0.1:9: no elastic job answers there" in run.stderr


@pytest.mark.parametrize("differs", ["data", "save"])
def test_a_joiner_whose_data_or_save_directory_differs_from_the_jobs_is_refused_naming_it(tmp_path, budget,
                                                                                          differs):
    """`shardshift join` reads the job's command line, so it trains the same model on the same
    --data path and saves into the same --save path; but on its host those paths may hold other
    bytes, or be another directory. The job publishes what a worker must share (versions, model,
    data digest, a token in --save): a joiner that differs is refused, exit 2, naming the
    difference, and the job goes on untouched."""
    data, save = tmp_path / "text.txt", tmp_path / "ckpt"
    data.write_text("to be or not to be, that is the question\n" * 200)
    job = subprocess.Popen([sys.executable, "-m", "shardshift", "train", "--model", "test", "--global-batch", "6",
                            "--steps", "100000", "--log-every", "1", "--data", str(data), "--save", str(save),
                            "--elastic", "--nproc", "2", "--max-nproc", "3", "--timeout", "30",
                            "--log-dir", str(tmp_path / "logs")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        address = coordinator_address(job.stdout, until="step     2")
        assert address is not None
        if differs == "data":  # as another host's file at the same path
            data.write_text("all the world's a stage, and all the men and women merely players\n" * 200)
            named = "this worker's data (digest of --data) is "
        else:  # as another host's directory at the same path
            (save / ".shardshift-job").unlink()
            named = f"--save {save} on this host is not the directory the job saves into"
        joiner = run_shardshift(["join", "--coordinator", address, "--timeout", "30"], timeout=budget.left())
        assert joiner.returncode == 2, joiner.stderr[-3000:]
        assert joiner.stderr.startswith(f"shardshift: error: {named}"), joiner.stderr[-3000:]
        assert joiner.stderr.count("\n") == 1, joiner.stderr[-3000:]
        assert job.poll() is None  # the job trains on
        job.send_signal(signal.SIGTERM)
        job.communicate(timeout=budget.left())
        assert job.returncode == 128 + signal.SIGTERM
    finally:
        job.kill()
    assert _all_gone(str(tmp_path))
