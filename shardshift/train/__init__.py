"""Training any model (`shardshift.models`) under any layout: configuration (`config`), data
(`data`), parallelization (`parallelize`), one rank's `TrainingState` (`state`), the `Trainer`
(`trainer`), switching its state to another layout (`switch`), DCP checkpoints (`checkpoint`,
`catalog`), and one rank's whole run (`run`)."""

from shardshift._exports import lazy_exports

_NAMES = {
    "OptimConfig": ".config", "TrainConfig": ".config",
    "Progress": ".state", "TrainingState": ".state",
    "Trainer": ".trainer", "StepResult": ".trainer",
    "PreparedSwitch": ".switch", "SwitchReport": ".switch",
}  # fmt: skip
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
