"""The job's store protocol: every key the coordinator and the workers of an elastic job share, and
its record, read and written through one typed object (`JobStore`). Nothing else formats a key.

The coordinator serves torch's c10d `TCPStore`; every worker holds clients of it. The store is
never on the training path: a worker reads and writes small values at step boundaries, in its
commit vote, and from its lookout and heartbeat threads.

| key | value | written by | read by |
|---|---|---|---|
| ``config/argv``, ``config/nproc`` | the training command (JSON), the first world's size | coordinator | joiners (`shardshift join`), workers (joiners' ids) |
| ``config/identity`` | what a joiner must share with the job: versions, model, data digest (JSON) | the first world's rank 0 | joiners |
| ``spawn/started`` | joiners the coordinator started for scripted joins | coordinator | rank 0 (a scripted join waits for them) |
| ``epoch/{e}``, ``epoch/current`` | each world's `Epoch`; the one training now | the new world's rank 0 | everyone |
| ``pid/{host}/{pid}`` | the worker id of a process of a host | the worker | coordinator (names a crashed worker) |
| ``host/{member}`` | the worker's host: the address it reaches the store from | the worker | every world's workers (where copies go) |
| ``heartbeat/{member}`` | wall-clock time of the worker's last beat | the worker's heartbeat thread | coordinator |
| ``join/ready``, ``join/ready/{i}`` | joiners ready (a counter); the i-th one's process | joiners | rank 0, lookouts |
| ``join/admitted/{i}`` | the epoch that admitted joiner i | the new world's rank 0 | joiner i |
| ``join/dead/{i}``, ``join/dead-before-ready`` | joiners that died before admission | coordinator | rank 0, lookouts |
| ``admit/{e}/{step}`` | the queue places admitted after that step (JSON) | rank 0 | the world's other ranks |
| ``notice/{e}``, ``notice/{e}/{rank}`` | notices to leave (a counter; the rank's flag) | the rank's lookout | lookouts |
| ``commit/{e}/{step}``, ``…/decision`` | the step's votes (a counter); apply or abort, set once | workers | workers |
| ``moved/{e}``, ``…/decision`` | votes that the change into epoch e is complete (a counter); done or failed, set once | the change's workers | the change's workers |
| ``crash/{e}`` | the workers lost from epoch e, or from the change into it (`CrashRecord`, JSON) | coordinator | survivors |
| ``stop``, ``stopped``, ``done`` | a signal to stop the job; the job stopped; it finished | coordinator; rank 0; rank 0 | workers; coordinator; both |
| ``inject/{event}/…`` | scripted events fired once (`--inject`) | workers | workers |

Worker ids are stable for the job: the first world's ranks ``0 .. nproc-1``, then joiners numbered
after them by their place in the queue (`JobStore.joiner_id`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
import time
from collections.abc import Callable, Iterable

import torch.distributed as dist

from shardshift.elastic.config import Observed
from shardshift.layout import Layout


@dataclasses.dataclass(frozen=True)
class Epoch:
    """One world: its workers (`members[r]` is the worker id of rank r, which holds coordinate r of
    `layout`), and how it came to be. The world before epoch e is epoch e - 1."""

    number: int
    members: tuple[int, ...]
    layout: Layout
    step: int  # optimizer steps taken when it starts
    kind: str = "start"  # what made it: start, join, leave, crash
    admitted: int = 0  # joiners admitted since the job started (the next one is join/ready/{admitted})
    observed: Observed = ()  # the job's measured steps the layout was chosen by

    def to_json(self) -> str:
        return json.dumps({"number": self.number, "members": list(self.members), "layout": str(self.layout),
                           "step": self.step, "kind": self.kind, "admitted": self.admitted,
                           "observed": [[str(layout), seconds] for layout, seconds in self.observed]})

    @classmethod
    def from_json(cls, text: str | bytes) -> Epoch:
        d = json.loads(text)
        return cls(d["number"], tuple(d["members"]), Layout.parse(d["layout"]), d["step"], d["kind"], d["admitted"],
                   tuple((Layout.parse(layout), seconds) for layout, seconds in d["observed"]))

    @property
    def world_size(self) -> int:
        return len(self.members)


@dataclasses.dataclass(frozen=True)
class CrashRecord:
    """The workers lost from an epoch, as the coordinator saw them die: every survivor plans from it."""

    lost: tuple[int, ...]  # worker ids
    seen: float  # wall-clock time of the first death

    def to_json(self) -> str:
        return json.dumps({"lost": list(self.lost), "seen": self.seen})

    @classmethod
    def from_json(cls, text: str | bytes) -> CrashRecord:
        d = json.loads(text)
        return cls(tuple(d["lost"]), d["seen"])


def connect(address: str, timeout_s: float) -> dist.TCPStore:
    """A client of the coordinator's store at HOST:PORT."""
    host, _, port = address.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


