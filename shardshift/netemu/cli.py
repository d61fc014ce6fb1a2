"""`python -m shardshift.netemu`: run a command on N emulated ranks, measure the links,
or remove namespaces that a killed run left behind.

    python -m shardshift.netemu [run] --nproc 4 --rate 1gbit,0-1=200mbit -- CMD ...
    python -m shardshift.netemu measure --nproc 4 --rates-file links.yaml [--json]
    python -m shardshift.netemu cleanup

Rates (`--rate`, comma-separated, units of `shardshift.units`: 200mbit, 1gbit, 25MB/s, a number = bytes/s):
  - one plain rate: every ordered pair at that rate;
  - n(n-1) plain rates: the ordered pairs in row order 0-1, 0-2, ..., 1-0, 1-2, ...;
  - `S-D=RATE` entries: the pair from rank S to rank D, over the plain rates (a plain default can
    be left out only if every pair is given).
A rates file (JSON or YAML) holds the same as a mapping:
    nproc: 4                  # optional; must equal --nproc when both are given
    default: 1gbit            # optional
    rates: {"0-1": 200mbit, "1-0": 200mbit}

`run` starts CMD once per rank inside its namespace with RANK, WORLD_SIZE, LOCAL_RANK,
SHARDSHIFT_STORE (file-store path for `init_process_group_from_env`), SHARDSHIFT_ADDR (the rank's
address), MASTER_ADDR (rank 0's) and GLOO_SOCKET_IFNAME set; output is not redirected. Exit
status: 0 if every rank exits 0, else the first failing rank's status; 124 after --timeout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from shardshift.launch import supervise
from shardshift.netemu.network import EmulatedNetwork, netns_unavailable_reason
from shardshift.netemu.processes import cleanup_stale
from shardshift.netemu.shaping import DEFAULT_PREFIX
from shardshift.units import format_rate, parse_rate


def _parse_pair(text: str, n: int) -> tuple[int, int]:
    try:
        src, dst = (int(x) for x in text.split("-"))
    except ValueError:
        raise ValueError(f"pair {text!r} must be written SRC-DST, e.g. 0-1") from None
    if not (0 <= src < n and 0 <= dst < n and src != dst):
        raise ValueError(f"pair {text!r}: need two distinct ranks in 0..{n - 1}")
    return src, dst


def rates_from_spec(spec: str, n: int) -> dict[tuple[int, int], float]:
    """Parse --rate (see the module docstring) into bytes/s per ordered pair."""
    plain = [e.strip() for e in spec.split(",") if e.strip() and "=" not in e]
    pairs = dict(e.split("=", 1) for e in spec.split(",") if "=" in e)
    return _complete(plain, pairs, n, where="--rate")


def rates_from_file(path: Path, n: int | None) -> tuple[dict[tuple[int, int], float], int]:
    """Read a rates file (see the module docstring); returns (rates, n)."""
    from shardshift.textfile import read_yaml  # JSON is YAML; one parser reads both

    doc = read_yaml(path, "--rates-file", "a JSON or YAML rates file")
    if not isinstance(doc, dict) or not set(doc) <= {"nproc", "default", "rates"}:
        raise ValueError(f"rates file {path} must be a mapping with keys nproc (optional), "
                         f"default (optional) and rates ({{'0-1': '200mbit', ...}})")
    file_n = doc.get("nproc")
    if n is not None and file_n is not None and int(file_n) != n:
        raise ValueError(f"--nproc {n} differs from nproc: {file_n} in {path}; drop one")
    n = n if n is not None else file_n
    if n is None:
        raise ValueError(f"give --nproc or write nproc: N in {path}")
    plain = [str(doc["default"])] if doc.get("default") is not None else []
    pairs = {str(k): str(v) for k, v in (doc.get("rates") or {}).items()}
    return _complete(plain, pairs, int(n), where=str(path)), int(n)


def _complete(plain: list[str], pairs: dict[str, str], n: int,
              where: str) -> dict[tuple[int, int], float]:
    order = [(s, d) for s in range(n) for d in range(n) if s != d]
    if len(plain) == 1:
        rates = dict.fromkeys(order, parse_rate(plain[0]))
    elif len(plain) == len(order):
        rates = {pair: parse_rate(text) for pair, text in zip(order, plain, strict=True)}
    elif plain:
        raise ValueError(f"{where}: {len(plain)} plain rates; give 1 (every pair) or "
                         f"n(n-1) = {len(order)} (pairs in row order), plus SRC-DST=RATE entries")
    else:
        rates = {}
    for key, text in pairs.items():
        rates[_parse_pair(key.strip(), n)] = parse_rate(text)
    missing = [f"{s}-{d}" for s, d in order if (s, d) not in rates]
    if missing:
        raise ValueError(f"{where}: no rate for pairs {', '.join(missing[:8])}"
                         f"{' ...' if len(missing) > 8 else ''}; add a default rate")
    return rates


def _add_network_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, help="number of ranks")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--rate", help="rates per ordered pair, e.g. 1gbit or 1gbit,0-1=200mbit")
    group.add_argument("--rates-file", type=Path, help="JSON or YAML rates file")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX,
                        help="namespace name prefix (the pid and a counter are appended)")
    parser.add_argument("--tcp-slow-start-after-idle", action="store_true",
                        help="keep the kernel's default of restarting TCP slow start after an idle period")


def _network(args: argparse.Namespace) -> EmulatedNetwork:
    if args.rate is not None:
        if args.nproc is None:
            raise ValueError("--rate needs --nproc N")
        rates, n = rates_from_spec(args.rate, args.nproc), args.nproc
    else:
        rates, n = rates_from_file(args.rates_file, args.nproc)
    return EmulatedNetwork(rates, n, prefix=args.prefix,
                           slow_start_after_idle=args.tcp_slow_start_after_idle)


def _cmd_run(args: argparse.Namespace, command: list[str]) -> int:
    if not command:
        raise ValueError("nothing to run: put the command after `--`, e.g. -- python train.py")
    with _network(args) as net:
        outcome = supervise(net.launch(command), timeout_s=args.timeout)
    if outcome.timed_out:
        print(f"emulate: ranks {outcome.running} still running after {args.timeout:.0f} s; killed",
              file=sys.stderr)
    elif outcome.failed is not None:
        print(f"emulate: rank {outcome.failed} exited with status {outcome.codes[outcome.failed]}; "
              f"stopped the others", file=sys.stderr)
    return outcome.status


def _cmd_measure(args: argparse.Namespace) -> int:
    with _network(args) as net:
        pairs = ([_parse_pair(p.strip(), net.n) for p in args.pairs.split(",")]
                 if args.pairs else None)
        results = net.measure(pairs, seconds=args.seconds)
    if args.json:
        print(json.dumps({"pairs": [
            {"src": m.src, "dst": m.dst, "configured_bytes_s": m.configured,
             "measured_bytes_s": m.measured, "ratio": m.ratio, "bytes": m.nbytes,
             "seconds": m.seconds} for m in results]}))
        return 0
    print(f"{'src':>3} {'dst':>3} {'configured':>15} {'measured':>15} {'ratio':>6}")
    for m in results:
        print(f"{m.src:>3} {m.dst:>3} {format_rate(m.configured):>15} "
              f"{format_rate(m.measured):>15} {m.ratio:>6.3f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        command, argv = argv[argv.index("--") + 1:], argv[:argv.index("--")]
    parser = argparse.ArgumentParser(prog="python -m shardshift.netemu",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd")
    run = sub.add_parser("run", help="run -- CMD ... once per rank (the default)")
    _add_network_args(run)
    run.add_argument("--timeout", type=float, default=3600.0, help="seconds before killing all")
    measure = sub.add_parser("measure", help="measure ordered pairs, one at a time")
    _add_network_args(measure)
    measure.add_argument("--pairs", help="pairs to measure, e.g. 0-1,1-0 (default: all)")
    measure.add_argument("--seconds", type=float, default=0.25,
                         help="length of each transfer at the configured rate")
    measure.add_argument("--json", action="store_true", help="print one JSON object")
    cleanup = sub.add_parser("cleanup", help="delete namespaces left by killed runs")
    cleanup.add_argument("--prefix", default=DEFAULT_PREFIX)
    if not argv or argv[0] not in ("run", "measure", "cleanup", "-h", "--help"):
        argv = ["run", *argv]
    args = parser.parse_args(argv)
    reason = netns_unavailable_reason()
    if reason is not None:
        parser.exit(2, f"emulate: {reason}\n")
    try:
        if args.cmd == "cleanup":
            removed = cleanup_stale(args.prefix)
            print(f"removed {len(removed)} namespace(s): {' '.join(removed)}")
            return 0
        if command and args.cmd != "run":
            raise ValueError(f"`{args.cmd}` takes no command after `--`")
        return _cmd_run(args, command) if args.cmd == "run" else _cmd_measure(args)
    except ValueError as err:
        parser.exit(2, f"emulate: {err}\n")
    except KeyboardInterrupt:  # the network is already torn down by the SIGINT handler
        print("emulate: interrupted", file=sys.stderr)
        return 130
