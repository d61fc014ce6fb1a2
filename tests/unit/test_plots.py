"""The pictures: `shardshift plot`, `topo draw` and the benches' drawings write PNGs of the size
asked for, and what they draw is checked on the figure's own artists against the inputs (metrics
files written by the training run's own writers, bench results built by the benches' own report
functions or by hand in their format, packings from the packer)."""

from __future__ import annotations

import ast
import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from shardshift.cli.main import main
from shardshift.layout import Layout
from shardshift.models import model_spec
from shardshift.plots.bench import draw_collectives_bench, draw_switch_bench, draw_train_bench
from shardshift.plots.canvas import parse_pixels
from shardshift.plots.runs import draw_runs
from shardshift.plots.topology import draw_packing
from shardshift.train.config import TrainConfig
from shardshift.train.report import Metrics, report_step
from shardshift.train.switch import SwitchReport
from shardshift.train.trainer import StepResult
from support import REPO


def png_size(path: Path) -> tuple[int, int]:
    """The width and height a PNG's IHDR chunk declares, after checking the PNG signature."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


# ---- metrics files, written as the training run writes them -----------------------------------

CFG = TrainConfig(layout=Layout(dp=4), model=model_spec("test"), steps=20, log_every=0)


def _step(metrics: Metrics, layout: str, step: int, loss: float | None = None) -> None:
    result = StepResult(step=step, loss=10.0 / step if loss is None else loss, grad_norm=1.0, lr=1e-3,
                        step_time_s=0.1, tokens_per_s=1000.0 * step)
    report_step(CFG.with_layout(Layout.parse(layout)), result, metrics)


def _switch(metrics: Metrics, step: int, old: str, new: str) -> None:
    metrics.write(SwitchReport(step=step, old=old, new=new, seconds=0.5, move_seconds=0.4, prepare_seconds=0.1,
                               prepared_ahead=True,
                               bytes_moved=1, bytes_kept=1, bytes_handed_over=0, bytes_lower_bound=1, bytes_total=2,
                               max_bytes_received=1,
                               rounds=1, budget=1 << 20, peak_mem_bytes=1, extra_mem_bytes=0).event())


def _membership(metrics: Metrics, step: int, kind: str, worlds: tuple[int, int], layouts: tuple[str, str],
                steps_lost: int = 0) -> None:
    """As `shardshift.elastic.worker` writes it when a new world opens."""
    metrics.write({"event": "membership", "step": step, "kind": kind, "from_world": worlds[0], "to_world": worlds[1],
                   "from": layouts[0], "to": layouts[1], "detect_seconds": 0.0, "pause_seconds": 0.2,
                   "bytes_moved": 1, "steps_lost": steps_lost, "recovered_from": "replica", "planned_ahead": True,
                   "phases": {}})


def switching_run(path: Path) -> Path:
    """dp=4 for steps 1-4, a switch before step 5 to fsdp=2,tp=2, another before step 8 to tp=2,pp=2."""
    metrics = Metrics(str(path), rank=0)
    for step in range(1, 11):
        if step == 5:
            _switch(metrics, 5, "dp=4", "fsdp=2,tp=2")
        if step == 8:
            _switch(metrics, 8, "fsdp=2,tp=2", "tp=2,pp=2")
        _step(metrics, "dp=4" if step < 5 else "fsdp=2,tp=2" if step < 8 else "tp=2,pp=2", step)
    metrics.close()
    return path


def elastic_run(path: Path) -> Path:
    """4 workers; one leaves after step 2; a crash during step 5 goes back to the checkpoint of step
    4 (step 5 is trained again, by 2 workers); two join after step 6."""
    metrics = Metrics(str(path), rank=0)
    for step in (1, 2):
        _step(metrics, "fsdp=4", step)
    _membership(metrics, 2, "leave", (4, 3), ("fsdp=4", "fsdp=3"))
    for step in (3, 4, 5):
        _step(metrics, "fsdp=3", step)
    _membership(metrics, 4, "crash", (3, 2), ("fsdp=3", "fsdp=2"), steps_lost=1)
    for step in (5, 6):
        _step(metrics, "fsdp=2", step, loss=0.5 + step)  # step 5 again: a loss unlike the first one
    _membership(metrics, 6, "join", (2, 4), ("fsdp=2", "fsdp=4"))
    for step in (7, 8):
        _step(metrics, "fsdp=4", step)
    metrics.close()
    return path


def _axes(figure, ylabel: str):
    (ax,) = [ax for ax in figure.axes if ax.get_ylabel() == ylabel]
    return ax


def _vertical_lines(ax) -> list:
    """The axvlines of `ax`: two points at one x, spanning the axes' height."""
    return [line for line in ax.get_lines() if len(line.get_xdata()) == 2 and line.get_xdata()[0] == line.get_xdata()[1]]


