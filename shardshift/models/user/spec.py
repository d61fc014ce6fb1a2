"""`ModuleSpec`: a plain PyTorch module of the user's own as a `ModelSpec`, in a few lines.

The module is any ``nn.Module`` class (or a function returning one) that follows the interface's
three conventions (`models.spec`): its repeated layers in an ``nn.ModuleDict`` keyed ``"0"``,
``"1"``, ...; a forward that passes hidden states through when the modules of the first or the
last stage are None; attention that counts its heads from its projections. What the engine needs
besides is derived here, from the module built on the meta device:

- the pipeline split: the number of layers is the container's;
- the layouts it refuses (`check_layout`): tp must divide the width that the plan splits of every
  module it names (a colwise linear's output features, a rowwise one's input features) and every
  config entry `tp_divides` names (the heads); pp at most the layers; a parameter shared by two
  stages (a tied head) only under pp=1; no experts;
- its sizes: ``vocab_size``, ``hidden_size`` and ``seq_len`` are config entries (the module is
  called with the whole config, as Hugging Face models are with theirs), the parameter count the
  module's own;
- initial values that depend on (seed, name) only: biases zero, other vectors (norm gains) one,
  matrices normal(0, `init_std`); the loss: next-token cross entropy (`models.loss`).

Override a method in a subclass where a model needs otherwise (buffers to fill after the meta
device: `init_buffers`). A spec is named by `--model FILE.py:NAME` or ``MODULE:NAME``
(`models.user.load`), which sets `name`.

This module imports no torch until a model is built.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from shardshift.layout import Layout
from shardshift.models.spec import (
    TP_STYLES,
    ModelSpec,
    PipelineSplit,
    check_divides,
    check_stages,
    plan_matcher,
)

if TYPE_CHECKING:
    from torch import nn

SIZES = ("vocab_size", "hidden_size", "seq_len")  # config entries the engine reads


@dataclasses.dataclass(frozen=True)
class Structure:
    """What the engine reads of a module built on the meta device (`ModuleSpec.structure`)."""

    module_type: str
    num_layers: int
    num_params: int
    split_widths: tuple[tuple[str, str, str, int], ...]  # (module, style, size's name, size) the plan splits
    shared_across_stages: tuple[str, ...]  # parameters reached from two pipeline stages


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModuleSpec(ModelSpec):
    """A plain ``nn.Module`` as a `ModelSpec` (module docstring)."""

    module: Callable[..., nn.Module]  # its class, or a function returning it: called as module(**config)
    config: Mapping[str, Any]  # its keyword arguments, JSON values holding SIZES; a checkpoint records them
    layers: str  # the ModuleDict of its repeated layers, keyed "0", "1", ...
    first: tuple[str, ...] = ()  # modules only the first pipeline stage keeps (the embeddings)
    last: tuple[str, ...] = ()  # modules only the last stage keeps (the final norm, the head)
    plan: Mapping[str, str] = dataclasses.field(default_factory=dict)  # the tp plan (`ModelSpec.tp_plan`)
    tp_divides: tuple[str, ...] = ()  # config entries tp must divide besides the plan's widths (the heads)
    init_std: float = 0.02  # the standard deviation of the initial matrices
    name: str = ""  # as --model names it (`models.user.load` sets it); "": the module's own name

    def __post_init__(self) -> None:
        for field in ("first", "last", "tp_divides"):
            value = getattr(self, field)
            object.__setattr__(self, field, (value,) if isinstance(value, str) else tuple(value))
        if not self.name:
            object.__setattr__(self, "name", getattr(self.module, "__name__", type(self.module).__name__))
        try:
            json.dumps(dict(self.config))
        except (TypeError, ValueError) as err:
            raise ValueError(f"{self.name}: config must hold JSON values (a checkpoint records it): {err}") from None
        for key in (*SIZES, *self.tp_divides):
            value = self.config.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{self.name}: config[{key!r}] is {value!r}; give a whole number >= 1 "
                                 f"(the engine reads {', '.join(SIZES)} from the config)")
        for pattern, style in self.plan.items():
            if style not in TP_STYLES:
                raise ValueError(f"{self.name}: plan makes {pattern} {style!r}; choose one of {', '.join(TP_STYLES)}")

    def __hash__(self) -> int:  # config and plan are dicts: hashed as their JSON
        return hash((type(self), self.name, self.module, json.dumps(dict(self.config), sort_keys=True),
                     json.dumps(dict(self.plan), sort_keys=True), self.layers, self.first, self.last,
                     self.tp_divides, self.init_std))

    # ---- what the model is ---------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.config["vocab_size"]

    @property
    def seq_len(self) -> int:
        return self.config["seq_len"]

    @property
    def hidden_size(self) -> int:
        return self.config["hidden_size"]

    @property
    def pipeline(self) -> PipelineSplit:
        return PipelineSplit(self.layers, self.structure.num_layers, first=self.first, last=self.last)

    @property
    def tp_plan(self) -> Mapping[str, str]:
        return self.plan

    def config_dict(self) -> dict[str, Any]:
        return dict(self.config)

    def with_config(self, config: Mapping[str, Any]) -> ModuleSpec:
        return dataclasses.replace(self, config=dict(config))

    def num_params(self) -> int:
        return self.structure.num_params

    def check_layout(self, layout: Layout) -> None:
        if layout.ep > 1:
            raise ValueError(f"ep={layout.ep}: {self.name} has no experts to split; train with ep=1")
        structure = self.structure
        if layout.tp > 1:
            if not self.plan:
                raise ValueError(f"tp={layout.tp}: {self.name} has no tensor-parallel plan; give ModuleSpec a plan, "
                                 f"or train with tp=1")
            sizes = [(f"the {what}={size} of {module} ({style})", size)
                     for module, style, what, size in structure.split_widths]
            sizes += [(f"{key}={self.config[key]}", self.config[key]) for key in self.tp_divides]
            check_divides("tp", layout.tp, sizes)
        check_stages(layout.pp, structure.num_layers, f"({self.layers} holds {structure.num_layers})")
        if layout.pp > 1 and structure.shared_across_stages:
            raise ValueError(f"pp={layout.pp}: {self.name} shares {' and '.join(structure.shared_across_stages)}, "
                             f"one parameter that two pipeline stages would both need; train it with pp=1")

    @functools.cached_property
    def structure(self) -> Structure:
        """The module built once on the meta device, read and checked: ValueError naming what does
        not fit the interface, and the fix."""
        import torch
        from torch import nn

        with torch.device("meta"):
            model = self.build()
        kind = type(model).__name__
        modules = dict(model.named_modules())
        container = modules.get(self.layers)
        keys = list(container.keys()) if isinstance(container, nn.ModuleDict) else None
        if not keys or keys != [str(i) for i in range(len(keys))]:
            raise ValueError(f"{self.name}: layers={self.layers!r} must name the nn.ModuleDict of {kind}'s repeated "
                             f"layers, keyed '0', '1', ... (a stage keeps its layers' names); "
                             f"it is {type(container).__name__ if container is not None else 'not a module of it'}")
        for field in ("first", "last"):
            for name in getattr(self, field):
                if not isinstance(modules.get(name), nn.Module) or name in ("", self.layers):
                    raise ValueError(f"{self.name}: {field}={getattr(self, field)!r} names {name!r}, which is no "
                                     f"module of {kind} besides its layers; name its own modules")
        split = PipelineSplit(self.layers, len(keys), first=self.first, last=self.last)
        stage_of, shared = {}, []
        for fqn, param in model.named_parameters(remove_duplicate=False):
            owners = [m for m in (self.layers, *self.first, *self.last) if fqn.startswith(m + ".")]
            if not owners:
                raise ValueError(f"{self.name}: parameter {fqn} is in no layer of {self.layers} and in no module of "
                                 f"first or last; name its module in first= (kept by the first pipeline stage) or "
                                 f"last= (the last stage)")
            stage = split.layer_of(fqn)
            if stage_of.setdefault(id(param), (fqn, stage))[1] != stage:
                shared.append(f"{stage_of[id(param)][0]} with {fqn}")
        widths = []
        for pattern, style in self.plan.items():
            named = [name for name in modules if plan_matcher({pattern: style})(name) is not None]
            if not named:
                raise ValueError(f"{self.name}: plan names {pattern}, which matches no module of {kind}; "
                                 f"give the names of its modules ('*' for a layer's index)")
            if style in ("colwise", "rowwise"):
                for name in named:
                    widths.append((name, style, *_split_width(modules[name], style, name, self.name)))
        num_params = sum(p.numel() for p in model.parameters())
        return Structure(kind, len(keys), num_params, tuple(widths), tuple(shared))

    # ---- torch ---------------------------------------------------------------------------------

    def build(self):
        return self.module(**self.config)

    def init_value(self, fqn, shape, dtype, seed):
        import torch

        from shardshift.models.init import seeded_normal

        if fqn.rsplit(".", 1)[-1] == "bias":
            return torch.zeros(shape, dtype=dtype)
        if len(shape) == 1:  # a norm's gain
            return torch.ones(shape, dtype=dtype)
        return seeded_normal(fqn, shape, dtype, seed, self.init_std)

    def loss(self, logits, targets):
        from shardshift.models.loss import next_token_loss

        return next_token_loss(logits, targets)


def _split_width(module, style: str, name: str, model: str) -> tuple[str, int]:
    """The size's name and the size that tensor parallelism splits of `module` under `style`."""
    from torch import nn

    if isinstance(module, nn.Linear):
        return ("out_features", module.out_features) if style == "colwise" else ("in_features", module.in_features)
    if isinstance(module, nn.Embedding):
        return ("embedding_dim", module.embedding_dim) if style == "colwise" else ("num_embeddings",
                                                                                  module.num_embeddings)
    raise ValueError(f"{model}: plan makes {name} ({type(module).__name__}) {style}, which applies to linear and "
                     f"embedding modules only; fix the plan")
