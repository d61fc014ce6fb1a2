"""Training with `--collectives trees`: DDP's and FSDP2's collectives on packed trees (the
`shardshift` backend) compute what gloo computes (float64, relative 1e-9), in every data-parallel
layout, across an online switch and for the Llama, and they really ran on trees."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardshift.layout import Layout
from shardshift.models import model_spec
from shardshift.train.config import TrainConfig
from shardshift.train.report import tree_calls
from shardshift.train.trainer import Trainer
from support import EXAMPLE_MODEL
from support.cli import run_shardshift
from support.dist import run_distributed
from support.hf import save_hf_model
from support.training import full_parameters

pytestmark = pytest.mark.multiproc

STEPS = 3
RTOL = 1e-9
HETERO4 = str(Path(__file__).parents[2] / "docs" / "topologies" / "hetero4.yaml")
LAYOUTS = ["dp=4", "fsdp=4", "dp=2,fsdp=2"]  # DDP, FSDP2, HSDP: axis groups of the whole job and of part of it


def _config(layout: str, collectives: str, model: str = "test") -> TrainConfig:
    return TrainConfig(layout=Layout.parse(layout), model=model_spec(model), steps=2 * STEPS,
                       dtype="float64", global_batch=8, seed=5, collectives=collectives,
                       topology=HETERO4 if collectives == "trees" else None)


def _train(rank: int, world_size: int, qwen2: str) -> dict:
    out = {}
    for layout in LAYOUTS:
        for collectives in ("gloo", "trees"):
            trainer = Trainer(_config(layout, collectives), rank, "cpu")
            losses = [trainer.train_step().loss for _ in range(STEPS)]
            out[layout, collectives] = {"losses": losses, "params": full_parameters(trainer),
                                        "calls": tree_calls(trainer)}
    # An online switch keeps the trees: the new layout's groups are shardshift groups too. A run
    # that switches computes what one that does not computes (docs/switching.md): dp=4's, on gloo.
    trainer = Trainer(_config("dp=4", "trees"), rank, "cpu")
    losses = [trainer.train_step().loss for _ in range(STEPS - 1)]
    trainer.switch(trainer.prepare_switch(Layout(fsdp=4)))
    losses.append(trainer.train_step().loss)
    out["switch", "trees"] = {"losses": losses, "params": full_parameters(trainer), "calls": tree_calls(trainer)}
    # The Llama, the README's own module and a Qwen2-style Hugging Face model (transformers' modules)
    # under HSDP: gradients all-reduced across replicas and reduce-scattered within them.
    for kind, model in (("llama", "llama-test"), ("own", EXAMPLE_MODEL), ("qwen2", qwen2)):
        for collectives in ("gloo", "trees"):
            trainer = Trainer(_config("dp=2,fsdp=2", collectives, model=model), rank, "cpu")
            losses = [trainer.train_step().loss for _ in range(STEPS)]
            out[kind, collectives] = {"losses": losses, "params": full_parameters(trainer), "calls": tree_calls(trainer)}
    return out


def test_trees_train_as_gloo_does_in_every_data_parallel_layout(tmp_path):
    results = run_distributed(4, _train, save_hf_model("qwen2", tmp_path / "qwen2", weights=False))
    for layout, same in [*((layout, layout) for layout in LAYOUTS), ("switch", "dp=4"), ("llama", "llama"),
                         ("own", "own"), ("qwen2", "qwen2")]:
        gloo, trees = results[0][same, "gloo"], results[0][layout, "trees"]
        torch.testing.assert_close(torch.tensor(trees["losses"]), torch.tensor(gloo["losses"]), rtol=RTOL, atol=0)
        for name, value in gloo["params"].items():
            torch.testing.assert_close(trees["params"][name], value, rtol=RTOL, atol=1e-14, msg=f"{layout} {name}")
        assert all(not r[same, "gloo"]["calls"] for r in results), layout
    # DDP's gradients are all-reduced on trees; FSDP2 gathers parameters and scatters gradients on them;
    # HSDP does both, the all-reduce across its replicas.
    for layout, ops in [("dp=4", {"allreduce"}), ("fsdp=4", {"allgather", "reducescatter"}),
                        ("dp=2,fsdp=2", {"allgather", "reducescatter", "allreduce"}),
                        ("llama", {"allgather", "reducescatter", "allreduce"}),
                        ("own", {"allgather", "reducescatter", "allreduce"}),
                        ("qwen2", {"allgather", "reducescatter", "allreduce"}),
                        ("switch", {"allgather", "reducescatter"})]:  # the fsdp=4 groups after the switch
        for rank, result in enumerate(results):
            calls = result[layout, "trees"]["calls"]
            assert ops <= {op for op, count in calls.items() if count > 0}, (layout, rank, calls)


def test_the_command_trains_on_trees_and_counts_their_calls(tmp_path, budget):
    """The README's command, on the `test` model: its end-of-run line and summary record count the
    calls FSDP2 ran on trees (an all-gather per block and stage root forward and backward, a
    reduce-scatter per one of them backward)."""
    out = run_shardshift(["train", "--nproc", "4", "--layout", "fsdp=4",
                          "--collectives", "trees", "--topology", HETERO4, "--model", "test", "--global-batch", "8",
                          "--steps", "2", "--metrics", str(tmp_path / "run.jsonl")],
                         timeout=budget.left(), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = [json.loads(line) for line in open(tmp_path / "run.jsonl")][-1]
    assert summary["event"] == "summary" and summary["steps"] == 2
    calls = summary["tree_calls"]
    assert set(calls) == {"allgather", "reducescatter"} and calls["allgather"] > calls["reducescatter"] > 0
    assert f"on trees: allgather {calls['allgather']}, reducescatter {calls['reducescatter']}" in out.stdout
