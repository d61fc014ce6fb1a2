"""What every picture shares: its size in pixels, its file, and matplotlib, imported only here.

matplotlib is an optional dependency (``pip install 'shardshift[plot]'``) and slow to import, so
nothing imports it until a picture is drawn: `new_figure` does, and says how to install it when it
is missing. Figures are plain `matplotlib.figure.Figure` objects on an Agg canvas, never pyplot's
global figure manager, so drawing holds no state between calls and needs no display.

A PNG is written at exactly the size asked for: the figure is `width / DPI` × `height / DPI`
inches and is saved at `DPI`, with no tight bounding box (which would crop it to its contents).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DPI = 100
DEFAULT_PIXELS = (1600, 1000)  # width, height
MIN_PIXELS, MAX_PIXELS = 200, 8000  # per side: below, nothing is legible; above, memory runs out
INSTALL = "pip install 'shardshift[plot]'"


def parse_pixels(text: str, flag: str = "--size") -> tuple[int, int]:
    """``"1600x1000"`` → (1600, 1000); ValueError names `flag` and the sizes it takes."""
    width, sep, height = text.lower().partition("x")
    try:
        size = (int(width), int(height)) if sep else None
    except ValueError:
        size = None
    if size is None or not all(MIN_PIXELS <= side <= MAX_PIXELS for side in size):
        raise ValueError(f"{flag} {text!r}: give WIDTHxHEIGHT in pixels, each from {MIN_PIXELS} to "
                         f"{MAX_PIXELS}, e.g. {DEFAULT_PIXELS[0]}x{DEFAULT_PIXELS[1]}")
    return size


def can_draw() -> bool:
    """Whether matplotlib is installed (found, not imported)."""
    return importlib.util.find_spec("matplotlib") is not None


def check_drawable(out: Path, flag: str) -> None:
    """Refuse, before any work, a picture that could not be written: matplotlib missing, a name
    that is not ``.png``, a folder that does not exist."""
    if not can_draw():
        raise ValueError(f"{flag} needs matplotlib, which is not installed: {INSTALL}")
    if out.suffix.lower() != ".png":
        raise ValueError(f"{flag} {out}: pictures are PNG files; give a name ending in .png")
    folder = out.parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {out}: no folder {folder}; create it or give another path")


def new_figure(size: tuple[int, int]) -> Figure:
    """An empty figure of `size` pixels on an Agg canvas."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError(f"drawing needs matplotlib, which is not installed: {INSTALL}") from None
    width, height = size
    figure = Figure(figsize=(width / DPI, height / DPI), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def save_png(figure: Figure, out: Path) -> None:
    """Write `figure` to `out` as a PNG of exactly the figure's pixel size."""
    try:
        figure.savefig(out, format="png", dpi=DPI)
    except OSError as err:
        raise ValueError(f"cannot write {out}: {err.strerror or err}; give a path in a writable folder") from None


def palette(count: int) -> list[tuple[float, float, float, float]]:
    """`count` distinct colours: matplotlib's ten categorical ones, or, for more, points of a
    perceptual colour map a golden-ratio stride apart (all distinct; neighbours in the list far
    apart in colour)."""
    from matplotlib import colormaps

    if count <= 10:
        colors = [colormaps["tab10"](i) for i in range(count)]
    else:
        colors = [colormaps["turbo"](0.05 + 0.9 * ((i * 0.6180339887) % 1.0)) for i in range(count)]
    return [tuple(float(c) for c in color) for color in colors]
