"""A worker on another (emulated) host joins a running elastic job through `--coordinator`.

Two network namespaces joined by a shaped bridge stand for two hosts. The job (its coordinator and
two workers) runs in the first, serving its store on that host's emulated address, which exists
nowhere else; `shardshift join --coordinator ADDRESS` runs in the second. Everything the joiner
does, from reading the job's command line to receiving its share of the state and training,
crosses the emulated network. The losses equal a fixed run's; no process is left.
"""

from __future__ import annotations

import subprocess
import sys

import torch

from shardshift.netemu.shaping import uniform_rates
from support.cli import coordinator_address
from support.training import metrics, step_losses

STEPS = 30
RUN = ["--model", "test", "--dtype", "float64", "--global-batch", "6", "--seed", "4", "--steps", str(STEPS),
       "--log-every", "1"]


def test_a_joiner_on_another_host_joins_through_the_coordinator_address(emulated_network, tmp_path, budget):
    fixed = subprocess.run([sys.executable, "-m", "shardshift", "train", *RUN, "--nproc", "1", "--metrics",
                            str(tmp_path / "fixed.jsonl")], capture_output=True, text=True, timeout=budget.left())
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    net = emulated_network(uniform_rates(2, 125e6), 2)  # 1 Gbit/s each way
    job = net.spawn(0, [sys.executable, "-m", "shardshift", "train", *RUN, "--elastic", "--nproc", "2",
                        "--max-nproc", "3", "--layout-for", "3:fsdp=3", "--coordinator", f"{net.address(0)}:0",
                        "--metrics", str(tmp_path / "elastic.jsonl"), "--log-dir", str(tmp_path / "logs")],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    joiner = None
    try:
        address = coordinator_address(job.stdout, until="step     2")
        assert address is not None and address.startswith(net.address(0)), address
        joiner = net.spawn(1, [sys.executable, "-m", "shardshift", "join", "--coordinator", address, "--timeout",
                               "120"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = job.communicate(timeout=budget.left())
        joined_out, joined_err = joiner.communicate(timeout=60)
    finally:
        for proc in (job, joiner):
            if proc is not None:
                proc.kill()
    assert job.returncode == 0, err[-3000:]
    assert joiner.returncode == 0, joined_err[-3000:]
    events = [r for r in metrics(tmp_path / "elastic.jsonl") if r.get("event") == "membership"]
    assert [(e["kind"], e["from_world"], e["to_world"], e["to"]) for e in events] == [("join", 2, 3, "fsdp=3")]
    assert events[0]["bytes_moved"] > 0 and events[0]["step"] < STEPS
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes of the job left: {left}"
    got, want = step_losses(tmp_path / "elastic.jsonl"), step_losses(tmp_path / "fixed.jsonl")
    assert sorted(got) == list(range(1, STEPS + 1))
    torch.testing.assert_close(torch.tensor([got[s] for s in sorted(got)]), torch.tensor([want[s] for s in sorted(want)]),
                               rtol=1e-9, atol=0)
