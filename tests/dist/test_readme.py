"""Every command the README shows runs: here on tiny sizes (the last of a repeated flag wins), or in
the test named beside it, which runs the same command on tiny sizes. A command added to the README
without a smoke test here fails `test_every_readme_command_has_a_smoke_test`."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from support import REPO
from support.cli import run_shardshift

TINY = ["--model", "test", "--global-batch", "8"]
# README command (comment stripped) -> the arguments that shrink it, or the test that runs it.
SMOKE: dict[str, list[str] | str] = {
    "shardshift train": [*TINY, "--steps", "5"],  # the default job: two switches, at steps 3 and 5
    "shardshift train --nproc 4 --layout pp=2,fsdp=2 --steps 100 --metrics run.jsonl": [*TINY, "--steps", "2"],
    "shardshift train --nproc 4 --layout dp=2,tp=2 --dtype float64 --model small": [*TINY, "--steps", "2"],
    "shardshift train --nproc 4 --layout fsdp=4 --steps 100 --stop-at 40 --save ckpt":
        "dist/test_checkpoint.py::test_cli_save_and_resume_under_another_layout",
    "shardshift train --nproc 4 --layout pp=4 --steps 100 --resume ckpt":
        "dist/test_checkpoint.py::test_cli_save_and_resume_under_another_layout",
    "torchrun --nproc-per-node 4 -m shardshift train --layout tp=4": "dist/test_torchrun.py::test_torchrun_matches_the_local_launcher",
    "shardshift train --nproc 4 --layout dp=4 --switch 20:fsdp=2,tp=2 --switch 35:tp=2,pp=2 --metrics run.jsonl":
        "dist/test_torchrun.py::test_torchrun_matches_the_local_launcher",
    "shardshift plot run.jsonl": "unit/test_plots.py::test_the_command_writes_beside_the_first_file_by_default",
    "shardshift train --elastic --nproc 4 --max-nproc 4 --layout-for 4:fsdp=4 --layout-for 3:fsdp=3 "
    "--layout-for 2:fsdp=2 --redundancy 1 --inject 2:leave=3 --inject 4:kill=1 --inject 6:join=2 --steps 8":
        "dist/test_elastic.py::test_a_world_that_shrinks_and_grows_computes_what_a_fixed_world_computes",
    "shardshift train --elastic --nproc 4 --max-nproc 8 --coordinator 10.0.0.1:29400 --redundancy 1 --save /shared/ckpt":
        "netns/test_elastic_join.py::test_a_host_lost_with_all_its_workers_is_survived_from_copies_kept_on_the_other",
    "shardshift join --coordinator 10.0.0.1:29400 --nproc 4 --save /shared/ckpt":
        "netns/test_elastic_join.py::test_a_host_lost_with_all_its_workers_is_survived_from_copies_kept_on_the_other",
    "shardshift bench train --nproc 4 --layout dp=4": [*TINY, "--steps", "1", "--rounds", "1", "--warmup", "1",
                                                     "--also", "fsdp=2,tp=2;fsdp=2,tp=2 --activation-checkpointing full "
                                                     "--compile aot_eager", "--json"],
    "shardshift bench switch --nproc 4 --suite": "dist/test_bench_switch.py::test_small_chain_reports_every_column",
    "shardshift bench elastic --nproc 4 --suite": "dist/test_bench_elastic.py::test_the_suite_reports_every_event_beside_its_restart",
    "shardshift bench packing": "unit/test_packing.py::test_bench_packing_runs_small",
    "shardshift bench collectives --op allreduce --sizes 1M:64M --nproc 4":
        "dist/test_bench_collectives.py::test_small_run_reports_every_impl_without_wrong_elements",
    "shardshift bench data": "dist/test_bench_data.py::test_a_small_run_reports_every_figure",
    "shardshift topo pack --preset dgx1v --gpus 0,1,2,3,4,5 --op allreduce": "unit/test_packing.py::test_topo_pack_json",
    "shardshift sample --resume ckpt --prompt 'ROMEO:' --tokens 200 --temperature 0.8 --seed 0":
        "dist/test_sample.py::test_the_same_state_saved_under_three_layouts_writes_the_same_text",
    "shardshift data prepare --input corpus/ --tokenizer bpe:8192 --out data/corpus --val-fraction 0.01":
        "dist/test_readme.py::test_the_data_commands_prepare_a_corpus_and_train_on_it",
    "shardshift train --nproc 4 --data data/corpus --model llama-small --global-batch 64 --micro-batch-size 8 "
    "--eval-every 100": "dist/test_readme.py::test_the_data_commands_prepare_a_corpus_and_train_on_it",
    "shardshift export --resume ckpt --out qwen-trained":
        "dist/test_hf.py::test_an_exported_checkpoint_is_what_transformers_reads",
    "shardshift train --nproc 4 --model examples/tiny_decoder.py:spec --layout fsdp=2,tp=2 --switch 10:pp=2,dp=2 "
    "--steps 20": "dist/test_own_model.py::test_the_readme_command_trains_switches_and_saves_a_checkpoint_that_samples_anywhere",
    "shardshift train --elastic --nproc 3 --model examples/tiny_decoder.py:spec --inject 4:leave=1 --steps 300":
        "dist/test_own_model.py::"
    "test_an_elastic_job_of_the_readme_model_joined_from_a_shell_computes_what_one_process_computes",
    "shardshift join --coordinator HOST:PORT": "dist/test_own_model.py::"
    "test_an_elastic_job_of_the_readme_model_joined_from_a_shell_computes_what_one_process_computes",
    "shardshift simulate switch --model examples/tiny_decoder.py:spec --ranks 4 --from fsdp=2,tp=2 --to pp=2,dp=2":
        "unit/test_module_spec.py::test_simulate_plans_the_example_through_its_spec",
    "shardshift train --nproc 4 --layout fsdp=4 --collectives trees --topology docs/topologies/hetero4x.yaml":
        "dist/test_train_trees.py::test_the_command_trains_on_trees_and_counts_their_calls",
    "shardshift bench train --nproc 4 --layout dp=4 --also 'fsdp=4' --topology docs/topologies/hetero4x.yaml --emulate":
        "netns/test_collectives_emulated.py::test_bench_train_on_emulated_links_trains_each_layout_on_gloo_and_on_trees",
    "shardshift simulate switch --model qwen3-235b-a22b --ranks 4096 --from dp=8,ep=16,tp=4,pp=8 "
    "--to dp=16,ep=8,tp=4,pp=8": "unit/test_simulate.py::test_the_command_reports_every_figure_as_json",
    "shardshift simulate switch --model llama3-70b --ranks 512 --from dp=8,tp=8,pp=8 --to dp=16,tp=8,pp=4 "
    "--cluster docs/topologies/cluster-dynatrain.yaml": "unit/test_simulate.py::test_the_command_reports_every_figure_as_json",
    "shardshift topo draw --preset dgx1v --gpus 0,1,2,3 --op broadcast":
        "unit/test_plots.py::test_topo_draw_writes_the_packing_on_the_topology",
}  # fmt: skip


def readme_commands() -> list[str]:
    """The shell commands of the README's code blocks that run ShardShift (comments stripped)."""
    commands = []
    for line in (REPO / "README.md").read_text().splitlines():
        text = line.strip().split("  #")[0].strip()
        if line.startswith("    ") and (text.startswith(("shardshift ", "torchrun ")) or text == "shardshift"):
            commands.append(text)
        elif line.startswith("    ") and text.endswith(".venv/bin/shardshift train"):  # the first command
            commands.append("shardshift train")
    return commands


