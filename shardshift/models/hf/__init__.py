"""Hugging Face architectures (``--model hf:DIR``): a directory's config.json and weights read as
data (`config`, pure), the spec (`spec`, pure) and transformers' modules run stage by stage
(`model`, which imports transformers); mixtures of experts are ShardShift's own (`moe`, pure)."""

from shardshift._exports import lazy_exports

_NAMES = {
    "HFConfig": ".config", "ARCHITECTURES": ".config", "HFSpec": ".spec",
    "HFCausalLM": ".model", "HFMoESpec": ".moe",
}  # fmt: skip
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
