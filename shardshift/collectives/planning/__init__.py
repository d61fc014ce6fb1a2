"""Planning collectives, pure data and no torch.distributed: bounds of a topology, tree packings
that reach them, rings, schedules that cut a packing into pipelined chunk transfers, and the
symbolic checker that proves a schedule computes its collective before it runs."""

from shardshift._exports import lazy_exports

_NAMES = {
    "Collective": ".ops", "Direction": ".ops", "TransferKind": ".ops",
    "collective_bound": ".bounds",
    "Packing": ".trees", "Piece": ".trees", "Tree": ".trees",
    "Depth": ".packing", "Method": ".packing", "PackOptions": ".packing", "describe": ".packing", "pack": ".packing",
    "best_ring": ".rings", "ring_packing": ".rings",
    "Chunk": ".schedule", "ChunkTransfer": ".schedule", "CollectiveSchedule": ".schedule", "make_schedule": ".schedule",
    "ScheduleError": ".checker", "check_schedule": ".checker", "run_reference": ".checker",
}  # fmt: skip
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
