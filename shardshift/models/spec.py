"""The model interface: everything the engine needs to know of a model, and nothing else.

Training, the switch, elastic membership, checkpoints, `sample`, the layout policy and the
simulator reach a model only through a `ModelSpec`. A spec is a small frozen value (its name and
its configuration); it says

- how to build the model: `build` returns a plain `nn.Module` (the engine calls it under
  ``torch.device("meta")`` and materialises only this rank's pieces), which takes token ids
  ``(batch, seq)`` and returns logits ``(batch, seq, vocab)`` (or an output they are part of:
  `logits` picks them out, `loss` takes the whole);
- its tensor-parallel plan (`tp_plan`), in Hugging Face's ``base_model_tp_plan`` vocabulary: module
  names, ``*`` standing for one name part (a layer's index), mapped to ``"colwise"`` (a linear's
  output features split: its weight's rows and its bias), ``"rowwise"`` (its input features: its
  weight's columns; its bias whole) or ``"replicated_with_grad_allreduce"`` (a module whose input
  is split over tp, such as a norm over each head of the heads a rank holds: its parameters whole
  on every rank, their gradients summed over tp);
- its pipeline split (`pipeline`): the container of its repeated layers, keyed by their global
  index so that a stage keeping layers 3..5 still names them ``layers.3`` .. ``layers.5``, and the
  modules only the first or the last stage keeps. On other stages those modules are set to None,
  and the model's forward must then pass hidden states through (a middle stage takes and returns
  ``(batch, seq, hidden)``);
- a deterministic initial value per parameter name and seed (`init_value`), so that every layout
  starts from the same weights, and how to rebuild buffers that are not saved (`init_buffers`);
- its loss, the layouts it refuses (`check_layout`), and the sizes the layout policy prices;
- its Hugging Face form, if it has one (`hf_config`: the ``config.json`` under which its parameter
  names and shapes are a Hugging Face model's), which ``shardshift export`` writes.

From the spec and its plan the engine derives the model's state space (`models.space.state_space`):
no model writes its boxes by hand. Parallelism is applied from outside (`train.parallelize`): model
code knows nothing of it.

This module imports no torch: a launcher checks a run's layout against its model before any rank
starts.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from shardshift.layout import Layout, divisors
from shardshift.reshard.training import FIRST, LAST

if TYPE_CHECKING:
    import torch
    from torch import nn

TP_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")


@dataclasses.dataclass(frozen=True)
class PipelineSplit:
    """How a model splits into pipeline stages, keeping parameter names (module docstring)."""

    layers: str  # the container (a ModuleDict keyed "0", "1", ...) of the repeated layers
    num_layers: int
    first: tuple[str, ...] = ()  # modules only the first stage keeps (the embeddings)
    last: tuple[str, ...] = ()  # modules only the last stage keeps (the final norm, the head)

    def layer_of(self, fqn: str) -> int:
        """`reshard.training.ParamRule.layer` of a parameter: its layer's index, FIRST or LAST."""
        prefix = self.layers + "."
        if fqn.startswith(prefix):
            return int(fqn[len(prefix):].split(".", 1)[0])
        if any(fqn == m or fqn.startswith(m + ".") for m in self.first):
            return FIRST
        if any(fqn == m or fqn.startswith(m + ".") for m in self.last):
            return LAST
        raise AssertionError(f"parameter {fqn!r} is in no layer and in no module of the first or the last stage")


def check_divides(axis: str, degree: int, widths: Sequence[tuple[str, int]]) -> None:
    """Refuse a degree of `axis` that does not divide one of `widths`, each (how a message names it,
    e.g. ``"n_heads=8"``, its size): ValueError naming the first and the degrees that divide them all."""
    for what, size in widths:
        if size % degree:
            valid = divisors(math.gcd(*(s for _, s in widths)))
            raise ValueError(f"{axis}={degree} does not divide {what}; choose {axis} in "
                             f"{{{', '.join(map(str, valid))}}}")


def check_stages(pp: int, num_layers: int, what: str) -> None:
    """Refuse more pipeline stages than layers; `what` names the layers' count (``"n_layers=5"``)."""
    if pp > num_layers:
        raise ValueError(f"pp={pp} is larger than the number of layers {what}; choose pp <= {num_layers}")


def plan_matcher(tp_plan: Mapping[str, str]):
    """A function from a module's name to its style in `tp_plan` (None if none): ``*`` in a pattern
    stands for one name part."""
    compiled = [(re.compile("[^.]+".join(map(re.escape, pattern.split("*")))), style)
                for pattern, style in tp_plan.items()]

    def style_of(module_name: str) -> str | None:
        return next((style for regex, style in compiled if regex.fullmatch(module_name)), None)

    return style_of


