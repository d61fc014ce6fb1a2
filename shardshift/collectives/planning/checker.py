"""Symbolic checking of schedules before they run, and a numeric reference execution.

`check_schedule` replays a schedule on symbols instead of numbers: every (rank, chunk) holds a
multiset of the ranks whose data it contains — {r: 1} for rank r's own input, sums of them after
REDUCE transfers — or nothing. It checks, step by step, the ordering contract of schedule.py
(a rank sends only what it holds at the start of the step; no chunk is read and written, or
written twice by COPY, in one step), and at the end the op's postcondition for every rank and
chunk:

  broadcast      every rank holds {root: 1} in every chunk
  reduce         the root holds {every rank: 1} in every chunk (each rank counted exactly once)
  allreduce      every rank holds {every rank: 1} in every chunk
  allgather      every rank holds {r: 1} in every chunk of shard r
  reducescatter  rank r holds {every rank: 1} in every chunk of shard r

The first violation raises `ScheduleError`, naming the step or the rank and chunk that is wrong.

`run_reference` executes a schedule on numpy arrays with the exact semantics an executor must
implement (step-batched, REDUCE contributions added in list order), as an oracle for executors.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from shardshift.collectives.planning.ops import Collective, TransferKind
from shardshift.collectives.planning.schedule import CollectiveSchedule, element_ranges


class ScheduleError(ValueError):
    """A schedule breaks its ordering contract or does not compute its collective."""


@dataclass(frozen=True)
class CheckReport:
    """What a successful check covered."""

    op: Collective
    num_ranks: int
    num_chunks: int
    num_transfers: int
    num_steps: int


def check_schedule(schedule: CollectiveSchedule) -> CheckReport:
    """Replay `schedule` symbolically; raise ScheduleError at the first violation."""
    op, n = schedule.op, schedule.num_ranks
    state = _initial_state(schedule)
    steps: dict[int, list] = {}
    for t in schedule.transfers:
        steps.setdefault(t.step, []).append(t)
    for step in sorted(steps):
        batch = steps[step]
        read: set[tuple[int, int]] = set()
        written: dict[tuple[int, int], TransferKind] = {}
        for t in batch:
            where = f"step {step}: {t.kind.value} of chunk {t.chunk} from rank {t.src} to rank {t.dst}"
            if state[t.src][t.chunk] is None:
                raise ScheduleError(f"{where}: rank {t.src} does not hold chunk {t.chunk} yet")
            read.add((t.src, t.chunk))
            previous = written.get((t.dst, t.chunk))
            if previous is not None and (previous is TransferKind.COPY or t.kind is TransferKind.COPY):
                raise ScheduleError(f"{where}: rank {t.dst} chunk {t.chunk} is written twice in one "
                                    "step by a COPY; move one transfer to another step")  # fmt: skip
            if t.kind is TransferKind.REDUCE and state[t.dst][t.chunk] is None:
                raise ScheduleError(f"{where}: rank {t.dst} has no value of chunk {t.chunk} to add to")
            written[(t.dst, t.chunk)] = t.kind
        clash = read & set(written)
        if clash:
            rank, chunk = min(clash)
            raise ScheduleError(f"step {step}: rank {rank} both sends and receives chunk {chunk}; "
                                "a chunk in flight must not be overwritten")  # fmt: skip
        snapshot = {(t.src, t.chunk): state[t.src][t.chunk] for t in batch}
        for t in batch:  # apply, reading the values as they were at the start of the step
            value = snapshot[(t.src, t.chunk)]
            if t.kind is TransferKind.COPY:
                state[t.dst][t.chunk] = Counter(value)
            else:
                state[t.dst][t.chunk] = state[t.dst][t.chunk] + value
    _check_postcondition(schedule, state)
    return CheckReport(op, n, len(schedule.chunks), len(schedule.transfers), schedule.num_steps)


def _initial_state(schedule: CollectiveSchedule) -> list[list[Counter | None]]:
    """state[rank][chunk]: what each rank holds before the first step."""
    op, n = schedule.op, schedule.num_ranks
    state: list[list[Counter | None]] = [[None] * len(schedule.chunks) for _ in range(n)]
    for c in schedule.chunks:
        if op is Collective.BROADCAST:
            state[schedule.root][c.index] = Counter({schedule.root: 1})
        elif op is Collective.ALLGATHER:
            state[c.root][c.index] = Counter({c.root: 1})
        else:  # every reduction starts from every rank's own contribution
            for r in range(n):
                state[r][c.index] = Counter({r: 1})
    return state


def _check_postcondition(schedule: CollectiveSchedule, state: list[list[Counter | None]]) -> None:
    op, n = schedule.op, schedule.num_ranks
    everyone = Counter({r: 1 for r in range(n)})
    for c in schedule.chunks:
        if op is Collective.BROADCAST:
            expected = {r: Counter({schedule.root: 1}) for r in range(n)}
        elif op is Collective.REDUCE:
            expected = {schedule.root: everyone}
        elif op is Collective.ALLREDUCE:
            expected = {r: everyone for r in range(n)}
        elif op is Collective.ALLGATHER:
            expected = {r: Counter({c.root: 1}) for r in range(n)}
        else:
            expected = {c.root: everyone}
        for rank, want in expected.items():
            got = state[rank][c.index]
            if got != want:
                raise ScheduleError(
                    f"{op.value}: rank {rank} chunk {c.index} (buffer [{c.start}, {c.stop}), "
                    f"piece {c.piece}, root {c.root}) holds {_show(got)}, expected {_show(want)}"
                    + _diagnose(got, want)
                )


def _show(value: Counter | None) -> str:
    if value is None:
        return "nothing"
    return "{" + ", ".join(f"rank {r}×{m}" for r, m in sorted(value.items())) + "}"


def _diagnose(got: Counter | None, want: Counter) -> str:
    if got is None:
        return ""
    missing = sorted(set(want) - set(got))
    extra = sorted(r for r in got if got[r] > want.get(r, 0))
    parts = ([f"missing ranks {missing}"] if missing else []) + (
        [f"ranks counted too often or not expected {extra}"] if extra else []
    )
    return ": " + "; ".join(parts) if parts else ""


def run_reference(schedule: CollectiveSchedule, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Execute `schedule` on numpy buffers, one per rank (the buffer of the module docstring of
    schedule.py: for allgather, rank r's buffer needs only shard r filled). Returns the buffers
    after the last step. Deterministic: REDUCE contributions are added in transfer order."""
    n = schedule.num_ranks
    if len(inputs) != n or len({x.shape for x in inputs}) != 1:
        raise ValueError(f"give {n} one-dimensional buffers of equal length")
    buffers = [np.array(x, copy=True) for x in inputs]
    ranges = element_ranges(schedule, int(buffers[0].shape[0]))
    steps: dict[int, list] = {}
    for t in schedule.transfers:
        steps.setdefault(t.step, []).append(t)
    for step in sorted(steps):
        sent = [(t, buffers[t.src][slice(*ranges[t.chunk])].copy()) for t in steps[step]]
        for t, data in sent:
            target = buffers[t.dst][slice(*ranges[t.chunk])]
            if t.kind is TransferKind.COPY:
                target[...] = data
            else:
                target += data
    return buffers