HOST_ENV = "SHARDSHIFT_HOST"  # a worker's host, where its address does not tell (`JobStore.publish_host`)


def host_of_this_process(coordinator_host: str, port: int = 1) -> str:
    """The host a worker of this process's machine is known by: ``$SHARDSHIFT_HOST`` if set, else
    the local address it reaches the coordinator from (distinct per machine, and per network
    namespace)."""
    name = os.environ.get(HOST_ENV)
    if name:
        return name
    family = socket.AF_INET6 if ":" in coordinator_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((coordinator_host, port or 1))  # sends nothing: picks the route, and so the local address
        return probe.getsockname()[0]


class JobStore:
    """Typed reads and writes of the job's store (module docstring). Every method is one or a few
    store calls; none blocks but `wait_for_admission`."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store

    @classmethod
    def connect(cls, address: str, timeout_s: float) -> JobStore:
        return cls(connect(address, timeout_s))

    @property
    def address(self) -> str:
        return f"{self.store.host}:{self.store.port}"

    def _has(self, key: str) -> bool:
        return self.store.check([key])

    def _int(self, key: str) -> int:
        """An integer key's value, 0 while it is not set."""
        return int(self.store.get(key)) if self._has(key) else 0

    # ---- the job -------------------------------------------------------------------------------

    def publish_job(self, argv: list[str], nproc: int, joiners_to_start: int) -> None:
        self.store.set("config/argv", json.dumps(list(argv)))
        self.store.set("config/nproc", str(nproc))
        self.store.set("spawn/started", str(joiners_to_start))

    def argv(self) -> list[str]:
        return json.loads(self.store.get("config/argv"))

    def first_world_size(self) -> int:
        return int(self.store.get("config/nproc"))

    def publish_identity(self, identity: dict) -> None:
        """What every worker of the job must share (`member.job_identity`)."""
        self.store.set("config/identity", json.dumps(identity, sort_keys=True))

    def identity(self) -> dict | None:
        """The job's identity, once its first world has published it."""
        return json.loads(self.store.get("config/identity")) if self._has("config/identity") else None

    def joiner_id(self, index: int) -> int:
        """The worker id of the joiner at place `index` of the queue."""
        return self.first_world_size() + index

    def joiners_started(self) -> int:
        """Joiners the coordinator started for scripted joins."""
        return self._int("spawn/started")

    def request_stop(self, signum: int) -> None:
        """The coordinator got `signum`: the whole job stops (and saves)."""
        self.store.set("stop", str(signum))

    def stop_requested(self) -> int:
        """The signal the coordinator passed on; 0 while none."""
        return self._int("stop")

    def mark_stopped(self, signum: int) -> None:
        """The workers agreed to stop: their exits from now on are not crashes."""
        self.store.set("stopped", str(signum))

    def mark_failed(self) -> None:
        """A worker stops the job: it cannot go on (`restart.WorldLost`); exits now are not crashes."""
        self.store.set("stopped", "failed")

    def stopped(self) -> bool:
        return self._has("stopped")

    def mark_done(self) -> None:
        self.store.set("done", "1")

    def done(self) -> bool:
        return self._has("done")

    # ---- epochs --------------------------------------------------------------------------------

    def publish_epoch(self, epoch: Epoch) -> None:
        self.store.set(f"epoch/{epoch.number}", epoch.to_json())

    def has_epoch(self, number: int) -> bool:
        return self._has(f"epoch/{number}")

    def epoch(self, number: int) -> Epoch:
        return Epoch.from_json(self.store.get(f"epoch/{number}"))

    def newest_number(self) -> int | None:
        """The newest epoch written: the current one, or a change into a next one under way (maybe one
        that failed, and the try after it)."""
        number = self.current_number()
        if number is None:
            return None
        while self.has_epoch(number + 1):
            number += 1
        return number

    def set_current(self, number: int) -> None:
        """Epoch `number`'s world is ready and trains."""
        self.store.set("epoch/current", str(number))

    def current_number(self) -> int | None:
        return int(self.store.get("epoch/current")) if self._has("epoch/current") else None

    def current_epoch(self) -> Epoch | None:
        number = self.current_number()
        return None if number is None else self.epoch(number)

    # ---- workers -------------------------------------------------------------------------------

    def register_process(self, member: int, pid: int | None = None) -> None:
        """Process `pid` (this one by default) of this host is worker `member` (a process id alone
        is not: two hosts can have processes of the same id)."""
        self.store.set(f"pid/{socket.gethostname()}/{os.getpid() if pid is None else pid}", str(member))

    def member_of(self, pid: int) -> int | None:
        """The worker id of process `pid` of this host, if it registered."""
        key = f"pid/{socket.gethostname()}/{pid}"
        return int(self.store.get(key)) if self._has(key) else None

    def this_host(self) -> str:
        """This process's host (`host_of_this_process`)."""
        host, _, port = self.address.rpartition(":")
        return host_of_this_process(host, int(port))

    def publish_host(self, member: int) -> None:
        """Worker `member` runs on this host (`this_host`)."""
        self.store.set(f"host/{member}", self.this_host())

    def host(self, member: int) -> str:
        """Worker `member`'s host (`publish_host`), waiting for it up to the store's timeout."""
        return self.store.get(f"host/{member}").decode()

    def beat(self, member: int) -> None:
        self.store.set(f"heartbeat/{member}", repr(time.time()))

    def last_beat(self, member: int) -> float | None:
        """When worker `member` last beat (its wall clock), or None if it never did."""
        key = f"heartbeat/{member}"
        return float(self.store.get(key)) if self._has(key) else None

    # ---- joiners -------------------------------------------------------------------------------

    def register_joiner(self) -> int:
        """Say this process is ready to join; its place in the queue of joiners."""
        index = self.store.add("join/ready", 1) - 1
        self.store.set(f"join/ready/{index}", json.dumps({"pid": os.getpid()}))
        return index

    def ready_joiners(self) -> int:
        """Joiners that said they are ready, since the job started."""
        return self.store.add("join/ready", 0)

    def live_joiners(self, admitted: int) -> list[int]:
        """Queue places of the joiners ready and not yet admitted (the first `admitted` were), but
        those that died."""
        return [i for i in range(admitted, self.ready_joiners()) if not self._has(f"join/dead/{i}")]

    def mark_joiner_dead(self, index: int) -> None:
        self.store.set(f"join/dead/{index}", "1")

    def joiner_died_before_ready(self) -> None:
        self.store.add("join/dead-before-ready", 1)

    def dead_before_ready(self) -> int:
        return self._int("join/dead-before-ready")

    def is_admitted(self, index: int) -> bool:
        return self._has(f"join/admitted/{index}")

    def admit(self, epoch: Epoch, places: Iterable[int]) -> None:
        """The new world's rank 0: write the epoch, then admit its joiners (they read it next)."""
        self.publish_epoch(epoch)
        for index in places:
            self.store.set(f"join/admitted/{index}", str(epoch.number))

    def wait_for_admission(self, index: int, while_waiting: Callable[[], None] = lambda: None,
                           poll_s: float = 0.05) -> Epoch | None:
        """Block until joiner `index` is admitted (its epoch), or the job stops or ends (None);
        `while_waiting()` is called at every poll."""
        key = f"join/admitted/{index}"
        while True:
            if self._has(key):
                return self.epoch(int(self.store.get(key)))
            if self._has("stop") or self.done():
                return None
            while_waiting()
            time.sleep(poll_s)

    def set_admissions(self, epoch: int, step: int, places: list[int]) -> None:
        """Rank 0: the queue places admitted after `step` of `epoch`, for the world's other ranks."""
        self.store.set(f"admit/{epoch}/{step}", json.dumps(places))

    def admissions(self, epoch: int, step: int) -> list[int]:
        return json.loads(self.store.get(f"admit/{epoch}/{step}"))

    # ---- notices, votes, crashes ---------------------------------------------------------------

    def publish_notice(self, epoch: int, rank: int) -> None:
        """Rank `rank` of epoch `epoch` got a notice to leave."""
        self.store.set(f"notice/{epoch}/{rank}", "1")
        self.store.add(f"notice/{epoch}", 1)

    def notices(self, epoch: int, world_size: int) -> frozenset[int]:
        """The ranks of epoch `epoch` that published a notice."""
        if not self.store.add(f"notice/{epoch}", 0):
            return frozenset()
        return frozenset(r for r in range(world_size) if self._has(f"notice/{epoch}/{r}"))

    def vote(self, epoch: int, step: int) -> int:
        """Count this worker's vote for `step` of `epoch`; the votes counted with it."""
        return self.store.add(f"commit/{epoch}/{step}", 1)

    def votes(self, epoch: int, step: int) -> int:
        return self.store.add(f"commit/{epoch}/{step}", 0)

    def decide(self, epoch: int, step: int, apply: bool) -> bool:
        """Propose whether `step` of `epoch` is applied; the decision, which the first proposal made
        (one compare-and-set: whoever reads it later reads the same, whatever was counted since)."""
        return self._decide(f"commit/{epoch}/{step}/decision", apply)

    def decision(self, epoch: int, step: int) -> bool | None:
        """Whether `step` of `epoch` is applied, once decided (None before)."""
        return self._decision(f"commit/{epoch}/{step}/decision")

    def vote_moved(self, epoch: int) -> int:
        """Count this worker's vote that the change into `epoch` is complete here; the votes counted."""
        return self.store.add(f"moved/{epoch}", 1)

    def moved_votes(self, epoch: int) -> int:
        return self.store.add(f"moved/{epoch}", 0)

    def decide_moved(self, epoch: int, done: bool) -> bool:
        """Propose whether the change into `epoch` is done (its world trains) or failed (the workers go
        back to the world before it); the decision, as for `decide`."""
        return self._decide(f"moved/{epoch}/decision", done)

    def moved_decision(self, epoch: int) -> bool | None:
        return self._decision(f"moved/{epoch}/decision")

    def _decide(self, key: str, yes: bool) -> bool:
        return self.store.compare_set(key, "", "yes" if yes else "no").decode() == "yes"

    def _decision(self, key: str) -> bool | None:
        return self.store.get(key).decode() == "yes" if self._has(key) else None

    def publish_crash(self, epoch: int, record: CrashRecord) -> None:
        self.store.set(f"crash/{epoch}", record.to_json())

    def crash(self, epoch: int) -> CrashRecord | None:
        """Who was lost from epoch `epoch`, once the coordinator has said so."""
        key = f"crash/{epoch}"
        return CrashRecord.from_json(self.store.get(key)) if self._has(key) else None

    def has_crash(self, epoch: int) -> bool:
        return self._has(f"crash/{epoch}")

    # ---- scripted events -----------------------------------------------------------------------

    def claim_event(self, event: str, epoch: int) -> bool:
        """Whether scripted event `event` fires in epoch `epoch`: only in the first epoch that
        reaches it (a step run again after a crash does not repeat it)."""
        first = self.store.compare_set(f"inject/{event}/epoch", "", str(epoch)).decode()
        return first == str(epoch)

    def fire_once(self, event: str, who: str) -> bool:
        """Whether `who` acts on scripted event `event` now: the first time it asks only."""
        return self.store.add(f"inject/{event}/fired/{who}", 1) == 1
