"""Text from a trained model: `shardshift sample --resume DIR`.

The newest intact checkpoint in DIR (or DIR itself, if it is one) is read into one process,
whatever layout wrote it: its manifest names the model and its configuration (`models.ModelSpec`),
and DCP reshards every parameter into a whole tensor on load (optimizer state is not read). The
prompt is encoded and the text decoded with the run's tokenizer: the one its prepared data were
tokenized with (the checkpoint holds its file and its manifest entry), or bytes for a text file.

Sampling draws each next token, among the tokenizer's ids (of a vocabulary that may be larger),
from the softmax of the last position's logits divided by the temperature, with a generator seeded
by `seed` (temperature 0: always the most likely token); it stops early at the end-of-document
token of prepared data. The context is the last `seq_len` tokens. The same checkpoint, prompt and
seed give the same text, whatever layout the checkpoint was saved under: the parameters DCP gives
back are the same bytes.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from shardshift.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from shardshift.models import recorded_spec
from shardshift.models.spec import ModelSpec
from shardshift.train.catalog import Manifest, choose
from shardshift.train.config import torch_dtype


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


def run_tokenizer(path: Path, manifest: Manifest) -> tuple[Tokenizer, int | None]:
    """The tokenizer the checkpoint at `path` was trained with, and the end-of-document id to stop
    at (None: a text file, one document)."""
    if manifest.tokenizer is None:
        return ByteTokenizer(), None
    return load_tokenizer(path, manifest.tokenizer, "--resume"), int(manifest.tokenizer["eod"])


def generate(model: Callable[[torch.Tensor], torch.Tensor], seq_len: int, prompt: list[int], tokens: int,
             temperature: float, seed: int, vocab_size: int, stop: int | None = None) -> list[int]:
    """At most `tokens` ids that follow `prompt`, drawn among ``0 .. vocab_size - 1``, ending at
    `stop` if it is drawn (left out; see the module docstring). `model`: token ids (1, t) -> logits
    (1, t, vocab)."""
    if not prompt:
        raise ValueError("--prompt is empty: give at least one character to start from")
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor(prompt, dtype=torch.int64)[None]
    out = []
    with torch.no_grad():
        for _ in range(tokens):
            logits = model(ids[:, -seq_len:])[0, -1, :vocab_size].double()
            if temperature == 0:
                nxt = int(torch.argmax(logits))
            else:
                nxt = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator))
            if nxt == stop:
                break
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def sample(where: str, prompt: str, tokens: int = 200, temperature: float = 0.8, seed: int = 0) -> Sample:
    """Text written by the model saved in `where` after `prompt`."""
    if tokens < 1:
        raise ValueError(f"--tokens {tokens} must be >= 1")
    if not temperature >= 0:
        raise ValueError(f"--temperature {temperature} must be >= 0 (0: the most likely token each time)")
    model, spec, path, manifest = load_model(where)
    tokenizer, stop = run_tokenizer(path, manifest)
    ids = generate(lambda ids: spec.logits(model(ids)), spec.seq_len, tokenizer.encode(prompt), tokens, temperature,
                   seed, tokenizer.vocab_size, stop)
    return Sample(path, manifest, prompt, tokenizer.decode(ids))