def _curves(ax) -> list:
    return [line for line in ax.get_lines() if line not in _vertical_lines(ax)]


# ---- shardshift plot ---------------------------------------------------------------------------

def test_switch_marks_fall_at_the_recorded_steps(tmp_path):
    path = switching_run(tmp_path / "run.jsonl")
    drawn = draw_runs([path], tmp_path / "run.png")
    (run,) = drawn.runs
    assert run.steps == tuple(range(1, 11))
    assert [(m.kind, m.step, m.label) for m in run.marks] == [
        ("switch", 5, "switch → fsdp=2,tp=2"), ("switch", 8, "switch → tp=2,pp=2")]
    # A switch before step S is drawn between steps S - 1 and S, on both panels, in the run's colour.
    for ylabel in ("loss", "tokens/s"):
        lines = _vertical_lines(_axes(drawn.figure, ylabel))
        assert sorted(line.get_xdata()[0] for line in lines) == [4.5, 7.5] == [m.x for m in run.marks]
        assert all(line.get_color() == run.color for line in lines)
    (curve,) = _curves(_axes(drawn.figure, "loss"))
    assert list(curve.get_xdata()) == list(range(1, 11))
    np.testing.assert_allclose(curve.get_ydata(), [10.0 / s for s in range(1, 11)])
    texts = [t.get_text().strip() for t in _axes(drawn.figure, "loss").texts]
    assert texts == ["switch → fsdp=2,tp=2", "switch → tp=2,pp=2"]


def test_each_layout_is_shown_over_the_steps_it_ran(tmp_path):
    drawn = draw_runs([switching_run(tmp_path / "run.jsonl")], tmp_path / "run.png")
    (run,) = drawn.runs
    assert [(s.first, s.last, s.layout) for s in run.spans] == [
        (1, 4, "dp=4"), (5, 7, "fsdp=2,tp=2"), (8, 10, "tp=2,pp=2")]
    strip = drawn.figure.axes[0]
    bars = [(path.vertices[:, 0].min(), path.vertices[:, 0].max()) for bar in strip.collections
            for path in bar.get_paths()]
    assert bars == [(0.5, 4.5), (4.5, 7.5), (7.5, 10.5)]
    assert [t.get_text() for t in strip.texts] == ["dp=4", "fsdp=2,tp=2", "tp=2,pp=2"]


def test_membership_changes_are_marked_and_redone_steps_replace_the_lost_ones(tmp_path):
    drawn = draw_runs([elastic_run(tmp_path / "elastic.jsonl")], tmp_path / "elastic.png")
    (run,) = drawn.runs
    assert [(m.kind, m.step, m.x, m.label) for m in run.marks] == [
        ("leave", 2, 2.5, "leave 4→3"), ("crash", 4, 4.5, "crash 3→2"), ("join", 6, 6.5, "join 2→4")]
    lines = _vertical_lines(_axes(drawn.figure, "loss"))
    assert sorted(line.get_xdata()[0] for line in lines) == [2.5, 4.5, 6.5]
    (curve,) = _curves(_axes(drawn.figure, "loss"))
    assert list(curve.get_xdata()) == list(range(1, 9))  # step 5 once: the run's second try
    assert curve.get_ydata()[4] == 5.5
    assert [(s.first, s.last, s.layout) for s in run.spans] == [
        (1, 2, "fsdp=4"), (3, 4, "fsdp=3"), (5, 6, "fsdp=2"), (7, 8, "fsdp=4")]


def test_the_held_out_loss_is_drawn_dashed_beside_the_loss_and_undone_with_its_steps(tmp_path):
    """Held-out losses after steps 2, 4 and 6, as `Loop` records them; the run resumes from step 3
    and evaluates after step 4 again: the curve is 2, 4 (the second), 6."""
    from shardshift.train.report import report_eval

    path = tmp_path / "eval.jsonl"
    for start, stop, shift in ((1, 6, 0.0), (4, 6, 1.0)):
        metrics = Metrics(str(path), rank=0)
        for step in range(start, stop + 1):
            _step(metrics, "dp=4", step)
            if step % 2 == 0:
                report_eval(CFG, step, 20.0 / step + shift, metrics)
        metrics.close()
    drawn = draw_runs([path], tmp_path / "eval.png")
    (run,) = drawn.runs
    assert run.held_out == (2, 4, 6)
    loss, held_out = _curves(_axes(drawn.figure, "loss"))
    assert held_out.get_linestyle() == "--" and held_out.get_label() == "eval.jsonl (held-out)"
    assert list(held_out.get_xdata()) == [2, 4, 6] and list(held_out.get_ydata()) == [10.0, 6.0, 20 / 6 + 1]
    assert list(loss.get_xdata()) == list(range(1, 7))


