"""Checkpoints through PyTorch DCP: save under one layout, resume under any other.

A checkpoint directory ``DIR/step-00000012`` holds DCP's files plus ``shardshift.json`` (the model
and layout it was written under). The state is name-keyed (``get_state_dict``), so DCP reshards it
on load into whatever layout the resuming job has built:

- ``model``, ``optim``: parameters and AdamW moments/steps, as this rank's DTensor shards;
- ``progress``: ``[step, position]`` (optimizer steps taken, samples of the data stream consumed);
- ``rng``: the CPU generator state (the same on every rank: seeded from ``--seed``).

The LR schedule is a pure function of the step, so the step is its whole state.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from shardshift.train.trainer import Trainer

META_FILE = "shardshift.json"
_DCP_METADATA = ".metadata"  # written last by DCP: its presence marks a complete checkpoint
# Optimizer hyperparameters are stored per parameter name ("param_groups.<fqn>.lr"), not as one
# list of groups: DCP writes a replicated object from one rank only, and under pp that rank's
# groups would name only its own stage's parameters, leaving other stages nothing to load.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


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


def _state(trainer: Trainer) -> dict:
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer, options=_OPTIONS)
    progress = torch.tensor([trainer.progress.step, trainer.progress.position], dtype=torch.int64)
    return {"model": model_sd, "optim": optim_sd, "progress": progress, "rng": torch.get_rng_state()}


def save(trainer: Trainer, root: str) -> Path:
    path = checkpoint_dir(root, trainer.progress.step)
    dcp.save(_state(trainer), checkpoint_id=str(path))
    if dist.get_rank() == 0:
        meta = {
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
    state = _state(trainer)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        trainer.model, trainer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
        options=_OPTIONS,
    )
    step, position = (int(v) for v in state["progress"])
    trainer.progress.step, trainer.progress.position = step, position
    torch.set_rng_state(state["rng"])


def check_compatible(path: Path, model_name: str, model_config, global_batch: int, seed: int) -> None:
    """Refuse, before any process starts, to resume a checkpoint into a different model."""
    meta = read_meta(path)
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
