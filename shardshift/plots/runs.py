"""Training runs in one picture: loss and tokens/s against step, with every change marked.

    draw_runs([Path("run.jsonl")], Path("run.png"))        # what `shardshift plot run.jsonl` does

From the top: a strip with one row per run showing the layout of each stretch of steps, the loss
(and the held-out loss, dashed with dots, where the run recorded one: ``--eval-every``), and
tokens/s, on one step axis. Each run has its own colour (the legend names its file). Every
switch, membership change and resume is a vertical line in the run's colour at the boundary it
happened on, half a step after the last step before it (a switch before step S at S - 0.5, a
worker joining after step S at S + 0.5), labelled at the top of the loss panel.

`draw_runs` returns a `RunsFigure` that says what was drawn, the figure included, so that callers
and tests can check the picture against the files without reading pixels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from shardshift.plots.canvas import DEFAULT_PIXELS, new_figure, palette, save_png
from shardshift.plots.metrics import LayoutSpan, RunHistory, read_history

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# Line style of each kind of mark: switches dashed, membership changes dotted, resumes dash-dotted.
MARK_STYLES = {"switch": "--", "join": ":", "leave": ":", "crash": ":", "resume": "-."}


@dataclass(frozen=True)
class EventMark:
    """One vertical line: an event of a run, where it was drawn."""

    kind: str  # "switch", "join", "leave", "crash" or "resume"
    step: int  # as recorded in the file
    x: float  # its position on the step axis: the boundary after step `RunEvent.after`
    label: str


@dataclass(frozen=True)
class RunCurve:
    """What was drawn of one run."""

    path: Path
    name: str  # its legend entry: the file's name
    color: tuple[float, float, float, float]  # RGBA of its curves and marks
    steps: tuple[int, ...]  # the x of its loss and tokens/s curves
    held_out: tuple[int, ...]  # the x of its held-out loss curve (none without one)
    marks: tuple[EventMark, ...]
    spans: tuple[LayoutSpan, ...]  # the layout strip's bars, in order


@dataclass(frozen=True)
class RunsFigure:
    """What `draw_runs` drew, and where."""

    out: Path
    size: tuple[int, int]  # pixels
    runs: tuple[RunCurve, ...]
    figure: Figure = field(repr=False, compare=False)


def draw_runs(paths: list[Path], out: Path, size: tuple[int, int] = DEFAULT_PIXELS) -> RunsFigure:
    """Read the metrics files `paths` and draw their runs into the PNG `out` of `size` pixels.

    ValueError (naming the file and line) for a file that is missing, garbled or has no steps;
    every file is read before anything is drawn."""
    histories = [read_history(Path(p)) for p in paths]
    figure = new_figure(size)
    strip, loss, speed = figure.subplots(3, 1, sharex=True,
                                         height_ratios=[0.5 + 0.25 * len(histories), 3, 2])  # fmt: skip
    layouts = sorted({span.layout for h in histories for span in h.spans})
    layout_colors = dict(zip(layouts, _pale(len(layouts))))
    runs = []
    for row, (history, color) in enumerate(zip(histories, palette(len(histories)))):
        runs.append(_draw_run(history, color, row, strip, loss, speed, layout_colors))
    _dress(strip, loss, speed, runs)
    save_png(figure, out)
    return RunsFigure(out, size, tuple(runs), figure)


def _draw_run(history: RunHistory, color, row: int, strip: Axes, loss: Axes, speed: Axes,
              layout_colors: dict) -> RunCurve:
    """One run's curves, marks and layout bars; its record."""
    name = history.path.name
    steps = [p.step for p in history.steps]
    loss.plot(steps, [p.loss for p in history.steps], color=color, label=name, linewidth=1.2)
    if history.held_out:
        loss.plot([p.step for p in history.held_out], [p.loss for p in history.held_out], color=color,
                  linestyle="--", marker="o", markersize=3, linewidth=1.0, label=f"{name} (held-out)")
    speed.plot(steps, [p.tokens_per_s for p in history.steps], color=color, linewidth=1.2)
    for span in history.spans:
        strip.broken_barh([(span.first - 0.5, span.last - span.first + 1)], (row - 0.4, 0.8),
                          facecolors=layout_colors[span.layout], edgecolors="white")
        strip.text((span.first + span.last) / 2, row, span.layout, ha="center", va="center", fontsize=8,
                   clip_on=True)
    marks = []
    for event in history.events:
        mark = EventMark(event.kind, event.step, event.after + 0.5, event.label)
        for ax in (loss, speed):
            ax.axvline(mark.x, color=color, linestyle=MARK_STYLES[mark.kind], linewidth=1.0)
        loss.text(mark.x, 0.98, f" {mark.label}", transform=loss.get_xaxis_transform(), rotation=90,
                  ha="right", va="top", fontsize=8, color=color)
        marks.append(mark)
    return RunCurve(history.path, name, color, tuple(steps), tuple(p.step for p in history.held_out), tuple(marks),
                    history.spans)


def _dress(strip: Axes, loss: Axes, speed: Axes, runs: list[RunCurve]) -> None:
    """Titles, labels, ticks and the legend."""
    strip.set_title("layout", fontsize=10, loc="left")
    strip.set_yticks(range(len(runs)), [run.name for run in runs], fontsize=8)
    strip.set_ylim(len(runs) - 0.5, -0.5)  # the first run on top, as in the legend
    strip.tick_params(axis="x", labelbottom=False)
    loss.set_ylabel("loss")
    loss.legend(loc="upper right", fontsize=9)
    loss.grid(alpha=0.3)
    speed.set_ylabel("tokens/s")
    speed.set_xlabel("step")
    speed.grid(alpha=0.3)
    speed.set_ylim(bottom=0)


def _pale(count: int) -> list:
    """Light fill colours for the layouts, so the black layout names stay readable on them."""
    from matplotlib.colors import to_rgba

    return [tuple(0.55 * c + 0.45 for c in to_rgba(color)[:3]) + (1.0,) for color in palette(count)]
