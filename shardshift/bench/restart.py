"""The checkpoint-and-restart baseline of the benchmarks: what users do today when the layout or the
world changes. A fresh `shardshift train` job (fresh processes, imports, process group, trainer)
resumes from a DCP checkpoint and runs one step; the time until it starts that step is what the
restart costs, before counting the save (the callers add it, or take the checkpoint as given)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from shardshift.launch import dies_with_this_process
from shardshift.train.argv import train_argv
from shardshift.train.config import TrainConfig

# Environment a launcher sets for its workers; the restart job must not inherit it, or its
# `shardshift train` would take itself for a worker of the bench's job.
_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SHARDSHIFT_STORE", "MASTER_ADDR", "MASTER_PORT")


class RestartFailed(RuntimeError):
    """The fresh job did not get through its first step; `reason` is its error line."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class Restart:
    seconds: float  # spawn -> its rank 0 starts the first step (without the save)
    step_seconds: float  # that first step
    job_seconds: float  # spawn -> exit


def restart_job(cfg: TrainConfig, path: Path, step: int, nproc: int, timeout_s: float, work: Path) -> Restart:
    """Run `shardshift train --resume path` under `cfg` on `nproc` fresh processes until it has
    taken step `step` + 1; `work` holds its metrics and its stderr."""
    metrics, log = work / "restart-metrics.jsonl", work / "restart-stderr.txt"
    metrics.unlink(missing_ok=True)
    resumed = dataclasses.replace(cfg, stop_at=step + 1, resume=str(path), metrics=str(metrics))
    argv = [sys.executable, "-m", "shardshift", *train_argv(resumed, nproc=nproc, timeout_s=timeout_s)]
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV}
    with open(log, "w") as err:
        start = time.perf_counter()
        job = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, env=env, text=True,
                               preexec_fn=dies_with_this_process())  # a launcher of its own: it dies with this rank
        watchdog = threading.Timer(timeout_s, job.terminate)  # its launcher then stops its workers
        watchdog.start()
        first_line = None
        try:
            for line in job.stdout:
                if first_line is None and line.startswith("step "):
                    first_line = time.perf_counter() - start
            code = job.wait()
        finally:
            watchdog.cancel()
        job_seconds = time.perf_counter() - start
    if code != 0 or first_line is None or not metrics.is_file():
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        errors = [line for line in lines if "Error" in line and "Traceback" not in line]
        reason = errors[-1].split("]:")[-1].strip() if errors else f"exit code {code}"
        tail = "\n".join(lines[-20:])
        raise RestartFailed(f"the restart job {' '.join(argv[2:])} exited with code {code} without "
                            f"finishing a step; its last output:\n{tail}", reason)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    step_seconds = next(r["step_time_s"] for r in records if "step_time_s" in r)  # after its resume event
    return Restart(first_line - step_seconds, step_seconds, job_seconds)
