"""Joining the job's default process group, from the environment a launcher set.

Two launchers are understood: ShardShift's own (`shardshift.launch`: ``shardshift train --nproc
N``, the benchmarks, link emulation), which sets ``SHARDSHIFT_STORE`` to a file-store path, and
``torchrun``, which sets ``MASTER_ADDR`` and ``MASTER_PORT``. Both set ``RANK``, ``WORLD_SIZE``
and ``LOCAL_RANK``. CUDA devices get NCCL; CPUs get gloo (or the backend asked for). Every
collective of the group times out after `timeout_s`, so a lost peer fails a run instead of
hanging it.

The device is ``SHARDSHIFT_DEVICE`` (``--device``: auto, cpu or cuda; `resolve_device`). NCCL
refuses two ranks on one GPU, so `auto` runs on CUDA only when this host has a GPU for every local
rank, and on the CPU with gloo otherwise (four ranks on a laptop with one GPU train on its CPU).
GPUs are counted through NVML, as `torch.cuda.device_count` does, not by initialising CUDA: a
launcher that counts them before forking its ranks leaves CUDA usable in the forks.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import os
from collections.abc import Callable
from typing import NoReturn, TypeVar

from shardshift.launch import STORE_ENV, flush_standard_streams

# torch is imported where it is used: every rank parses its command line first (`in_worker`),
# and a command that turns out to be bad input should not pay for torch.

T = TypeVar("T")

DEVICE_ENV = "SHARDSHIFT_DEVICE"
DEVICES = ("auto", "cpu", "cuda")


@dataclasses.dataclass(frozen=True)
class Process:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    parent: int = dataclasses.field(default_factory=os.getppid)  # the launcher, when this process started

    @functools.cached_property
    def device_type(self) -> str:
        return resolve_device(requested_device(), self.local_world_size)


def requested_device() -> str:
    """The device this job was asked for (``SHARDSHIFT_DEVICE``, set from ``--device``): auto by default."""
    return os.environ.get(DEVICE_ENV) or "auto"


def resolve_device(requested: str, local_ranks: int) -> str:
    """The device type ("cuda" or "cpu") of a job with `local_ranks` processes on this host, for
    `requested` ("auto", "cpu" or "cuda"; see the module docstring). ValueError says what to change
    when CUDA is asked for and this host has fewer GPUs than local ranks."""
    if requested not in DEVICES:
        raise ValueError(f"device {requested!r}: expected one of {', '.join(DEVICES)}")
    if requested == "cpu":
        return "cpu"
    gpus = gpu_count()
    if gpus and gpus >= local_ranks:
        return "cuda"
    if requested == "cuda":
        raise ValueError(f"--device cuda: {local_ranks} processes on this host need a GPU each (NCCL refuses two "
                         f"ranks on one GPU) and CUDA sees {gpus}; start at most {gpus} per host, or pass --device cpu")
    return "cpu"


def device_note(requested: str, local_ranks: int) -> str | None:
    """Why `auto` chose the CPU on a host that has GPUs, for the job's log; None where it did not."""
    gpus = gpu_count() if requested == "auto" else 0
    if 0 < gpus < local_ranks:
        plural = "s" if gpus > 1 else ""
        return (f"CUDA sees {gpus} GPU{plural} for {local_ranks} ranks on this host and NCCL needs one per rank: "
                f"running on the CPU with gloo (start at most {gpus} per host for CUDA)")
    return None


def say_device_note(proc: Process) -> None:
    """Print `device_note` for this job's ranks on this host, if there is one."""
    from shardshift.console import say

    note = device_note(requested_device(), proc.local_world_size)
    if note:
        say(note)


def gpu_count() -> int:
    """GPUs CUDA sees here, counted without initialising CUDA where NVML can count them."""
    import torch

    return torch.cuda.device_count()


def in_worker() -> bool:
    """True when this process was started by a launcher as one rank of a job."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def process_from_env() -> Process:
    missing = [key for key in ("RANK", "WORLD_SIZE") if key not in os.environ]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not set: start this process with shardshift's launcher "
                           "(shardshift.launch), an emulated network's launch, or torchrun")
    world_size = int(os.environ["WORLD_SIZE"])
    return Process(
        rank=int(os.environ["RANK"]),
        world_size=world_size,
        local_rank=int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
    )


def init_distributed(timeout_s: float, backend: str | None = None) -> Process:
    """Join the default process group of the job this process is a rank of.

    `backend`: None picks NCCL on CUDA machines and gloo elsewhere; any registered name is taken
    as it is ("shardshift": call `shardshift.collectives.register_backend()` first).
    """
    import torch
    import torch.distributed as dist

    proc = process_from_env()
    # Share the cores among the local ranks instead of oversubscribing them.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // proc.local_world_size))
    timeout = datetime.timedelta(seconds=timeout_s)
    if proc.device_type == "cuda":
        torch.cuda.set_device(proc.local_rank)
    if backend is None:
        backend = "nccl" if proc.device_type == "cuda" else "gloo"
    if os.environ.get("MASTER_ADDR", "") in ("localhost", "127.0.0.1", "::1"):
        # A single-host job (torchrun --standalone): keep gloo's sockets on the loopback interface,
        # as our own launcher does, rather than on whatever address the hostname resolves to.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # The rank's GPU named up front: NCCL binds the group to it, and barrier() need not guess it.
    device = {"device_id": torch.device("cuda", proc.local_rank)} if backend == "nccl" else {}
    store_path = os.environ.get(STORE_ENV)
    if store_path:
        store = dist.FileStore(store_path, proc.world_size)
        dist.init_process_group(backend, store=store, rank=proc.rank, world_size=proc.world_size, timeout=timeout,
                                **device)
    else:
        dist.init_process_group(backend, init_method="env://", timeout=timeout, **device)
    return proc


def run_in_group(timeout_s: float, body: Callable[[Process], T], backend: str | None = None) -> tuple[Process, T]:
    """Join the job's default group (`init_distributed`), run `body(process)`, and leave the group
    again, also when `body` raises."""
    import torch.distributed as dist

    proc = init_distributed(timeout_s, backend)
    try:
        return proc, body(proc)
    finally:
        dist.destroy_process_group()
        _clean_up_after(proc)


def leave(code: int) -> NoReturn:
    """End this rank's process with exit status `code` without the interpreter's teardown.

    A rank calls this once its command has returned, after it left its process groups. Torch's
    C++ threads (gloo's workers, and the work objects they hold with tensors that reference
    Python objects) can outlive the group, and an interpreter tearing itself down under them
    aborts the process now and then ("terminate called without an active exception", signal 6)
    after a run that finished: the launcher would then fail a completed job. Nothing is left to do
    by then: files (metrics, checkpoints) were closed by the code that wrote them, and the
    standard streams are flushed here.
    """
    flush_standard_streams()
    os._exit(code)


def _clean_up_after(proc: Process) -> None:
    """When this rank's launcher died (SIGKILL: nothing of it ran), remove the temporary directory
    of the job's file store that it would have removed. Each rank tries; the directory is no
    longer needed once a rank has left the group, and the others are stopping too (each got
    SIGTERM when the launcher died)."""
    store = os.environ.get(STORE_ENV)
    if store and os.getppid() != proc.parent:
        import shutil

        shutil.rmtree(os.path.dirname(store), ignore_errors=True)
