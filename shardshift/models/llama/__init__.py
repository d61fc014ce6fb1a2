"""The built-in Llama family: its sizes (`config`) and spec (`spec`), both pure, and its modules
(`model`), with Hugging Face's ``LlamaForCausalLM`` parameter names."""

from shardshift._exports import lazy_exports

_NAMES = {
    "LlamaConfig": ".config", "PRESETS": ".config", "LlamaSpec": ".spec",
    "Llama": ".model",
}  # fmt: skip
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
