"""Text from a trained model: `shardshift sample --resume DIR`.

The newest intact checkpoint in DIR (or DIR itself, if it is one) is read into one process,
whatever layout wrote it: its manifest names the model and its configuration (`models.ModelSpec`),
and DCP reshards every parameter into a whole tensor on load (optimizer state is not read). The
model reads and writes bytes (the first 256 ids of its vocabulary), so a prompt is its UTF-8 bytes and the
text is decoded with invalid bytes replaced.

Sampling draws each next byte from the softmax of the last position's logits divided by the
temperature, with a generator seeded by `seed` (temperature 0: always the most likely byte). The
context is the last `seq_len` bytes. The same checkpoint, prompt and seed give the same text,
whatever layout the checkpoint was saved under: the parameters DCP gives back are the same bytes.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from shardshift.models import recorded_spec
from shardshift.models.spec import ModelSpec
from shardshift.train.catalog import Manifest, choose
from shardshift.train.config import torch_dtype
from shardshift.train.data import BYTE_VALUES


@dataclasses.dataclass(frozen=True)
class Sample:
    checkpoint: Path
    manifest: Manifest
    prompt: str
    text: str  # what the model wrote after the prompt


def recorded_model(where: str, hint: str = ""):
    """The newest intact checkpoint in `where` (of any run, `catalog.choose`) and the spec of its
    model, built from its manifest alone; ValueError naming --resume (then `hint`) when it cannot be."""
    choice = choose(where, run=None)
    run = choice.manifest.run
    try:
        return choice, recorded_spec(run.model, run.model_config)
    except (ValueError, TypeError) as err:
        raise ValueError(f"--resume {choice.path}: its model {run.model!r} cannot be built from its manifest "
                         f"({err}){hint}") from None


def load_model(where: str) -> tuple[nn.Module, ModelSpec, Path, Manifest]:
    """The model of the newest intact checkpoint in `where` (of any run), on the CPU, in eval mode,
    and its spec; ValueError naming --resume when there is none."""
    choice, spec = recorded_model(where, "; sample it from Python with its ModelSpec")
    manifest = choice.manifest
    dtype = torch_dtype("float32" if manifest.run.dtype == "bfloat16" else manifest.run.dtype)
    model = spec.build().to(dtype)
    spec.init_buffers(model)  # in the model's dtype, as training filled them
    state = {f"param:{name}": param.detach() for name, param in model.named_parameters()}
    with warnings.catch_warnings():  # DCP says it is loading in one process, as it is meant to here
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, checkpoint_id=str(choice.path), no_dist=True)  # into the parameters, resharded
    return model.eval(), spec, choice.path, manifest


def generate(model: nn.Module, seq_len: int, prompt: bytes, tokens: int, temperature: float, seed: int) -> bytes:
    """`tokens` bytes that follow `prompt` (see the module docstring)."""
    if not prompt:
        raise ValueError("--prompt is empty: give at least one character to start from")
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor(list(prompt), dtype=torch.int64)[None]
    out = []
    with torch.no_grad():
        for _ in range(tokens):
            logits = model(ids[:, -seq_len:])[0, -1, :BYTE_VALUES].double()  # bytes only, of a larger vocabulary
            if temperature == 0:
                nxt = int(torch.argmax(logits))
            else:
                nxt = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator))
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return bytes(out)


def sample(where: str, prompt: str, tokens: int = 200, temperature: float = 0.8, seed: int = 0) -> Sample:
    """Text written by the model saved in `where` after `prompt`."""
    if tokens < 1:
        raise ValueError(f"--tokens {tokens} must be >= 1")
    if not temperature >= 0:
        raise ValueError(f"--temperature {temperature} must be >= 0 (0: the most likely byte each time)")
    model, spec, path, manifest = load_model(where)
    text = generate(model, spec.seq_len, prompt.encode(), tokens, temperature, seed).decode("utf-8", errors="replace")
    return Sample(path, manifest, prompt, text)
