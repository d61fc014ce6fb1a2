"""Start one process per rank, watch them, and stop them all when one fails or time runs out.

Every multi-process command starts its ranks here: `shardshift train`, the benchmarks, and the
link emulation's `run` (whose ranks start inside network namespaces: it passes its own `spawn`).

- `start_ranks(nproc, argv, store)` starts ``argv`` once per rank with ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``SHARDSHIFT_STORE`` (a file-store path: no port is
  ever chosen) in its environment. Each rank leads a session of its own, so stopping it stops
  whatever it started too; and on Linux each gets SIGTERM when the launcher dies, even by SIGKILL,
  so no rank outlives the command that started it.
- `fork_rank` starts a rank of ``shardshift <argv>`` as a fork of this process, which imported the
  rank's code once (torch, DTensor, DCP: about 3 s of CPU) just before: ranks that each ran
  ``python -m shardshift`` would import it again, all at once, on as few cores as the machine has.
  The fork gets its own session, environment, standard streams and the signal handlers the
  process had before the launcher set its own, runs the command, and ends with `os._exit` (never
  returning into the launcher's code). `Forked` watches it as `subprocess.Popen` watches a child.
- `supervise(procs, timeout_s)` waits: when a rank exits with an error the others get `settle_s`
  to fail on their own (each says what broke for it: the collective, the switch round, the peer)
  and are then stopped; past `timeout_s` all are. When `cancelled()` becomes true (a signal, in `launch`),
  every rank gets SIGTERM and `drain_s` to finish on its own (a training run saves a checkpoint
  then), and only what is left after that is killed.
- `stop(procs)` sends SIGTERM to each rank's process group, SIGKILL after a grace period, and
  reaps them.
- `launch(nproc, argv)` runs ``shardshift <argv>`` as a job on this machine (forked ranks, or
  with `spawn`, processes of ``python -m shardshift <argv>``, as an emulated network starts): rank 0's
  output is passed through, every other rank's goes to ``rank-N.log`` in a log directory (kept
  when the job fails, and named in its message). When a rank fails, the others are stopped and
  its last lines are repeated, so the cause is the last thing printed. SIGINT, SIGTERM and
  SIGHUP are passed on to the ranks as SIGTERM; the launcher exits with 128 + the signal once
  they are done, naming any rank that did not finish within the drain time or failed in it.
  With ``log_dir``, each rank's log is appended to, under a line naming the job and its start.
  gloo is bound to the loopback interface (``GLOO_SOCKET_IFNAME=lo``) unless the environment
  names another: nothing of a local job listens on the machine's network.

The signal handler only records the signal; the loops that start and watch the ranks act on it.
A handler that raised would be lost when the signal lands during a fork: Python runs it inside
an at-fork hook (the `logging` module registers one), whose exceptions it ignores.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import importlib
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from shardshift.console import say

STORE_ENV = "SHARDSHIFT_STORE"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # passed on to the ranks as SIGTERM
GRACE_S = 5.0  # between SIGTERM and SIGKILL when stopping ranks
SETTLE_S = 2.0  # after a rank fails: time for the others to fail on their own, saying why, before they are stopped
DRAIN_S = 120.0  # after a signal: time for the ranks to finish their step and save before SIGKILL
TIMEOUT_EXIT = 124  # exit status of a job stopped for running past its time, as timeout(1) uses
TAIL_LINES = 20  # of a failed rank's log, repeated in the launcher's message
_PR_SET_PDEATHSIG = 1  # prctl options (linux/prctl.h)
_PR_SET_NAME = 15
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None

Spawn = Callable[..., "subprocess.Popen | Forked"]
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


Handlers = Mapping[int, Callable | int | None]
"""Signal handlers by signal number, as `signal.getsignal` gives them."""


class Forked:
    """A rank forked from this process (`fork_rank`), watched as `subprocess.Popen` watches a child:
    `pid`, `poll()`, `wait(timeout)`, `returncode` (negative: the signal that killed it),
    `send_signal`, `terminate`, `kill`."""

    def __init__(self, pid: int, argv: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(argv)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: its status is lost
                self.returncode = 255
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_rank(rank: int, argv: Sequence[str], env: Mapping[str, str], *, stdin=None, stdout=None, stderr=None,
              handlers: Handlers | None = None, close_fds: Sequence[int] = (), name: str | None = None) -> Forked:
    """Start ``shardshift <argv>`` as a fork of this process (see the module docstring).

    `stdin`, `stdout` and `stderr` are as for `subprocess.Popen` (None: this process's own, a file,
    `subprocess.DEVNULL`, or for `stderr` `subprocess.STDOUT`). `handlers` are the signal handlers
    the rank starts with (those this process had before its launcher changed them), `close_fds`
    descriptors of this process the rank must not hold (a listening socket). The fork keeps this
    process's command line; its name (``ps -o comm``, ``top``, ``pgrep``) is `name`, by default
    ``rank-N`` as its log is. The caller must have no thread but the calling one: a fork has no
    other, and a lock another one held would stay locked in it."""
    name = name or f"rank-{rank}"
    parent = os.getpid()
    flush_standard_streams()  # or the fork would print the same buffered text again
    ready, set_ready = os.pipe()
    pid = os.fork()
    if pid:
        # Returns once the fork leads its own session, under its name and with its own signal
        # handlers (or died trying: end of file): stopping its process group reaches it from now on.
        os.close(set_ready)
        os.read(ready, 1)
        os.close(ready)
        return Forked(pid, argv)
    try:
        os.close(ready)
        os.setsid()
        die_with_parent(parent)
        if _PRCTL is not None:
            _PRCTL(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))
        for sig, handler in (handlers or {}).items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        os.close(set_ready)
        for fd in close_fds:
            os.close(fd)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    become_command(argv, env, stdin=stdin, stdout=stdout, stderr=stderr)


def become_command(argv: Sequence[str], env: Mapping[str, str], *, stdin=None, stdout=None, stderr=None,
                   cwd: str | None = None) -> NoReturn:
    """Run ``shardshift <argv>`` in this process as ``python -m shardshift <argv>`` would, with
    environment `env`, the standard streams redirected as `fork_rank` takes them and working
    directory `cwd`, then end the process with the command's exit status. For a fork: nothing
    of the process's own teardown runs (`os._exit`); the command's modules imported already are
    not imported again."""
    code = 1
    try:
        _redirect(stdin, stdout, stderr)
        os.environ.clear()
        os.environ.update(env)
        if cwd is not None:
            os.chdir(cwd)
        sys.argv = ["shardshift", *argv]
        runpy.run_module("shardshift", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:
        code = _exit_status(exit_)
    except BaseException:
        traceback.print_exc()
    finally:
        flush_standard_streams()
        os._exit(code)


def flush_standard_streams() -> None:
    """Flush stdout and stderr, whatever became of them (a closed terminal, a stream its owner closed)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()