def test_a_resumed_run_drops_what_it_had_recorded_past_its_checkpoint(tmp_path):
    """Steps 1-6 with a switch before step 5, stopped; resumed from the checkpoint of step 3, the
    run trains steps 4-8 again and switches again: one switch, one resume, each step once."""
    path = tmp_path / "resumed.jsonl"
    for start, stop in ((1, 6), (4, 8)):
        metrics = Metrics(str(path), rank=0)
        if start > 1:
            metrics.write({"event": "resume", "step": start - 1, "checkpoint": "ckpt/step-3", "layout": "dp=4"})
        for step in range(start, stop + 1):
            if step == 5:
                _switch(metrics, 5, "dp=4", "fsdp=4")
            _step(metrics, "dp=4" if step < 5 else "fsdp=4", step, loss=float(start))
        metrics.close()
    drawn = draw_runs([path], tmp_path / "resumed.png")
    (run,) = drawn.runs
    assert [(m.kind, m.x) for m in run.marks] == [("resume", 3.5), ("switch", 4.5)]
    assert sorted(line.get_xdata()[0] for line in _vertical_lines(_axes(drawn.figure, "loss"))) == [3.5, 4.5]
    (curve,) = _curves(_axes(drawn.figure, "loss"))
    assert list(curve.get_xdata()) == list(range(1, 9))
    assert list(curve.get_ydata()) == [1.0] * 3 + [4.0] * 5


def test_two_runs_get_two_colours_and_a_legend_by_file_name(tmp_path):
    paths = [switching_run(tmp_path / "a.jsonl"), elastic_run(tmp_path / "b.jsonl")]
    drawn = draw_runs(paths, tmp_path / "both.png")
    loss = _axes(drawn.figure, "loss")
    curves = _curves(loss)
    assert [c.get_label() for c in curves] == ["a.jsonl", "b.jsonl"]
    assert curves[0].get_color() != curves[1].get_color()
    assert [c.get_color() for c in curves] == [r.color for r in drawn.runs]
    assert [t.get_text() for t in loss.get_legend().get_texts()] == ["a.jsonl", "b.jsonl"]
    for run in drawn.runs:  # each run's marks in its own colour, at its own events
        mine = [line for line in _vertical_lines(loss) if line.get_color() == run.color]
        assert [line.get_xdata()[0] for line in mine] == [m.x for m in run.marks]
    assert [m.x for m in drawn.runs[0].marks] == [4.5, 7.5] and [m.x for m in drawn.runs[1].marks] == [2.5, 4.5, 6.5]


@pytest.mark.parametrize("size", [(1600, 1000), (1234, 567)])
def test_the_picture_has_exactly_the_size_asked_for(tmp_path, size):
    out = tmp_path / "run.png"
    drawn = draw_runs([switching_run(tmp_path / "run.jsonl")], out, size)
    assert png_size(out) == size == drawn.size


