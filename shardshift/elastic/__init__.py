"""Elastic training: a run whose world grows and shrinks while it trains (`shardshift train --elastic`).

- `config`: what a run may become: its world sizes, the layout of each, scripted events
  (`ElasticConfig`, `Inject`; pure, checked before any process starts);
- `policy`: the layout of a world that ``--layout-for`` does not name, the fastest that fits
  (`choose_layout`, on a `CostModel`; pure);
- `coordinator`: the process that serves the job's store and starts and watches the workers
  (`launch_elastic`); `membership`: the epochs of membership kept in that store (`Epoch`);
- `worker`: one worker, which trains and at each step boundary agrees with the others on the next
  world and moves its state there (`ElasticWorker`); its `lookout` thread sees a change coming
  during a step (`Lookout`), and `ahead` plans that change before it (`Ahead`);
- `redundancy`: in-memory copies of the state, so that the pieces of crashed workers survive
  (`copy_duties`, `Copies`).

The names below are imported from their modules on first use: importing the package imports
neither torch nor the store.
"""

from shardshift._exports import lazy_exports

_NAMES = {
    "ElasticConfig": ".config", "Inject": ".config", "check_every_world": ".config",
    "CostModel": ".policy", "choose_layout": ".policy",
    "launch_elastic": ".coordinator", "Epoch": ".membership",
    "ElasticWorker": ".worker", "WorldLost": ".worker", "Lookout": ".lookout", "Ahead": ".ahead",
    "Copies": ".redundancy", "copy_duties": ".redundancy",
}  # fmt: skip
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
