"""The README's model of one's own (examples/tiny_decoder.py: a plain nn.Module and its
ModuleSpec), named on the command line as the README names it: trained with a switch and saved,
sampled from another directory, and run elastically with workers the coordinator starts and one
started from another shell, which builds the model from the job's command line. (Every 4-rank
layout against one process: tests/dist/test_train_equivalence.py; a switch against DCP:
tests/dist/test_switch.py; refusals: tests/unit/test_module_spec.py.)"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import torch

from support import REPO
from support.cli import coordinator_address, run_shardshift
from support.training import metrics, step_losses

README = REPO / "README.md"
MODEL = "examples/tiny_decoder.py:spec"  # as the README names it, from the repository's root
TRAIN = f"shardshift train --nproc 4 --model {MODEL} --layout fsdp=2,tp=2 --switch 10:pp=2,dp=2 --steps 20"
ELASTIC = f"shardshift train --elastic --nproc 3 --model {MODEL} --inject 4:leave=1 --steps 300"
JOIN = "shardshift join --coordinator HOST:PORT"
# float64, so that any world computes what one process computes to 1e-9 (the numerics contract).
FLOAT64 = ["--dtype", "float64", "--global-batch", "6", "--seed", "4", "--log-every", "1"]


def test_the_readme_command_trains_switches_and_saves_a_checkpoint_that_samples_anywhere(tmp_path, budget):
    """The README's command, run from the repository's root; its checkpoint names the model by
    its file's absolute path, so `sample` builds it from another directory."""
    assert f"    {TRAIN}\n" in README.read_text()
    run = run_shardshift([*TRAIN.split()[1:], "--save", str(tmp_path / "ckpt")], timeout=budget.left(), cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "switched fsdp=2,tp=2 -> dp=2,pp=2 before step 10" in run.stdout, run.stdout
    assert "step    20 | loss" in run.stdout
    manifest = json.loads(next((tmp_path / "ckpt").glob("step-*/shardshift.json")).read_text())
    assert manifest["run"]["model"] == f"{REPO / MODEL}"
    assert manifest["run"]["model_config"] == dict(vocab_size=256, hidden_size=32, n_heads=4, n_layers=5, seq_len=30)
    text = run_shardshift(["sample", "--resume", tmp_path / "ckpt", "--tokens", "8"], timeout=budget.left(),
                          cwd=tmp_path)
    assert text.returncode == 0 and "(step 20, saved under dp=2,pp=2)" in text.stderr, text.stderr[-3000:]
    assert text.stdout.startswith("ROMEO:")


def test_an_elastic_job_of_the_readme_model_joined_from_a_shell_computes_what_one_process_computes(tmp_path,
                                                                                                   budget):
    """The README's elastic job: 3 workers, one leaves after step 4 (a real SIGTERM: 3 -> 2); then
    `shardshift join` from a shell in another directory adds a worker (2 -> 3): it reads the job's
    command line, which names the model by its file's absolute path, and builds the model from that
    file. The job is stopped by SIGTERM some steps later, the joiner with it; its losses equal one
    process's, step for step."""
    readme = README.read_text()
    assert f"    {ELASTIC}\n" in readme and f"    {JOIN}  #" in readme
    events_file = tmp_path / "elastic.jsonl"
    job = subprocess.Popen([sys.executable, "-m", "shardshift", *ELASTIC.split()[1:], *FLOAT64, "--steps", "100000",
                            "--timeout", "60", "--metrics", str(events_file), "--log-dir", str(tmp_path / "logs")],
                           cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    joiner: dict = {}

    def joins() -> list[dict]:
        records = metrics(events_file) if events_file.exists() else []
        return [r for r in records if r.get("event") == "membership" and r["kind"] == "join"]

    def join(address: str) -> None:
        joiner["run"] = run_shardshift(["join", "--coordinator", address, "--timeout", "60"], timeout=budget.left(),
                                       cwd=tmp_path)

    thread = None
    try:
        address = coordinator_address(job.stdout, until="step     5")  # after the scripted leave
        assert address is not None
        thread = threading.Thread(target=join, args=(address,), daemon=True)
        thread.start()
        deadline = time.monotonic() + budget.left() / 2
        while not joins() and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.05)
        assert joins(), joiner.get("run") or "no join"
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=budget.left())
        thread.join(budget.left())
    finally:
        job.kill()
    assert job.returncode == 128 + signal.SIGTERM, err[-3000:]
    changes = [(e["kind"], e["from_world"], e["to_world"]) for e in metrics(events_file) if e.get("event") == "membership"]
    assert changes == [("leave", 3, 2), ("join", 2, 3)], changes
    # The joiner trained as a worker until the job stopped, and stopped with it, as every worker does.
    assert joiner["run"].returncode == 128 + signal.SIGTERM, joiner["run"].stderr[-3000:]

    got = step_losses(events_file)
    last = max(got)
    assert sorted(got) == list(range(1, last + 1)) and last > joins()[0]["step"]
    fixed = run_shardshift(["train", "--model", MODEL, *FLOAT64, "--steps", "100000", "--stop-at", str(last),
                            "--nproc", "1", "--metrics", str(tmp_path / "fixed.jsonl")], timeout=budget.left(),
                           cwd=REPO)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    want = step_losses(tmp_path / "fixed.jsonl")
    torch.testing.assert_close(torch.tensor([got[s] for s in sorted(got)]), torch.tensor([want[s] for s in sorted(got)]),
                               rtol=1e-9, atol=0)
    assert want[1] != want[last]  # not vacuous: training moved the loss
