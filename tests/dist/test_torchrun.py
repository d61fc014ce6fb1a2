"""The same entry point runs under torchrun (its rendezvous on a free port: --standalone)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from support.cli import run_shardshift
from support.training import step_losses


def test_torchrun_matches_the_local_launcher(tmp_path, budget):
    common = ["train", "--model", "test", "--dtype", "float64", "--steps", "3", "--global-batch", "4",
              "--log-every", "0"]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    under_torchrun = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "shardshift", *common,
         "--layout", "tp=2", "--switch", "2:fsdp=2", "--switch", "3:pp=2", "--save", str(tmp_path / "ckpt"),
         "--metrics", str(tmp_path / "torchrun.jsonl"), "--tensorboard", str(tmp_path / "tb")],
        capture_output=True, text=True, timeout=budget.left(),
    )
    assert under_torchrun.returncode == 0, under_torchrun.stderr[-3000:]
    local = run_shardshift(
        [*common, "--nproc", "1",
         "--metrics", str(tmp_path / "local.jsonl")],
        timeout=budget.left(),
    )
    assert local.returncode == 0, local.stderr[-3000:]
    records = [json.loads(line) for line in open(tmp_path / "torchrun.jsonl")]
    # Rank 0 alone wrote the metrics; the layout was switched online twice under torchrun.
    assert [r.get("layout", r.get("event")) for r in records] == ["tp=2", "switch", "fsdp=2", "switch", "pp=2", "summary"]
    torch.testing.assert_close(
        torch.tensor(list(step_losses(tmp_path / "torchrun.jsonl").values()), dtype=torch.float64),
        torch.tensor(list(step_losses(tmp_path / "local.jsonl").values()), dtype=torch.float64), rtol=1e-9, atol=0,
    )

    # The same records, as TensorBoard's own reader reads its event file (scalars in float32).
    board = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    board.Reload()
    losses = [(e.step, e.value) for e in board.Scalars("train/loss")]
    assert losses == [(s, pytest.approx(loss, rel=1e-6)) for s, loss in step_losses(tmp_path / "torchrun.jsonl").items()]
    assert [e.step for e in board.Scalars("switch/seconds")] == [2, 3]
    texts = [e.tensor_proto.string_val[0].decode() for e in board.Tensors("events/switch")]
    assert [text.split(" in ")[0] for text in texts] == ["switched tp=2 -> fsdp=2 before step 2",
                                                        "switched fsdp=2 -> pp=2 before step 3"], texts
    assert [e.step for e in board.Tensors("events/summary")] == [3]

    # A resume under torchrun checks the run's identity too (nothing runs before its workers).
    other = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "shardshift", *common, "--steps", "6",
         "--resume", str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=budget.left(),
    )
    assert other.returncode != 0
    assert "was saved by another run: --steps: steps is 3 in the checkpoint, 6 in this run" in other.stderr
    ours = [line for line in other.stderr.splitlines() if line.strip().startswith("File ") and "/shardshift/" in line]
    assert ours == [], other.stderr[-3000:]  # one line from us; the traceback after it is torchrun's own

    # So does saving into a directory of checkpoints the run does not resume from.
    clash = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "shardshift", *common, "--save", str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=budget.left(),
    )
    assert clash.returncode != 0
    assert f"--save {tmp_path / 'ckpt'} holds checkpoints already (newest step-00000003)" in clash.stderr, \
        clash.stderr[-3000:]


def test_elastic_under_torchrun_is_refused_before_anything_starts_with_the_recipe(tmp_path, budget):
    """torchrun forms one fixed world and starts no coordinator: every worker refuses at once, in one
    line that says how to run an elastic job over several machines."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    run = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "shardshift", "train",
                          "--elastic", "--model", "test", "--save", str(tmp_path / "ckpt")],
                         capture_output=True, text=True, timeout=budget.left())
    assert run.returncode != 0
    assert "--elastic does not run under torchrun" in run.stderr and "shardshift join --coordinator" in run.stderr
    assert "KeyError" not in run.stderr and not (tmp_path / "ckpt").exists(), run.stderr[-3000:]
