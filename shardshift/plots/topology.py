"""A packing on its topology, as a picture (`shardshift topo draw`): which links carry what.

The main panel is the load on every link. Ranks sit on a circle in rank order; a switch sits
inside it, on a smaller circle the more hops it is from the nearest rank (a fat-tree's leaves
inside its hosts, its spines inside its leaves), in the angular order of the nodes it links to, so
that short links stay short. Every directed link is one straight line, shifted to its left as
seen travelling along it, so that the two directions of a pair lie side by side, with an
arrowhead half-way. A line's width is proportional to the rate the packing puts on the link (the
sum over trees of the tree's weight times the number of its edges whose path crosses the link);
its colour is the fraction of the link's capacity that rate uses (the colorbar). A link the
packing leaves idle is a thin grey dashed line.

Beside it, one small panel per piece of the packing (`Packing.pieces`: a tree, or for all-reduce
an IN tree and the OUT tree that carries the same data on), the heaviest first, shows that
piece's edges along their physical paths on the same layout, titled with its root and rate; the
pieces not shown are summed in one note. The figure's title gives the op, the rate, the bound and
their ratio, in GB/s and link units as `topo pack` prints them.

`draw_packing` returns a `PackingFigure`: where each node was drawn, per link the rate, width and
colour value drawn, and the pieces shown. The main panel's axes have the gid ``"links"`` and its
lines ``"link SRC->DST"``; panel i's axes ``"tree panel i"`` and its lines ``"tree T A->B"`` (T
the tree's index in `Packing.trees`, A->B the tree edge whose path the line follows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from shardshift.collectives.planning.ops import Collective, Direction
from shardshift.collectives.topology.model import Topology
from shardshift.plots.canvas import DEFAULT_PIXELS, new_figure, save_png

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure, SubFigure

    from shardshift.collectives.planning.trees import Packing, Piece

DEFAULT_PANELS = 6  # pieces drawn in panels of their own
IDLE_WIDTH = 0.8  # points: the dashed line of a link that carries nothing
_IDLE_COLOR = (0.6, 0.6, 0.6, 1.0)
_LIMIT = 1.15  # the axes show [-_LIMIT, _LIMIT]² of data units: the rank circle and its nodes
_SHIFT = 0.035  # data units: each directed line's offset to its left in the main panel
_WIDEST = 14.0  # points: the widest link line, at most
# The load colours: YlOrRd without its palest fifth, so a lightly used link still shows on white.
_LOAD_MAP, _LOAD_FROM = "YlOrRd", 0.2
# A panel's IN and OUT tree edges: tab10's blue and green, apart from the load colours.
_TOWARDS_ROOT, _FROM_ROOT = (0.12, 0.47, 0.71, 1.0), (0.17, 0.63, 0.17, 1.0)


@dataclass(frozen=True)
class LinkDrawing:
    """One directed link of the main panel, as drawn."""

    src: int  # node ids
    dst: int
    capacity: float  # bytes/s
    rate: float  # bytes/s the packing puts on the link
    fraction: float  # rate / capacity: the colour's value on the colorbar
    width: float  # points: proportional to rate, or IDLE_WIDTH (dashed) when rate is 0
    color: tuple[float, float, float, float]  # RGBA


@dataclass(frozen=True)
class TreePanel:
    """One small panel: a piece of the packing."""

    root: int
    rate: float  # bytes/s, the piece's weight
    trees: tuple[int, ...]  # its trees' indices in `Packing.trees`
    title: str


@dataclass(frozen=True)
class PackingFigure:
    """What `draw_packing` drew, and where."""

    out: Path
    size: tuple[int, int]  # pixels
    positions: dict[int, tuple[float, float]]  # node → its centre in data coordinates (every panel)
    links: tuple[LinkDrawing, ...]  # in `Topology.links` order
    panels: tuple[TreePanel, ...]  # heaviest piece first
    more: str  # the note on the pieces without a panel; "" when every piece has one
    title: str
    figure: Figure = field(repr=False, compare=False)


def link_rates(topology: Topology, packing: Packing) -> np.ndarray:
    """Bytes/s `packing` puts on each link, in `topology.links` order: the sum over trees of the
    tree's weight times the number of its edges whose physical path crosses the link. (L,)"""
    rates = np.zeros(len(topology.links))
    for tree in packing.trees:
        for path in tree.paths or tree.edges:
            for a, b in zip(path, path[1:]):
                i = topology.link_id(a, b)
                assert i >= 0, f"a tree at root {tree.root} crosses {a}->{b}, which {topology.name} lacks"
                rates[i] += tree.weight
    return rates