def test_every_readme_command_has_a_smoke_test():
    assert sorted(set(readme_commands())) == sorted(SMOKE)
    for target in (t for t in SMOKE.values() if isinstance(t, str)):
        path, name = target.split("::")
        assert re.search(rf"^def {name}\(", (REPO / "tests" / path).read_text(), re.M), f"no test {target}"


def _run(command: str, tmp_path, budget) -> subprocess.CompletedProcess:
    argv = [*command.split()[1:], *SMOKE[command]]
    run = run_shardshift(argv, timeout=budget.left(), cwd=tmp_path)
    assert run.returncode == 0, f"shardshift {' '.join(argv)}:\n{run.stderr[-3000:]}"
    return run


def test_the_default_job_trains_and_switches_twice(tmp_path, budget):
    run = _run("shardshift train", tmp_path, budget)
    assert "under fsdp=2,tp=2 on 4 cpu ranks" in run.stdout
    switches = re.findall(r"^switched (\S+) -> (\S+) before step (\d+)", run.stdout, re.M)
    assert [(a, b.split(",on")[0], int(s)) for a, b, s in switches] == [
        ("fsdp=2,tp=2", "tp=2,pp=2", 3), ("tp=2,pp=2", "fsdp=4", 5)], run.stdout
    assert re.search(r"^step     5 \| loss", run.stdout, re.M)
    # Its outputs, in a run directory it names: metrics, picture, last checkpoint, and text from it.
    where = re.search(r"^this run's outputs go to (runs/train-[0-9-]+)/$", run.stdout, re.M)
    assert where, run.stdout
    run_dir = tmp_path / where[1]
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5]
    # Each step's peak memory (the largest rank's) and model FLOPs per second; no MFU on a CPU.
    assert all(r["peak_memory_bytes"] > 0 and r["model_flops_per_s"] > 0 and r["mfu"] is None
               for r in records if "loss" in r)
    assert re.search(r"^step     5 \| .* tokens/s \| [\d.]+ MiB peak \| [\d.,]+ GFLOP/s$", run.stdout, re.M), run.stdout
    summary = records[-1]
    assert summary["event"] == "summary" and summary["steps"] == 5 and summary["changes"] == 2
    assert re.search(r"^done: 5 steps, 520 tokens in .*; 2 switches took", run.stdout, re.M), run.stdout
    assert (run_dir / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"picture: {where[1]}/metrics.png" in run.stdout
    assert f"checkpoint: {where[1]}/checkpoints/step-00000005" in run.stdout
    assert "text from the trained model" in run.stdout and "\nROMEO:\n" in run.stdout


@pytest.mark.parametrize("command", [c for c, smoke in SMOKE.items() if isinstance(smoke, list)
                                     and c.startswith("shardshift train --")])
def test_train_commands_run(command, tmp_path, budget):
    run = _run(command, tmp_path, budget)
    assert re.search(r"^step     2 \| loss", run.stdout, re.M), run.stdout
    if "--metrics run.jsonl" in command:
        records = [json.loads(line) for line in open(tmp_path / "run.jsonl")]
        assert [r["step"] for r in records if "loss" in r] == [1, 2] and records[0]["layout"] == "fsdp=2,pp=2"
        assert records[-1]["event"] == "summary"


def test_bench_train_reports_every_variant_beside_ddp(tmp_path, budget):
    out = json.loads(_run("shardshift bench train --nproc 4 --layout dp=4", tmp_path, budget).stdout)
    assert [r["impl"] for r in out["rows"]] == ["ddp", "dp=4", "fsdp=2,tp=2",
                                                 "fsdp=2,tp=2 --activation-checkpointing full --compile aot_eager"]
    assert all(r["tokens_per_s"] > 0 and r["steps"] == 1 and r["working_bytes"] > 0 for r in out["rows"])
    assert out["rows"][0]["ratio_vs_ddp"] == 1.0


def test_the_data_commands_prepare_a_corpus_and_train_on_it(tmp_path, budget):
    """The README's two data commands, in order, on a folder of 40 small documents: a smaller BPE,
    a larger held-out fraction, the `test` model on 2 processes for 2 steps."""
    (prepare, train), text = [c for c in SMOKE if " --data" in c or " data prepare" in c], "To be, or not to be. "
    (tmp_path / "corpus").mkdir()
    for i in range(40):
        (tmp_path / "corpus" / f"doc-{i:02d}.txt").write_text(f"Document {i}. " + text * (20 + i))
    run = run_shardshift([*prepare.split()[1:], "--tokenizer", "bpe:300", "--val-fraction", "0.25"],
                         timeout=budget.left(), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "prepared 40 documents" in run.stdout and (tmp_path / "data" / "corpus" / "manifest.json").is_file()
    run = run_shardshift([*train.split()[1:], "--nproc", "2", *TINY, "--steps", "2", "--micro-batch-size", "2",
                          "--eval-every", "1", "--eval-batches", "1"], timeout=budget.left(), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"^step     2 \| held-out loss", run.stdout, re.M) and "held-out" in run.stdout.splitlines()[-1]
