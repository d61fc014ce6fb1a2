"""Pictures, drawn with matplotlib on an Agg canvas (an optional extra: ``pip install 'shardshift[plot]'``).

`runs` draws training runs from their ``--metrics`` files (loss and tokens/s against step, every
switch and membership change marked, the layout of each stretch); `bench` draws a benchmark's
result, the same dict its ``--json`` prints; `topology` draws a topology with the trees packed on
it. `metrics` reads the metrics files (pure) and `canvas` holds what all pictures share: sizes,
files, and the one place that imports matplotlib, only when something is drawn. Each drawing
function returns a small record of what it drew.
"""

from shardshift._exports import lazy_exports

_NAMES = {
    "draw_runs": ".runs", "RunsFigure": ".runs", "read_history": ".metrics", "RunHistory": ".metrics",
    "draw_switch_bench": ".bench", "draw_collectives_bench": ".bench", "draw_train_bench": ".bench",
    "BenchFigure": ".bench", "draw_packing": ".topology", "PackingFigure": ".topology",
    "parse_pixels": ".canvas", "check_drawable": ".canvas",
}  # fmt: skip
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
