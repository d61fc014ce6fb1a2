"""A step's figures: peak memory measured afresh each step, model FLOPs from the model's own count."""

from __future__ import annotations

import math

import numpy as np
import torch

from shardshift.layout import Layout
from shardshift.models import model_spec
from shardshift.train.config import TrainConfig
from shardshift.train.memory import device_peak_flops, peak_bytes, reset_peak
from shardshift.train.report import Metrics, report_step
from shardshift.train.trainer import StepResult

CPU = torch.device("cpu")


def test_the_cpu_peak_is_reset_and_then_follows_what_the_process_touches():
    reset_peak(CPU)
    before = peak_bytes(CPU)
    block = np.ones(64 << 20, dtype=np.uint8)  # 64 MiB touched
    during = peak_bytes(CPU)
    del block
    reset_peak(CPU)
    after = peak_bytes(CPU)
    assert before > 0 and during - before >= 60 << 20
    assert after < during - (32 << 20)  # the reset forgot the freed block's peak


def test_flops_per_token_are_palms_count_and_a_mixture_counts_the_experts_a_token_reads():
    llama = model_spec("llama-tiny")
    assert llama.flops_per_token() == 6 * llama.num_params() + 12 * 8 * 128 * 128
    moe = model_spec("moe-tiny")
    cfg = moe.config
    read = moe.num_params() - cfg.n_layers * 3 * (cfg.num_experts - cfg.top_k) * cfg.moe_intermediate_size * 128
    assert read == 764_160  # the "parameters (read per token)" of docs/models.md
    assert moe.flops_per_token() == 6 * read + 12 * 8 * 128 * 128


def test_the_device_peak_is_unknown_on_a_cpu():
    assert device_peak_flops(CPU) is None


def test_the_progress_line_and_the_metrics_carry_the_figures(tmp_path, capsys):
    cfg = TrainConfig(layout=Layout(dp=2), model=model_spec("test"), steps=4)
    path = tmp_path / "m.jsonl"
    metrics = Metrics(str(path), rank=0)
    report_step(cfg, StepResult(step=1, loss=5.0, grad_norm=1.0, lr=1e-3, step_time_s=0.5, tokens_per_s=1000.0,
                                peak_memory=3 << 20, flops_per_s=2.5e9, mfu=0.125), metrics)
    metrics.close()
    line = capsys.readouterr().out
    assert "| 3.0 MiB peak | 2.50 GFLOP/s | MFU 12.5%" in line
    import json

    record = json.loads(path.read_text())
    assert (record["peak_memory_bytes"], record["model_flops_per_s"], record["mfu"]) == (3 << 20, 2.5e9, 0.125)
    assert not math.isnan(record["model_flops_per_s"])
