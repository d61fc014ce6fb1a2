"""Public names of a package, imported from their modules on first use (PEP 562).

A package's ``__init__`` names what it offers without importing it: ``shardshift.collectives``
lists the backend, but `shardshift topo pack` must not pay for importing torch.distributed, and
the command line imports nothing it does not run.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_exports(package: str, names: Mapping[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for `package`: ``names[name]`` is the module (relative to
    the package) that defines `name`."""

    def __getattr__(name: str) -> object:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module, package), name)

    def __dir__() -> list[str]:
        return sorted(names)

    return __getattr__, __dir__
