"""Running collectives: a schedule compiled for one rank and one buffer (program.py), the executor
that runs it over point-to-point transfers (executor.py), the reductions it applies, the
per-group runner with its plan cache (runner.py), and the `shardshift` torch.distributed
backend on top (backend.py)."""

from shardshift._exports import lazy_exports

_NAMES = {
    "ExecutionPlan": ".program", "compile_plan": ".program",
    "ExecMode": ".executor", "run_plan": ".executor",
    "Reduction": ".reduction", "UnsupportedReduction": ".reduction",
    "RunOptions": ".runner", "TreeCollectives": ".runner",
    "ShardShiftOptions": ".backend", "register_backend": ".backend",
}  # fmt: skip
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
