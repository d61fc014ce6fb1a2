"""Start N local worker processes, relay their output, and stop them all when one fails.

Each worker runs ``python -m shardshift <the same arguments>`` with ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` and ``SHARDSHIFT_STORE`` (a file store in a fresh temporary directory: no port is
ever chosen) in its environment. Rank 0's standard output is passed through; every worker's
standard error is passed through prefixed with its rank. When a worker exits with an error the
others are stopped at once and the failing worker's last lines are repeated, so the cause is the
last thing printed.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

from shardshift.runtime import STORE_ENV

_GRACE_S = 5.0  # between SIGTERM and SIGKILL when stopping workers


def _relay(stream, rank: int, tail: collections.deque) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        tail.append(line)
        print(f"[rank {rank}] {line}", file=sys.stderr, flush=True)
    stream.close()


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + _GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def launch(nproc: int, argv: list[str], extra_env: dict[str, str] | None = None) -> int:
    """Run ``python -m shardshift *argv`` as `nproc` ranks; return 0, or the first failure's code."""
    with tempfile.TemporaryDirectory(prefix="shardshift-") as tmp:
        base_env = dict(os.environ, **(extra_env or {}))
        base_env[STORE_ENV] = os.path.join(tmp, "store")
        base_env["WORLD_SIZE"] = base_env["LOCAL_WORLD_SIZE"] = str(nproc)
        procs, tails, relays = [], [], []
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

        def on_signal(signum, _frame):
            _stop(procs)
            raise SystemExit(128 + signum)

        for sig in previous:
            signal.signal(sig, on_signal)
        try:
            for rank in range(nproc):
                env = dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank))
                proc = subprocess.Popen(
                    [sys.executable, "-m", "shardshift", *argv],
                    env=env,
                    stdout=None if rank == 0 else subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    stdin=subprocess.DEVNULL,
                )
                tail: collections.deque = collections.deque(maxlen=20)
                relay = threading.Thread(target=_relay, args=(proc.stderr, rank, tail), daemon=True)
                relay.start()
                procs.append(proc)
                tails.append(tail)
                relays.append(relay)
            return _supervise(procs, tails, relays)
        finally:
            _stop(procs)
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _supervise(procs, tails, relays) -> int:
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            rank = failed[0]
            _stop(procs)
            for relay in relays:
                relay.join(timeout=1.0)
            lines = "\n".join(f"  {line}" for line in tails[rank])
            print(
                f"shardshift: worker rank {rank} exited with code {codes[rank]}; "
                f"stopped the other workers. Its last output:\n{lines}",
                file=sys.stderr,
                flush=True,
            )
            return codes[rank] if codes[rank] > 0 else 1
        if all(code == 0 for code in codes):
            for relay in relays:
                relay.join(timeout=1.0)
            return 0
        time.sleep(0.05)
