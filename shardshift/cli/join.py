"""`shardshift join --coordinator HOST:PORT [--nproc K]`: add workers to a running elastic job.

A worker reads the job's command line from the coordinator's store, so it trains exactly what the
others train; it loads its data and imports torch while they go on, says it is ready, and is
admitted at a step boundary (`shardshift.elastic.worker`). `--data` and `--save` name this host's
paths when they differ from the job's: the data must have the job's digest, and the save directory
must be the one the job saves into (the worker checks both, and is refused otherwise).

With ``--nproc K`` this command starts K such workers on this host, as processes of their own, and
waits for them: a stop signal to it (SIGINT, SIGTERM, SIGHUP) is a notice to each (they leave at
the next step boundary, their state moved to the others), and one that dies is a crash the job
survives like any other, without stopping the rest. Its exit status is the first worker's that
failed, else 0.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time


def register(subparsers) -> None:
    p = subparsers.add_parser("join", help="add a worker to a running elastic job (`train --elastic`)")
    p.add_argument("--coordinator", required=True, metavar="HOST:PORT", help="the address the job's coordinator printed")
    p.add_argument("--nproc", type=int, default=1, help="workers to start on this host (default 1)")
    p.add_argument("--data", default=None, help="this host's path of the job's data (the same digest)")
    p.add_argument("--save", default=None, help="this host's path of the directory the job saves into")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds to reach the coordinator, and before a stuck collective fails the run")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shardshift.cli.main import build_parser
    from shardshift.cli.train import elastic_job
    from shardshift.elastic.config import parse_address

    try:
        if not args.timeout > 0:
            raise ValueError(f"--timeout {args.timeout} must be > 0 seconds")
        if args.nproc < 1:
            raise ValueError(f"--nproc {args.nproc} must be at least 1")
        parse_address(args.coordinator)
        if args.nproc > 1:
            return _start_workers(args)
        from shardshift.elastic.protocol import JobStore

        try:
            store = JobStore.connect(args.coordinator, args.timeout)
            argv = store.argv()
        except (RuntimeError, OSError) as err:
            raise ValueError(f"--coordinator {args.coordinator}: no elastic job answers there ({err})") from None
        for flag, value in (("--data", args.data), ("--save", args.save)):
            if value is not None:
                argv = [*argv, flag, value]  # this host's path: the last of a flag given wins
        job = build_parser(argv).parse_args(argv)
        _, cfg, ecfg = elastic_job(job)
    except ValueError as err:
        print(f"shardshift: error: {err}", file=sys.stderr)
        return 2
    from shardshift.elastic.worker import joiner_main
    from shardshift.runtime import leave

    del store  # the worker connects its own clients
    leave(joiner_main(cfg, ecfg, args.coordinator, args.timeout))  # as a rank ends (`runtime.leave` says why)


def _start_workers(args: argparse.Namespace) -> int:
    """Start `args.nproc` workers of one each and wait for them (module docstring)."""
    from shardshift.launch import STOP_SIGNALS, dies_with_this_process

    argv = [sys.executable, "-m", "shardshift", "join", "--coordinator", args.coordinator, "--timeout",
            repr(args.timeout)]
    for flag, value in (("--data", args.data), ("--save", args.save)):
        if value is not None:
            argv += [flag, value]
    workers = [subprocess.Popen(argv, start_new_session=True, preexec_fn=dies_with_this_process())
               for _ in range(args.nproc)]

    def notice(signum, frame) -> None:
        for worker in workers:
            if worker.poll() is None:
                worker.send_signal(signal.SIGTERM)

    for signum in STOP_SIGNALS:
        signal.signal(signum, notice)
    while any(worker.poll() is None for worker in workers):
        time.sleep(0.1)
    failed = [worker.returncode for worker in workers if worker.returncode]
    return (failed[0] if failed[0] > 0 else 128 - failed[0]) if failed else 0
