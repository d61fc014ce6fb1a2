"""Benchmark results as pictures: each function takes the dict the bench's ``--json`` prints.

    draw_switch_bench(result, Path("switch.png"))        # `shardshift bench switch --plot switch.png`
    draw_collectives_bench(result, Path("allreduce.png"))
    draw_train_bench(result, Path("train.png"))

- switch: per transition, the online switch beside DCP save + load, a restart from DCP and the
  link limit, as grouped bars on a log scale of seconds (a restart that failed is marked so);
- collectives: algorithm bandwidth against message size, one line per implementation, the
  topology's bound dashed, as nccl-tests results are usually drawn;
- train: tokens/s per layout (and plain DDP), bars grouped by every further text column of the
  rows (e.g. ``"collectives": "trees"``), one bar per group.

Each returns a `BenchFigure`: the series it drew (label, x, y; None where nothing was drawn).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from shardshift.plots.canvas import DEFAULT_PIXELS, new_figure, palette, save_png
from shardshift.units import format_size

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# The switch bench's columns drawn, in order: the record's key and the legend's words.
SWITCH_COLUMNS = (("switch_seconds", "online switch"), ("dcp_seconds", "DCP save + load"),
                  ("restart_seconds", "restart from DCP"), ("limit_seconds", "link limit"))  # fmt: skip


@dataclass(frozen=True)
class Series:
    """One legend entry: its values by x (a category, or a message size in bytes)."""

    label: str
    x: tuple
    y: tuple[float | None, ...]  # None: not measured, nothing drawn


@dataclass(frozen=True)
class BenchFigure:
    """What a bench drawing drew, and where."""

    out: Path
    size: tuple[int, int]  # pixels
    series: tuple[Series, ...]
    figure: Figure = field(repr=False, compare=False)


def draw_switch_bench(result: dict, out: Path, size: tuple[int, int] = DEFAULT_PIXELS) -> BenchFigure:
    """`shardshift bench switch --json`'s `result` as grouped bars of seconds per transition."""
    transitions = _rows(result, "transitions", "bench switch")
    names = [f"{t['from']} → {t['to']}" for t in transitions]
    series = [Series(label, tuple(names), tuple(_positive(t.get(key)) for t in transitions))
              for key, label in SWITCH_COLUMNS]  # fmt: skip
    figure = new_figure(size)
    ax = figure.subplots()
    ax.set_yscale("log")
    _grouped_bars(ax, series, value_format="{:.3g}")
    restart = [key for key, _ in SWITCH_COLUMNS].index("restart_seconds")
    for i, t in enumerate(transitions):
        if t.get("restart_error"):
            ax.text(_slot(i, restart, len(series)), 0.02, "failed", transform=ax.get_xaxis_transform(),
                    rotation=90, ha="center", va="bottom", fontsize=8, color="firebrick")
    ax.set_ylabel("seconds (slowest rank, log scale)")
    ax.set_title(f"layout switch: {_setup(result)}")
    ax.tick_params(axis="x", labelrotation=20)
    save_png(figure, out)
    return BenchFigure(out, size, tuple(series), figure)


def draw_collectives_bench(result: dict, out: Path, size: tuple[int, int] = DEFAULT_PIXELS) -> BenchFigure:
    """`shardshift bench collectives --json`'s `result`: algbw against message size per implementation."""
    rows = _rows(result, "rows", "bench collectives")
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    sizes = sorted({r["bytes"] for r in rows})
    figure = new_figure(size)
    ax = figure.subplots()
    series = []
    for impl, color in zip(impls, palette(len(impls))):
        mine = sorted((r["bytes"], r["algbw_gbps"]) for r in rows if r["impl"] == impl)
        x, y = zip(*mine)
        ax.plot(x, y, marker="o", color=color, label=impl)
        series.append(Series(impl, x, y))
    bounds = sorted({(r["bytes"], r["bound_algbw_gbps"]) for r in rows if r.get("bound_algbw_gbps")})
    if bounds:
        x, y = zip(*bounds)
        ax.plot(x, y, linestyle="--", color="black", label="bound")
        series.append(Series("bound", x, y))
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [_size(s) for s in sizes])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("algorithm bandwidth (GB/s)")
    first = rows[0]
    ax.set_title(f"{first['op']}, {first['nproc']} ranks, {first['type']}")
    ax.grid(alpha=0.3)
    ax.legend()
    save_png(figure, out)
    return BenchFigure(out, size, tuple(series), figure)


