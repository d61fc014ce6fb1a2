"""Topology-aware collectives, in three layers that follow the flow of data:

- `topology`: the network (ranks, switches, directed links) from a preset, a YAML file, a spec
  string, or probing a running group;
- `planning`: bounds, tree packings, rings, schedules and their symbolic checker (pure);
- `execution`: compiled per-rank programs, the executor, `TreeCollectives`, and the
  `shardshift` torch.distributed backend.

The names below are the ones a user needs; each is imported from its module on first use.
"""

from shardshift._exports import lazy_exports

_NAMES = {
    "Link": ".topology", "Topology": ".topology", "dgx1v": ".topology", "fat_tree": ".topology",
    "full": ".topology", "ring": ".topology", "load_topology": ".topology", "probe_topology": ".topology",
    "Collective": ".planning", "PackOptions": ".planning", "Packing": ".planning", "collective_bound": ".planning",
    "pack": ".planning", "check_schedule": ".planning", "make_schedule": ".planning",
    "Reduction": ".execution", "RunOptions": ".execution", "TreeCollectives": ".execution",
    "ShardShiftOptions": ".execution", "register_backend": ".execution",
}  # fmt: skip
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
