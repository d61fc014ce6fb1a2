"""Elastic training: a run whose world grows and shrinks while it trains (`shardshift train --elastic`).

- `config`: what a run may become: its world sizes, the layout of each, scripted events
  (`ElasticConfig`, `Inject`; pure, checked before any process starts);
- `policy`: the layout of a world that ``--layout-for`` does not name, the fastest that fits
  (`choose_layout`, on a `CostModel`; pure);
- `protocol`: every key of the job's store, read and written through one typed object
  (`JobStore`; its records `Epoch`, `CrashRecord`);
- `coordinator`: the process that serves the job's store and starts and watches the workers
  (`launch_elastic`); `membership`: a world's process groups, and a worker's heartbeat;
- `worker`: one worker, the one training loop with the hooks of a changing world
  (`ElasticWorker`); `change`: the next world and the plan into it (`plan_change`, pure);
  `moving`: the move of the state into it, tried again when a worker of it dies; `admission`:
  how joiners join; `recovery`: the commit vote and crash recovery; `restart`: a world from the
  newest checkpoint, when no live worker holds some piece (`WorldLost` when that fails too);
  `watch`: leaving a broken world at once; `orphaned`: the coordinator's loss; `faults`: scripted
  faults (`--inject`); its `lookout` thread sees a change coming during a step (`Lookout`), and
  `ahead` plans that change before it (`Ahead`);
- `redundancy`: in-memory copies of the state, so that the pieces of crashed workers survive
  (`copy_duties`, `Copies`).

The names below are imported from their modules on first use: importing the package imports
neither torch nor the store.
"""

from shardshift._exports import lazy_exports

_NAMES = {
    "ElasticConfig": ".config", "Inject": ".config", "check_every_world": ".config",
    "CostModel": ".policy", "choose_layout": ".policy",
    "JobStore": ".protocol", "Epoch": ".protocol", "CrashRecord": ".protocol",
    "launch_elastic": ".coordinator",
    "ElasticWorker": ".worker", "plan_change": ".change", "WorldLost": ".restart",
    "Lookout": ".lookout", "Ahead": ".ahead",
    "Copies": ".redundancy", "copy_duties": ".redundancy",
}  # fmt: skip
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