def draw_packing(topology: Topology, packing: Packing, out: Path, size: tuple[int, int] = DEFAULT_PIXELS,
                 panels: int = DEFAULT_PANELS) -> PackingFigure:
    """Draw the load `packing` puts on `topology`'s links and its `panels` heaviest pieces into
    the PNG `out` of `size` pixels."""
    from matplotlib import colormaps, rc_context
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import ListedColormap, Normalize

    if panels < 1:
        raise ValueError(f"panels={panels}: give at least 1 (the trees drawn in panels of their own)")
    positions = node_positions(topology)
    rates = link_rates(topology, packing)
    fractions = rates / topology.capacities()
    cmap = ListedColormap(colormaps[_LOAD_MAP](np.linspace(_LOAD_FROM, 1.0, 256)))
    norm = Normalize(0.0, max(1.0, float(fractions.max())))
    pieces = sorted(packing.pieces(), key=lambda p: -p.weight)  # stable: ties keep the packing's order
    shown, rest = pieces[:panels], pieces[panels:]
    total = sum(p.weight for p in pieces)

    # Text scales with the picture, down to half size; the default picture's text is matplotlib's.
    text = max(0.5, min(1.0, size[0] / DEFAULT_PIXELS[0], size[1] / DEFAULT_PIXELS[1]))
    with rc_context({"font.size": 10 * text}):
        figure = new_figure(size)
        main, side = _split(figure, size)
        title = _title(topology, packing)
        figure.suptitle(title, fontsize="large")
        ax = main.subplots()
        ax.set_gid("links")
        _frame(ax)
        ax.set_anchor("E")  # beside its colorbar
        main.colorbar(ScalarMappable(norm, cmap), ax=ax, label="fraction of capacity", shrink=0.6)
        busiest = float(rates.max())
        ax.set_title(f"load on each link: width ∝ rate (widest {busiest / 1e9:.4g} GB/s), dashed grey: idle",
                     fontsize="small")
        grid = _panel_axes(side, len(shown), size)
        what = "tree pairs (reduce to the root, then broadcast from it)" if packing.op is Collective.ALLREDUCE \
            else "trees"
        side.suptitle(f"the {len(shown)} heaviest of {len(pieces)} {what}" if rest else f"its {len(pieces)} {what}",
                      fontsize="medium")
        more = (f"and {len(rest)} more carrying {sum(p.weight for p in rest) / total:.1%} of the rate"
                if rest else "")  # fmt: skip
        if more:
            side.supxlabel(more, fontsize="small")
        _direction_key(side, {packing.trees[i].direction for p in shown for i in p.trees})
        figure.draw_without_rendering()  # lay the axes out, so that points per data unit are known

        radius = _node_radius(topology)
        links = _draw_loads(ax, topology, positions, rates, lambda f: tuple(float(c) for c in cmap(norm(f))))
        _draw_nodes(ax, topology, positions, radius, _points_per_unit(ax))

        drawn = []
        for i, (panel_ax, piece) in enumerate(zip(grid, shown)):
            panel_ax.set_gid(f"tree panel {i}")
            drawn.append(_draw_piece(panel_ax, topology, packing, piece, positions, 1.3 * radius, total))
        for panel_ax in grid[len(shown):]:
            panel_ax.remove()
        save_png(figure, out)
    return PackingFigure(out, size, positions, links, tuple(drawn), more, title, figure)


