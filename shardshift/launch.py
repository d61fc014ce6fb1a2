"""Start one process per rank, watch them, and stop them all when one fails or time runs out.

Every multi-process command starts its ranks here: `shardshift train`, the benchmarks, and the
link emulation's `run` (whose ranks start inside network namespaces: it passes its own `spawn`).

- `start_ranks(nproc, argv, store)` starts ``argv`` once per rank with ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``SHARDSHIFT_STORE`` (a file-store path: no port is
  ever chosen) in its environment. Each rank leads a session of its own, so stopping it stops
  whatever it started too; and on Linux each gets SIGTERM when the launcher dies, even by SIGKILL,
  so no rank outlives the command that started it.
- `supervise(procs, timeout_s)` waits: when a rank exits with an error the others are stopped at
  once, and past `timeout_s` all are. When `cancelled()` becomes true (a signal, in `launch`),
  every rank gets SIGTERM and `drain_s` to finish on its own (a training run saves a checkpoint
  then), and only what is left after that is killed.
- `stop(procs)` sends SIGTERM to each rank's process group, SIGKILL after a grace period, and
  reaps them.
- `launch(nproc, argv)` runs ``python -m shardshift <argv>`` as a job on this machine: rank 0's
  output is passed through, every other rank's goes to ``rank-N.log`` in a log directory (kept
  when the job fails, and named in its message). When a rank fails, the others are stopped and
  its last lines are repeated, so the cause is the last thing printed. SIGINT, SIGTERM and
  SIGHUP are passed on to the ranks as SIGTERM; the launcher exits with 128 + the signal once
  they are done, naming any rank that did not finish within the drain time or failed in it.
  With ``log_dir``, each rank's log is appended to, under a line naming the job and its start. gloo is bound to the loopback interface (``GLOO_SOCKET_IFNAME=lo``) unless the
  environment names another: nothing of a local job listens on the machine's network.

The signal handler only records the signal; the loops that start and watch the ranks act on it.
A handler that raised would be lost when the signal lands during a fork: Python runs it inside
an at-fork hook (the `logging` module registers one), whose exceptions it ignores.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from shardshift.console import say

STORE_ENV = "SHARDSHIFT_STORE"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # passed on to the ranks as SIGTERM
GRACE_S = 5.0  # between SIGTERM and SIGKILL when stopping ranks
DRAIN_S = 120.0  # after a signal: time for the ranks to finish their step and save before SIGKILL
TIMEOUT_EXIT = 124  # exit status of a job stopped for running past its time, as timeout(1) uses
TAIL_LINES = 20  # of a failed rank's log, repeated in the launcher's message
_PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None

Spawn = Callable[..., subprocess.Popen]
"""``spawn(rank, argv, env, **popen_kwargs)``: start one rank's process in a session of its own."""


def local_spawn(rank: int, argv: Sequence[str], env: Mapping[str, str], **popen_kwargs) -> subprocess.Popen:
    """Start a rank on this machine, as a session leader (see the module docstring)."""
    del rank  # every rank starts alike here; an emulated network places each in its namespace
    return subprocess.Popen(list(argv), env=dict(env), start_new_session=True,
                            preexec_fn=dies_with_this_process(), **popen_kwargs)


def dies_with_this_process() -> Callable[[], None]:
    """A `preexec_fn` for Popen: the child gets SIGTERM when this process dies (`die_with_parent`)."""
    return functools.partial(die_with_parent, os.getpid())


def die_with_parent(parent: int) -> None:
    """In a child of process `parent`, between fork and exec: ask Linux to send it SIGTERM when
    its parent dies (``PR_SET_PDEATHSIG``; a no-op elsewhere), and exit at once if the parent
    died before the request was made. Nothing is imported here: `_PRCTL` was looked up when this
    module was imported."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(128 + signal.SIGTERM)


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
              cancelled: Callable[[], bool] = lambda: False, drain_s: float = 0.0) -> Outcome:
    """Wait until every rank has exited; stop them all as soon as one fails or `timeout_s` passes.
    Once `cancelled()` becomes true, every rank gets SIGTERM and up to `drain_s` to exit on its own
    (exits then are not failures), after which what is left is stopped."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    drained_by = None  # set when cancelled: the end of the drain
    while True:
        codes = tuple(proc.poll() for proc in procs)
        if drained_by is None and cancelled():
            _signal(procs, signal.SIGTERM)
            drained_by = time.monotonic() + drain_s
        if drained_by is not None:
            if None not in codes or time.monotonic() > drained_by:
                stop(procs, grace_s)
                return Outcome(codes, None, False, True)
        else:
            # A rank killed by a signal is named first: its peers fail after it, their collectives broken.
            errors = [(code >= 0, rank) for rank, code in enumerate(codes) if code not in (None, 0)]
            failed = min(errors)[1] if errors else None
            timed_out = deadline is not None and time.monotonic() > deadline and None in codes
            if failed is not None or timed_out or None not in codes:
                if None in codes:
                    stop(procs, grace_s)
                return Outcome(codes, failed, timed_out and failed is None)
        time.sleep(0.05)


