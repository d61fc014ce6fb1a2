"""Where the ranks run: `--device` / SHARDSHIFT_DEVICE, resolved against the GPUs this host has
(NCCL takes one GPU per rank). The GPU count is patched: the rules are the same on any machine."""

from __future__ import annotations

import pytest

from shardshift import runtime
from shardshift.cli.main import main
from shardshift.runtime import DEVICE_ENV, Process, device_note, resolve_device


@pytest.fixture
def gpus(monkeypatch):
    """Set how many GPUs CUDA sees here; and run as a user's shell would, starting no process."""
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(DEVICE_ENV, "auto")  # restored after the test, whatever `main` sets

    def no_process(*args, **kwargs):
        raise AssertionError("bad input reached the launcher: a process would have been started")

    monkeypatch.setattr("shardshift.launch.start_ranks", no_process)
    monkeypatch.setattr("shardshift.elastic.coordinator.launch_elastic", no_process)

    def have(n: int) -> None:
        monkeypatch.setattr(runtime, "gpu_count", lambda: n)

    return have


@pytest.mark.parametrize("count, ranks, requested, expected", [
    (0, 1, "auto", "cpu"),
    (1, 1, "auto", "cuda"),
    (1, 4, "auto", "cpu"),  # a laptop with one GPU: four ranks train on its CPU
    (4, 4, "auto", "cuda"),
    (8, 4, "auto", "cuda"),
    (8, 4, "cpu", "cpu"),
    (4, 4, "cuda", "cuda"),
])
def test_auto_takes_cuda_only_with_a_gpu_for_every_local_rank(gpus, count, ranks, requested, expected):
    gpus(count)
    assert resolve_device(requested, ranks) == expected


@pytest.mark.parametrize("count", [0, 1, 3])
def test_cuda_with_too_few_gpus_says_how_many_and_what_to_do(gpus, count):
    gpus(count)
    with pytest.raises(ValueError, match=f"4 processes on this host need a GPU each .* CUDA sees {count}; "
                                         f"start at most {count} per host, or pass --device cpu"):
        resolve_device("cuda", 4)


def test_an_unknown_device_is_refused(gpus):
    gpus(1)
    with pytest.raises(ValueError, match="device 'tpu': expected one of auto, cpu, cuda"):
        resolve_device("tpu", 1)


def test_the_note_says_why_auto_left_the_gpus_alone(gpus):
    gpus(1)
    assert "CUDA sees 1 GPU for 4 ranks" in device_note("auto", 4)
    assert device_note("auto", 1) is None  # it took the GPU
    assert device_note("cpu", 4) is None  # asked for
    gpus(0)
    assert device_note("auto", 4) is None  # nothing to explain on a machine without GPUs


def test_a_rank_reads_the_device_from_its_environment(gpus, monkeypatch):
    gpus(4)
    rank = Process(rank=0, world_size=4, local_rank=0, local_world_size=4, parent=1)
    assert rank.device_type == "cuda"
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert Process(rank=0, world_size=4, local_rank=0, local_world_size=4, parent=1).device_type == "cpu"
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    gpus(2)
    with pytest.raises(ValueError, match="CUDA sees 2"):
        Process(rank=0, world_size=4, local_rank=0, local_world_size=4, parent=1).device_type


@pytest.mark.parametrize("argv, needle", [
    (["train", "--device", "cuda"], "--device cuda: 4 processes on this host need a GPU each"),
    (["train", "--nproc", "2", "--layout", "dp=2", "--device", "cuda"], "2 processes on this host need a GPU each"),
    (["train", "--elastic", "--nproc", "2", "--device", "cuda"], "--elastic runs on the CPU with gloo"),
    (["bench", "switch", "--suite", "--device", "cuda"], "--device cuda: 4 processes on this host need a GPU each"),
    (["bench", "train", "--device", "cuda"], "--device cuda: 4 processes on this host need a GPU each"),
])
def test_the_command_line_refuses_cuda_without_a_gpu_per_rank_before_any_process_starts(gpus, argv, needle, capsys):
    gpus(1)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardshift: error: ") and err.count("\n") == 1 and needle in err, err


def test_the_train_bench_names_the_groups_own_collectives_after_the_device(capsys):
    from shardshift.bench.train import Throughput, TrainBenchOptions, report
    from shardshift.layout import Layout
    from shardshift.models import model_spec
    from shardshift.train.config import TrainConfig

    base = TrainConfig(layout=Layout(), model=model_spec("test"), steps=3)
    opts = TrainBenchOptions(base=base, also=(), nproc=1, steps=1, rounds=1, warmup=0, timeout_s=60.0, json=False)
    rows = [Throughput(("ddp", "gloo"), 1, 1.0, 100.0), Throughput(("dp=1", "gloo"), 1, 1.0, 90.0)]
    for device, backend in (("cuda", "nccl"), ("cpu", "gloo")):
        result = report(opts, rows, device)
        table = capsys.readouterr().out
        assert result["backend"] == backend and f"vs {backend}" in table, table
        assert [line.split()[1] for line in table.splitlines()[2:]] == [backend, backend], table
        assert result["rows"][1]["collectives"] == "gloo"  # the JSON's key stays what it was