def _direction_key(side: SubFigure, directions: set[Direction]) -> None:
    """The legend of the panels' edge colours, one entry per direction drawn."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=color, linewidth=1.6, label=label)
               for direction, color, label in ((Direction.IN, _TOWARDS_ROOT, "edge towards the root"),
                                               (Direction.OUT, _FROM_ROOT, "edge from the root"))
               if direction in directions]  # fmt: skip
    side.figure.legend(handles=handles, loc="outside lower right", ncols=len(handles), fontsize="small", frameon=False)


def _title(topology: Topology, packing: Packing) -> str:
    """The op and topology; below, the rate, bound and rate/bound, as `topo pack` prints them."""
    unit = topology.link_unit

    def rate(value: float) -> str:
        return f"{value / 1e9:.4g} GB/s" + (f" = {value / unit:.4g} link units" if unit else "")

    root = f" from root {packing.root}" if packing.op is Collective.BROADCAST else \
        f" to root {packing.root}" if packing.root is not None else ""
    head = f"{packing.op.value}{root} on {topology.name}, {len(packing.trees)} trees\nrate {rate(packing.rate)}"
    if not math.isfinite(packing.bound):
        return f"{head} (no bound)"
    return f"{head}, bound {rate(packing.bound)}, rate/bound {packing.rate / packing.bound:.4f}"


def _split(figure: Figure, size: tuple[int, int]) -> tuple[SubFigure, SubFigure]:
    """The main panel's part of the figure and the small panels' part: side by side in a wide
    picture (the main part about as wide as it is high), one above the other in a tall one."""
    width, height = size
    if width >= height:
        share = min(0.62, max(0.45, 1.1 * height / width))
        main, side = figure.subfigures(1, 2, width_ratios=[share, 1 - share])
    else:
        share = min(0.62, max(0.45, 1.1 * width / height))
        main, side = figure.subfigures(2, 1, height_ratios=[share, 1 - share])
    return main, side


def _panel_axes(side: SubFigure, count: int, size: tuple[int, int]) -> list[Axes]:
    """`count` axes on a grid in `side`, its columns chosen to make the (square) panels largest."""
    x0, y0, x1, y1 = side.bbox_relative.extents
    width, height = (x1 - x0) * size[0], (y1 - y0) * size[1] - 60  # pixels, less the titles

    def cell(cols: int) -> float:
        return min(width / cols, height / math.ceil(count / cols))

    cols = max(range(1, count + 1), key=cell)
    axes = side.subplots(math.ceil(count / cols), cols, squeeze=False).ravel().tolist()
    for ax in axes:
        _frame(ax)
    return axes


def _frame(ax: Axes) -> None:
    ax.set_xlim(-_LIMIT, _LIMIT)
    ax.set_ylim(-_LIMIT, _LIMIT)
    ax.set_aspect("equal")
    ax.axis("off")


def _points_per_unit(ax: Axes) -> float:
    """How many points one data unit spans in `ax`, as laid out."""
    left, right = ax.get_xlim()
    return ax.get_window_extent().width / (right - left) * 72 / ax.figure.dpi


def _node_radius(topology: Topology) -> float:
    """A node's radius in data units: small enough that neighbours on the rank circle stay apart."""
    return min(0.1, 0.8 * math.sin(math.pi / max(topology.num_ranks, 2)))


def _left(p: np.ndarray, q: np.ndarray, shift: float) -> tuple[np.ndarray, np.ndarray]:
    """The segment p→q moved `shift` data units to its left."""
    along = (q - p) / max(np.linalg.norm(q - p), 1e-9)
    across = np.array([-along[1], along[0]]) * shift
    return p + across, q + across


def _arrowhead(ax: Axes, p: np.ndarray, q: np.ndarray, color, size: float) -> None:
    """An arrowhead of `size` points half-way along p→q, pointing at q."""
    along = (q - p) / max(np.linalg.norm(q - p), 1e-9)
    middle = (p + q) / 2
    ax.annotate("", xy=tuple(middle + 0.02 * along), xytext=tuple(middle - 0.02 * along), zorder=3,
                arrowprops={"arrowstyle": "-|>", "color": color, "linewidth": 0, "mutation_scale": size})