class ModelSpec(abc.ABC):
    """A model the engine can train under any layout (module docstring). Subclasses are frozen
    dataclasses: equal specs build equal models, and a spec is a key of caches."""

    name: str  # as the user names it (``--model``); a checkpoint records it

    # ---- what the model is ---------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abc.abstractmethod
    def seq_len(self) -> int:
        """The sequence length the model trains on."""

    @property
    @abc.abstractmethod
    def hidden_size(self) -> int:
        """The width of the hidden states between layers (activations between pipeline stages)."""

    @property
    @abc.abstractmethod
    def pipeline(self) -> PipelineSplit: ...

    @property
    @abc.abstractmethod
    def tp_plan(self) -> Mapping[str, str]: ...

    @abc.abstractmethod
    def config_dict(self) -> dict[str, Any]:
        """The configuration as JSON values: what a checkpoint records of the model, and what
        `with_config` takes back."""

    @abc.abstractmethod
    def with_config(self, config: Mapping[str, Any]) -> ModelSpec:
        """The same family of model with another configuration (from a checkpoint's manifest)."""

    @abc.abstractmethod
    def num_params(self) -> int: ...

    @abc.abstractmethod
    def check_layout(self, layout: Layout) -> None:
        """Raise ValueError for a layout the model cannot take, naming the constraint and the fix."""

    def hf_config(self) -> dict[str, Any] | None:
        """The fields of the Hugging Face ``config.json`` of this model, whose parameters then carry
        that architecture's names and shapes (``shardshift export``); None (the default): the model
        has no Hugging Face form."""
        return None

    def hf_state_dict(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`params` (name -> whole tensor) under the names and shapes of `hf_config`'s checkpoint,
        as ``save_pretrained`` writes it (``shardshift export``). The default: unchanged, for a
        model whose parameters carry that architecture's names and shapes already."""
        return params

    # ---- torch ---------------------------------------------------------------------------------

    @abc.abstractmethod
    def build(self) -> nn.Module:
        """The whole model, as plain PyTorch (the engine calls it on the meta device)."""

    @abc.abstractmethod
    def init_value(self, fqn: str, shape: torch.Size, dtype: torch.dtype, seed: int) -> torch.Tensor:
        """The initial value of parameter `fqn`, whole; a function of (seed, fqn) only."""

    def init_buffers(self, module: nn.Module) -> None:
        """Fill the buffers of `module` (this rank's stage, materialised) that no checkpoint holds
        (e.g. RoPE's ``inv_freq``). The default: the model has none."""

    def flops_per_token(self) -> int:
        """Model FLOPs of one token in one training step, forward and backward: PaLM's count,
        ``6 · N + 12 · layers · hidden · seq_len`` with N the parameters a token reads (all of them
        in a dense model) and the second term attention's scores and weighted sums."""
        return 6 * self.num_params() + 12 * self.pipeline.num_layers * self.hidden_size * self.seq_len

    @property
    def expert_modules(self) -> tuple[str, ...]:
        """Name patterns (``*`` standing for one name part) of the modules that hold a layer's
        experts stacked along dim 0 of each of their parameters, called with the rows of each
        expert they hold (`models.moe.model.MoEExperts`). Expert parallelism (``ep``) splits those
        parameters along dim 0 and sets the ``dispatch`` of each such module's parent, which then
        sends the rows to the rank holding their expert (`train.dispatch`). The default: no
        experts (``ep`` must be 1)."""
        return ()

    def logits(self, output: Any) -> torch.Tensor:
        """The logits (b, t, vocab) in what the whole model's forward returned (`build`): the
        default, the output itself; a model that returns more (a mixture of experts' routing
        statistics) picks them out."""
        return output

    @abc.abstractmethod
    def loss(self, logits: Any, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss of the model's output (logits (b, t, vocab), or what `logits` reads them from)
        against targets (b, t)."""


class SizedSpec(ModelSpec):
    """A model that is its name and a frozen dataclass of sizes (`config`), as the built-in families
    and ``hf:`` are: the sizes the engine asks for are the configuration's (a GPT's hidden size is
    its ``d_model``), its JSON form the dataclass's fields (``hf:`` keeps its config.json's)."""

    config: Any

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def seq_len(self) -> int:
        return self.config.seq_len

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def config_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self.config)

    def with_config(self, config: Mapping[str, Any]) -> SizedSpec:
        return dataclasses.replace(self, config=type(self.config)(**config))

    def num_params(self) -> int:
        return self.config.num_params()
