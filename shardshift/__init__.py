"""ShardShift: elastic multi-dimensional parallel training on PyTorch's distributed stack.

    from shardshift import Layout, TrainConfig, Trainer, model_spec

The packages, from the top: `cli` (the `shardshift` command), `bench` (benchmarks), `netemu` (link
emulation, a harness), `elastic` (membership changes of a running job), `simulate` (planning at
sizes no machine here has), `train` (the training loop, state, switch, checkpoints), `models` (the
model interface and the built-in models), `reshard` (the virtual parameter space and the switch's
planner and executor), `plots` (pictures of runs, benchmarks and packings; matplotlib only when
drawing), `collectives` (topology → planning → execution of tree collectives, and the
torch.distributed backend), `comm` (point-to-point transfers), `layout` and `units`.
docs/architecture.md has the map.
"""

from shardshift._exports import lazy_exports

__version__ = "0.1.0"

_NAMES = {
    "Layout": ".layout",
    "TrainConfig": ".train.config", "OptimConfig": ".train.config",
    "ModelSpec": ".models.spec", "model_spec": ".models",
    "Trainer": ".train.trainer", "TrainingState": ".train.state",
}  # fmt: skip
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