def _draw_loads(ax: Axes, topology: Topology, positions: dict, rates: np.ndarray, color) -> tuple[LinkDrawing, ...]:
    """Every link of `topology`, as wide as its share of the busiest link's rate and coloured by
    `color(fraction of capacity)`; idle ones dashed."""
    busiest = float(rates.max())
    widest = min(_WIDEST, 1.7 * _SHIFT * _points_per_unit(ax))  # the two lines of a pair stay apart
    links = []
    for link, rate in zip(topology.links, rates):
        idle, fraction = rate <= 0, float(rate) / link.capacity
        shade = _IDLE_COLOR if idle else color(fraction)
        width = IDLE_WIDTH if idle else widest * rate / busiest
        _draw_link(ax, link.src, link.dst, positions, shade, width, idle)
        links.append(LinkDrawing(link.src, link.dst, link.capacity, float(rate), fraction, width, shade))
    return tuple(links)


def _draw_link(ax: Axes, src: int, dst: int, positions: dict, color, width: float, idle: bool) -> None:
    """The directed link src→dst, shifted to its left; an arrowhead half-way unless it is idle."""
    p, q = _left(np.asarray(positions[src]), np.asarray(positions[dst]), _SHIFT)
    ax.plot([p[0], q[0]], [p[1], q[1]], color=color, linewidth=width, linestyle="--" if idle else "-",
            solid_capstyle="butt", zorder=1 if idle else 2, gid=f"link {src}->{dst}")
    if not idle:  # white inside a line wide enough to hold it, else in the line's colour and wider
        wide = width >= 5.0
        _arrowhead(ax, p, q, "white" if wide else color, width if wide else max(6.0, 3.0 * width))


def _draw_nodes(ax: Axes, topology: Topology, positions: dict, radius: float, scale: float,
                root: int | None = None) -> None:
    """Ranks as circles, switches as squares, each with its name; `root` filled yellow."""
    from matplotlib.patches import Circle, Rectangle

    fontsize = max(4.0, min(9.0, 0.7 * radius * scale))
    for v, (x, y) in positions.items():
        switch = topology.is_switch(v)
        face = "0.35" if switch else "gold" if v == root else "white"
        shape = Rectangle((x - radius, y - radius), 2 * radius, 2 * radius) if switch else Circle((x, y), radius)
        shape.set(facecolor=face, edgecolor="black", linewidth=1.2, zorder=4)
        ax.add_patch(shape)
        ax.text(x, y, topology.names[v], ha="center", va="center", fontsize=fontsize, zorder=5,
                color="white" if switch else "black", clip_on=True)


def _draw_piece(ax: Axes, topology: Topology, packing: Packing, piece: Piece, positions: dict, radius: float,
                total: float) -> TreePanel:
    """`piece`'s tree edges along their paths over the topology's links in light grey."""
    scale = _points_per_unit(ax)
    shift = max(0.03, 1.5 / scale)  # data units: at least 1.5 points
    for a, b in {(min(l.src, l.dst), max(l.src, l.dst)) for l in topology.links}:
        ax.plot(*zip(positions[a], positions[b]), color="0.88", linewidth=1.0, zorder=1)
    for index in piece.trees:
        tree = packing.trees[index]
        color = _TOWARDS_ROOT if tree.direction is Direction.IN else _FROM_ROOT
        for edge, path in zip(tree.edges, tree.paths or tree.edges):
            points = []
            for u, v in zip(path, path[1:]):
                p, q = _left(np.asarray(positions[u]), np.asarray(positions[v]), shift)
                points += [p, q]
                _arrowhead(ax, p, q, color, max(5.0, 0.1 * scale))
            xs, ys = zip(*points)
            ax.plot(xs, ys, color=color, linewidth=1.6, solid_capstyle="round", zorder=2,
                    gid=f"tree {index} {edge[0]}->{edge[1]}")
    _draw_nodes(ax, topology, positions, radius, scale, piece.root)
    title = f"root {piece.root}: {piece.weight / 1e9:.4g} GB/s ({piece.weight / total:.0%})"
    ax.set_title(title, fontsize="small")
    return TreePanel(piece.root, piece.weight, piece.trees, title)


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