def import_for_forks(modules: Sequence[str]) -> None:
    """Import `modules` here, once, before forking the processes that run them (`fork_rank`)."""
    for module in modules:
        importlib.import_module(module)


def _redirect(stdin, stdout, stderr) -> None:
    """Point the standard streams of this (forked) process where `fork_rank` was asked to."""
    def target(spec, mode: int) -> int | None:
        if spec is None:
            return None
        if spec == subprocess.DEVNULL:
            return os.open(os.devnull, mode)
        return spec if isinstance(spec, int) else spec.fileno()

    for fd, spec, mode in ((0, stdin, os.O_RDONLY), (1, stdout, os.O_WRONLY)):
        source = target(spec, mode)
        if source is not None:
            os.dup2(source, fd)
    if stderr == subprocess.STDOUT:
        os.dup2(1, 2)
    elif (source := target(stderr, os.O_WRONLY)) is not None:
        os.dup2(source, 2)
    # Python's streams may not be the descriptors (a caller that captures its output has its own):
    # a redirected one is opened afresh on its descriptor, line-buffered so that a log can be followed.
    if stdin is not None:
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process ends with os._exit)
    if stdout is not None:
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    if stderr is not None:
        sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115


def _exit_status(exit_: SystemExit) -> int:
    """The exit status the interpreter would give for `exit_` (a message goes to stderr, as it does)."""
    if exit_.code is None:
        return 0
    if isinstance(exit_.code, int):
        return exit_.code & 0xFF
    print(exit_.code, file=sys.stderr)
    return 1


