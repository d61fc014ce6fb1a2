"""Hugging Face directories from checkpoints: ``shardshift export --resume CKPT --out DIR``.

The newest intact checkpoint in CKPT (or CKPT itself, if it is one), saved under any layout, is
read in one process: its manifest names the model and its configuration, and DCP reshards every
parameter into a whole tensor on load (optimizer state is not read), in the dtype it was trained
in. DIR then holds what ``save_pretrained`` writes and ``transformers``' ``from_pretrained`` reads:

- ``config.json``: the model's `ModelSpec.hf_config`, its ``dtype`` the tensors' own;
- ``model.safetensors``: every parameter, whole, under its Hugging Face name (a tied head is the
  embeddings' tensor, saved once, as transformers saves it); a spec whose parameters are held
  otherwise than the Hugging Face checkpoint holds them maps them with its ``hf_state_dict`` (the
  mixture of experts: one matrix per expert, `models.moe.hf`).

A model with no Hugging Face form (``hf_config()`` is None: the GPT) is refused in one line, as is
a DIR that exists already. The files are written into a hidden sibling of DIR and renamed to DIR
once complete and synced, so an export interrupted at any point leaves no DIR: at worst a
``.DIR.partial`` beside it, which the next export to DIR removes.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from shardshift.files import fsync_path
from shardshift.models.spec import ModelSpec
from shardshift.train.catalog import Manifest
from shardshift.train.config import torch_dtype
from shardshift.train.sample import recorded_model

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INSTALL = "pip install 'shardshift[hf]'"


@dataclasses.dataclass(frozen=True)
class Export:
    out: Path
    checkpoint: Path
    manifest: Manifest
    tensors: int  # how many tensors model.safetensors holds
    nbytes: int  # their bytes


def read_parameters(spec: ModelSpec, checkpoint: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every parameter of `spec`'s model saved in `checkpoint`, whole, by name (`named_parameters`:
    a tied weight once); read by DCP in this one process, whatever layout saved it."""
    with torch.device("meta"):
        model = spec.build()
    params = {name: torch.empty(param.shape, dtype=dtype) for name, param in model.named_parameters()}
    state = {f"param:{name}": tensor for name, tensor in params.items()}
    with warnings.catch_warnings():  # DCP says it is loading in one process, as it is meant to here
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)  # into `params`, resharded
    return params


def export(where: str, out: str) -> Export:
    """Write the model saved in `where` as the Hugging Face directory `out` (module docstring);
    ValueError naming the flag and the fix when it cannot be."""
    target = Path(out)
    if target.exists():
        raise ValueError(f"--out {out}: exists already; give a new directory (export never writes into one)")
    if not target.parent.is_dir():
        raise ValueError(f"--out {out}: no directory {target.parent}; create it or give another path")
    choice, spec = recorded_model(where)
    manifest = choice.manifest
    config = spec.hf_config()
    if config is None:
        raise ValueError(f"--resume {choice.path}: its model {manifest.run.model!r} has no Hugging Face form; export "
                         f"takes a model that has one (the llama family, moe-tiny, moe-small, or --model hf:DIR)")
    if importlib.util.find_spec("safetensors") is None:
        raise ValueError(f"export writes safetensors, which is not installed: {INSTALL}")
    from safetensors.torch import save_file

    dtype = torch_dtype("float32" if manifest.run.dtype == "bfloat16" else manifest.run.dtype)
    tensors = read_parameters(spec, choice.path, dtype)
    tensors = spec.hf_state_dict(tensors)
    dtype_name = str(dtype).removeprefix("torch.")
    config = {**config, "dtype": dtype_name, **({"torch_dtype": dtype_name} if "torch_dtype" in config else {})}

    partial = target.with_name(f".{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # left by an interrupted export
    partial.mkdir()
    try:
        with open(partial / CONFIG, "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")
        save_file(tensors, str(partial / WEIGHTS), metadata={"format": "pt"})
        for name in (CONFIG, WEIGHTS):
            fsync_path(partial / name)
        partial.rename(target)
        fsync_path(target.parent)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return Export(target, choice.path, manifest, len(tensors), nbytes)