def test_the_command_writes_beside_the_first_file_by_default(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    switching_run(tmp_path / "run.jsonl")
    assert main(["plot", "run.jsonl"]) == 0  # as the README shows it
    assert png_size(tmp_path / "run.png") == (1600, 1000)
    assert "wrote run.png (1600x1000): 1 run(s), 2 event(s) marked" in capsys.readouterr().out
    elastic_run(tmp_path / "b.jsonl")
    assert main(["plot", "b.jsonl", "run.jsonl", "-o", "small.png", "--size", "800x600"]) == 0
    assert png_size(tmp_path / "small.png") == (800, 600)
    assert not (tmp_path / "b.png").exists()


@pytest.mark.parametrize("content, needle", [
    (None, "missing.jsonl: no such file"),
    ('{"step": 1, "loss": 2.0, "layout": "dp=4", "tokens_per_s": 5.0}\n{"step": 2, "loss"\n', "bad.jsonl:2: not JSON"),
    ('[1, 2]\n', "bad.jsonl:1: a JSON list, not an object"),
    ('{"hello": 1}\n', "bad.jsonl:1: neither a step record"),
    ('{"step": 1, "loss": "low", "layout": "dp=4", "tokens_per_s": 5.0}\n', 'bad.jsonl:1: "loss" is \'low\''),
    ('{"event": "switch", "step": 3, "from": "dp=4", "to": "tp=4"}\n', "bad.jsonl: no step records"),
    ("", "bad.jsonl: the file is empty"),
    ("\n", "bad.jsonl: no step records"),
])
def test_bad_input_is_one_line_naming_the_file_and_exit_2(tmp_path, capsys, content, needle):
    path = tmp_path / ("missing.jsonl" if content is None else "bad.jsonl")
    if content is not None:
        path.write_text(content)
    good = switching_run(tmp_path / "good.jsonl")
    assert main(["plot", str(good), str(path), "-o", str(tmp_path / "out.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardshift: error: ") and err.count("\n") == 1
    assert needle in err, err
    assert not (tmp_path / "out.png").exists()
    with pytest.raises(ValueError, match="no such file|empty|not JSON|not an object|neither|expected|no step"):
        draw_runs([path], tmp_path / "out.png")


@pytest.mark.parametrize("argv, needle", [
    (["--size", "10x10"], "--size '10x10': give WIDTHxHEIGHT in pixels"),
    (["--size", "wide"], "--size 'wide'"),
    (["-o", "/nonexistent/dir/x.png"], "no folder /nonexistent/dir"),
    (["-o", "picture.pdf"], "give a name ending in .png"),
])
def test_bad_picture_options_are_refused(tmp_path, capsys, argv, needle):
    assert main(["plot", str(switching_run(tmp_path / "run.jsonl")), *argv]) == 2
    assert needle in capsys.readouterr().err


def test_without_matplotlib_drawing_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    path = switching_run(tmp_path / "run.jsonl")
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    assert main(["plot", str(path)]) == 2
    assert "pip install 'shardshift[plot]'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"pip install 'shardshift\[plot\]'"):
        draw_runs([path], tmp_path / "run.png")
    assert main(["bench", "switch", "--suite", "--plot", str(tmp_path / "s.png")]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_parse_pixels():
    assert parse_pixels("1600x1000") == (1600, 1000)
    assert parse_pixels("640X480") == (640, 480)
    for text in ("1600", "0x100", "100x-5", "1e3x500", "9000x100"):
        with pytest.raises(ValueError, match="WIDTHxHEIGHT"):
            parse_pixels(text)


def test_matplotlib_is_imported_only_inside_the_functions_that_draw():
    """`import shardshift` and every command's parser must not pay for (or need) matplotlib."""
    found = []
    for path in (REPO / "shardshift").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in _module_level(tree.body):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{path.relative_to(REPO)}: {name}" for name in names if name.split(".")[0] == "matplotlib"]
    assert found == [], found


def _module_level(body):
    """The imports a module runs when it is imported (not those in functions or TYPE_CHECKING blocks)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
            yield from _module_level(node.body + node.orelse)
        elif isinstance(node, (ast.Try, ast.ClassDef, ast.With)):
            yield from _module_level(node.body)


# ---- the benches' pictures -------------------------------------------------------------------

def _bars(ax) -> dict[str, list[float]]:
    """Each legend entry's bar heights, left to right."""
    return {c.get_label(): [bar.get_height() for bar in c] for c in ax.containers}


def switch_result() -> dict:
    """The `bench switch --json` object of a three-layout chain whose second restart failed."""
    def transition(before, after, switch, dcp, restart, limit):
        return {"from": before, "to": after, "placed": after, "steps_taken": 1, "switch_seconds": switch,
                "prepare_seconds": 0.1, "dcp_seconds": dcp, "dcp_save_seconds": dcp / 2, "seal_seconds": 0.01,
                "dcp_load_seconds": dcp / 2, "dcp_build_seconds": 0.2, "restart_seconds": restart,
                "restart_step_seconds": None, "restart_job_seconds": None,
                "restart_error": None if restart else "exit status 1", "limit_seconds": limit,
                "predicted_seconds": None, "move_seconds": switch / 2, "move_cpu_seconds": switch, "transfer_cpu_seconds": 0.01,
                "move_page_faults": 7,
                "link_bytes_per_s": 1e9, "link_cpu_seconds_per_byte": 1e-9, "bytes_moved": 10, "bytes_kept": 5, "bytes_lower_bound": 10,
                "bytes_total": 20, "max_bytes_received": 5, "rounds": 1, "budget": 1 << 28, "peak_mem_bytes": 30,
                "extra_mem_bytes": 3, "state_mismatches": 0, "step_after_seconds": 0.3, "loss_after": 4.0,
                "dcp_over_switch": dcp / switch, "restart_over_switch": restart and restart / switch,
                "switch_over_limit": switch / limit, "predicted_over_switch": None,
                "predicted_over_move": None, "floor_seconds": limit * 1.2, "copy_floor_seconds": limit * 0.2,
                "switch_over_floor": switch / (limit * 1.2), "pieces_per_rank": 40, "host_calls_per_rank": 12,
                "host_calls_before_per_rank": 50,
                "time_split": {"plan": 0.1, "open": 0.0, "pack": 0.01, "wire": switch / 3, "copy": 0.01, "unpack": 0.01,
                               "close": 0.0, "rebuild": 0.02}}  # fmt: skip

    return {"model": "test", "params": 1000, "nproc": 4, "device": "cpu", "dtype": "float32", "global_batch": 8,
            "budget": 1 << 28, "geomean": {},
            "transitions": [transition("dp=4", "fsdp=4", 0.2, 2.0, 12.0, 0.01),
                            transition("fsdp=4", "tp=4", 0.4, 3.0, None, 0.02)]}


def test_switch_bench_bars_per_transition_on_a_log_scale(tmp_path):
    out = tmp_path / "switch.png"
    drawn = draw_switch_bench(switch_result(), out, (1000, 700))
    assert png_size(out) == (1000, 700)
    ax = drawn.figure.axes[0]
    assert ax.get_yscale() == "log"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["dp=4 → fsdp=4", "fsdp=4 → tp=4"]
    assert _bars(ax) == {"online switch": [0.2, 0.4], "DCP save + load": [2.0, 3.0],
                         "restart from DCP": [12.0], "link limit": [0.01, 0.02]}
    assert "failed" in [t.get_text() for t in ax.texts]
    assert [s.y for s in drawn.series] == [(0.2, 0.4), (2.0, 3.0), (12.0, None), (0.01, 0.02)]


def test_switch_bench_table_says_how_many_cores_the_move_kept_busy(capsys):
    from shardshift.bench.switch import SwitchBenchOptions, report, summarise

    records = [summarise([t, t]) for t in switch_result()["transitions"]]
    cfg = TrainConfig(layout=Layout(dp=4), model=model_spec("test"), steps=3, global_batch=8)
    opts = SwitchBenchOptions(chain=(Layout(dp=4), Layout(fsdp=4), Layout(tp=4)), cfg=cfg, nproc=4, budget=1 << 28,
                              p2p_bytes=1 << 20)
    result = report(opts, records, "cpu")
    out = capsys.readouterr().out
    assert f"on {result['cores']} cores:" in out
    # The fixture's moves took switch / 2 seconds and switch core-seconds: 2 cores busy.
    line = next(line for line in out.splitlines() if line.startswith("  dp=4 -> fsdp=4 ") and "core-s" in line)
    assert "0.20 core-s in 0.10 s (2.0 cores busy)" in line
    assert line.endswith("the links' cost of the bytes moved: 0.01 core-s (1.00 per GB); 7 pages first touched")


def test_switch_bench_draws_the_object_its_report_prints(tmp_path, capsys):
    from shardshift.bench.switch import SwitchBenchOptions, report, summarise

    records = [summarise([t, t]) for t in switch_result()["transitions"]]
    cfg = TrainConfig(layout=Layout(dp=4), model=model_spec("test"), steps=3, global_batch=8)
    opts = SwitchBenchOptions(chain=(Layout(dp=4), Layout(fsdp=4), Layout(tp=4)), cfg=cfg, nproc=4, budget=1 << 28,
                              p2p_bytes=1 << 20, json=True)
    result = report(opts, records, "cpu")
    assert json.loads(capsys.readouterr().out) == result
    drawn = draw_switch_bench(result, tmp_path / "switch.png")
    assert [s.y for s in drawn.series][0] == (0.2, 0.4)


def test_collectives_bench_lines_per_implementation_with_the_bound_dashed(tmp_path, capsys):
    from shardshift.bench.collectives import CollectivesBenchOptions, report, rows
    from shardshift.collectives.execution.runner import RunOptions
    from shardshift.collectives.planning.ops import Collective
    from shardshift.collectives.topology.presets import full

    sizes = (1 << 20, 1 << 22)
    opts = CollectivesBenchOptions(op=Collective.ALLREDUCE, sizes=sizes, nproc=4, topology=full(4),
                                   impls=("gloo", "trees"), run=RunOptions(), json=True)
    seconds = {"gloo": 0.02, "trees": 0.01}
    measured = [{"impl": impl, "bytes": size, "count": size // 4, "seconds": seconds[impl] * size / sizes[0],
                 "all_seconds": [seconds[impl]], "wrong": 0, "num_trees": None, "packing_rate": None,
                 "cpu_busy": None} for size in sizes for impl in ("gloo", "trees")]  # fmt: skip
    result = report(opts, rows(opts, measured, opts.bound), None)
    assert json.loads(capsys.readouterr().out) == result
    out = tmp_path / "allreduce.png"
    drawn = draw_collectives_bench(result, out, (900, 600))
    assert png_size(out) == (900, 600)
    ax = drawn.figure.axes[0]
    assert ax.get_xscale() == "log"
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"gloo", "trees", "bound"}
    assert list(lines["gloo"].get_xdata()) == list(sizes)
    np.testing.assert_allclose(lines["gloo"].get_ydata(), [sizes[0] / 0.02 / 1e9] * 2)
    np.testing.assert_allclose(lines["trees"].get_ydata(), [sizes[0] / 0.01 / 1e9] * 2)
    np.testing.assert_allclose(lines["bound"].get_ydata(), [opts.bound / 1e9] * 2)
    assert lines["bound"].get_linestyle() == "--" and lines["gloo"].get_linestyle() == "-"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["gloo", "trees", "bound"]


def test_train_bench_bars_per_layout_grouped_by_further_columns(tmp_path, capsys):
    from shardshift.bench.train import Throughput, TrainBenchOptions, Variant, report

    base = TrainConfig(layout=Layout(dp=4), model=model_spec("test"), steps=11)
    opts = TrainBenchOptions(base=base, also=(Variant(Layout(fsdp=4)),), json=True)
    result = report(opts, [Throughput(("ddp", "gloo"), 9, 1.0, 900.0), Throughput(("dp=4", "gloo"), 9, 1.0, 800.0),
                           Throughput(("fsdp=4", "gloo"), 9, 2.0, 450.0)], "cpu")
    assert json.loads(capsys.readouterr().out) == result
    out = tmp_path / "train.png"
    drawn = draw_train_bench(result, out)
    assert png_size(out) == (1600, 1000)
    ax = drawn.figure.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["ddp", "dp=4", "fsdp=4"]
    assert _bars(ax) == {"collectives=gloo": [900.0, 800.0, 450.0]}
    # Rows with a further text column (which collectives ran) are grouped by it, a bar per group.
    rows = [{"impl": impl, "collectives": c, "tokens_per_s": v * (2 if c == "trees" else 1), "seconds": 1.0}
            for c in ("gloo", "trees") for impl, v in (("ddp", 900.0), ("dp=4", 800.0))]
    drawn = draw_train_bench({"model": "test", "nproc": 4, "device": "cpu", "rows": rows}, out)
    ax = drawn.figure.axes[0]
    assert _bars(ax) == {"collectives=gloo": [900.0, 800.0], "collectives=trees": [1800.0, 1600.0]}
    gloo, trees = ax.containers
    assert all(a.get_x() < b.get_x() for a, b in zip(gloo, trees))  # side by side over each layout


@pytest.mark.parametrize("rank", [0, 1])
def test_only_rank_0_draws_the_report_it_printed(tmp_path, capsys, monkeypatch, rank):
    """The benches' rank code, its process group replaced by what the ranks would have measured."""
    from shardshift.bench import switch, train

    proc = type("Proc", (), {"rank": rank, "device_type": "cpu"})
    records = [switch.summarise([t]) for t in switch_result()["transitions"]]
    monkeypatch.setattr(switch, "run_in_group", lambda timeout_s, body: (proc, records))
    cfg = TrainConfig(layout=Layout(dp=4), model=model_spec("test"), steps=3, global_batch=8)
    opts = switch.SwitchBenchOptions(chain=(Layout(dp=4), Layout(fsdp=4), Layout(tp=4)), cfg=cfg, nproc=4,
                                     budget=1 << 28, p2p_bytes=1 << 20, plot=tmp_path / "switch.png")
    assert switch.run_rank(opts) == 0
    results = [train.Throughput(("ddp", "gloo"), 9, 1.0, 900.0), train.Throughput(("dp=4", "gloo"), 9, 1.0, 800.0)]
    monkeypatch.setattr(train, "run_in_group", lambda timeout_s, body: (proc, results))
    base = TrainConfig(layout=Layout(dp=4), model=model_spec("test"), steps=11)
    assert train.run_rank(train.TrainBenchOptions(base=base, plot=tmp_path / "train.png")) == 0
    err = capsys.readouterr().err
    for name in ("switch.png", "train.png"):
        if rank == 0:
            assert png_size(tmp_path / name) == (1600, 1000) and f"wrote {tmp_path / name}" in err
        else:
            assert not (tmp_path / name).exists()


def test_bench_plot_is_refused_before_any_process_starts(tmp_path, capsys, monkeypatch):
    def no_process(*args, **kwargs):
        raise AssertionError("a process would have been started")

    monkeypatch.setattr("shardshift.launch.start_ranks", no_process)
    for argv in (["bench", "switch", "--suite"], ["bench", "train"], ["bench", "collectives", "--op", "allreduce",
                                                                     "--nproc", "2"]):
        assert main([*argv, "--plot", "/nonexistent/dir/b.png"]) == 2
        assert "--plot /nonexistent/dir/b.png: no folder /nonexistent/dir" in capsys.readouterr().err


# ---- topo draw ---------------------------------------------------------------------------------

def _axes_by_gid(figure, prefix: str) -> list:
    return [ax for ax in figure.axes if (ax.get_gid() or "").startswith(prefix)]


def _lines_by_gid(ax) -> dict:
    return {line.get_gid(): line for line in ax.get_lines() if line.get_gid()}


def _nearest(point, positions) -> int:
    return min(positions, key=lambda v: np.hypot(*(np.asarray(positions[v]) - point)))


def _expected_link_rates(packing) -> dict[tuple[int, int], float]:
    """(src, dst) → the sum over trees of weight × the tree's edges whose path crosses src→dst."""
    rates: dict[tuple[int, int], float] = {}
    for tree in packing.trees:
        for path in tree.paths or tree.edges:
            for hop in zip(path, path[1:]):
                rates[hop] = rates.get(hop, 0.0) + tree.weight
    return rates


def test_topo_draw_writes_the_packing_on_the_topology(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["topo", "draw", "--preset", "dgx1v", "--gpus", "0,1,2,3", "--op", "broadcast"]) == 0  # the README's
    assert png_size(tmp_path / "topology-broadcast.png") == (1600, 1000)
    assert "wrote topology-broadcast.png (1600x1000): broadcast on dgx1v[0,1,2,3]" in capsys.readouterr().out
    argv = ["topo", "draw", "--preset", "ring", "--ranks", "5", "--op", "reduce", "--root", "2", "--max-trees", "2",
            "-o", "ring.png", "--size", "1000x800", "--trees", "1"]
    assert main(argv) == 0
    assert png_size(tmp_path / "ring.png") == (1000, 800)
    assert "2 trees (1 drawn apart)" in capsys.readouterr().out


def test_link_widths_and_colours_are_the_load_the_packing_puts_on_each_link(tmp_path):
    from matplotlib.collections import QuadMesh
    from matplotlib.colors import to_rgba

    from shardshift.collectives.planning.packing import pack
    from shardshift.collectives.topology.presets import dgx1v, fat_tree

    for topology, op in ((dgx1v([0, 1, 2, 3]), "broadcast"), (fat_tree(4, hosts_per_leaf=2), "allgather"),
                         (dgx1v([0, 1, 2, 3, 4, 5]), "allreduce")):
        packing = pack(topology, op)
        drawn = draw_packing(topology, packing, tmp_path / "topo.png", (900, 700))
        assert png_size(tmp_path / "topo.png") == (900, 700)
        expected = _expected_link_rates(packing)
        assert [(d.src, d.dst) for d in drawn.links] == [(link.src, link.dst) for link in topology.links]
        (ax,) = _axes_by_gid(drawn.figure, "links")
        lines = _lines_by_gid(ax)
        (colorbar,) = [a for a in drawn.figure.axes if a.get_ylabel() == "fraction of capacity"]
        (key,) = [c for c in colorbar.collections if isinstance(c, QuadMesh)]  # the colorbar's colours and scale
        busiest = max(expected.values())
        widest = max(d.width for d in drawn.links)
        for d, link in zip(drawn.links, topology.links):
            line = lines[f"link {d.src}->{d.dst}"]
            rate = expected.get((d.src, d.dst), 0.0)
            assert d.rate == pytest.approx(rate, rel=1e-12, abs=0) and d.capacity == link.capacity
            assert d.fraction == pytest.approx(rate / link.capacity, rel=1e-12, abs=0)
            assert line.get_linewidth() == d.width and to_rgba(line.get_color()) == d.color
            if rate > 0:  # width proportional to the rate; colour: the colorbar's at the fraction
                assert d.width == pytest.approx(widest * rate / busiest, rel=1e-9)
                assert line.get_linestyle() == "-" and d.color == tuple(key.cmap(key.norm(d.fraction)))
            else:
                assert line.get_linestyle() == "--" and d.width < 0.2 * widest
        assert key.norm.vmin == 0 and key.norm.vmax == max(1.0, max(d.fraction for d in drawn.links))
        if op == "broadcast":  # broadcast from rank 0 leaves links idle: they are there, dashed
            assert any(d.rate == 0 for d in drawn.links)
        title = drawn.figure.texts[0].get_text()
        assert title == drawn.title and f"rate {packing.rate / 1e9:.4g} GB/s" in title
        assert f"bound {packing.bound / 1e9:.4g} GB/s" in title and f"rate/bound {packing.rate / packing.bound:.4f}" in title


def test_the_heaviest_trees_get_small_panels_and_the_rest_one_note(tmp_path):
    from shardshift.collectives.planning.packing import pack
    from shardshift.collectives.topology.presets import dgx1v, fat_tree

    for topology, op, asks in ((dgx1v([0, 1, 2, 3, 4, 5]), "allreduce", (1, 4, 100)),
                               (fat_tree(4, hosts_per_leaf=2), "broadcast", (2,))):
        packing = pack(topology, op)
        pieces = sorted(packing.pieces(), key=lambda p: -p.weight)
        for asked in asks:
            drawn = draw_packing(topology, packing, tmp_path / "topo.png", (800, 500), panels=asked)
            assert png_size(tmp_path / "topo.png") == (800, 500)
            shown = min(asked, len(pieces))
            axes = _axes_by_gid(drawn.figure, "tree panel")
            assert len(drawn.panels) == len(axes) == shown
            assert [(p.root, p.rate, p.trees) for p in drawn.panels] == [(p.root, p.weight, p.trees)
                                                                         for p in pieces[:shown]]
            for panel, ax in zip(drawn.panels, axes):
                assert ax.get_title() == panel.title and panel.title.startswith(f"root {panel.root}: "
                                                                                f"{panel.rate / 1e9:.4g} GB/s")
                lines = _lines_by_gid(ax)
                edges = {f"tree {i} {a}->{b}": (a, b, path) for i in panel.trees
                         for (a, b), path in zip(packing.trees[i].edges, packing.trees[i].paths or packing.trees[i].edges)}
                assert set(lines) == set(edges)  # only this piece's trees, every edge of them
                for gid, (a, b, path) in edges.items():  # from sender to receiver, bending at each switch
                    xs, ys = lines[gid].get_xdata(), lines[gid].get_ydata()
                    assert len(xs) == 2 * (len(path) - 1)
                    assert _nearest(np.array([xs[0], ys[0]]), drawn.positions) == a
                    assert _nearest(np.array([xs[-1], ys[-1]]), drawn.positions) == b
            rest = pieces[shown:]
            assert drawn.more == (f"and {len(rest)} more carrying "
                                  f"{sum(p.weight for p in rest) / sum(p.weight for p in pieces):.1%} of the rate"
                                  if rest else "")  # fmt: skip
            assert (drawn.more in [t.get_text() for sub in drawn.figure.subfigs for t in sub.texts]) == bool(rest)


def test_topo_draw_refuses_bad_input(tmp_path, capsys):
    base = ["topo", "draw", "--preset", "ring", "--ranks", "4", "--op", "broadcast", "-o", str(tmp_path / "t.png")]
    assert main([*base, "--root", "7"]) == 2
    assert "--root 7 is not a rank of ring4" in capsys.readouterr().err
    assert main([*base, "--size", "3x3"]) == 2
    assert "--size '3x3'" in capsys.readouterr().err
    assert main([*base, "--trees", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--trees 0: give at least 1" in err
    assert not (tmp_path / "t.png").exists()
