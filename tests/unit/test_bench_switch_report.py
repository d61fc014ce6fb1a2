"""How `bench switch --repeat` summarises the repeats of a transition (`bench.switch.summarise`)."""

from __future__ import annotations

import pytest

from shardshift.bench.switch import RATIOS, SPREAD, spread, summarise


def _repeat(switch: float, dcp: float, limit: float, mismatches: int = 0, peak: int = 100) -> dict:
    record = {"from": "dp=4", "to": "fsdp=4", "steps_taken": 7, "switch_seconds": switch, "move_seconds": switch / 2,
              "dcp_seconds": dcp, "dcp_save_seconds": dcp / 2, "dcp_load_seconds": dcp / 2, "restart_seconds": None,
              "restart_error": None, "limit_seconds": limit, "predicted_seconds": None, "link_bytes_per_s": 1 / limit,
              "bytes_moved": 64, "peak_mem_bytes": peak, "extra_mem_bytes": peak // 2, "state_mismatches": mismatches}
    for key, (a, b) in RATIOS.items():
        record[key] = None if record[a] is None else record[a] / record[b]
    return record


def test_the_median_of_each_figure_and_ratio_with_its_least_and_most():
    out = summarise([_repeat(0.4, 8.0, 0.2), _repeat(0.2, 6.0, 0.1, peak=300), _repeat(0.3, 9.0, 0.2, mismatches=2)])
    assert out["repeats"] == 3 and out["steps_taken"] == 7 and out["bytes_moved"] == 64
    assert (out["switch_seconds_min"], out["switch_seconds"], out["switch_seconds_max"]) == (0.2, 0.3, 0.4)
    # Ratios are per repeat, then their median: 20, 30, 30 (not 8 / 0.3).
    assert out["dcp_over_switch"] == pytest.approx(30.0) and out["dcp_over_switch_min"] == pytest.approx(20.0)
    assert out["switch_over_limit"] == pytest.approx(2.0) and out["switch_over_limit_max"] == pytest.approx(2.0)
    assert out["peak_mem_bytes"] == 300 and out["extra_mem_bytes"] == 150  # the worst repeat: the budget's
    assert out["state_mismatches"] == 2  # one bad repeat is a bad transition
    # Never measured (no restart, no prediction): None, and no spread of it.
    assert out["restart_seconds"] is None and out["restart_over_switch_min"] is None
    assert set(SPREAD) <= set(out)
    # dcp/sw strayed from 30 to 20 (-33%); sw/lim from 2 to 1.5 (-25%): the spread is the larger.
    assert spread(out) == pytest.approx(1 / 3)


def test_a_restart_that_failed_in_any_repeat_is_reported():
    ok, failed = _repeat(0.3, 8.0, 0.2), _repeat(0.3, 8.0, 0.2)
    failed["restart_error"] = "exit status 1"
    assert summarise([ok, failed])["restart_error"] == "exit status 1"
    assert summarise([ok])["repeats"] == 1 and spread(summarise([ok])) == 0
