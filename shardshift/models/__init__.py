"""Models, behind one interface: `ModelSpec` (`spec`: how to build a model, its tensor-parallel plan,
its pipeline split, its initialisation and loss), the state space derived from it (`space`), and
the built-in models (`gpt`). `model_spec` resolves a name as the command line gives it.

Importing this package imports no torch: a launcher checks a run against its model first.
"""

from __future__ import annotations

from shardshift._exports import lazy_exports

_NAMES = {
    "ModelSpec": ".spec", "PipelineSplit": ".spec",
    "state_space": ".space",
}  # fmt: skip
__all__ = sorted([*_NAMES, "model_names", "model_spec"])
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)


def model_names() -> tuple[str, ...]:
    """The built-in models, as --model names them."""
    from shardshift.models.gpt.config import PRESETS

    return tuple(PRESETS)


def model_spec(name: str):
    """The built-in model `name` (a `ModelSpec`); ValueError naming --model if there is none."""
    from shardshift.models.gpt.config import PRESETS
    from shardshift.models.gpt.spec import GPTSpec

    if name not in PRESETS:
        raise ValueError(f"--model {name!r} is unknown; choose one of {', '.join(model_names())}")
    return GPTSpec.preset(name)
