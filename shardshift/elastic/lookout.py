"""A worker's lookout: the changes of world it can see coming while a step runs.

The step boundary decides every change (`worker.ElasticWorker._control`: one all-reduce, so that
every worker decides alike). But most changes are announced before the boundary: a preemption
notice (SIGTERM) reaches one worker some time during a step, and a joiner says it is ready in the
store whenever its start-up is done. The lookout is a thread that looks every `LOOK_S` while a step
runs: it publishes its own worker's notice in the store (`protocol.JobStore.publish_notice`), and
reads the others' notices and the joiners' queue. Each change it sees
(the workers with a notice leaving; the ready joiners coming, counted as the boundary will count
them) it hands to `foresee`, which plans it in the background (`ahead.Ahead`): by the boundary the
plan is ready, and the pause is the move itself. What it sees is only a forecast: a change that
does not come costs the background work, never a wrong plan.

It has a store client of its own, and reads the world only from `world`, which the main thread
sets when a step starts and clears when the boundary begins to change the world.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

from shardshift.elastic.config import ElasticConfig, Observed
from shardshift.elastic.protocol import Epoch, JobStore

LOOK_S = 0.1  # how often the lookout looks


@dataclasses.dataclass(frozen=True)
class World:
    """The world while a step runs, as the lookout sees it."""

    epoch: Epoch
    observed: Observed  # the job's measured steps (the layout policy's calibration)
    step: int  # the step that runs


Foresee = Callable[[World, frozenset[int], tuple[int, ...]], None]  # (world, leaving ids, joiner ids)


class Lookout:
    """Worker `member`'s lookout (module docstring). `noticed()`: whether this worker got a stop
    signal; `foresee(world, leaving, joiners)`: start planning that change."""

    def __init__(self, store: JobStore, member: int, ecfg: ElasticConfig, noticed: Callable[[], bool],
                 foresee: Foresee) -> None:
        self.store, self.member, self.ecfg, self.noticed, self.foresee = store, member, ecfg, noticed, foresee
        self.world: World | None = None
        self._published: set[int] = set()  # epochs whose notice this worker wrote
        self._seen: set[tuple] = set()  # (epoch, leaving, joiners) handed to `foresee`
        self._closed = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._run, name=f"shardshift-lookout-{self.member}", daemon=True).start()

    def close(self) -> None:
        self.world = None
        self._closed.set()

    def _run(self) -> None:
        while not self._closed.wait(LOOK_S):
            try:
                self.look()
            except (RuntimeError, OSError):  # the coordinator is gone, and the job with it
                return

    def look(self) -> None:
        """One look (the thread's; callable directly)."""
        world = self.world
        if world is None:
            return
        epoch, store = world.epoch, self.store
        if self.noticed() and epoch.number not in self._published and self.member in epoch.members:
            self._published.add(epoch.number)
            store.publish_notice(epoch.number, epoch.members.index(self.member))
        leaving = frozenset(epoch.members[r] for r in store.notices(epoch.number, epoch.world_size))
        joiners = tuple(self._coming(world))
        for change in ((leaving, ()), (frozenset(), joiners)):
            if any(change) and (epoch.number, *change) not in self._seen and self.world is world:
                self._seen.add((epoch.number, *change))
                self.foresee(world, *change)

    def _coming(self, world: World) -> list[int]:
        """The ids of the joiners the boundary after `world.step` would admit if they stay ready
        (`config.ElasticConfig.admits`)."""
        room = self.ecfg.admits(world.epoch.world_size, self.ecfg.inject_at(world.step))
        if not room:
            return []
        return [self.store.joiner_id(i) for i in self.store.live_joiners(world.epoch.admitted)[:room]]
