"""Models, behind one interface: `ModelSpec` (`spec`: how to build a model, its tensor-parallel plan,
its pipeline split, its initialisation and loss), the state space derived from it (`space`), the
Hugging Face architectures (`hf`: ``--model hf:DIR``), the built-in models (`gpt`, `llama`, `moe`), and
models of the user's own (`user`: `ModuleSpec`, ``--model FILE.py:NAME`` or ``MODULE:NAME``).
`model_spec` resolves a name as the command line gives it, `recorded_spec` a model as a checkpoint
records it.

Importing this package imports no torch: a launcher checks a run against its model first.
"""

from __future__ import annotations

from shardshift._exports import lazy_exports

_NAMES = {
    "ModelSpec": ".spec", "PipelineSplit": ".spec", "ModuleSpec": ".user.spec",
    "state_space": ".space",
}  # fmt: skip
__all__ = sorted([*_NAMES, "model_names", "model_spec", "names_a_model", "recorded_spec"])
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)


def model_names() -> tuple[str, ...]:
    """The built-in models, as --model names them: the GPT's sizes, the Llama family's, then the
    mixture-of-experts family's."""
    return tuple(_presets())


def _presets() -> dict:
    """Every built-in model's name -> a function of it that gives its spec."""
    from shardshift.models.gpt.config import PRESETS as GPT
    from shardshift.models.gpt.spec import GPTSpec
    from shardshift.models.llama.config import PRESETS as LLAMA
    from shardshift.models.llama.spec import LlamaSpec
    from shardshift.models.moe.config import PRESETS as MOE
    from shardshift.models.moe.spec import MoESpec

    return {**dict.fromkeys(GPT, GPTSpec.preset), **dict.fromkeys(LLAMA, LlamaSpec.preset),
            **dict.fromkeys(MOE, MoESpec.preset)}


def names_a_model(name: str) -> bool:
    """Whether --model `name` has the form of a model `model_spec` resolves (which may still refuse it)."""
    from shardshift.models.user.load import is_imported_name

    return name in model_names() or name.startswith("hf:") or is_imported_name(name)


def model_spec(name: str, vocab_size: int | None = None):
    """The model `name` (a `ModelSpec`): a built-in one; ``hf:DIR``, the Hugging Face model whose
    config.json (and weights, if any) DIR holds; or ``FILE.py:NAME`` / ``MODULE:NAME``, a spec of
    the user's own (`user.load`). ValueError naming --model if there is none.

    `vocab_size`: the vocabulary of the data's tokenizer, which a built-in model takes as its own
    (its preset's is the 256 byte values); a Hugging Face model or one of the user's keeps its own."""
    from shardshift.models.user.load import imported_spec, is_imported_name

    if name.startswith("hf:"):  # a Hugging Face model directory
        from shardshift.models.hf.spec import HFSpec

        return HFSpec.from_name(name)
    if is_imported_name(name):
        return imported_spec(name)
    presets = _presets()
    if name not in presets:
        raise ValueError(f"--model {name!r} is unknown; choose one of {', '.join(presets)}, hf:DIR (a Hugging Face "
                         f"directory), or FILE.py:NAME (a ModelSpec of your own, docs/models.md)")
    spec = presets[name](name)
    if vocab_size is not None and vocab_size != spec.vocab_size:
        spec = spec.with_config({**spec.config_dict(), "vocab_size": vocab_size})
    return spec


def recorded_spec(name: str, config: dict):
    """The model a checkpoint's manifest records by its --model name and configuration; an
    ``hf:DIR`` model is built from the recorded config.json, whether DIR is still there or not; a
    model of the user's own from its file or module, with the recorded configuration."""
    if name.startswith("hf:"):
        from shardshift.models.hf.spec import HFSpec

        return HFSpec.from_config(name, config)
    return model_spec(name).with_config(config)
