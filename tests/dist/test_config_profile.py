"""`shardshift train --config FILE` runs what the same flags run, and records its configuration;
`--profile A:B` leaves a Chrome trace per rank.

One run from flags and one from a config file (with --run-dir and --profile 2:2), in float64 on 2
ranks: the profiler only watches, so the losses are equal exactly."""

from __future__ import annotations

import json
import tomllib

from support.cli import run_shardshift
from support.training import step_losses

FLAGS = ["--model", "test", "--nproc", "2", "--steps", "2", "--global-batch", "4", "--dtype", "float64"]
CONFIG = 'model = "test"\nnproc = 2\nsteps = 2\nglobal_batch = 4\ndtype = "float64"\nprofile = "2:2"\n'


def test_a_config_file_runs_what_its_flags_run_and_is_recorded_with_a_profile(tmp_path, budget):
    flags = run_shardshift(["train", *FLAGS, "--metrics", tmp_path / "flags.jsonl"], timeout=budget.left())
    assert flags.returncode == 0, flags.stderr[-3000:]
    (tmp_path / "run.toml").write_text(CONFIG)
    run_dir = tmp_path / "run"
    config = run_shardshift(["train", "--config", "run.toml", "--run-dir", "run"], timeout=budget.left(),
                            cwd=tmp_path)  # a relative path: the ranks never read the file themselves
    assert config.returncode == 0, config.stderr[-3000:]

    reference = step_losses(tmp_path / "flags.jsonl")
    assert sorted(reference) == [1, 2]
    assert step_losses(run_dir / "metrics.jsonl") == reference

    recorded = tomllib.loads((run_dir / "config.toml").read_text())
    assert {key: recorded[key] for key in tomllib.loads(CONFIG)} == tomllib.loads(CONFIG)
    assert recorded["run_dir"] == "run"
    manifest = json.loads((run_dir / "checkpoints" / "step-00000002" / "shardshift.json").read_text())
    assert manifest["config"] == manifest["config"] | {"model": "test", "steps": 2, "global_batch": 4,
                                                       "dtype": "float64", "layout": "dp=2"}

    for rank in (0, 1):
        trace = json.loads((run_dir / f"profile-rank-{rank}.json").read_text())
        assert trace["traceEvents"], f"rank {rank}'s trace holds no events"
        assert trace["distributedInfo"]["rank"] == rank
