"""`shardshift bench switch`: bad input is refused before launch; a small chain runs end to end.

No timing is asserted: the run checks that every column is there, that byte and memory figures are
consistent with one another, and that every switched state equals what DCP gives (the bench's own
bit-for-bit check).
"""

from __future__ import annotations

import json
import math

import pytest

from support import REPO
from support.cli import run_shardshift


def test_bad_layout_from_the_shell_exits_2(budget):
    run = run_shardshift(
        ["bench", "switch", "--nproc", "4", "--from", "dp=4", "--to", "dp=2"],
        timeout=budget.left(), cwd=REPO)
    assert run.returncode == 2
    assert "layout dp=2 has 2 ranks (product of its degrees) but 4 processes were asked for" in run.stderr


def test_small_chain_reports_every_column(budget):
    chain = ["dp=2", "fsdp=2", "tp=2"]
    run = run_shardshift(
        ["bench", "switch", "--nproc", "2", "--model", "test",
         "--suite", ";".join(chain), "--budget", "16K", "--p2p-size", "256K", "--predict", "--repeat", "2", "--json",
         "--timeout", str(budget.left())],
        timeout=budget.left(), cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    rows = out["transitions"]
    assert [(r["from"], r["to"]) for r in rows] == list(zip(chain, chain[1:]))
    for i, r in enumerate(rows):
        # One step before the first switch, one after each measured one (two per transition).
        assert r["repeats"] == 2 and r["steps_taken"] == 1 + 2 * i
        assert r["state_mismatches"] == 0, r  # the switched state is DCP's, bit for bit
        assert r["restart_error"] is None, (r["restart_error"], run.stderr[-3000:])
        for key in ("switch_seconds", "dcp_save_seconds", "dcp_load_seconds", "dcp_build_seconds",
                    "restart_step_seconds", "restart_job_seconds", "link_bytes_per_s", "step_after_seconds"):
            assert r[key] > 0, (key, r)
        assert r["dcp_seconds"] == pytest.approx(r["dcp_save_seconds"] + r["dcp_load_seconds"])  # 2 repeats: means
        assert r["restart_seconds"] > r["dcp_save_seconds"]  # the save, then a whole fresh job
        assert r["bytes_moved"] == r["bytes_lower_bound"] <= r["bytes_total"]
        assert r["bytes_moved"] + r["bytes_kept"] == r["bytes_total"]
        assert 0 <= r["max_bytes_received"] <= r["bytes_moved"]
        # Each repeat's limit is of its own link rate: the fastest rate gives the least limit.
        assert r["limit_seconds_min"] == pytest.approx(r["max_bytes_received"] / r["link_bytes_per_s_max"])
        assert r["limit_seconds_max"] == pytest.approx(r["max_bytes_received"] / r["link_bytes_per_s_min"])
        for key in ("switch_seconds", "dcp_seconds", "restart_seconds", "link_bytes_per_s", "dcp_over_switch",
                    "restart_over_switch", "predicted_over_move"):
            assert 0 < r[f"{key}_min"] <= r[key] <= r[f"{key}_max"], (key, r)
        assert r["spread"] >= 0
        assert r["budget"] == 16 << 10 and r["rounds"] >= 1
        assert r["peak_mem_bytes"] > 0 and 0 <= r["extra_mem_bytes"] < r["peak_mem_bytes"]
        assert r["move_cpu_seconds"] > 0 and r["link_cpu_seconds_per_byte"] > 0  # the ranks' processor time
        assert math.isfinite(r["loss_after"])
    # Not vacuous: replicas to shards keeps every byte local, shards to tp must move some.
    assert rows[0]["bytes_moved"] == 0 and rows[1]["bytes_moved"] > 0 and rows[1]["rounds"] > 1
    assert rows[0]["transfer_cpu_seconds"] == 0 < rows[1]["transfer_cpu_seconds"]  # what the links cost the cores
    assert rows[1]["switch_over_limit"] > 0 and out["geomean"]["restart_over_switch"] > 0
    # --predict: each switch's schedule timed on the machine's measured alpha-beta model, beside it.
    for r in rows:
        assert r["predicted_seconds"] > 0 and r["predicted_over_switch"] > 0
        given = ("link_bytes_per_s", "message_seconds", "message_cpu_seconds", "pair_bytes_per_s", "copy_bytes_per_s",
                 "strided_copy_bytes_per_s", "piece_seconds")
        assert min(r[f"model_{k}"] for k in given) > 0  # what the model was given
        # The model's link rate is the median of 3 timed runs, the limit's the best: below it, ties aside.
        assert r["model_link_bytes_per_s"] < r["link_bytes_per_s"]
        # On CPU with glibc, the kernel's work on pages: its rates, and every rank's allocator as the switch starts.
        assert r["model_fresh_page_bytes_per_s"] > 0 and r["model_free_bytes_per_s"] > 0
        assert len(r["model_heap_free_bytes"]) == 2 and min(r["model_heap_free_bytes"]) >= 0
        assert len(r["model_mapped_share"]) == 2 and all(0 <= s <= 1 for s in r["model_mapped_share"])
        assert r["predicted_fresh_bytes"] >= 0 and r["predicted_unmapped_bytes"] >= 0
        assert 0 < r["move_seconds"] <= r["switch_seconds"] and r["predicted_over_move"] > 0
    assert rows[1]["predicted_seconds"] > rows[0]["predicted_seconds"]  # bytes on the links cost more than copies
