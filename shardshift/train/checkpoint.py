"""Checkpoints through PyTorch DCP: save under one layout, resume under any other, lose nothing.

What is saved is the trainer's `TrainingState.tensors()`: every logical tensor by its layout-free
key (``param:<fqn>``, ``exp_avg:<fqn>``, ``exp_avg_sq:<fqn>``, ``step:<fqn>``, ``progress:train``,
``rng:cpu``), parameters and moments as this rank's DTensor shards. DCP reshards them on load into
whatever layout the resuming job has built. The LR schedule is a pure function of the step, and
the optimizer's hyperparameters come from the configuration, so neither is saved.

A save is atomic. It is two collectives (every rank calls each): `write`, then `publish`; `save`
is the two.

1. `write`: every rank writes its DCP files into ``DIR/.partial-step-00000012`` (rank 0 first
   removes what an earlier, interrupted save of that step left there);
2. `publish`: the ranks share out the files by size and each takes the CRC-32 of its share
   (`catalog.file_table`), so that no rank reads the whole checkpoint; rank 0 writes the manifest
   (``shardshift.json``: the run's identity, the layout, the step, and every file with its size
   and CRC-32) and syncs it;
3. rank 0 renames the directory to ``DIR/step-00000012`` (a checkpoint of the same step, left by a
   run resumed from an earlier one, is set aside as ``.partial-replaced-step-00000012`` first and
   removed after) and syncs ``DIR``; then it prunes to the newest `keep` (`catalog.prunable`).

A job killed at any point leaves either no ``step-00000012`` or a complete one; `catalog.choose`
passes over the unfinished ``.partial-step-*`` directory and says so, and takes a set-aside
checkpoint whose replacement a crash kept from being renamed in.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from shardshift.files import fsync_path
from shardshift.train.argv import train_keys
from shardshift.train.catalog import (
    FORMAT,
    PARTIAL_PREFIX,
    REPLACED_PREFIX,
    Manifest,
    RunIdentity,
    file_table,
    prunable,
)
from shardshift.train.trainer import Diverged, Trainer


def checkpoint_dir(root: str, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def save(trainer: Trainer, root: str, keep: int = 0) -> Path:
    """Save the trainer's state as ``root/step-<step>`` (see the module docstring); keep only the
    newest `keep` checkpoints of `root` (0: all). Returns the checkpoint's path. A state holding a
    non-finite value on any rank is not saved: `Diverged`."""
    return publish(trainer, write(trainer, root), keep)


def write(trainer: Trainer, root: str) -> Path:
    """Step 1 of a save: the state's DCP files in ``root/.partial-step-<step>``, which is returned
    (not a checkpoint yet: `publish` makes it one). `Diverged` if any rank's state is not finite."""
    finite = torch.tensor([int(trainer.state.finite())], device=trainer.par.device)
    dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    if not int(finite):
        raise Diverged(trainer.progress.step, "the state holds non-finite values")
    partial = Path(root) / f"{PARTIAL_PREFIX}step-{trainer.progress.step:08d}"
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        trainer.corpus.copy_tokenizer(partial)  # `sample` reads the run's tokenizer from the checkpoint
    dist.barrier()
    dcp.save(trainer.state.tensors(), checkpoint_id=str(partial))  # returns once every rank's files are written
    return partial


def publish(trainer: Trainer, partial: Path, keep: int = 0) -> Path:
    """Steps 2 and 3 of a save: the manifest of `partial` (written by `write`), the rename to
    ``step-<step>`` and the pruning to `keep`. Returns the checkpoint's path."""
    rank, world = dist.get_rank(), dist.get_world_size()
    shares: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(shares, file_table(partial, rank, world))
    final = checkpoint_dir(str(partial.parent), trainer.progress.step)
    if rank == 0:
        run = RunIdentity.of(trainer.cfg, trainer.corpus.digest)
        files = dict(sorted(item for share in shares for item in share.items()))
        Manifest(FORMAT, run, str(trainer.cfg.layout), trainer.progress.step, files,
                 trainer.corpus.tokenizer, train_keys(trainer.cfg, switches=False)).write(partial)
        _publish(partial, final)
        if keep:
            for old in prunable(final.parent, run, trainer.progress.step, keep):
                shutil.rmtree(old)
    dist.barrier()
    return final


def _publish(partial: Path, final: Path) -> None:
    """Make `partial` visible as `final` with one rename (an existing `final` is set aside first
    and removed after), and sync the directory so the rename survives a crash."""
    replaced = final.with_name(REPLACED_PREFIX + final.name)
    if final.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        final.rename(replaced)
    partial.rename(final)
    fsync_path(final.parent)
    shutil.rmtree(replaced, ignore_errors=True)


def load(trainer: Trainer, path: Path) -> None:
    """Load `path` into the trainer, resharding to its layout (a collective: every rank calls it)."""
    tensors = trainer.state.tensors()
    dcp.load(tensors, checkpoint_id=str(path))  # in place into the state's own tensors
    trainer.state.restore(tensors)
