"""The `shardshift train` command line as data.

- Keys: every flag of `shardshift train` is a key named like the flag with underscores
  (``--global-batch`` is ``global_batch``), the name argparse gives it. `flag_keys` lists them with
  the type a value must have; `read_config` reads a ``--config`` TOML file of them, checked;
  `to_toml` writes values back as such a file; `keys_argv` turns values into the flags that give
  them.
- `train_argv`: the command line whose configuration is a given `TrainConfig`, for harnesses that
  start a training run as a job of their own (the restart baseline in `bench.restart`, the jobs of
  `bench.elastic`); `train_keys`: that configuration as keys (a checkpoint's manifest records
  them). `shardshift.cli.train.config_from_args` reads either back.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tomllib

# What a key's value must be in a --config file, by kind: (the TOML types taken, how messages name it).
_KINDS = {"int": ((int,), "an integer"), "float": ((int, float), "a number"), "str": ((str,), "a string"),
          "bool": ((bool,), "true or false"), "list": ((list,), "a list of strings")}
_EXAMPLES = {"int": 1, "float": 1.0, "str": "...", "bool": True, "list": ["..."]}
COMMAND_LINE_ONLY = ("config", "print_config")  # flags that are not keys: they say what to do with the keys


@dataclasses.dataclass(frozen=True)
class FlagKey:
    """One flag of `shardshift train` as a key: its flag, the kind of value it takes (`_KINDS`),
    the values it may take (None: any), and its default."""

    flag: str
    kind: str
    choices: tuple | None
    default: object


def flag_keys(parser: argparse.ArgumentParser) -> dict[str, FlagKey]:
    """The keys of `parser`'s flags, in the order it lists them (help and `COMMAND_LINE_ONLY` aside)."""
    keys = {}
    for action in parser._actions:  # argparse has no public list of a parser's arguments
        if not action.option_strings or action.dest == "help" or action.dest in COMMAND_LINE_ONLY:
            continue
        if action.nargs == 0:
            kind = "bool"
        elif isinstance(action, argparse._AppendAction):
            kind = "list"
        else:
            kind = {int: "int", float: "float", None: "str"}[action.type]
        flag = max(action.option_strings, key=len)
        keys[action.dest] = FlagKey(flag, kind, tuple(action.choices) if action.choices else None, action.default)
    return keys


