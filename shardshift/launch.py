"""Start one process per rank, watch them, and stop them all when one fails or time runs out.

Every multi-process command starts its ranks here: `shardshift train`, the benchmarks, and the
link emulation's `run` (whose ranks start inside network namespaces: it passes its own `spawn`).

- `start_ranks(nproc, argv, store)` starts ``argv`` once per rank with ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``SHARDSHIFT_STORE`` (a file-store path: no port is
  ever chosen) in its environment. Each rank leads a session of its own, so stopping it stops
  whatever it started too; and on Linux each gets SIGTERM when the launcher dies, even by SIGKILL,
  so no rank outlives the command that started it.
- `supervise(procs, timeout_s)` waits: when a rank exits with an error the others are stopped at
  once, and past `timeout_s` all are.
- `stop(procs)` sends SIGTERM to each rank's process group, SIGKILL after a grace period, and
  reaps them.
- `launch(nproc, argv)` runs ``python -m shardshift <argv>`` as a job: rank 0's standard output
  is passed through, every rank's standard error is passed through prefixed with its rank, and
  when a rank fails its last lines are repeated, so the cause is the last thing printed. SIGINT
  and SIGTERM stop the ranks before the launcher exits with 128 + the signal.

The signal handler only records the signal; the loops that start and watch the ranks act on it.
A handler that raised would be lost when the signal lands during a fork: Python runs it inside
an at-fork hook (the `logging` module registers one), whose exceptions it ignores.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence

STORE_ENV = "SHARDSHIFT_STORE"
GRACE_S = 5.0  # between SIGTERM and SIGKILL when stopping ranks
TIMEOUT_EXIT = 124  # exit status of a job stopped for running past its time, as timeout(1) uses
_PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None

Spawn = Callable[..., subprocess.Popen]
"""``spawn(rank, argv, env, **popen_kwargs)``: start one rank's process in a session of its own."""


def local_spawn(rank: int, argv: Sequence[str], env: Mapping[str, str], **popen_kwargs) -> subprocess.Popen:
    """Start a rank on this machine, as a session leader (see the module docstring)."""
    del rank  # every rank starts alike here; an emulated network places each in its namespace
    return subprocess.Popen(list(argv), env=dict(env), start_new_session=True, preexec_fn=die_with_parent,
                            **popen_kwargs)


def die_with_parent() -> None:
    """In a child between fork and exec: ask Linux to send it SIGTERM when its parent dies
    (``PR_SET_PDEATHSIG``; a no-op elsewhere). Nothing is imported or allocated here: the
    function was looked up when this module was imported."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


def rank_env(rank: int, nproc: int, store: str) -> dict[str, str]:
    """What a rank reads to join its job's process group (`shardshift.runtime`)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), STORE_ENV: store}  # fmt: skip


class Interrupted(Exception):
    """Starting the ranks was called off (`cancelled()` became true); those started are stopped."""


