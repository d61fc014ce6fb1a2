"""Save under one layout, resume under another: training goes on as if never interrupted.

DCP reshards on load. The reference is one process training straight through; the runs under test
save at step 3 under layout A and resume under layout B for 3 more steps, all in float64, compared
to a relative 1e-9 (collective sums reorder float additions, nothing else differs).
"""

from __future__ import annotations

import json
import os
import subprocess

import torch

from shardshift.layout import Layout
from shardshift.models import model_spec
from shardshift.train import checkpoint
from shardshift.train.catalog import check_intact
from shardshift.train.config import TrainConfig
from shardshift.train.trainer import Trainer
from support.cli import run_shardshift
from support.dist import run_distributed
from support.training import ATOL, full_parameters, step_losses

STEPS, SAVE_AT = 6, 3
PAIRS = [("fsdp=2,tp=2", "pp=2,dp=2"), ("pp=4", "fsdp=4"), ("dp=2,tp=2", "pp=2,fsdp=2"), ("tp=2,pp=2", "pp=4")]


def _config(text: str) -> TrainConfig:
    layout = Layout.parse(text)
    return TrainConfig(
        layout=layout, model=model_spec("test"), steps=STEPS, seed=5,
        dtype="float64", global_batch=8, micro_batches=4 if layout.pp == 4 else 0,
    )


def _straight(rank: int, world_size: int) -> dict:
    trainer = Trainer(_config("dp=1"), rank, "cpu")
    return {"losses": [trainer.train_step().loss for _ in range(STEPS)], "params": full_parameters(trainer)}


def _save_then_resume(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for before, after in PAIRS:
        directory = os.path.join(root, f"{before}-to-{after}")
        first = Trainer(_config(before), rank, "cpu")
        losses = [first.train_step().loss for _ in range(SAVE_AT)]
        checkpoint.save(first, directory)
        del first
        second = Trainer(_config(after), rank, "cpu")
        checkpoint.load(second, checkpoint.checkpoint_dir(directory, SAVE_AT))
        assert second.progress.step == SAVE_AT and second.progress.position == SAVE_AT * 8
        losses += [second.train_step().loss for _ in range(STEPS - SAVE_AT)]
        out[(before, after)] = {"losses": losses, "params": full_parameters(second)}
    return out


def test_resume_under_another_layout_continues_the_curve(tmp_path, budget):
    reference = run_distributed(1, _straight, timeout_s=budget.left())[0]
    per_rank = run_distributed(4, _save_then_resume, str(tmp_path), timeout_s=budget.left())
    expected = torch.tensor(reference["losses"], dtype=torch.float64)
    for pair in PAIRS:
        manifest = check_intact(checkpoint.checkpoint_dir(str(tmp_path / f"{pair[0]}-to-{pair[1]}"), SAVE_AT))
        assert (manifest.step, manifest.layout) == (SAVE_AT, str(Layout.parse(pair[0])))
        for rank, results in enumerate(per_rank):
            got = torch.tensor(results[pair]["losses"], dtype=torch.float64)
            torch.testing.assert_close(got, expected, rtol=1e-9, atol=0, msg=f"{pair} rank {rank}")
            for name, value in results[pair]["params"].items():
                torch.testing.assert_close(value, reference["params"][name], rtol=1e-9, atol=ATOL)


def _cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return run_shardshift(
        ["train", "--model", "test", "--dtype", "float64",
         "--global-batch", "4", "--seed", "2", "--log-every", "0", *args],
        timeout=timeout,
    )



def test_cli_save_and_resume_under_another_layout(tmp_path, budget):
    ref = _cli("--nproc", "1", "--steps", "4", "--metrics", str(tmp_path / "ref.jsonl"), timeout=budget.left())
    assert ref.returncode == 0, ref.stderr
    first = _cli("--nproc", "2", "--layout", "fsdp=2", "--steps", "4", "--stop-at", "2",
                 "--save", str(tmp_path / "ckpt"), "--metrics", str(tmp_path / "run.jsonl"), timeout=budget.left())
    assert first.returncode == 0, first.stderr
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000002"]
    second = _cli("--nproc", "2", "--layout", "tp=2", "--steps", "4", "--resume", str(tmp_path / "ckpt"),
                  "--metrics", str(tmp_path / "run.jsonl"), timeout=budget.left())
    assert second.returncode == 0, second.stderr
    records = [json.loads(line) for line in open(tmp_path / "run.jsonl")]
    assert [(r.get("event", "step"), r["step"], r.get("layout")) for r in records] == [
        ("step", 1, "fsdp=2"), ("step", 2, "fsdp=2"), ("summary", 2, None), ("resume", 2, "tp=2"), ("step", 3, "tp=2"),
        ("step", 4, "tp=2"), ("summary", 4, None)]
    assert records[3]["checkpoint"] == str(tmp_path / "ckpt" / "step-00000002")
    assert (records[2]["steps"], records[6]["steps"]) == (2, 2)  # each run's own steps
    for record in (r for r in records if "event" not in r):
        assert {"step", "loss", "layout", "step_time_s", "tokens_per_s"} <= record.keys()
        assert isinstance(record["loss"], float)
    torch.testing.assert_close(
        torch.tensor(list(step_losses(tmp_path / "run.jsonl").values()), dtype=torch.float64),
        torch.tensor(list(step_losses(tmp_path / "ref.jsonl").values()), dtype=torch.float64), rtol=1e-9, atol=0,
    )


def _finite_cases(rank: int, world_size: int) -> list[bool]:
    import dataclasses

    trainer = Trainer(dataclasses.replace(_config("fsdp=2"), dtype="float32"), rank, "cpu")
    trainer.train_step()
    state, answers = trainer.state, []
    moment = next(t for key, t in state.tensors().items() if key.startswith("exp_avg_sq:"))
    piece = moment.to_local() if hasattr(moment, "to_local") else moment
    answers.append(state.finite())
    kept = piece.clone()
    for value in (float("inf"), float("nan")):
        piece.view(-1)[-1] = value
        answers.append(state.finite())
    piece.fill_(3e38)  # every element finite, their float32 sum overflows
    answers.append(state.finite())
    piece.copy_(kept)
    return answers


def test_the_finite_check_finds_an_inf_or_a_nan_and_passes_a_sum_that_overflows():
    """`TrainingState.finite` (what a save checks first) sums each piece and only looks at
    elements when the sum is not finite: an inf or a NaN is found, large finite values are not
    mistaken for one."""
    assert run_distributed(2, _finite_cases) == [[True, False, False, True]] * 2
