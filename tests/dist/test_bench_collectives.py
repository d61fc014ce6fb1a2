"""`shardshift bench collectives`: argument checking, and one small run on loopback processes."""

from __future__ import annotations

import json
import time

import pytest

from support import REPO
from support.cli import run_shardshift


def test_small_run_reports_every_impl_without_wrong_elements(budget):
    proc = run_shardshift(
        ["bench", "collectives", "--op", "reducescatter",
         "--sizes", "96K", "--preset", "ring", "--nproc", "3", "--iters", "1", "--json", "--timeout", str(budget.left())],
        timeout=budget.left(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout)["rows"]
    assert [r["impl"] for r in rows] == ["gloo", "ring", "trees", "auto"]
    assert rows[-1]["picked"] in ("trees", "gloo")  # auto's pick after its trial calls
    for r in rows:
        assert r["wrong"] == 0 and r["op"] == "reducescatter" and r["count"] == 96 * 1024 // 4
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 2 / 3)
        assert "bound_algbw_gbps" in r
        # Rank 0's host over the timed calls; None when they fit inside one 10 ms clock tick.
        assert r["cpu_busy"] is None or 0 <= r["cpu_busy"] <= 1


def test_cpu_ticks_count_busy_time_of_the_host():
    from shardshift.bench.collectives_rank import cpu_ticks

    before = cpu_ticks()
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:  # keep one CPU busy for at least 5 ticks
        pass
    after = cpu_ticks()
    assert before is not None and after is not None  # Linux
    busy, total = after[0] - before[0], after[1] - before[1]
    assert 4 <= busy <= total  # in 10 ms ticks: this process alone was busy for 50 ms
