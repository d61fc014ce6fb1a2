"""Membership epochs on torch's c10d store: who the workers of each world are, and how a worker
joins, leaves, and learns of the next world.

The coordinator (`coordinator.py`) serves a `TCPStore`; every worker connects to it. Each epoch
is one world: its members (stable worker ids, in the world's rank order), its layout, and the
step it starts from. Its process groups live under a prefix of their own (``epoch{e}/world``
for the training world, ``epoch{e}/move`` for the group of old and new members that moves the
state), so nothing of an earlier world can be mistaken for the next.

Keys (all small values; the store is never on the training path):

- ``config/argv``: the training command, JSON; ``config/nproc``: the first world's size. A worker
  started by ``shardshift join`` reads them to run the same job.
- ``join/ready`` (a counter) and ``join/ready/{i}``: the i-th joiner to be ready (torch imported,
  data loaded) and its process id; ``join/admitted/{i}``: the epoch that admitted it;
  ``admit/{epoch}/{step}``: the queue places rank 0 admits after that step (the others read
  them); ``join/dead/{i}`` and the counter ``join/dead-before-ready``: joiners the coordinator
  saw die before they were admitted (they are passed over).
- ``epoch/{e}``: the epoch's `Epoch`, written by the new world's rank 0 before anything moves.
- ``spawn/started``: joiners the coordinator started for scripted joins; ``pid/{pid}``: the
  worker id of a process (the coordinator names a crashed worker by it).
- ``heartbeat/{member}``: the wall-clock time of the worker's last heartbeat (`start_heartbeat`).
- ``stop``: the signal the coordinator got (the whole job stops and saves); ``done``: the run
  reached its last step. A joiner still waiting to be admitted exits on either.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import threading
import time

import torch.distributed as dist

from shardshift.layout import Layout

COORDINATOR_ENV = "SHARDSHIFT_COORDINATOR"  # HOST:PORT of the store, in every worker's environment
MEMBER_ENV = "SHARDSHIFT_MEMBER"  # a first-world worker's id (its rank there)
JOB_DIR_ENV = "SHARDSHIFT_JOB_DIR"  # the coordinator's temporary directory (the default logs), if any


@dataclasses.dataclass(frozen=True)
class Epoch:
    """One world, and the one before it (what a joiner needs to plan the move as the others do).

    `members[r]` is the worker id of rank r. A world after the first is numbered by the
    coordinates of its layout (rank r holds coordinate r); `previous_ranks` is the old world's rank
    at each coordinate of `previous_layout` (an online layout switch may have reordered them)."""

    number: int
    members: tuple[int, ...]
    layout: Layout
    step: int  # optimizer steps taken when it starts
    kind: str = "start"  # what made it: start, join, leave
    admitted: int = 0  # joiners admitted since the job started (the next one is join/ready/{admitted})
    previous: tuple[int, ...] = ()
    previous_layout: Layout | None = None
    previous_ranks: tuple[int, ...] = ()
    observed: tuple[tuple[Layout, float], ...] = ()  # the job's measured steps the layout was chosen by

    def to_json(self) -> str:
        return json.dumps({"number": self.number, "members": list(self.members), "layout": str(self.layout),
                           "step": self.step, "kind": self.kind, "admitted": self.admitted,
                           "previous": list(self.previous), "previous_ranks": list(self.previous_ranks),
                           "previous_layout": None if self.previous_layout is None else str(self.previous_layout),
                           "observed": [[str(layout), seconds] for layout, seconds in self.observed]})

    @classmethod
    def from_json(cls, text: str | bytes) -> Epoch:
        d = json.loads(text)
        previous_layout = None if d["previous_layout"] is None else Layout.parse(d["previous_layout"])
        return cls(d["number"], tuple(d["members"]), Layout.parse(d["layout"]), d["step"], d["kind"], d["admitted"],
                   tuple(d["previous"]), previous_layout, tuple(d["previous_ranks"]),
                   tuple((Layout.parse(layout), seconds) for layout, seconds in d["observed"]))

    @property
    def world_size(self) -> int:
        return len(self.members)


def connect(address: str, timeout_s: float) -> dist.TCPStore:
    """A client of the coordinator's store at HOST:PORT."""
    host, _, port = address.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def read_int(store: dist.Store, key: str) -> int:
    """An integer key's value, 0 while it is not set (never blocks)."""
    return int(store.get(key)) if store.check([key]) else 0


