"""A topology and the trees packed on it, as a picture (`shardshift topo draw`).

Ranks sit on a circle in rank order; a switch sits inside it, on a smaller circle the more hops it
is from the nearest rank (a fat-tree's leaves inside its hosts, its spines inside its leaves), in
the angular order of the nodes it links to, so that short links stay short. The links are grey,
thicker for more capacity. Every tree of the packing has its own colour and a line per tree
edge, along the edge's physical path through switches; its width grows with the tree's rate
(`Tree.weight`), an arrowhead shows which way the data goes, and the trees that share a link are
drawn side by side, shifted across it. The legend gives each tree's root, direction and rate.

`draw_packing` returns a `PackingFigure`: where each node was drawn and, per tree, the edges,
colour and width it was drawn with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from shardshift.collectives.topology.model import Topology
from shardshift.plots.canvas import DEFAULT_PIXELS, DPI, new_figure, palette, save_png

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from shardshift.collectives.planning.trees import Packing, Tree

MAX_LEGEND = 16  # trees named in the legend; more are counted in one line
# Every tree has a lane: its lines are shifted across each link by the lane's offset, the same
# on every link, so that a tree can be followed and trees that share a link lie side by side.
# A lane is this wide, in radii of the rank circle, while all lanes together stay within _SPREAD.
_LANE, _SPREAD = 0.025, 0.3
_WIDEST = 6.0  # points: the line of the heaviest tree, at most


@dataclass(frozen=True)
class TreeDrawing:
    """How one tree of the packing was drawn."""

    index: int  # its place in `Packing.trees`
    root: int
    direction: str  # "out" (from the root) or "in" (towards it)
    rate: float  # bytes/s, the tree's weight
    color: tuple[float, float, float, float]  # RGBA
    width: float  # points
    edges: tuple[tuple[int, int], ...]  # (sender rank, receiver rank), as in the tree
    paths: tuple[tuple[int, ...], ...]  # the nodes each edge's line passes, switches included


@dataclass(frozen=True)
class PackingFigure:
    """What `draw_packing` drew, and where."""

    out: Path
    size: tuple[int, int]  # pixels
    positions: dict[int, tuple[float, float]]  # node → its centre in the axes' data coordinates
    trees: tuple[TreeDrawing, ...]
    figure: Figure = field(repr=False, compare=False)


def draw_packing(topology: Topology, packing: Packing, out: Path,
                 size: tuple[int, int] = DEFAULT_PIXELS) -> PackingFigure:
    """Draw `topology` and `packing`'s trees on it into the PNG `out` of `size` pixels."""
    positions = node_positions(topology)
    figure = new_figure(size)
    ax = figure.subplots()
    _draw_links(ax, topology, positions)
    count = len(packing.trees)
    lane = min(_LANE, _SPREAD / count)
    widest = min(_WIDEST, 0.8 * lane * _radius_points(size))
    heaviest = max(tree.weight for tree in packing.trees)
    trees = []
    for index, (tree, color) in enumerate(zip(packing.trees, palette(count))):
        width = max(0.5, widest * (0.35 + 0.65 * tree.weight / heaviest))
        trees.append(_draw_tree(ax, index, tree, color, width, lane * (index - (count - 1) / 2), positions))
    _draw_nodes(ax, topology, positions)
    _legend(ax, trees)
    bound = f", bound {packing.bound / 1e9:.4g} GB/s" if math.isfinite(packing.bound) else ""
    root = f" from root {packing.root}" if packing.root is not None else ""
    ax.set_title(f"{packing.op.value}{root} on {topology.name}: {len(packing.trees)} trees, "
                 f"rate {packing.rate / 1e9:.4g} GB/s{bound}")
    ax.set_aspect("equal")
    ax.axis("off")
    save_png(figure, out)
    return PackingFigure(out, size, positions, tuple(trees), figure)


def node_positions(topology: Topology) -> dict[int, tuple[float, float]]:
    """Ranks on the unit circle (rank 0 at the top, clockwise); switches inside (module docstring).

    A layer of switches the same number of hops from the ranks is spread evenly on its circle,
    in the order of its switches' bearings: the mean direction of the nodes they link to that are
    already placed, or, where those cancel out (a switch linked to every rank), the direction
    between ranks 0 and 1. A lone innermost switch sits near the middle but off it, so that the
    links between opposite ranks do not seem to pass through it. A switch no rank reaches goes
    in the middle."""
    n = topology.num_ranks
    angle = {r: math.pi / 2 - 2 * math.pi * r / n for r in range(n)}
    positions = {v: (0.0, 0.0) for v in range(topology.num_nodes)}
    positions.update({r: (math.cos(a), math.sin(a)) for r, a in angle.items()})
    neighbours = {v: set() for v in range(topology.num_nodes)}
    for link in topology.links:
        neighbours[link.src].add(link.dst)
        neighbours[link.dst].add(link.src)
    between = math.pi / 2 - math.pi / n
    layers = _layers_from_ranks(topology, neighbours)
    for depth, layer in enumerate(layers, 1):
        bearing = {v: _mean_angle([angle[u] for u in neighbours[v] if u in angle], between) for v in layer}
        layer = sorted(layer, key=bearing.__getitem__)
        lone = len(layer) == 1 and depth == len(layers)
        radius = 0.3 if lone else 1.0 - 0.8 * depth / (len(layers) + 1)
        for i, v in enumerate(layer):
            angle[v] = bearing[layer[0]] + 2 * math.pi * i / len(layer)
            positions[v] = (radius * math.cos(angle[v]), radius * math.sin(angle[v]))
    return positions