def draw_train_bench(result: dict, out: Path, size: tuple[int, int] = DEFAULT_PIXELS) -> BenchFigure:
    """`shardshift bench train --json`'s `result`: tokens/s per layout, a bar per variant group."""
    rows = _rows(result, "rows", "bench train")
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    groups = list(dict.fromkeys(_group(r) for r in rows))
    series = []
    for group in groups:
        value = {r["impl"]: r["tokens_per_s"] for r in rows if _group(r) == group}
        label = ", ".join(f"{k}={v}" for k, v in group) or "tokens/s"
        series.append(Series(label, tuple(impls), tuple(value.get(impl) for impl in impls)))
    figure = new_figure(size)
    ax = figure.subplots()
    _grouped_bars(ax, series, value_format="{:,.0f}")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"training throughput: {_setup(result)}")
    save_png(figure, out)
    return BenchFigure(out, size, tuple(series), figure)


def _grouped_bars(ax: Axes, series: list[Series], value_format: str) -> None:
    """A group of bars per category of `series[0].x`, one bar per series, each labelled with its value."""
    categories = series[0].x
    for j, (s, color) in enumerate(zip(series, palette(len(series)))):
        drawn = [(i, y) for i, y in enumerate(s.y) if y is not None]
        if not drawn:
            continue
        bars = ax.bar([_slot(i, j, len(series)) for i, _ in drawn], [y for _, y in drawn],
                      width=_WIDTH / len(series), color=color, label=s.label)
        ax.bar_label(bars, [value_format.format(y) for _, y in drawn], fontsize=7, padding=2)
    ax.set_xticks(range(len(categories)), categories)
    ax.grid(axis="y", alpha=0.3)
    ax.legend()


_WIDTH = 0.8  # of a category's slot, shared by its bars


def _slot(category: int, bar: int, bars: int) -> float:
    """The x of bar `bar` of `bars` in category `category`."""
    return category + (bar - (bars - 1) / 2) * _WIDTH / bars


def _group(row: dict) -> tuple[tuple[str, str], ...]:
    """The variant a train bench row belongs to: its text columns other than the layout (such as
    `collectives`: gloo or trees)."""
    return tuple((k, v) for k, v in row.items() if k not in ("impl", "layout") and isinstance(v, str))


def _rows(result: dict, key: str, bench: str) -> list[dict]:
    rows = result.get(key) if isinstance(result, dict) else None
    if not rows:
        raise ValueError(f"the {bench} result has no {key!r} to draw; give the object its --json prints")
    return rows


def _positive(value) -> float | None:
    """A time drawn on a log scale: None (not drawn) when missing or not positive."""
    return value if value is not None and value > 0 else None


def _setup(result: dict) -> str:
    """The run's setting, from the result's top-level keys, e.g. "model tiny, 4 cpu ranks"."""
    parts = [f"model {result['model']}" if "model" in result else "",
             f"{result['nproc']} {result.get('device', '')} ranks".replace("  ", " ") if "nproc" in result else "",
             result.get("dtype", "")]  # fmt: skip
    if result.get("topology"):
        scale = result.get("emulate_scale")
        parts.append(f"on {Path(result['topology']).name}" + (f" emulated × {scale:g}" if scale else ""))
    return ", ".join(p for p in parts if p)


def _size(nbytes: int) -> str:
    """1048576 → '1M', 1572864 → '1.5M' (tick labels)."""
    return format_size(nbytes, digits=1).replace(".0 ", " ").replace(" ", "").removesuffix("iB")
