"""`shardshift join --coordinator HOST:PORT`: add a worker to a running elastic job.

The worker reads the job's command line from the coordinator's store, so it trains exactly
what the others train; it loads its data and imports torch while they go on, says it is ready,
and is admitted at a step boundary (`shardshift.elastic.worker`).
"""

from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser("join", help="add a worker to a running elastic job (`train --elastic`)")
    p.add_argument("--coordinator", required=True, metavar="HOST:PORT", help="the address the job's coordinator printed")
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
        parse_address(args.coordinator)
        from shardshift.elastic.protocol import JobStore

        try:
            store = JobStore.connect(args.coordinator, args.timeout)
            argv = store.argv()
        except (RuntimeError, OSError) as err:
            raise ValueError(f"--coordinator {args.coordinator}: no elastic job answers there ({err})") from None
        job = build_parser(argv).parse_args(argv)
        _, cfg, ecfg = elastic_job(job)
    except ValueError as err:
        print(f"shardshift: error: {err}", file=sys.stderr)
        return 2
    from shardshift.elastic.worker import joiner_main
    from shardshift.runtime import leave

    del store  # the worker connects its own clients
    leave(joiner_main(cfg, ecfg, args.coordinator, args.timeout))  # as a rank ends (`runtime.leave` says why)