def start_ranks(nproc: int, argv: Sequence[str], store: str, *, env: Mapping[str, str] | None = None,
                spawn: Spawn = local_spawn, per_rank: Callable[[int], Mapping] | None = None,
                cancelled: Callable[[], bool] = lambda: False, **popen_kwargs) -> list[subprocess.Popen]:
    """Start `argv` as ranks 0..nproc-1 of one job meeting at the file store `store` (a path that
    must not exist yet). `env` is added to every rank's environment; `per_rank(rank)` gives
    Popen arguments of one rank over `popen_kwargs`. If starting fails, or `cancelled()` becomes
    true (checked after each rank; `Interrupted` is raised), the ranks already started are stopped."""
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(nproc):
            full_env = {**os.environ, **(env or {}), **rank_env(rank, nproc, store)}
            kwargs = {**popen_kwargs, **(per_rank(rank) if per_rank else {})}
            procs.append(spawn(rank, argv, full_env, **kwargs))
            if cancelled():
                raise Interrupted(f"called off after starting {len(procs)} of {nproc} ranks")
    except BaseException:
        stop(procs)
        raise
    return procs


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How a job ended."""

    codes: tuple[int | None, ...]  # exit status per rank as it was when the job ended (None: running)
    failed: int | None  # the first rank that exited with an error, if one did
    timed_out: bool  # stopped for running past its time
    cancelled: bool = False  # stopped because `cancelled()` became true (a signal, in `launch`)

    @property
    def status(self) -> int:
        """The job's exit status: 0, the failing rank's code (128 + signal if a signal killed it),
        or `TIMEOUT_EXIT`. A cancelled job's status is its caller's to set."""
        if self.timed_out:
            return TIMEOUT_EXIT
        if self.failed is None:
            return 0
        code = self.codes[self.failed]
        return code if code > 0 else 128 - code

    @property
    def running(self) -> list[int]:
        return [rank for rank, code in enumerate(self.codes) if code is None]


def supervise(procs: Sequence[subprocess.Popen], timeout_s: float | None = None, grace_s: float = GRACE_S,
              cancelled: Callable[[], bool] = lambda: False) -> Outcome:
    """Wait until every rank has exited; stop them all as soon as one fails, `timeout_s` passes,
    or `cancelled()` becomes true."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        codes = tuple(proc.poll() for proc in procs)
        failed = next((rank for rank, code in enumerate(codes) if code not in (None, 0)), None)
        timed_out = deadline is not None and time.monotonic() > deadline and None in codes
        stopping = cancelled() and None in codes
        if failed is not None or timed_out or stopping or None not in codes:
            if None in codes:
                stop(procs, grace_s)
            return Outcome(codes, failed, timed_out and failed is None, stopping and failed is None)
        time.sleep(0.05)


def stop(procs: Sequence[subprocess.Popen], grace_s: float = GRACE_S) -> None:
    """SIGTERM every rank's process group, SIGKILL what is left after `grace_s`; reap them all."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [proc for proc in procs if proc.poll() is None]
        for proc in alive:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        for proc in alive:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


def _relay(stream, rank: int, tail: collections.deque) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        tail.append(line)
        print(f"[rank {rank}] {line}", file=sys.stderr, flush=True)
    stream.close()


def launch(nproc: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None, spawn: Spawn = local_spawn,
           timeout_s: float | None = None) -> int:
    """Run ``python -m shardshift *argv`` as `nproc` ranks; return 0 or the job's exit status."""
    with tempfile.TemporaryDirectory(prefix="shardshift-") as tmp:
        procs: list[subprocess.Popen] = []
        signals: list[int] = []  # received; see the module docstring for why nothing more is done here
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        for sig in previous:
            signal.signal(sig, lambda signum, _frame: signals.append(signum))
        try:
            try:
                procs += start_ranks(nproc, [sys.executable, "-m", "shardshift", *argv], os.path.join(tmp, "store"),
                                     env=env, spawn=spawn, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                     per_rank=lambda rank: {"stdout": None if rank == 0 else subprocess.DEVNULL},
                                     cancelled=lambda: bool(signals))
            except Interrupted:
                return 128 + signals[0]
            tails = [collections.deque(maxlen=20) for _ in range(nproc)]
            relays = [threading.Thread(target=_relay, args=(proc.stderr, rank, tails[rank]), daemon=True)
                      for rank, proc in enumerate(procs)]
            for relay in relays:
                relay.start()
            outcome = supervise(procs, timeout_s, cancelled=lambda: bool(signals))
            for relay in relays:
                relay.join(timeout=1.0)
            if outcome.cancelled:
                return 128 + signals[0]
            if outcome.timed_out:
                print(f"shardshift: ranks {outcome.running} still running after {timeout_s:.0f} s; stopped them",
                      file=sys.stderr, flush=True)
            elif outcome.failed is not None:
                lines = "\n".join(f"  {line}" for line in tails[outcome.failed])
                print(f"shardshift: worker rank {outcome.failed} exited with code {outcome.codes[outcome.failed]}; "
                      f"stopped the other workers. Its last output:\n{lines}", file=sys.stderr, flush=True)
            return outcome.status
        finally:
            stop(procs)
            for sig, handler in previous.items():
                signal.signal(sig, handler)

