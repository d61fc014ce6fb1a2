"""`shardshift data prepare`: tokenize text and JSON lines files into a prepared directory of token
shards (`shardshift.data.prepare`, docs/data.md)."""

from __future__ import annotations

import argparse
import re
import signal
import sys

_TOKENS = re.compile(r"^\s*(\d+)\s*([KMG]?)\s*$", re.IGNORECASE)
_SCALE = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def register(subparsers) -> None:
    p = subparsers.add_parser("data", help="prepare training data: documents tokenized into token shards")
    sub = p.add_subparsers(dest="data", required=True)
    s = sub.add_parser("prepare", help="tokenize text and JSON lines files into a new directory of token shards "
                                       "and a manifest (train --data DIR reads it)")
    s.add_argument("--input", required=True, nargs="+", action="extend", metavar="PATH",
                   help="text files (.txt or any name; .gz: gzipped), JSON lines files (.jsonl, .json, gzipped "
                        "too), folders (their such files, recursively) or globs; one document per text file, one "
                        "per JSON line, in the order given, each folder and glob sorted")
    s.add_argument("--tokenizer", required=True, metavar="T",
                   help="bytes (UTF-8 bytes, 256 ids); hf:PATH (a tokenizer.json, or a directory holding one such "
                        "as a Hugging Face model's); bpe:N (a byte-level BPE of N tokens trained on the inputs)")
    s.add_argument("--out", required=True, metavar="DIR", help="the directory to write (it must not exist)")
    s.add_argument("--field", default="text", help="the field of each JSON line that holds its text (default text)")
    s.add_argument("--val-fraction", type=float, default=0.0, metavar="F",
                   help="hold out this fraction of the documents, evenly spaced, as the val split (default 0: none)")
    s.add_argument("--shard-tokens", default="256M", metavar="N",
                   help="tokens per shard file, e.g. 1048576 or 64M (default 256M = 2**28)")
    s.set_defaults(func=run_prepare)


def parse_tokens(text: str) -> int:
    """A count of tokens: ``1048576``, or with a binary unit, ``64M``."""
    match = _TOKENS.match(text)
    if match is None or int(match.group(1)) < 1:
        raise ValueError(f"--shard-tokens {text!r} is not a positive number of tokens; give e.g. 1048576 or 64M")
    return int(match.group(1)) * _SCALE[match.group(2).upper()]


def run_prepare(args: argparse.Namespace) -> int:
    from shardshift.console import say
    from shardshift.data.prepare import prepare

    came: list[int] = []
    before = {signum: signal.signal(signum, _stop(came)) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        result = prepare(args.input, args.tokenizer, args.out, field=args.field, val_fraction=args.val_fraction,
                         shard_tokens=parse_tokens(args.shard_tokens))
    except ValueError as err:
        print(f"shardshift: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        signum = came[0] if came else signal.SIGINT
        say(f"shardshift: stopped by {signal.Signals(signum).name}; {args.out} was not written", "stderr")
        return 128 + signum
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
    say(result.summary())
    return 0


def _stop(came: list[int]):
    """A handler that stops the command as Ctrl-C does (a KeyboardInterrupt, upon which `prepare`
    removes what it wrote), noting the signal in `came`."""

    def stop(signum, frame):
        came.append(signum)
        raise KeyboardInterrupt

    return stop
