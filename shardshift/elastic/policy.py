"""The layout of a world of N workers that `--layout-for` does not name: the fastest that fits.

Among the layouts of N ranks that the model and the batch take (`TrainConfig.with_layout`) and whose
busiest rank fits the memory limit, the policy takes the one a cost model predicts to step fastest.
All of it is pure; every worker evaluates it on the same inputs and must reach the same layout.

**Memory** (`state_bytes_per_rank`): the most any rank holds of parameters, gradients (one per
parameter element held) and AdamW's two moments, read exactly from the model's state space
(`models.space.state_space`), plus an estimate of its activations (`activation_bytes`). A rank reads at most
``b = ceil(global_batch / (dp * fsdp))`` sequences. Under pp with m micro-batches, 1F1B keeps
``min(pp - stage, m)`` micro-batches of ``b / m`` in flight on a stage. A layer keeps
`ACTIVATION_VALUES` values of width ``hidden_size / tp`` per token in flight; the last stage adds
`LOGIT_COPIES` × ``vocab_size`` values per token of one micro-batch. Values are of the compute
dtype (bfloat16 under autocast).

**Step features** (`step_features`), for one step of the busiest rank, each term taken separately:

- ``compute = 6 · P · b · seq_len · (pp - 1 + m) / m``, with P the parameters of a stage's tp piece
  (the most of any rank; FSDP does not divide the work) and the 1F1B bubble factor (1 without pp);
- ``comm_bytes``, what a rank sends: the dp all-reduce ``2 (dp-1)/dp`` × its parameter piece; FSDP's
  all-gathers (forward and backward, or once under pp, which keeps parameters gathered) and
  reduce-scatter, each ``(fsdp-1)/fsdp`` × the tp piece; tp's 4 all-reduces per layer (2 forward,
  2 backward) of ``2 (tp-1)/tp`` × the local activation ``b · seq_len · hidden_size``; pp's activations
  forward and their gradients backward, one activation each per stage boundary the rank touches;
- ``messages``, collective calls: per FSDP unit (each block and the stage root) one per FSDP
  collective and one dp all-reduce (DDP under pure replication: one per 25 MiB bucket); tp's 4 per
  layer and pp's sends per micro-batch; and the loss and gradient-norm all-reduces.

Expert parallelism (a model with `ModelSpec.expert_modules`): P counts the experts a rank holds,
``1/ep`` of them; each layer's block sends ``(ep-1)/ep`` of its ``b · seq_len · hidden_size``
activation to the other ranks of its group and back, forward and backward (4 exchanges of 2
all-to-alls each, the counts and the rows, per layer and micro-batch); the dense gradients' average
over ep is one all-reduce of ``2 (ep-1)/ep`` × the dense piece. (A token runs top-k of the experts,
not all: P overstates a mixture's compute alike under every layout, which the ranking tolerates.)

**Cost** (`CostModel`): seconds = a · compute + b · comm_bytes + c · messages, nothing overlapped.
Only the ratios of a, b, c matter to the choice (all candidates have the same N). `DEFAULT` is
set from one measured layout (below); `calibrate` fits a, b, c to the job's own measured steps.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import numpy as np
import torch

from shardshift.layout import Layout, all_layouts
from shardshift.models.space import state_space
from shardshift.models.spec import ModelSpec
from shardshift.reshard.plan import Assignment, holdings_of
from shardshift.reshard.training import MOMENTS, stage_layers, uses_fsdp
from shardshift.train.config import TrainConfig, torch_dtype
from shardshift.units import format_size

ACTIVATION_VALUES = 16  # values of width hidden_size a layer keeps per token for its backward (estimate)
LOGIT_COPIES = 2  # the logits and their log-softmax, vocab_size values per token each
DDP_BUCKET_BYTES = 25 << 20  # DistributedDataParallel's default bucket: one all-reduce each
RIDGE = 1e-6  # weight of the pull towards the scaled prior, in units of relative step-time error
TIE_DIGITS = 9  # predictions that agree to this many significant digits are a tie
NEAR = 0.05  # layouts predicted within this fraction of the best are as good: the simplest is taken


@dataclasses.dataclass(frozen=True, order=True)
class StepFeatures:
    """What one step costs the busiest rank of a layout, in the units the cost model prices."""

    compute: float  # 6 · parameters · tokens (the flops of forward and backward), times the bubble
    comm_bytes: float  # bytes sent
    messages: int  # collective calls and point-to-point sends

    @property
    def values(self) -> tuple[float, float, float]:
        return (self.compute, self.comm_bytes, float(self.messages))


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Seconds of a step: a price per unit of each `StepFeatures` term, summed."""

    seconds_per_compute: float
    seconds_per_byte: float
    seconds_per_message: float

    def __post_init__(self) -> None:
        for name, value in zip(("seconds_per_compute", "seconds_per_byte", "seconds_per_message"), self.coefficients):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"cost model {name}={value} must be a finite number >= 0")

    @property
    def coefficients(self) -> tuple[float, float, float]:
        return (self.seconds_per_compute, self.seconds_per_byte, self.seconds_per_message)

    def predict(self, features: StepFeatures) -> float:
        return sum(c * v for c, v in zip(self.coefficients, features.values))

    def scaled(self, factor: float) -> CostModel:
        return CostModel(*(c * factor for c in self.coefficients))


