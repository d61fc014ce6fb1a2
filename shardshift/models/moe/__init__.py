"""The built-in mixture-of-experts family: its sizes (`config`) and spec (`spec`), both pure, and
its modules (`model`), Qwen3-MoE-style under Hugging Face's parameter names."""

from shardshift._exports import lazy_exports

_NAMES = {
    "MoEConfig": ".config", "PRESETS": ".config", "MoESpec": ".spec",
    "MoE": ".model", "SparseMoEBlock": ".model", "MoEExperts": ".model", "Routing": ".model",
}  # fmt: skip
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
