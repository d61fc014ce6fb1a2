"""Models for tests: a GPT of any size, as the spec the engine takes."""

from __future__ import annotations

from shardshift.models.gpt.config import GPTConfig
from shardshift.models.gpt.spec import GPTSpec


def gpt(name: str = "gpt-test", **config) -> GPTSpec:
    """A GPT of the given `GPTConfig` fields."""
    return GPTSpec(name, GPTConfig(**config))