# The prior: prices of a CPU host with gloo on loopback, set so that a `base` step of dp=2,fsdp=2 on
# 4 workers is predicted as measured; `calibrate` rescales it to the job's own steps.
DEFAULT = CostModel(seconds_per_compute=3e-11, seconds_per_byte=1e-9, seconds_per_message=1e-4)


# ---- memory ------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _held(model: ModelSpec, dtype: torch.dtype, layout: Layout) -> tuple[tuple[int, int], ...]:
    """Per rank of `layout`: (bytes of its parameter pieces, bytes of its pieces of parameters,
    gradients and both moments)."""
    space = state_space(model, dtype)
    out = []
    for boxes in holdings_of(space, Assignment.identity(layout)):
        params = state = 0
        for tensor, box in zip(space.tensors, boxes):
            if box is None or tensor.kind not in ("param", *MOMENTS):
                continue
            nbytes = box.numel * tensor.itemsize
            state += nbytes
            if tensor.kind == "param":
                params += nbytes
                state += nbytes  # its gradient
        out.append((params, state))
    return tuple(out)


def _local_batch(cfg: TrainConfig, layout: Layout) -> int:
    """Sequences of the largest data slice (uneven splits give the first slices one more)."""
    return -(-cfg.global_batch // layout.data_parallel)


def _micro_batches(cfg: TrainConfig, layout: Layout) -> int:
    return cfg.micro_batches if layout.pp > 1 else 1


def activation_bytes(cfg: TrainConfig, layout: Layout) -> tuple[int, ...]:
    """Estimated activation bytes of a rank of each pipeline stage (see the module docstring)."""
    cfg = cfg.with_layout(layout)
    m, mc = _micro_batches(cfg, layout), cfg.model
    micro = _local_batch(cfg, layout) // m
    itemsize = torch_dtype(cfg.dtype).itemsize
    out = []
    for stage, blocks in enumerate(stage_layers(mc.pipeline.num_layers, layout.pp)):
        tokens = min(layout.pp - stage, m) * micro * mc.seq_len
        values = len(blocks) * -(-ACTIVATION_VALUES * tokens * mc.hidden_size // layout.tp)
        if stage == layout.pp - 1:
            values += LOGIT_COPIES * micro * mc.seq_len * mc.vocab_size
        out.append(values * itemsize)
    return tuple(out)


def state_bytes_per_rank(cfg: TrainConfig, layout: Layout, redundancy: int = 0) -> int:
    """The most bytes any rank of `layout` holds: parameters, gradients, AdamW moments and activations,
    and with `redundancy` K the copies it keeps of other ranks' pieces (`elastic.redundancy`: a piece
    has dp holders already, and gets copies until K + 1 hold it; a copy and its gradient buffer take
    what the piece, its gradient and its moments take). ValueError if the model or the batch cannot
    take `layout`."""
    activations = activation_bytes(cfg, layout)
    held = _held(cfg.model, cfg.param_dtype, layout)
    copies = max(0, min(redundancy, layout.world_size - 1) - (layout.dp - 1))
    return max(state * (1 + copies) + activations[coord.pp] for (_, state), coord in zip(held, layout.coords()))


# ---- time --------------------------------------------------------------------------------------


def step_features(cfg: TrainConfig, layout: Layout) -> StepFeatures:
    """The busiest rank's compute, bytes sent and messages in one step of `layout` (each term its
    own maximum). ValueError if the model or the batch cannot take `layout`."""
    cfg = cfg.with_layout(layout)
    mc, m = cfg.model, _micro_batches(cfg, layout)
    pp, dp, fsdp, tp, ep = layout.pp, layout.dp, layout.fsdp, layout.tp, layout.ep
    itemsize = cfg.param_dtype.itemsize
    piece = max(params for params, _ in _held(mc, cfg.param_dtype, layout))  # a rank's own shard
    tp_piece = max(params for params, _ in _held(mc, cfg.param_dtype, Layout(ep=ep, tp=tp, pp=pp)))  # before FSDP
    tokens = _local_batch(cfg, layout) * mc.seq_len
    activation = tokens * mc.hidden_size * torch_dtype(cfg.dtype).itemsize  # the local batch's hidden states
    layers = len(stage_layers(mc.pipeline.num_layers, pp)[0])  # the first stage is the longest
    units = layers + 1  # FSDP units: every block, and the stage root
    fsdp_calls = 3 if pp == 1 else 2  # all-gather forward (and backward), reduce-scatter
    boundaries = min(pp - 1, 2)  # a middle stage sends forward and backward

    compute = 6 * (tp_piece // itemsize) * tokens * (pp - 1 + m) / m
    comm = (2 * (dp - 1) / dp * piece + fsdp_calls * (fsdp - 1) / fsdp * tp_piece
            + 4 * layers * 2 * (tp - 1) / tp * activation + boundaries * activation
            + 4 * layers * (ep - 1) / ep * activation + 2 * (ep - 1) / ep * piece)
    messages = 2 if layout.world_size > 1 else 0  # the loss and the gradient norm
    if fsdp > 1:
        messages += fsdp_calls * units
    if dp > 1:
        messages += units if uses_fsdp(layout) else -(-piece // DDP_BUCKET_BYTES)
    if tp > 1:
        messages += 4 * layers * m
    messages += boundaries * m
    if ep > 1:
        messages += 8 * layers * m + 1
    return StepFeatures(compute=compute, comm_bytes=comm, messages=messages)


def calibrate(observations: Sequence[tuple[TrainConfig, Layout, float]], prior: CostModel = DEFAULT) -> CostModel:
    """The cost model that fits this job's measured steps: (config, layout, seconds) each.

    Observations of the same features are averaged. With one distinct kind, `prior` is scaled to
    predict its mean exactly. With more, the three prices are a non-negative least-squares fit of
    the relative errors; directions the observations leave free keep the scaled prior's ratios (a
    pull of weight `RIDGE`). A fit that fails (non-finite, or predicting a measured step to take
    no time) falls back to the scaled prior. The result does not depend on the order of
    `observations`.
    """
    groups: dict[StepFeatures, list[float]] = {}
    for cfg, layout, seconds in observations:
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"a measured step under {layout} took {seconds} s: step times must be finite and > 0")
        groups.setdefault(step_features(cfg, layout), []).append(seconds)
    if not groups:
        return prior
    rows = sorted((f, math.fsum(ts) / len(ts), len(ts)) for f, ts in groups.items())
    # Relative terms: each of the prior's three terms of a row, over the row's mean time.
    weights = np.sqrt([count for _, _, count in rows])
    terms = np.array([[c * v / mean for c, v in zip(prior.coefficients, f.values)] for f, mean, _ in rows])
    ratio = terms.sum(axis=1)  # the prior's prediction over the measurement
    if not np.all(ratio > 0):
        return prior
    scale = float(np.sum(weights**2 * ratio) / np.sum(weights**2 * ratio**2))  # one-parameter fit
    scaled = prior.scaled(scale)
    if len(rows) == 1:
        return scaled
    # x[j] now multiplies the scaled prior's price j, whose terms are fractions of a measured step.
    a = np.vstack([weights[:, None] * terms * scale, RIDGE * np.eye(3)])
    b = np.concatenate([weights, RIDGE * np.ones(3)])
    from scipy.optimize import nnls  # here: only a calibrated policy needs scipy

    x, _ = nnls(a, b)
    if not np.all(np.isfinite(x)):
        return scaled
    fitted = CostModel(*(c * float(v) for c, v in zip(scaled.coefficients, x)))
    if any(fitted.predict(f) <= 0 for f, _, _ in rows):
        return scaled
    return fitted


# ---- the choice --------------------------------------------------------------------------------


def _tie(seconds: float) -> float:
    return float(f"{seconds:.{TIE_DIGITS}g}")


def explain(n: int, cfg: TrainConfig, model: CostModel, memory_limit: int | None,
            redundancy: int = 0) -> list[tuple[Layout, float | None, int, str]]:
    """Every layout of `n` ranks as (layout, predicted seconds per step, bytes of the busiest rank,
    why it is rejected or ""), the layouts that fit first, best first: by predicted time (a tie
    within `TIE_DIGITS` digits goes to fewer pp, then fewer tp, then the name). A layout the model
    or batch cannot take has no prediction and 0 bytes."""
    if n < 1:
        raise ValueError(f"a world of {n} workers has no layout: give at least one worker")
    rows = []
    for layout in all_layouts(n, with_ep=bool(cfg.model.expert_modules)):
        try:
            need = state_bytes_per_rank(cfg, layout, redundancy)
        except ValueError as err:
            rows.append((layout, None, 0, str(err)))
            continue
        seconds = model.predict(step_features(cfg, layout))
        over = memory_limit is not None and need > memory_limit
        why = f"needs {format_size(need)} per rank, above the limit of {format_size(memory_limit)}" if over else ""
        rows.append((layout, seconds, need, why))

    def key(row):
        layout, seconds, _, why = row
        return (why != "", seconds is None, _tie(seconds or 0.0), layout.pp, layout.tp, str(layout))

    return sorted(rows, key=key)


def choose_layout(n: int, cfg: TrainConfig, model: CostModel, memory_limit: int | None,
                  redundancy: int = 0) -> Layout:
    """The layout of `n` ranks the model and batch take, whose busiest rank holds at most
    `memory_limit` bytes (None: no limit; `redundancy`: the copies it keeps count), and that is
    predicted to step fastest. Predictions within `NEAR` of the best are taken as equal (the model
    is not that precise): among them, the fewest pipeline stages, then the least tensor
    parallelism, then the name (``dp=2,fsdp=2`` before ``dp=4`` before ``fsdp=4``)."""
    rows = explain(n, cfg, model, memory_limit, redundancy)
    if rows[0][3] == "":
        best = rows[0][1]
        near = [row for row in rows if row[3] == "" and row[1] <= best * (1 + NEAR)]
        return min(near, key=lambda row: (row[0].pp, row[0].tp, str(row[0])))[0]
    reasons = "; ".join(f"{layout}: {why}" for layout, _, _, why in rows)
    more = ", or allow more memory per rank" if any(s is not None for _, s, _, _ in rows) else ""
    raise ValueError(f"no layout of {n} workers fits ({reasons}); give one with --layout-for {n}:LAYOUT{more}")
