"""Training a GPT under any layout: the model (`model`), data (`data`), configuration (`config`),
parallelization (`parallelize`), the GPT's virtual parameter space (`space`), one rank's
`TrainingState` (`state`), the `Trainer` (`trainer`), switching its state to another layout
(`switch`), DCP checkpoints (`checkpoint`), and one rank's whole run (`run`)."""

from shardshift._exports import lazy_exports

_NAMES = {
    "ModelConfig": ".model", "GPT": ".model",
    "OptimConfig": ".config", "TrainConfig": ".config", "model_config": ".config",
    "GPTSpace": ".space", "Progress": ".state", "TrainingState": ".state",
    "Trainer": ".trainer", "StepResult": ".trainer",
    "PreparedSwitch": ".switch", "SwitchReport": ".switch",
}  # fmt: skip
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
