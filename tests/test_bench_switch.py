"""`shardshift bench switch`: bad input is refused before launch; a small chain runs end to end.

No timing is asserted: the run checks that every column is there, that byte and memory figures are
consistent with one another, and that every switched state equals what DCP gives (the bench's own
bit-for-bit check).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from shardshift.cli.main import main

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "4", "--from", "dp=4", "--to", "dp=3"], "layout dp=3 has 3 ranks"),
    (["--nproc", "8", "--from", "dp=8", "--to", "tp=8"], "tp=8 does not divide n_head=12"),
    (["--nproc", "4", "--from", "dp=4", "--to", "xp=4"], "unknown axis 'xp'"),
    (["--nproc", "4", "--from", "dp=4"], "give --from LAYOUT and --to LAYOUT"),
    (["--nproc", "4", "--suite", "--from", "dp=4", "--to", "tp=4"], "either --suite or --from and --to"),
    (["--nproc", "2", "--suite"], "the default suite is for 4 ranks"),
    (["--nproc", "4", "--suite", "dp=4;dp=4"], "from dp=4 to itself"),
    (["--nproc", "4", "--suite", "dp=4;pp=4", "--global-batch", "4"], "does not split into --micro-batches 8"),
    (["--nproc", "1", "--suite", "dp=1;fsdp=1"], "give --nproc >= 2"),
    (["--nproc", "4", "--suite", "--budget", "1K"], "give at least 4096"),
    (["--nproc", "4", "--suite", "--model", "huge"], "--model 'huge' is unknown"),
])
def test_bad_input_is_refused_before_any_process_starts(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["bench", "switch", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardshift: error: ") and message in err, err


@pytest.mark.multiproc
def test_bad_layout_from_the_shell_exits_2():
    run = subprocess.run(
        [sys.executable, "-m", "shardshift", "bench", "switch", "--nproc", "4", "--from", "dp=4", "--to", "dp=2"],
        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 2
    assert "layout dp=2 has 2 ranks (product of its degrees) but 4 processes were asked for" in run.stderr


@pytest.mark.multiproc
def test_small_chain_reports_every_column():
    chain = ["dp=2", "fsdp=2", "tp=2"]
    run = subprocess.run(
        [sys.executable, "-m", "shardshift", "bench", "switch", "--nproc", "2", "--model", "test",
         "--suite", ";".join(chain), "--budget", "16K", "--p2p-size", "256K", "--json", "--timeout", "200"],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    rows = out["transitions"]
    assert [(r["from"], r["to"]) for r in rows] == list(zip(chain, chain[1:]))
    for i, r in enumerate(rows):
        assert r["steps_taken"] == i + 1  # one step before the first switch, one after each
        assert r["state_mismatches"] == 0, r  # the switched state is DCP's, bit for bit
        assert r["restart_error"] is None, (r["restart_error"], run.stderr[-3000:])
        for key in ("switch_seconds", "dcp_save_seconds", "dcp_load_seconds", "dcp_build_seconds",
                    "restart_step_seconds", "restart_job_seconds", "link_bytes_per_s", "step_after_seconds"):
            assert r[key] > 0, (key, r)
        assert r["dcp_seconds"] == pytest.approx(r["dcp_save_seconds"] + r["dcp_load_seconds"])
        assert r["restart_seconds"] > r["dcp_save_seconds"]  # the save, then a whole fresh job
        assert r["bytes_moved"] == r["bytes_lower_bound"] <= r["bytes_total"]
        assert r["bytes_moved"] + r["bytes_kept"] == r["bytes_total"]
        assert 0 <= r["max_bytes_received"] <= r["bytes_moved"]
        assert r["limit_seconds"] == pytest.approx(r["max_bytes_received"] / r["link_bytes_per_s"])
        assert r["budget"] == 16 << 10 and r["rounds"] >= 1
        assert r["peak_mem_bytes"] > 0 and 0 <= r["extra_mem_bytes"] < r["peak_mem_bytes"]
        assert math.isfinite(r["loss_after"])
    # Not vacuous: replicas to shards keeps every byte local, shards to tp must move some.
    assert rows[0]["bytes_moved"] == 0 and rows[1]["bytes_moved"] > 0 and rows[1]["rounds"] > 1
    assert rows[1]["switch_over_limit"] > 0 and out["geomean"]["restart_over_switch"] > 0
