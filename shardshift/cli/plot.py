"""`shardshift plot RUN.jsonl [MORE.jsonl ...]`: draw training runs from their --metrics files.

    shardshift plot run.jsonl                          # writes run.png
    shardshift plot a.jsonl b.jsonl -o both.png --size 1200x800

Loss and tokens/s against step, every switch and membership change marked, the layout of each
stretch of steps; several runs in one picture, one colour each (`shardshift.plots.runs`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers) -> None:
    from shardshift.plots.canvas import DEFAULT_PIXELS

    width, height = DEFAULT_PIXELS
    p = subparsers.add_parser("plot", help="draw loss and tokens/s of training runs from their --metrics files (PNG)")
    p.add_argument("metrics", nargs="+", type=Path, metavar="RUN.jsonl",
                   help="files written by `shardshift train --metrics`; each run gets its own colour")
    p.add_argument("-o", "--output", type=Path, default=None, metavar="FILE.png",
                   help="the picture (default: the first file's name with .png instead of .jsonl)")
    p.add_argument("--size", default=f"{width}x{height}", metavar="WxH",
                   help=f"the picture's size in pixels (default {width}x{height})")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shardshift.plots.canvas import check_drawable, parse_pixels
    from shardshift.plots.runs import draw_runs

    out = args.output if args.output is not None else args.metrics[0].with_suffix(".png")
    try:
        size = parse_pixels(args.size)
        check_drawable(out, "-o" if args.output is not None else "the picture")
        if any(out.resolve() == path.resolve() for path in args.metrics):
            raise ValueError(f"the picture {out} would overwrite a metrics file it draws; give -o FILE.png")
        drawn = draw_runs(args.metrics, out, size)
    except ValueError as err:
        print(f"shardshift: error: {err}", file=sys.stderr)
        return 2
    marks = sum(len(r.marks) for r in drawn.runs)
    print(f"wrote {out} ({size[0]}x{size[1]}): {len(drawn.runs)} run(s), {marks} event(s) marked")
    return 0