def _radius_points(size: tuple[int, int]) -> float:
    """About how long the rank circle's radius comes out, in points: the axes take the height
    and three quarters of the width (the legend the rest), and hold the circle with a margin."""
    width, height = size
    return 0.42 * min(0.75 * width, height) * 72 / DPI


def _layers_from_ranks(topology: Topology, neighbours: dict[int, set[int]]) -> list[list[int]]:
    """The switches one hop from a rank, then those one hop further, and so on."""
    layers, seen, frontier = [], set(range(topology.num_ranks)), set(range(topology.num_ranks))
    while frontier:
        frontier = {u for v in frontier for u in neighbours[v] if u not in seen}
        seen |= frontier
        if frontier:
            layers.append(sorted(frontier))
    return layers


def _mean_angle(angles: list[float], otherwise: float) -> float:
    """The direction of the mean of unit vectors at `angles` (`otherwise` when they cancel or are none)."""
    x, y = sum(map(math.cos, angles)), sum(map(math.sin, angles))
    return math.atan2(y, x) if math.hypot(x, y) > 1e-9 else otherwise


def _draw_links(ax: Axes, topology: Topology, positions: dict) -> None:
    """One grey line per connected pair of nodes, wider for the larger capacity of its two directions."""
    widest = max(link.capacity for link in topology.links)
    pairs: dict[tuple[int, int], float] = {}
    for link in topology.links:
        pair = (min(link.src, link.dst), max(link.src, link.dst))
        pairs[pair] = max(pairs.get(pair, 0.0), link.capacity)
    for (a, b), capacity in pairs.items():
        (xa, ya), (xb, yb) = positions[a], positions[b]
        ax.plot([xa, xb], [ya, yb], color="0.85", linewidth=2.0 + 8.0 * capacity / widest,
                solid_capstyle="round", zorder=1)


def _draw_tree(ax: Axes, index: int, tree: Tree, color, width: float, shift: float, positions: dict) -> TreeDrawing:
    """A line per edge of `tree` along its path, shifted `shift` across it; an arrowhead at its receiver."""
    paths = tree.paths or tuple(tree.edges)
    for path in paths:
        points = _shifted([positions[v] for v in path], shift)
        ax.plot(points[:, 0], points[:, 1], color=color, linewidth=width, solid_capstyle="round", zorder=2)
        tail, head = points[-2], points[-1]
        tip = tail + (head - tail) * max(0.0, 1.0 - 0.09 / max(np.linalg.norm(head - tail), 1e-9))
        ax.annotate("", xy=tuple(tip), xytext=tuple(tail + (tip - tail) * 0.6), zorder=3,
                    arrowprops={"arrowstyle": "-|>", "color": color, "linewidth": 0, "mutation_scale": 10 + 3 * width})
    return TreeDrawing(index, tree.root, tree.direction.value, tree.weight, color, width, tree.edges, paths)


def _shifted(points: list[tuple[float, float]], shift: float) -> np.ndarray:
    """The polyline through `points`, each segment moved `shift` to its left; (2 per segment, 2)."""
    out = []
    for a, b in zip(points, points[1:]):
        a, b = np.asarray(a), np.asarray(b)
        along = (b - a) / max(np.linalg.norm(b - a), 1e-9)
        across = np.array([-along[1], along[0]]) * shift
        out += [a + across, b + across]
    return np.array(out)


def _draw_nodes(ax: Axes, topology: Topology, positions: dict) -> None:
    """Ranks as circles, switches as squares, each with its name."""
    for v, (x, y) in positions.items():
        switch = topology.is_switch(v)
        ax.scatter([x], [y], s=700, marker="s" if switch else "o", color="0.35" if switch else "white",
                   edgecolors="black", linewidths=1.5, zorder=4)
        ax.text(x, y, topology.names[v], ha="center", va="center", fontsize=8, zorder=5,
                color="white" if switch else "black")


def _legend(ax: Axes, trees: list[TreeDrawing]) -> None:
    """Tree i: root, direction, rate; past `MAX_LEGEND` trees, one line for the rest."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=t.color, linewidth=t.width,
                      label=f"tree {t.index}: {t.direction} root {t.root}, {t.rate / 1e9:.4g} GB/s")
               for t in trees[:MAX_LEGEND]]  # fmt: skip
    if len(trees) > MAX_LEGEND:
        handles.append(Line2D([], [], color="none", label=f"… and {len(trees) - MAX_LEGEND} more trees"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