class Interrupted(Exception):
    """Starting the ranks was called off (`cancelled()` became true); those started are stopped."""


def start_ranks(nproc: int, argv: Sequence[str], store: str, *, env: Mapping[str, str] | None = None,
                spawn: Spawn = local_spawn, per_rank: Callable[[int], Mapping] | None = None,
                cancelled: Callable[[], bool] = lambda: False, **popen_kwargs) -> list[subprocess.Popen | Forked]:
    """Start `argv` as ranks 0..nproc-1 of one job meeting at the file store `store` (a path that
    must not exist yet). `env` is added to every rank's environment; `per_rank(rank)` gives
    Popen arguments of one rank over `popen_kwargs`. If starting fails, or `cancelled()` becomes
    true (checked after each rank; `Interrupted` is raised), the ranks already started are stopped."""
    procs: list[subprocess.Popen | Forked] = []
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


def supervise(procs: Sequence[subprocess.Popen | Forked], timeout_s: float | None = None, grace_s: float = GRACE_S,
              cancelled: Callable[[], bool] = lambda: False, drain_s: float = 0.0,
              settle_s: float = SETTLE_S) -> Outcome:
    """Wait until every rank has exited; stop them all `settle_s` after one fails, or once
    `timeout_s` passes. Once `cancelled()` becomes true, every rank gets SIGTERM and up to
    `drain_s` to exit on its own (exits then are not failures), after which what is left is stopped."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    drained_by = None  # set when cancelled: the end of the drain
    settled_by = None  # set when a rank fails: the end of the others' time to fail on their own
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
            if failed is not None and settled_by is None:
                settled_by = time.monotonic() + settle_s
            timed_out = deadline is not None and time.monotonic() > deadline and None in codes
            settled = settled_by is not None and time.monotonic() > settled_by
            if settled or timed_out or None not in codes:
                if None in codes:
                    stop(procs, grace_s)
                return Outcome(codes, failed, timed_out and failed is None)
        time.sleep(0.05)


def stop(procs: Sequence[subprocess.Popen | Forked], grace_s: float = GRACE_S) -> None:
    """SIGTERM every rank's process group, SIGKILL what is left after `grace_s`; reap them all."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = _signal(procs, sig)
        deadline = time.monotonic() + grace_s
        for proc in alive:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


def _signal(procs: Sequence[subprocess.Popen | Forked], sig: int) -> list[subprocess.Popen | Forked]:
    """Send `sig` to the process group of every rank still running; return those ranks."""
    alive = [proc for proc in procs if proc.poll() is None]
    for proc in alive:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
    return alive


def launch(nproc: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None, spawn: Spawn | None = None,
           preload: Sequence[str] = (), timeout_s: float | None = None, log_dir: str | None = None,
           drain_s: float = DRAIN_S) -> int:
    """Run ``shardshift *argv`` as `nproc` ranks; return 0 or the job's exit status.

    Without `spawn`, the ranks are forks of this process (`fork_rank`), which imports the modules
    named in `preload` first; with it, each is ``python -m shardshift *argv`` started by `spawn`.
    The job's file store and, without `log_dir`, the ranks' logs live in one temporary directory.
    It goes when the job ends; the logs of a job that did not succeed are kept (moved to a
    directory of their own, named in the message). If the launcher itself is killed, its ranks
    remove the directory as they stop (`shardshift.runtime`)."""
    env = dict(env or {})
    if spawn is None and "GLOO_SOCKET_IFNAME" not in os.environ:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    signals: list[int] = []  # received; see the module docstring for why nothing more is done here
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in previous:
        signal.signal(sig, lambda signum, _frame: signals.append(signum))
    if spawn is None:
        spawn = functools.partial(fork_rank, handlers=previous)
        command = list(argv)
    else:
        command = [sys.executable, "-m", "shardshift", *argv]
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
            procs: list[subprocess.Popen | Forked] = []
            try:
                import_for_forks(preload)
                if signals:
                    raise Interrupted("called off before the ranks started")
                procs += start_ranks(nproc, command, os.path.join(tmp, "store"),
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