def stop(procs: Sequence[subprocess.Popen], grace_s: float = GRACE_S) -> None:
    """SIGTERM every rank's process group, SIGKILL what is left after `grace_s`; reap them all."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = _signal(procs, sig)
        deadline = time.monotonic() + grace_s
        for proc in alive:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


def _signal(procs: Sequence[subprocess.Popen], sig: int) -> list[subprocess.Popen]:
    """Send `sig` to the process group of every rank still running; return those ranks."""
    alive = [proc for proc in procs if proc.poll() is None]
    for proc in alive:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
    return alive


def launch(nproc: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None, spawn: Spawn = local_spawn,
           timeout_s: float | None = None, log_dir: str | None = None, drain_s: float = DRAIN_S) -> int:
    """Run ``python -m shardshift *argv`` as `nproc` ranks; return 0 or the job's exit status.

    The job's file store and, without `log_dir`, the ranks' logs live in one temporary directory.
    It goes when the job ends; the logs of a job that did not succeed are kept (moved to a
    directory of their own, named in the message). If the launcher itself is killed, its ranks
    remove the directory as they stop (`shardshift.runtime`)."""
    env = dict(env or {})
    if spawn is local_spawn and "GLOO_SOCKET_IFNAME" not in os.environ:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    signals: list[int] = []  # received; see the module docstring for why nothing more is done here
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in previous:
        signal.signal(sig, lambda signum, _frame: signals.append(signum))
    outcome = None
    try:
        with tempfile.TemporaryDirectory(prefix="shardshift-") as tmp, contextlib.ExitStack() as files_open:
            logs = Path(log_dir) if log_dir is not None else Path(tmp) / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            files = {rank: files_open.enter_context(open(logs / f"rank-{rank}.log", "ab")) for rank in range(1, nproc)}
            if log_dir is not None:
                header = f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} shardshift {' '.join(argv)}: rank {{}} ===\n"
                for rank, file in files.items():
                    file.write(header.format(rank).encode())
                    file.flush()
            procs: list[subprocess.Popen] = []
            try:
                procs += start_ranks(nproc, [sys.executable, "-m", "shardshift", *argv], os.path.join(tmp, "store"),
                                     env=env, spawn=spawn, stdin=subprocess.DEVNULL, cancelled=lambda: bool(signals),
                                     per_rank=lambda rank: {} if rank == 0 else
                                     {"stdout": files[rank], "stderr": subprocess.STDOUT})
                outcome = supervise(procs, timeout_s, cancelled=lambda: bool(signals), drain_s=drain_s)
            except Interrupted:
                pass
            finally:
                stop(procs)
            succeeded = outcome is not None and not signals and outcome.status == 0
            if not succeeded and log_dir is None and nproc > 1:
                logs = Path(shutil.move(logs, tempfile.mkdtemp(prefix="shardshift-logs-")))
        if signals:
            say(_stopped(signals[0], outcome, drain_s), "stderr")
        elif outcome.timed_out:
            say(f"shardshift: ranks {outcome.running} still running after {timeout_s:.0f} s; stopped them", "stderr")
        elif outcome.failed is not None:
            say(_failure(outcome, logs), "stderr")
        if not succeeded and nproc > 1:
            others = "rank 1" if nproc == 2 else f"ranks 1..{nproc - 1}"
            say(f"shardshift: the output of {others} is in {logs}", "stderr")
        return 128 + signals[0] if signals else outcome.status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stopped(signum: int, outcome: Outcome | None, drain_s: float) -> str:
    """The launcher's last line after a signal: who did not stop cleanly, if any rank did not."""
    message = f"shardshift: stopped by signal {signum}"
    if outcome is None:
        return message + " while starting the ranks"
    clean = (0, 128 + signal.SIGTERM, -signal.SIGTERM)  # done, or stopped by the SIGTERM passed on
    killed = outcome.running
    failed = [rank for rank, code in enumerate(outcome.codes) if code is not None and code not in clean]
    if killed:
        message += (f"; ranks {killed} had not finished within {drain_s:.0f} s, and were killed: a checkpoint "
                    "they were writing is unfinished, and resuming takes an older one")
    if failed:
        message += f"; ranks {failed} exited with {[outcome.codes[rank] for rank in failed]} while stopping"
    return message


def _failure(outcome: Outcome, logs: Path) -> str:
    rank = outcome.failed
    message = (f"shardshift: worker rank {rank} exited with code {outcome.codes[rank]}; "
               f"stopped the other workers.")
    if rank == 0:
        return message + " Its output is above."
    log = logs / f"rank-{rank}.log"
    lines = log.read_text(errors="replace").splitlines()[-TAIL_LINES:]
    return message + f" Its last output ({log}):\n" + "\n".join(f"  {line}" for line in lines)
