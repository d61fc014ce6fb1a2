"""Run a function on N real processes joined in a gloo group, and collect what each returns.

The processes are started with ``torch.multiprocessing`` (spawn) and meet through a file store in a
temporary directory: no port is ever chosen. Every collective times out after `timeout_s`, and the
whole run is killed after `timeout_s`, so a hang fails the test instead of eating CI time. The
function's return value travels back through a file written with ``torch.save``.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, tmp: str, timeout_s: float, fn, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(tmp, f"result-{rank}.pt"))
    except BaseException:
        with open(os.path.join(tmp, f"error-{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_distributed(world_size: int, fn, *args, timeout_s: float = 240.0) -> list:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, each on its own process."""
    with tempfile.TemporaryDirectory(prefix="shardshift-test-") as tmp:
        ctx = mp.start_processes(
            _entry, args=(world_size, tmp, timeout_s, fn, args), nprocs=world_size,
            join=False, start_method="spawn",
        )
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        try:
            while not ctx.join(timeout=1.0):
                if datetime.datetime.now() > deadline:
                    raise TimeoutError(f"{world_size} ranks did not finish within {timeout_s} s")
        except mp.ProcessRaisedException as err:
            errors = [
                open(os.path.join(tmp, name)).read()
                for name in sorted(os.listdir(tmp)) if name.startswith("error-")
            ]
            raise AssertionError("a rank failed:\n" + "\n".join(errors)) from err
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
        return [torch.load(os.path.join(tmp, f"result-{rank}.pt"), weights_only=False) for rank in range(world_size)]
