"""A step's peak memory and its model FLOPs: what the progress line and the metrics say of each step.

**Peak memory** of one step on one rank: on CUDA, the most PyTorch's allocator held
(``torch.cuda.max_memory_allocated``, its peak reset before the step); on the CPU, the process's
peak resident set size (``VmHWM`` of ``/proc/self/status``), reset before the step by writing ``5``
to ``/proc/self/clear_refs`` (Linux). Where the reset is not allowed, the peak is the process's
since it started. A step reports the largest of its ranks' peaks.

**Working memory** of a call (`working_bytes`, what `bench train` reports per row): its peak less
what the process held before it, after handing free memory back (on the CPU, glibc's free heap
pages to the system, so that what the call allocates is counted as it is touched): activations,
gradients and temporaries, not the state that was there already.

**Model FLOPs** per token come from the model (`ModelSpec.flops_per_token`: PaLM's count, 6 per
parameter a token reads plus 12 · layers · hidden · seq_len for attention, forward and backward);
FLOPs per second are those times the step's tokens per second, all ranks together. Model FLOPs
utilisation (MFU) is that over the devices' peak: known for the GPUs in `PEAK_FLOPS` (their dense
bfloat16 rate, as MFU is usually quoted), unknown (None) on CPUs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

import torch

# Dense bfloat16 peak FLOP/s of one device, by a part of its name as CUDA reports it.
PEAK_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}
_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"


def reset_peak(device: torch.device) -> None:
    """Start measuring this process's peak memory afresh."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
    except OSError:
        pass  # not Linux, or not allowed: the peak since the process started


def peak_bytes(device: torch.device) -> int:
    """This process's peak memory since `reset_peak` (module docstring); 0 where unknown."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return _status_bytes("VmHWM:")


def _status_bytes(field: str) -> int:
    """A size in ``/proc/self/status`` (``VmHWM:``, ``VmRSS:``) in bytes; 0 where unknown."""
    try:
        with open(_STATUS) as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith(field))
    except (OSError, StopIteration, ValueError):
        return 0


def working_bytes(fn, device: torch.device) -> int:
    """The memory `fn()` takes beyond what this process held before it (module docstring); 0 where
    unknown."""
    return_free_memory()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        held = torch.cuda.memory_allocated(device)
    else:
        reset_peak(device)
        held = _status_bytes("VmRSS:")
    fn()
    return max(0, peak_bytes(device) - held)


def return_free_memory() -> None:
    """Collect garbage and ask glibc, where it is the allocator, to give free heap pages back."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc is not None:
        trim = getattr(ctypes.CDLL(libc), "malloc_trim", None)
        if trim is not None:
            trim(0)


def device_peak_flops(device: torch.device) -> float | None:
    """The dense bfloat16 peak FLOP/s of `device`, where known (`PEAK_FLOPS`); None on CPUs."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for part, peak in PEAK_FLOPS.items() if part in name), None)
