"""A model of the user's own, named as ``--model`` names it: ``FILE.py:NAME`` or ``MODULE:NAME``.

Every process of a job builds its model from the command line (the launcher's ranks, torchrun's,
the workers an elastic job's coordinator starts, joiners started from another shell, which read the
job's command line from its store), and `--resume`, `sample` and `export` from the name a
checkpoint's manifest records. So a model of one's own is named by something any process can
import: a Python file, or a module on ``sys.path`` (installed, or on ``PYTHONPATH``), and the name
of a `ModelSpec` in it, or of a function of no arguments that returns one.

A file is imported once per process, as a module of its own (not ``__main__``: a script that
trains its own model from ``if __name__ == "__main__":`` is not run again), and its spec is named
by the file's absolute path: the same file named from another working directory is the same model,
and a checkpoint names it wherever it is read.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys

from shardshift.models.spec import ModelSpec

EXAMPLE = "--model my_model.py:spec"


def is_imported_name(name: str) -> bool:
    """Whether --model `name` names a spec to import (a colon, and not ``hf:DIR``)."""
    return ":" in name and not name.startswith("hf:")


def imported_spec(name: str) -> ModelSpec:
    """The spec ``FILE.py:NAME`` or ``MODULE:NAME`` names, its `name` the canonical one (module
    docstring); ValueError in one line for a file or module that is not there, a NAME it does
    not define, or an object that is not a spec."""
    target, _, attr = name.rpartition(":")
    if not attr.isidentifier():
        raise ValueError(f"--model {name}: after the last colon give the name of a ModelSpec in {target or 'it'}, "
                         f"e.g. {EXAMPLE}")
    if target.endswith(".py"):
        path = os.path.abspath(target)
        module, where, canonical = _import_file(path, name), path, f"{path}:{attr}"
    elif target and all(part.isidentifier() for part in target.split(".")):
        module, where, canonical = _import_module(target, name), f"module {target}", name
    else:
        raise ValueError(f"--model {name}: {target!r} is neither a Python file (FILE.py) nor a module "
                         f"(package.module); e.g. {EXAMPLE}")
    found = getattr(module, attr, None)
    if found is None:
        specs = sorted(key for key, value in vars(module).items() if isinstance(value, ModelSpec))
        defined = f"the ModelSpecs it defines: {', '.join(specs)}" if specs else "it defines no ModelSpec"
        raise ValueError(f"--model {name}: {where} defines no {attr} ({defined})")
    spec = found() if inspect.isroutine(found) or isinstance(found, functools.partial) else found
    if not isinstance(spec, ModelSpec):
        got = f"returns a {type(spec).__name__}" if spec is not found else f"is a {type(found).__name__}"
        raise ValueError(f"--model {name}: {attr} {got}, not a ModelSpec; give a spec (such as "
                         f"shardshift.models.ModuleSpec(...)) or a function of no arguments that returns one")
    if not dataclasses.is_dataclass(spec):
        raise ValueError(f"--model {name}: {attr} is a {type(spec).__name__}, which is not a dataclass; "
                         f"make it a frozen dataclass, as every ModelSpec is")
    return dataclasses.replace(spec, name=canonical)


def _import_file(path: str, name: str):
    """The module of the Python file at `path`, imported once per process."""
    if not os.path.isfile(path):
        raise ValueError(f"--model {name}: no such file {path}; give a Python file that defines the model's "
                         f"ModelSpec, e.g. {EXAMPLE}")
    module_name = "shardshift_model_" + hashlib.sha256(path.encode()).hexdigest()[:16]
    if module_name in sys.modules:
        return sys.modules[module_name]
    loader = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(loader)
    sys.modules[module_name] = module  # dataclasses and pickle find the module of what it defines
    try:
        loader.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def _import_module(target: str, name: str):
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as err:
        if err.name is None or not (target == err.name or target.startswith(err.name + ".")):
            raise  # the module is there; something it imports is not
        raise ValueError(f"--model {name}: no module named {err.name} here; install it, put its directory on "
                         f"PYTHONPATH, or name its file (--model path/to/{target.rsplit('.', 1)[-1]}.py:"
                         f"{name.rpartition(':')[2]})") from None
