"""Models of the user's own: `ModuleSpec` (a plain ``nn.Module`` as a `ModelSpec`, in a few lines;
`spec`) and the specs ``--model FILE.py:NAME`` and ``--model MODULE:NAME`` name (`load`)."""

from shardshift._exports import lazy_exports

_NAMES = {"ModuleSpec": ".spec", "imported_spec": ".load", "is_imported_name": ".load"}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
