"""A step's peak memory and its model FLOPs: what the progress line and the metrics say of each step.

**Peak memory** of one step on one rank: on CUDA, the most PyTorch's allocator held
(``torch.cuda.max_memory_allocated``, its peak reset before the step); on the CPU, the process's
peak resident set size (``VmHWM`` of ``/proc/self/status``), reset before the step by writing ``5``
to ``/proc/self/clear_refs`` (Linux). Where the reset is not allowed, the peak is the process's
since it started. A step reports the largest of its ranks' peaks.

**Model FLOPs** per token come from the model (`ModelSpec.flops_per_token`: PaLM's count, 6 per
parameter a token reads plus 12 · layers · hidden · seq_len for attention, forward and backward);
FLOPs per second are those times the step's tokens per second, all ranks together. Model FLOPs
utilisation (MFU) is that over the devices' peak: known for the GPUs in `PEAK_FLOPS` (their dense
bfloat16 rate, as MFU is usually quoted), unknown (None) on CPUs.
"""

from __future__ import annotations

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
    try:
        with open(_STATUS) as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        return 0


def device_peak_flops(device: torch.device) -> float | None:
    """The dense bfloat16 peak FLOP/s of `device`, where known (`PEAK_FLOPS`); None on CPUs."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for part, peak in PEAK_FLOPS.items() if part in name), None)
