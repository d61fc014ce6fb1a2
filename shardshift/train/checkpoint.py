"""Checkpoints through PyTorch DCP: save under one layout, resume under any other.

A checkpoint directory ``DIR/step-00000012`` holds DCP's files plus ``shardshift.json`` (its format,
and the model and layout it was written under). What is saved is the trainer's `TrainingState.tensors()`: every
logical tensor by its layout-free key (``param:<fqn>``, ``exp_avg:<fqn>``, ``exp_avg_sq:<fqn>``,
``step:<fqn>``, ``progress:train``, ``rng:cpu``), parameters and moments as this rank's DTensor
shards. DCP reshards them on load into whatever layout the resuming job has built.

The LR schedule is a pure function of the step, and the optimizer's hyperparameters come from
the configuration, so neither is saved.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from shardshift.train.trainer import Trainer

META_FILE = "shardshift.json"
# What the DCP files hold: `TrainingState.tensors()` by key. Checkpoints of earlier versions held
# `get_state_dict`'s keys ("model.*", "optim.*") and have no "format" in their META_FILE.
FORMAT = "training-state/1"
_DCP_METADATA = ".metadata"  # written last by DCP: its presence marks a complete checkpoint


def checkpoint_dir(root: str, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def resolve(path: str) -> Path:
    """The checkpoint `path` names: itself if complete, else its newest complete ``step-*``."""
    root = Path(path)
    if (root / _DCP_METADATA).is_file():
        return root
    if not root.is_dir():
        raise ValueError(f"--resume {path}: no such directory; give a --save directory of an earlier run")
    steps = sorted(p for p in root.glob("step-*") if (p / _DCP_METADATA).is_file())
    if not steps:
        raise ValueError(f"--resume {path}: no complete checkpoint (step-*/.metadata) in it")
    return steps[-1]


def read_meta(path: Path) -> dict:
    return json.loads((path / META_FILE).read_text())


def save(trainer: Trainer, root: str) -> Path:
    """Save the trainer's state under ``root/step-<step>`` (a collective: every rank calls it)."""
    path = checkpoint_dir(root, trainer.progress.step)
    dcp.save(trainer.state.tensors(), checkpoint_id=str(path))
    if dist.get_rank() == 0:
        meta = {
            "format": FORMAT,
            "model": trainer.cfg.model_name,
            "model_config": {k: getattr(trainer.cfg.model, k) for k in ("n_layer", "n_head", "d_model", "seq_len", "d_ff", "vocab_size")},
            "layout": str(trainer.cfg.layout),
            "dtype": trainer.cfg.dtype,
            "step": trainer.progress.step,
            "global_batch": trainer.cfg.global_batch,
            "seed": trainer.cfg.seed,
        }
        tmp = path / (META_FILE + ".tmp")
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, path / META_FILE)
    dist.barrier()
    return path


def load(trainer: Trainer, path: Path) -> None:
    """Load `path` into the trainer, resharding to its layout (a collective: every rank calls it)."""
    tensors = trainer.state.tensors()
    dcp.load(tensors, checkpoint_id=str(path))  # in place into the state's own tensors
    trainer.state.restore(tensors)


def check_compatible(path: Path, model_name: str, model_config, global_batch: int, seed: int) -> None:
    """Refuse, before any process starts, to resume a checkpoint into a different model, or one
    written in another format."""
    meta = read_meta(path)
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"checkpoint {path} holds {meta.get('format', 'the state_dict layout of ShardShift before training-state/1')}, "
            f"not {FORMAT}: this version cannot read it; resume it with the version that wrote it, or start again"
        )
    if meta["model_config"] != {k: getattr(model_config, k) for k in meta["model_config"]}:
        raise ValueError(
            f"checkpoint {path} holds model {meta['model']!r} {meta['model_config']}, not "
            f"{model_name!r}; resume with --model {meta['model']}"
        )
    if meta["global_batch"] != global_batch or meta["seed"] != seed:
        raise ValueError(
            f"checkpoint {path} was trained with --global-batch {meta['global_batch']} --seed "
            f"{meta['seed']}; resume with the same values so the data stream continues where it stopped"
        )
