"""Run a function on N real processes joined in a gloo group, and collect what each returns.

The processes are forks of a ``multiprocessing`` fork server (a fresh interpreter, started once per
test session, that imported torch and ShardShift's training code: `PRELOAD`), so that a rank does
not import them again; they meet through a file store in a temporary directory: no port is ever
chosen. Every collective times out after `timeout_s`, and the
whole run is killed after `timeout_s` (give it the test's `budget`, tests/conftest.py), so a hang
fails the test instead of eating CI time. The function's return value travels back through a file
written with ``torch.save``. A rank that fails stops the others at once and its traceback is the
error. Ranks named in `dying` are expected to die (a test kills them for real): their exit must be
a failure, and the others go on.

When the run ends, by success or failure, every process it started has exited and been reaped:
`run_distributed` checks that by PID.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

from shardshift.runtime import leave


def _entry(rank: int, world_size: int, tmp: str, timeout_s: float, fn, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    status = 1
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(tmp, f"result-{rank}.pt"))
        status = 0
    except BaseException:
        with open(os.path.join(tmp, f"error-{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        traceback.print_exc()
    finally:
        dist.destroy_process_group()
    # As a rank of the CLI ends (`runtime.leave`): without the interpreter's teardown, which can
    # meet gloo's threads still alive and abort the process ("terminate called without an active
    # exception"), failing a rank that had finished.
    leave(status)


PRELOAD = ["torch", "torch.distributed", "shardshift.train.run", "shardshift.reshard.execute",
           "shardshift.collectives.execution.backend", "support.dist", "support.training",
           # transformers' models, for the ranks of --model hf:DIR (about 3 s of CPU each, else);
           # skipped by the fork server where transformers is not installed.
           *(f"transformers.models.{kind}.modeling_{kind}" for kind in ("llama", "mistral", "qwen2", "qwen3"))]


def context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts, at the first run
    return ctx


def run_distributed(world_size: int, fn, *args, timeout_s: float = 240.0, dying: frozenset[int] = frozenset()) -> list:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, each on its own process
    (None for the ranks in `dying`, which must exit with an error)."""
    ctx = context()
    with tempfile.TemporaryDirectory(prefix="shardshift-test-") as tmp:
        procs = [ctx.Process(target=_entry, args=(rank, world_size, tmp, timeout_s, fn, args), name=f"rank{rank}")
                 for rank in range(world_size)]  # fmt: skip
        try:
            for proc in procs:
                proc.start()
            deadline = time.monotonic() + timeout_s
            while any(proc.is_alive() for proc in procs):
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in dying]
                if failed:
                    raise AssertionError(f"rank {failed[0]} failed (exit code {procs[failed[0]].exitcode}):\n"
                                         + _errors(tmp))
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size} ranks did not finish within {timeout_s} s")
                time.sleep(0.1)
        finally:
            _stop(procs)
        codes = [proc.exitcode for proc in procs]
        wrong = [r for r, code in enumerate(codes) if (code == 0) == (r in dying)]
        if wrong:
            raise AssertionError(f"exit codes {codes}, ranks {sorted(dying)} expected to die:\n" + _errors(tmp))
        return [None if rank in dying else torch.load(os.path.join(tmp, f"result-{rank}.pt"), weights_only=False)
                for rank in range(world_size)]  # fmt: skip


def _errors(tmp: str) -> str:
    return "\n".join(open(os.path.join(tmp, name)).read() for name in sorted(os.listdir(tmp)) if name.startswith("error-"))


def _stop(procs) -> None:
    """Kill what still runs, reap everything, and check by PID that nothing is left."""
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        if proc.pid is not None:
            proc.join(timeout=30)
    left = [proc.pid for proc in procs if proc.pid is not None and pid_alive(proc.pid)]
    assert not left, f"processes {left} outlived the run"


def pid_alive(pid: int) -> bool:
    """True while `pid` is a process that has not been reaped (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