def given_keys(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The keys whose flags `argv` gives (parsed by `parser`)."""
    # argparse fills in a default only where the namespace has no value yet; each key starts as an
    # empty list of its own (a repeatable flag appends to a copy), so a value that is not that list was given.
    unset = {key: [] for key in vars(parser.parse_args([]))}
    parsed = vars(parser.parse_args(argv, argparse.Namespace(**unset)))
    return {key for key, value in parsed.items() if value is not unset.get(key)}


def read_config(path: str, keys: dict[str, FlagKey]) -> dict[str, object]:
    """The values of TOML file `path` (``--config``), by key, as the flags would give them (a
    number for a float flag as a float; an empty list as the flag's default: no flag given);
    ValueError in one line naming ``--config PATH``, the key, and what to write instead."""
    from shardshift.textfile import FileError, naming, read_text

    wanted = "a TOML file of `shardshift train` flags (docs/config.md)"
    try:
        table = tomllib.loads(read_text(path, "--config", wanted))
    except tomllib.TOMLDecodeError as err:
        raise FileError("--config", path, f"not valid TOML ({err})", f"give {wanted}") from None
    where = naming("--config", path)
    values = {}
    for key, value in table.items():
        if key in COMMAND_LINE_ONLY:
            raise ValueError(f"{where}: key {key!r}: --{key.replace('_', '-')} is a flag of the command line only; "
                             "remove it from the file")
        if key not in keys:
            fix = (f"write {key.replace('-', '_')}" if key.replace("-", "_") in keys else
                   "keys are the flags of `shardshift train` with underscores, e.g. global_batch for --global-batch")
            raise ValueError(f"{where}: unknown key {key!r}; {fix}")
        spec = keys[key]
        types, what = _KINDS[spec.kind]
        right = isinstance(value, types) and (spec.kind == "bool" or not isinstance(value, bool))
        if spec.kind == "list":
            right = right and all(isinstance(item, str) for item in value)
        if not right:
            example = spec.default if spec.default not in (None, [], False) else _EXAMPLES[spec.kind]
            raise ValueError(f"{where}: {key} = {_shown(value)} is not {what}; write e.g. {key} = "
                             f"{_value(example)}")
        if spec.choices is not None and value not in spec.choices:
            raise ValueError(f"{where}: {key} = {_shown(value)}: choose one of "
                             f"{', '.join(_value(c) for c in spec.choices)}")
        values[key] = float(value) if spec.kind == "float" else (value or spec.default) if spec.kind == "list" \
            else value
    return values


def to_toml(values: dict[str, object], keys: dict[str, FlagKey], header: str) -> str:
    """`values` (every key of `keys`) as a ``--config`` file: `header` as a comment, then one line per
    key in the flags' order; a key whose value is None (the flag not given, and no default) is a
    comment, as TOML has no null."""
    lines = [f"# {line}" for line in header.splitlines()]
    for key in keys:
        value = values[key]
        lines.append(f"# {key}: not set" if value is None else f"{key} = {_value(value)}")
    return "\n".join(lines) + "\n"


def _value(value) -> str:
    """`value` (a bool, int, float, str or list of str) as TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(item) for item in value) + "]"
    return json.dumps(value, ensure_ascii=False)  # a JSON string is a TOML basic string


def _shown(value) -> str:
    shown = _value(value) if isinstance(value, bool | int | float | str) else repr(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."


def keys_argv(values: dict[str, object]) -> list[str]:
    """The flags that give `values` (keys as `flag_keys` names them): ``--key=value`` (so that a value
    starting with '-' stays a value), a list as the flag repeated, True as the flag alone; None
    and False (the flags' defaults) give nothing."""
    argv = []
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        items = value if isinstance(value, list | tuple) else [value]
        for item in items:
            if item is True:
                argv.append(flag)
            elif item is not None and item is not False:
                argv.append(f"{flag}={item!r}" if isinstance(item, float) else f"{flag}={item}")
    return argv


def train_keys(cfg, *, switches: bool = True) -> dict[str, object]:
    """The keys of `shardshift train` that give `cfg`, a `TrainConfig` (`config_from_args`
    inverted; the model by its name, the optimizer by the settings flags have), without its
    ``switch`` when `switches` is False. Keys left at the flag's default of None are left out."""
    values = {"layout": str(cfg.layout), "model": cfg.model.name, "steps": cfg.steps, "stop_at": cfg.stop_at,
              "seed": cfg.seed, "dtype": cfg.dtype, "global_batch": cfg.global_batch,
              "micro_batches": 0 if cfg.auto_micro_batches else cfg.micro_batches,
              "micro_batch_size": cfg.micro_batch_size, "activation_checkpointing": cfg.activation_checkpointing,
              "mixed_precision": cfg.mixed_precision, "compile": cfg.compile,
              "eval_every": cfg.eval_every,
              "eval_batches": cfg.eval_batches, "data": cfg.data, "lr": cfg.optim.lr,
              "warmup": cfg.optim.warmup_steps, "grad_clip": cfg.optim.grad_clip, "save": cfg.save,
              "save_every": cfg.save_every, "keep_checkpoints": cfg.keep_checkpoints, "resume": cfg.resume,
              "metrics": cfg.metrics, "tensorboard": cfg.tensorboard, "log_every": cfg.log_every,
              "switch": [f"{step}:{layout}" for step, layout in cfg.switches] if switches and cfg.switches else None,
              "switch_budget": str(cfg.switch_budget), "plot": cfg.plot, "collectives": cfg.collectives,
              "topology": cfg.topology}
    return {key: value for key, value in values.items() if value is not None}


def train_argv(cfg, *, nproc: int, timeout_s: float) -> list[str]:
    """The `shardshift train` arguments whose configuration is `cfg` (`config_from_args` inverted),
    for jobs that start a training run of their own (the restart baseline of `bench switch`).

    Raises ValueError for a configuration the command line cannot express (a model or optimizer
    setting that has no flag)."""
    from shardshift.models import model_spec, names_a_model
    from shardshift.train.config import OptimConfig

    optim = OptimConfig(lr=cfg.optim.lr, warmup_steps=cfg.optim.warmup_steps, grad_clip=cfg.optim.grad_clip)
    named = names_a_model(cfg.model.name)  # what --model can say
    if cfg.optim != optim or not named or model_spec(cfg.model.name) != cfg.model:
        raise ValueError(f"the configuration has settings no flag of `shardshift train` sets: {cfg.optim}, "
                         f"{cfg.model}")
    return ["train", *keys_argv({"nproc": nproc, **train_keys(cfg), "timeout": float(timeout_s)})]