def register_joiner(store: dist.Store) -> int:
    """Say this process is ready to join; its place in the queue of joiners."""
    index = store.add("join/ready", 1) - 1
    store.set(f"join/ready/{index}", json.dumps({"pid": os.getpid()}))
    return index


def ready_joiners(store: dist.Store) -> int:
    """Joiners that said they are ready, since the job started."""
    return store.add("join/ready", 0)


def live_joiners(store: dist.Store, admitted: int) -> list[int]:
    """Queue places of the joiners ready and not yet admitted (the first `admitted` were), but
    those that died."""
    return [i for i in range(admitted, ready_joiners(store)) if not store.check([f"join/dead/{i}"])]


def wait_for_admission(store: dist.Store, index: int, while_waiting=lambda: None, poll_s: float = 0.05) -> Epoch | None:
    """Block until joiner `index` is admitted (its epoch), or the job stops or ends (None);
    `while_waiting()` is called at every poll."""
    key = f"join/admitted/{index}"
    while True:
        if store.check([key]):
            return Epoch.from_json(store.get(f"epoch/{int(store.get(key))}"))
        if store.check(["stop"]) or store.check(["done"]):
            return None
        while_waiting()
        time.sleep(poll_s)


def announce(store: dist.Store, epoch: Epoch, joiners) -> None:
    """The new world's rank 0: write the epoch, then admit its joiners (they read it next)."""
    store.set(f"epoch/{epoch.number}", epoch.to_json())
    for index in joiners:
        store.set(f"join/admitted/{index}", str(epoch.number))


def init_world(store: dist.Store, epoch: Epoch, rank: int, timeout_s: float, backend: str) -> None:
    """Join epoch `epoch`'s world as `rank`: the default process group, on its own prefix."""
    dist.init_process_group(backend, store=dist.PrefixStore(f"epoch{epoch.number}/world", store), rank=rank,
                            world_size=epoch.world_size, timeout=datetime.timedelta(seconds=timeout_s))


def move_group(store: dist.Store, epoch: Epoch, process: int, processes: int, timeout_s: float):
    """The group of the old world's and the new world's workers that moves the state into `epoch`
    (a gloo group built by hand: it needs no default group, so a joiner can be in it)."""
    return dist.ProcessGroupGloo(dist.PrefixStore(f"epoch{epoch.number}/move", store), process, processes,
                                 datetime.timedelta(seconds=timeout_s))


def start_heartbeat(address: str, member: int, interval_s: float, timeout_s: float) -> None:
    """Write ``heartbeat/{member}`` (the wall-clock time) every `interval_s`, from a thread and a
    store client of its own, for as long as this process lives: a worker frozen or cut off stops
    beating, and the coordinator notices within its heartbeat timeout."""
    store = connect(address, timeout_s)

    def beat() -> None:
        while True:
            try:
                store.set(f"heartbeat/{member}", repr(time.time()))
            except (RuntimeError, OSError):  # the coordinator is gone: so is the job
                return
            time.sleep(interval_s)

    threading.Thread(target=beat, name=f"shardshift-heartbeat-{member}", daemon=True).start()


def last_beat(store: dist.Store, member: int) -> float | None:
    """When worker `member` last beat (wall clock), or None if it never did."""
    key = f"heartbeat/{member}"
    return float(store.get(key)) if store.check([key]) else None
