"""The built-in GPT: its sizes (`config`) and spec (`spec`), both pure, and its modules (`model`)."""

from shardshift._exports import lazy_exports

_NAMES = {
    "GPTConfig": ".config", "PRESETS": ".config", "GPTSpec": ".spec",
    "GPT": ".model",
}  # fmt: skip
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
