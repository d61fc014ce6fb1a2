"""How `bench switch` records a transition: one repeat as a typed record (`SwitchRun`) and the JSON it
prints, and the repeats summarised (`bench.switch.summarise`)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from shardshift.bench.switch import RATIOS, SPREAD, spread, summarise


def _repeat(switch: float, dcp: float, limit: float, mismatches: int = 0, peak: int = 100) -> dict:
    record = {"from": "dp=4", "to": "fsdp=4", "steps_taken": 7, "switch_seconds": switch, "move_seconds": switch / 2,
              "dcp_seconds": dcp, "dcp_save_seconds": dcp / 2, "dcp_load_seconds": dcp / 2, "restart_seconds": None,
              "restart_error": None, "limit_seconds": limit, "predicted_seconds": None, "link_bytes_per_s": 1 / limit,
              "bytes_moved": 64, "peak_mem_bytes": peak, "extra_mem_bytes": peak // 2, "state_mismatches": mismatches,
              "floor_seconds": None}
    for key, (a, b) in RATIOS.items():
        record[key] = None if record[a] is None or record[b] is None else record[a] / record[b]
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


# The keys of one repeat's record, in the order ``--json`` prints them; with --predict the model's
# figures stand after ``limit_seconds`` (without, ``predicted_seconds`` alone).
_KEYS = ["from", "to", "placed", "steps_taken", "switch_seconds", "move_seconds", "move_phases", "move_cpu_seconds",
         "move_page_faults", "transfer_cpu_seconds", "prepare_seconds", "dcp_seconds", "dcp_save_seconds",
         "seal_seconds", "dcp_load_seconds", "dcp_build_seconds", "restart_seconds", "restart_step_seconds",
         "restart_job_seconds", "restart_error", "limit_seconds"]
_MODEL_KEYS = ["predicted_seconds", "model_link_bytes_per_s", "model_message_seconds", "model_message_cpu_seconds",
               "model_pair_bytes_per_s", "model_copy_bytes_per_s", "model_strided_copy_bytes_per_s",
               "model_piece_seconds", "model_fresh_page_bytes_per_s", "model_free_bytes_per_s", "model_heap_free_bytes",
               "model_mapped_share", "predicted_fresh_bytes", "predicted_unmapped_bytes"]
_AFTER = ["link_bytes_per_s", "link_cpu_seconds_per_byte", "bytes_moved", "bytes_kept", "bytes_handed_over",
          "bytes_lower_bound", "bytes_total", "max_bytes_received", "rounds", "budget", "peak_mem_bytes",
          "extra_mem_bytes", "state_mismatches", "step_after_seconds", "loss_after", "time_split", "floor_seconds",
          "copy_floor_seconds", "pieces_per_rank", "host_calls_per_rank", "host_calls_before_per_rank"]


def _run(predicted=None, restart=None, error=None):
    from shardshift.bench.calibration import LinkRate
    from shardshift.bench.switch import SwitchRun
    from shardshift.layout import Layout
    from shardshift.train.switch import SwitchReport

    switch = SwitchReport(step=3, old="dp=4", new="fsdp=4", seconds=0.5, move_seconds=0.25, prepare_seconds=0.1,
                          prepared_ahead=True, bytes_moved=400, bytes_kept=100, bytes_handed_over=50,
                          bytes_lower_bound=400, bytes_total=500, max_bytes_received=200, rounds=2, budget=1 << 20,
                          peak_mem_bytes=900, extra_mem_bytes=90, move_phases={"post": 0.1, "copy": 0.05},
                          move_cpu_seconds=0.75, move_page_faults=12)
    return SwitchRun(before=Layout(dp=4), after=Layout(fsdp=4), steps_taken=2, link=LinkRate(1000.0, 800.0, 1e-6),
                     dcp_save_seconds=2.0, seal_seconds=0.01, restart=restart, restart_error=error,
                     dcp_build_seconds=0.3, dcp_load_seconds=1.0, switch=switch, switch_seconds=0.5,
                     predicted=predicted, state_mismatches=0, step_after_seconds=0.2, loss_after=4.5)


def test_a_repeat_s_record_prints_the_keys_and_figures_of_its_typed_run():
    from shardshift.bench.calibration import Calibration
    from shardshift.bench.restart import Restart
    from shardshift.bench.switch import PredictedSwitch
    from shardshift.simulate.host_memory import HostMemory, PageRates, PageWork

    plain = _run(restart=Restart(5.0, 0.4, 7.0)).as_dict()
    assert list(plain) == _KEYS + ["predicted_seconds"] + _AFTER + list(RATIOS)
    assert (plain["from"], plain["to"], plain["placed"]) == ("dp=4", "fsdp=4", "fsdp=4")
    assert plain["dcp_seconds"] == 3.0 and plain["restart_seconds"] == 7.0 and plain["restart_job_seconds"] == 7.0
    assert plain["limit_seconds"] == 200 / 1000.0 and plain["transfer_cpu_seconds"] == 400 * 1e-6
    assert plain["dcp_over_switch"] == 6.0 and plain["switch_over_limit"] == 0.5 / 0.2
    assert plain["predicted_seconds"] is None and plain["predicted_over_move"] is None
    failed = _run(error="exit code 1").as_dict()
    assert failed["restart_seconds"] is None and failed["restart_error"] == "exit code 1"
    machine = Calibration(ranks=2, cores=2, link_bytes_per_s=800.0, message_seconds=1e-5, message_cpu_seconds=2e-5,
                          pair_bytes_per_s=900.0, copy_bytes_per_s=5e3, strided_copy_bytes_per_s=2e3,
                          piece_seconds=1e-6, pages=PageRates(3e3, 2e4), memory=HostMemory((10.0, 20.0), (0.5, 0.25)))
    pages = PageWork(np.zeros((2, 2)), fresh_bytes=64, unmapped_bytes=32)
    modelled = _run(predicted=PredictedSwitch(0.125, machine, pages)).as_dict()
    assert list(modelled) == _KEYS + _MODEL_KEYS + _AFTER + list(RATIOS)
    assert modelled["predicted_over_move"] == 0.5 and modelled["model_link_bytes_per_s"] == 800.0
    assert modelled["model_heap_free_bytes"] == [10.0, 20.0] and modelled["model_mapped_share"] == [0.5, 0.25]
    assert (modelled["predicted_fresh_bytes"], modelled["model_free_bytes_per_s"]) == (64, 2e4)
    # A CPU host's model: its port passes in and out together; on GPUs (no cores) pages are not modelled.
    assert machine.cluster().intra_bandwidth == 1800.0 and machine.cluster().host_cores == 2
    on_gpus = dataclasses.replace(machine, cores=0, pages=None, memory=None)
    assert on_gpus.cluster().intra_bandwidth == 900.0 and on_gpus.cluster().message_host_seconds == 0.0
    unknown = _run(predicted=PredictedSwitch(0.125, on_gpus, None)).as_dict()
    assert all(unknown[key] is None for key in _MODEL_KEYS[8:])
    summary = summarise([plain, plain])
    assert list(summary)[: len(plain)] == list(plain) and json.loads(json.dumps(summary))["repeats"] == 2
