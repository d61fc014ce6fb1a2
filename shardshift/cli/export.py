"""`shardshift export --resume CKPT --out DIR`: a checkpoint as a Hugging Face model directory
(`shardshift.train.export`)."""

from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser("export", help="write the model of a checkpoint, saved under any layout, as a Hugging "
                                             "Face directory (config.json, model.safetensors)")
    p.add_argument("--resume", required=True, metavar="CKPT",
                   help="a --save directory (its newest intact checkpoint) or one checkpoint in it")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="the directory to write (it must not exist); transformers' from_pretrained(DIR) reads it")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shardshift.train.export import export

    try:
        result = export(args.resume, args.out)
    except ValueError as err:
        print(f"shardshift: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {result.out}: config.json and model.safetensors ({result.tensors} tensors, "
          f"{result.nbytes / 1e6:.1f} MB) from {result.checkpoint} (step {result.manifest.step}, saved under "
          f"{result.manifest.layout})")
    return 0
