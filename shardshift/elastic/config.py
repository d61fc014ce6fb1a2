"""What an elastic run is allowed to become: its world sizes, the layout for each, scripted events.

Pure: parsing and validation only, done before any process starts (and again in every worker).
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

from shardshift.layout import Layout

if TYPE_CHECKING:
    from shardshift.train.config import TrainConfig

Observed = tuple[tuple[Layout, float], ...]  # measured step times of this job: (layout, seconds)

INJECT_KINDS = ("join", "leave", "kill", "term", "movekill", "wedge")


@dataclasses.dataclass(frozen=True)
class Inject:
    """A scripted membership event at the step boundary after step `step` (tests and demos):
    ``join=N``: N workers started by the coordinator are admitted there (the job waits for them
    if they are not ready yet); ``leave=R[,R...]``: the workers of those ranks get a real SIGTERM;
    ``kill=R[,R...]``: the workers of those ranks get a real SIGKILL inside that step;
    ``term=R[,R...]``: the workers of those ranks get a real SIGTERM while the first change of
    world after that step moves the state (they leave at the boundary after it);
    ``movekill=P[,P...]``: those processes of the first change of world after that step (the old
    world's workers that live, in rank order, then the joiners) get a real SIGKILL as the state
    starts to move; ``wedge=R``: inside that step the world's last rank gets a real SIGKILL, and
    rank R (another) waits to receive from the rank after it, which never sends: a survivor blocked
    on another survivor that has left the world to recover."""

    step: int
    kind: str
    values: tuple[int, ...]  # join: (N,); the others: the ranks (movekill: the processes)

    @classmethod
    def parse(cls, text: str) -> Inject:
        match = re.fullmatch(r"\s*(\d+)\s*:\s*(\w+)\s*=\s*(\d+(?:\s*,\s*\d+)*)\s*", text)
        if match is None or match.group(2) not in INJECT_KINDS or (match.group(2) == "join" and "," in match.group(3)):
            raise ValueError(f"--inject {text!r} is not STEP:join=N, STEP:leave=RANK[,RANK...], "
                             "STEP:kill=RANK[,RANK...], STEP:term=RANK[,RANK...], STEP:movekill=PROCESS[,...] or "
                             "STEP:wedge=RANK; write e.g. --inject 5:leave=3")
        step, kind = int(match.group(1)), match.group(2)
        values = tuple(int(v) for v in match.group(3).split(","))
        if step < 1:
            raise ValueError(f"--inject {text!r}: the step must be >= 1 (the event follows that step)")
        if kind == "wedge" and len(values) != 1:
            raise ValueError(f"--inject {text!r}: wedge one rank")
        if kind == "join" and values[0] < 1:
            raise ValueError(f"--inject {text!r}: join at least one worker")
        if len(set(values)) != len(values):
            raise ValueError(f"--inject {text!r} names a rank twice")
        return cls(step, kind, values)

    @property
    def count(self) -> int:
        """Workers that join (join), or ranks that leave or are killed."""
        return self.values[0] if self.kind == "join" else len(self.values)

    @property
    def ranks(self) -> tuple[int, ...]:
        return () if self.kind == "join" else self.values

    def __str__(self) -> str:
        return f"{self.step}:{self.kind}={','.join(map(str, self.values))}"


@dataclasses.dataclass(frozen=True)
class ElasticConfig:
    min_nproc: int
    max_nproc: int
    layouts: tuple[tuple[int, Layout], ...] = ()  # --layout-for N:LAYOUT
    injects: tuple[Inject, ...] = ()
    coordinator: str | None = None  # HOST:PORT the coordinator serves on (None: loopback, a free port)
    heartbeat_s: float = 5.0  # a worker silent this long is taken for dead
    redundancy: int = 0  # --redundancy K: every piece of the state kept by K + 1 workers
    memory_per_worker: int | None = None  # bytes of state a worker may hold (the layout policy's limit)

    def __post_init__(self) -> None:
        if self.redundancy < 0:
            raise ValueError(f"--redundancy {self.redundancy} must be >= 0 (the copies kept of each piece)")
        if self.redundancy >= self.max_nproc:
            raise ValueError(f"--redundancy {self.redundancy} needs more than {self.redundancy} workers: raise "
                             f"--max-nproc ({self.max_nproc}) or lower --redundancy")
        if not self.heartbeat_s > 0:
            raise ValueError(f"--heartbeat-timeout {self.heartbeat_s} must be > 0 seconds")
        if self.min_nproc < 1:
            raise ValueError(f"--min-nproc {self.min_nproc} must be >= 1")
        if self.max_nproc < self.min_nproc:
            raise ValueError(f"--max-nproc {self.max_nproc} is below --min-nproc {self.min_nproc}")
        sizes = [n for n, _ in self.layouts]
        for n, layout in self.layouts:
            if layout.world_size != n:
                raise ValueError(f"--layout-for {n}:{layout}: the layout has {layout.world_size} ranks, not {n}")
        if len(set(sizes)) != len(sizes):
            raise ValueError(f"--layout-for names a world size twice: {sorted(sizes)}")
        if len({i.step for i in self.injects}) != len(self.injects):
            raise ValueError("--inject: one event per step; put the events at different steps")

    @property
    def joiners_to_start(self) -> int:
        """Workers the coordinator starts for the scripted joins (they prepare while training goes on)."""
        return sum(i.count for i in self.injects if i.kind == "join")

    @property
    def heartbeat_interval_s(self) -> float:
        return self.heartbeat_s / 5

    def inject_at(self, step: int) -> Inject | None:
        return next((i for i in self.injects if i.step == step), None)

    def admits(self, world_size: int, event: Inject | None) -> int:
        """How many ready joiners a step boundary admits into a world of `world_size`: as many as
        fit under --max-nproc; with scripted joins, only at a join's boundary (`event`, that
        boundary's event) and at most its number."""
        room = max(0, self.max_nproc - world_size)
        if any(i.kind == "join" for i in self.injects):
            return min(room, event.count) if event is not None and event.kind == "join" else 0
        return room


def parse_layout_for(text: str) -> tuple[int, Layout]:
    size, sep, layout = text.partition(":")
    if not sep or not size.strip().isdigit():
        raise ValueError(f"--layout-for {text!r} is not N:LAYOUT; write e.g. --layout-for 3:fsdp=3")
    return int(size), Layout.parse(layout)


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--coordinator {text!r} is not HOST:PORT; write e.g. --coordinator 10.0.0.5:29400")
    return host, int(port)


def layout_for(n: int, ecfg: ElasticConfig, cfg: TrainConfig, observed: Observed = ()) -> Layout:
    """The layout of a world of `n` workers: the one `--layout-for` names (checked against the
    model and the batch: `TrainConfig.with_layout` raises ValueError), else the policy's
    (`policy.choose_layout`): among the layouts that fit `--memory-per-worker`, the one predicted
    to step fastest by the cost model calibrated on `observed` (this job's measured steps, as
    (layout, seconds): those of worlds of `n` when there are any, else all). Every worker gets
    the same layout from the same inputs. ValueError when none fits."""
    named = dict(ecfg.layouts)
    if n in named:
        cfg.with_layout(named[n])
        return named[n]
    from shardshift.elastic import policy

    same = [(layout, seconds) for layout, seconds in observed if layout.world_size == n] or list(observed)
    model = policy.calibrate([(cfg, layout, seconds) for layout, seconds in same])
    return policy.choose_layout(n, cfg, model, ecfg.memory_per_worker, ecfg.redundancy)


def check_every_world(ecfg: ElasticConfig, cfg: TrainConfig) -> dict[int, Layout]:
    """The layout of every world size from --min-nproc to --max-nproc (before any step is
    measured); ValueError naming the first size that has none."""
    return {n: layout_for(n, ecfg, cfg) for n in range(ecfg.min_nproc, ecfg.max_nproc + 1)}
